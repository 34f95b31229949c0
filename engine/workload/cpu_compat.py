"""Make megatron-core 0.16 run on CPU with gloo when CUDA is absent (how CI trains real models).

megatron-core hard-wires CUDA in places that have nothing to do with the maths: device
arguments, RNG bookkeeping, streams, type-name assertions. `apply()` redirects exactly those,
once per process, and only when `torch.cuda.is_available()` is False; on a GPU megatron runs as
is. Each patch below says which megatron code needs it (see RECIPES.md, "Megatron-Core training
on CPU"). Call `apply()` before building megatron models; it enters the device mode in the
calling thread and in every thread started afterwards (the mode is thread-local).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_CPU = torch.device("cpu")


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Install every redirection (idempotent). Returns True when the CPU path is active."""
    global _applied
    if not needed():
        return False
    if not _applied:
        _redirect_torch_cuda()
        _patch_megatron()
        _enter_in_new_threads()
        _applied = True
    enter_thread()
    return True


def enter_thread() -> None:
    """Enter the CUDA-to-CPU device mode in the calling thread (TorchFunctionModes are per thread)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if _applied and not any(isinstance(mode, CudaToCpuMode) for mode in stack):
        CudaToCpuMode().__enter__()   # never exited: it lasts for the thread's life


def _enter_in_new_threads() -> None:
    # megatron starts threads of its own (the dataset builder's pool, the straggler detector);
    # whatever runs there must see CUDA requests mapped too.
    run = threading.Thread.run

    @functools.wraps(run)
    def run_in_mode(self):
        enter_thread()
        run(self)

    threading.Thread.run = run_in_mode


# --------------------------------------------------------------------------------------------
# 1 and 4. torch.cuda.* used as plain utilities: devices, RNG, sync, streams and events
# --------------------------------------------------------------------------------------------
class _Stream:
    """Stands in for torch.cuda.Stream: on CPU every op is synchronous, so ordering is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    """Stands in for torch.cuda.Event (the MoE alltoall dispatcher's device-to-host sync)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = _Stream()


def _redirect_torch_cuda() -> None:
    cuda = torch.cuda
    # `torch.cuda.current_device()` is passed as a device all over megatron (buffers, masks,
    # optimizer state); answering the CPU device makes those allocations land on the CPU.
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # The RNG tracker (tensor_parallel.random) saves, seeds and restores the "CUDA" generator to
    # give each TP rank its own init/dropout stream; on CPU the default generator is that stream.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # 4. Streams and events: the alltoall token dispatcher overlaps its DtoH copy on a side stream.
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    # NVTX ranges (megatron's profiling hooks) raise on a CPU build; they mark nothing here.
    cuda.nvtx.range_push = lambda msg: None
    cuda.nvtx.range_pop = lambda: None


# --------------------------------------------------------------------------------------------
# 2. device="cuda" and tensor.type() == "torch.cuda.*Tensor"
# --------------------------------------------------------------------------------------------
def _to_cpu(device):
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU                    # a bare ordinal means a CUDA device to torch
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to the CPU and reports CPU tensors under CUDA type names.

    megatron allocates with `device="cuda"` / `.cuda()` (optimizer, schedules, grad buffers) and
    its optimizer and grad clipping assert `param.type()` is a `torch.cuda.*Tensor`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]             # pinning needs a CUDA runtime; pageable memory is fine
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# 3, 5, 6, 7. megatron internals
# --------------------------------------------------------------------------------------------
def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import mappings, random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import token_dispatcher

    # 3. tensor_parallel.random has private copies of torch.cuda's RNG getters/setters that go
    #    straight to torch.cuda.default_generators (empty without CUDA).
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # The tracker warns when the CPU generator moves inside a forked "CUDA" region; here they are
    # the same generator, so it always moves: the warning says nothing.
    logging.getLogger(random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())

    # 5b. The alltoall dispatcher moves split sizes to the host as numpy arrays, but only when
    #     they are CUDA tensors; gloo's all_to_all needs them as lists/arrays, never tensors.
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # 6. Sequence parallel with plain torch norms: WrappedTorchNorm asserts sequence_parallel is
    #    off. The norm maths is per token, so build it without SP and tag its parameters the way
    #    megatron's own SP norms do, so finalize_model_grads all-reduces their grads over TP.
    original_norm_new = torch_norm.WrappedTorchNorm.__new__

    @functools.wraps(original_norm_new)
    def norm_new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_norm_new(cls, config, hidden_size, *args, **kwargs)
        import dataclasses

        norm = original_norm_new(cls, dataclasses.replace(config, sequence_parallel=False),
                                 hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = norm_new

    # 7. gloo has no uneven all-gather (MoE alltoall with TP > 1 gathers variable token counts):
    #    pad every piece to the largest, gather evenly, then cut the padding out.
    original_gather = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)], dim=0)

    mappings._gather_along_first_dim = gather_along_first_dim
