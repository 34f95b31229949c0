"""The workload's CUDA path without a GPU: the real Trainer, built and stepped on a CUDA build of
torch with every tensor a FakeTensor on a `cuda` device.

Only what needs a driver is faked; everything the workload and megatron-core do runs as on a GPU:
- torch's FakeTensorMode gives tensors shapes, dtypes and devices but no data, and raises
  FakeTensorDeviceMismatchError for an op that mixes devices, as CUDA does (cpu_compat's virtual
  device does not);
- the `fake` process-group backend (torch.testing) answers every collective at once, so one
  process plays one rank of any world size;
- torch.cuda's driver utilities (streams, events, RNG state, memory statistics, NVTX) are stubs;
- a read of a value to the host (`.item()`, `float()`, `.tolist()`) answers 0 (there is no data)
  and is counted: a step's count is its host syncs.

What this lane cannot show, and the first GPU run must:
- the backward pass: the autograd engine asks the driver for a primary context, so backward is
  stubbed out (gradients stay the zeroed buffers; the optimizer steps on them);
- anything that reads data to decide a shape: MoE routing stops at the first such op;
- kernel choice (SDPA's flash / memory-efficient / cuDNN selection, cuBLAS), torch.compile code
  generation (torch.compile is off: megatron's compiled fusions run eagerly), NCCL, numerics,
  memory, speed.

Run in its own process (it patches torch for good): `install(world, rank)`, then `run(...)`, which
returns a JSON-able result. tests/engine/workload/test_fake_cuda.py drives it.
"""

from __future__ import annotations

import contextlib
import os
import traceback

# torch.compile cannot generate code for a device that is not there; megatron's jit_fuser functions
# (the fusions among them) then run as plain eager PyTorch, which is what this lane checks. Read when
# megatron-core decorates them, at import.
os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from charllm.engine.workload.cpu_compat import Event, Stream


def cuda_build() -> bool:
    """Whether this torch is a CUDA build (the lane needs its CUDA dispatch, not a GPU)."""
    return torch.version.cuda is not None


# --------------------------------------------------------------------------------------------
# What needs a driver
# --------------------------------------------------------------------------------------------
def _driver_stubs() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.device_count = lambda: 1
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.Stream, cuda.Event = Stream, Event   # cpu_compat's: every op already done
    cuda.current_stream = cuda.default_stream = lambda device=None: Stream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    cuda.set_rng_state = lambda new_state, device="cuda": None
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: None
    cuda.max_memory_allocated = cuda.max_memory_reserved = lambda device=None: 0
    cuda.memory_allocated = cuda.memory_reserved = lambda device=None: 0
    cuda.empty_cache = lambda: None
    cuda.nvtx.range_push = lambda message: None
    cuda.nvtx.range_pop = lambda: None


def _fake_module_apply(self, fn, recurse=True):
    """nn.Module._apply for fake parameters. The real one swaps a converted parameter's contents in
    place (torch.utils.swap_tensors), which FakeTensorMode's weak references forbid; here each
    parameter is replaced by a new one (attributes kept), a shared one once."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in self.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                with torch.no_grad():
                    applied = fn(param)
                if applied is param:
                    done[id(param)] = param
                else:
                    new = torch.nn.Parameter(applied.detach(), requires_grad=param.requires_grad)
                    new.__dict__.update({k: v for k, v in param.__dict__.items() if k not in new.__dict__})
                    done[id(param)] = new
            module._parameters[key] = done[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = fn(buffer)
    return self


def _fake_process_group(world: int, rank: int) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    init = dist.init_process_group
    dist.init_process_group = lambda backend=None, **kwargs: init("fake", store=FakeStore(), rank=rank,
                                                                  world_size=world)

    def all_gather_object(object_list, obj, group=None):   # pickles through tensors: here there is no data
        for i in range(len(object_list)):
            object_list[i] = obj

    dist.all_gather_object = all_gather_object

    class _Done:
        def wait(self):
            pass

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):   # the fake backend has no *_coalesced
        yield _Done()

    c10d._coalescing_manager = coalescing_manager
    from megatron.core.distributed import param_and_grad_buffer

    for name in dir(param_and_grad_buffer):
        if getattr(getattr(param_and_grad_buffer, name), "__name__", "") == "_coalescing_manager":
            setattr(param_and_grad_buffer, name, coalescing_manager)


def _no_backward() -> None:
    # The autograd engine asks the driver for each device's primary context
    # (GraphTask::stash_current_streams): without a GPU, backward cannot run on fake CUDA tensors.
    from megatron.core.pipeline_parallel import schedules

    schedules.custom_backward = lambda output, grad_output: None
    torch.autograd.backward = lambda *args, **kwargs: None


def install(world: int, rank: int) -> None:
    """Patch this process for good: fake process group of `world` ranks (this one `rank`), driver stubs."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    _driver_stubs()
    torch.nn.Module._apply = _fake_module_apply
    _fake_process_group(world, rank)
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.zeros(16, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None
    _no_backward()


class HostReads(TorchFunctionMode):
    """Answers a read of a fake tensor's value with 0 (there is none; a small tensor made from Python
    values answers with them), and counts the reads of CUDA tensors' values: on a GPU each is a
    device-to-host sync."""

    READS = (torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
             torch.Tensor.tolist)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS and isinstance(args[0], FakeTensor):
            tensor = args[0]
            if tensor.constant is not None:   # a small tensor made from Python values keeps them
                return func(tensor.constant, *args[1:], **kwargs)
            self.count += tensor.device.type == "cuda"   # a host tensor's value is no sync
            if func is torch.Tensor.tolist:
                return _zeros_list(tuple(tensor.shape), _zero(tensor))
            return {torch.Tensor.__int__: 0, torch.Tensor.__float__: 0.0, torch.Tensor.__bool__: False}.get(
                func, _zero(tensor))
        return func(*args, **kwargs)


def _zero(tensor):
    return False if tensor.dtype == torch.bool else 0.0 if tensor.dtype.is_floating_point else 0


def _zeros_list(shape: tuple, zero):
    return zero if not shape else [_zeros_list(shape[1:], zero) for _ in range(shape[0])]


# --------------------------------------------------------------------------------------------
# One rank of one experiment
# --------------------------------------------------------------------------------------------
def fake_stack(compiler: str | None = "cc (fake)"):
    from charllm.engine.model import runtime

    return runtime.Stack(cuda=True, capability=(9, 0), source="fake CUDA (tests/fakes_cuda.py)", compiler=compiler)


def placement(chunks) -> list[str]:
    """Every parameter, gradient buffer and main_grad of the model chunks that is not a CUDA tensor
    (what megatron's optimizer asserts and what would run on the host), as one line each."""
    wrong = []
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if param.device.type != "cuda" or not param.type().startswith("torch.cuda."):
                wrong.append(f"chunk {i} parameter {name}: {param.device} {param.type()}")
            grad = getattr(param, "main_grad", None)
            if grad is not None and grad.device.type != "cuda":
                wrong.append(f"chunk {i} main_grad of {name}: {grad.device}")
        for j, buffer in enumerate(getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", [])):
            for kind in ("grad_data", "param_data"):
                data = getattr(buffer, kind, None)
                if data is not None and data.device.type != "cuda":
                    wrong.append(f"chunk {i} buffer {j} {kind}: {data.device}")
        for name, tensor in chunk.named_buffers():
            if tensor.device.type != "cuda":
                wrong.append(f"chunk {i} buffer {name}: {tensor.device}")
    return wrong


def run(exp, *, rank: int, world: int, steps: int = 2, stack=None) -> dict:
    """Build the Trainer for `exp` as rank `rank` of `world` under fake CUDA and step it; the result:

    ok, error (the exception's type and last line; None when every step ran), traceback,
    implementation (runtime.resolve on the fake node), model (the megatron-core class),
    not_on_cuda (placement() of the model as the optimizer was about to be built),
    host_reads (per step), sdpa (the first SDPA calls: query heads, key heads,
    enable_gqa), sdpa_kernels (the kernels SDPA was restricted to, None: not), optimizer (whether every torch param
    group is fused; the gradient-norm function),
    param_sync (forward pre-hooks on and param_sync_func set: after setup, after each step)."""
    import torch.nn.functional as F
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.optimizer import clip_grads

    from charllm.engine.model import runtime
    from charllm.engine.workload import train

    stack = stack or fake_stack()
    result: dict = {"ok": False, "error": None, "traceback": None, "not_on_cuda": None, "host_reads": [],
                    "sdpa": [], "sdpa_kernels": None, "optimizer": None, "param_sync": [], "problems": [str(p) for p in
                                                                                   runtime.problems(exp, stack)]}
    if result["problems"]:
        result["error"] = "refused: " + result["problems"][0]
        return result
    impl = runtime.resolve(exp, stack)
    result["implementation"] = impl.to_dict()

    build_optimizer = mcore_optimizer.get_megatron_optimizer

    def checked_optimizer(config, chunks, *args, **kwargs):
        result["not_on_cuda"] = placement(chunks)
        return build_optimizer(config, chunks, *args, **kwargs)

    mcore_optimizer.get_megatron_optimizer = checked_optimizer
    sdpa = F.scaled_dot_product_attention

    def recorded_sdpa(q, k, v, *args, **kwargs):
        if len(result["sdpa"]) < 4:
                result["sdpa"].append({"query_heads": q.shape[1], "key_heads": k.shape[1],
                                   "enable_gqa": bool(kwargs.get("enable_gqa", False))})
        return sdpa(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = recorded_sdpa
    # Restricting SDPA's kernels makes torch query the device to choose one: recorded, not applied.
    import torch.nn.attention as sdpa_attention

    sdpa_kernel = sdpa_attention.sdpa_kernel

    def recorded_kernels(backends, *args, **kwargs):
        result["sdpa_kernels"] = sorted(backend.name for backend in backends)
        return contextlib.nullcontext()

    sdpa_attention.sdpa_kernel = recorded_kernels
    train.define_te_general_gemm()
    reads = HostReads()

    def sync_state(trainer):
        return {"pre_hooks": all(bool(chunk.remove_forward_pre_hook_handles) for chunk in trainer.model),
                "param_sync_func": trainer.config.param_sync_func is not None}

    with FakeTensorMode(allow_non_fake_inputs=True), reads:
        try:
            trainer = train.Trainer(exp, impl, cuda=True, local_rank=0)
            result["model"] = trainer.builder.name
            result["optimizer"] = {
                "fused": all(group.get("fused") for inner in getattr(trainer.optimizer, "chained_optimizers",
                                                                     [trainer.optimizer])
                             for group in inner.optimizer.param_groups),
                "grad_norm": clip_grads.l2_norm_impl.__name__}
            if exp.parallel.use_distributed_optimizer:
                result["param_sync"].append(sync_state(trainer))
            for _ in range(steps):
                before = reads.count
                trainer.step()
                trainer.agree(False, None)
                result["host_reads"].append(reads.count - before)
                if exp.parallel.use_distributed_optimizer:
                    result["param_sync"].append(sync_state(trainer))
            trainer.finish()
            result["ok"] = True
        except Exception as exc:   # noqa: BLE001 - the result says what failed, the test judges it
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            result["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"
            result["traceback"] = traceback.format_exc()[-6000:]
        finally:
            mcore_optimizer.get_megatron_optimizer = build_optimizer
            F.scaled_dot_product_attention = sdpa
            sdpa_attention.sdpa_kernel = sdpa_kernel
    return result


def main(experiment, assignments: list[str], *, rank: int, world: int, compiler: str | None = "cc (fake)") -> int:
    """Run one case and print its result as the last line, JSON (the caller installed the fakes)."""
    import json
    import warnings

    from charllm.engine.model.experiment import Experiment

    warnings.simplefilter("ignore")
    exp = experiment if not isinstance(experiment, str) else Experiment.load(experiment)
    exp.apply(list(assignments))
    result = run(exp, rank=rank, world=world, stack=fake_stack(compiler))
    print("\n" + json.dumps(result, default=str), flush=True)
    return 0

