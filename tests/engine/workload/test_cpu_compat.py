"""cpu_compat's virtual CUDA device, in real processes with real megatron-core objects.

cpu_compat patches torch globally, so it is never applied in this process: each test writes a
script and runs it (plain python, or torchrun with gloo ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infra_runs import finish, start

pytestmark = [pytest.mark.integration, pytest.mark.train]

PRELUDE = '''
import os, warnings
warnings.simplefilter("ignore")
import torch
from charllm.engine.workload import cpu_compat
assert cpu_compat.apply()
CUDA, HOST = "torch.cuda.FloatTensor", "torch.FloatTensor"
'''

# Each script ends as the workload's ranks end (train.py's __main__): it leaves its process groups
# and skips the interpreter's teardown, where threads torch still runs may abort the process.
ENDING = '''
import sys
from charllm.engine.workload import train
train.teardown()
sys.stdout.flush()
os._exit(0)
'''


def run_script(tmp_path: Path, body: str, *, nproc: int | None = None, timeout: float = 180) -> str:
    """Run PRELUDE + body (under torchrun with `nproc` gloo ranks, or plain python); return stdout."""
    script = tmp_path / "check.py"
    script.write_text(PRELUDE + body + ENDING)
    cmd = [sys.executable, str(script)] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    code, out, err = finish(start(cmd), timeout)
    assert code == 0, f"exit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return out


# --------------------------------------------------------------------------------------------
# where tensors live, and the type names they report
# --------------------------------------------------------------------------------------------
PLACEMENT = '''
# CUDA requests, in every spelling torch accepts, land on the CPU and report CUDA names
for device in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0, torch.cuda.current_device()):
    t = torch.empty(3, device=device)
    assert t.device.type == "cpu" and t.type() == CUDA, (device, t.type())
assert torch.cuda.current_device() == 0                     # what real CUDA answers
assert torch.ones(2, dtype=torch.bfloat16, device="cuda").type() == "torch.cuda.BFloat16Tensor"
assert torch.tensor([1, 2], device="cuda").type() == "torch.cuda.LongTensor"

# host-born tensors keep their CPU names, as they would on a GPU
host = torch.ones(3)
assert host.type() == HOST and torch.ones(2, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
assert torch.empty(3, device="cpu").type() == HOST

# moving: a copy on the virtual device; the host original stays a host tensor
for moved in (host.cuda(), host.cuda(0), host.to("cuda"), host.to(0), host.to(device="cuda:0"),
              host.to("cuda", torch.bfloat16), host.to(torch.empty(1, device="cuda"))):
    assert moved.device.type == "cpu" and moved.type().startswith("torch.cuda."), moved.type()
    assert moved.data_ptr() != host.data_ptr()
assert host.type() == HOST and host.to(torch.float64).type() == "torch.DoubleTensor"
dev = torch.zeros(4, device="cuda")
assert dev.cuda() is dev and dev.to("cuda") is dev          # already there: no copy, as on a GPU
back = dev.cpu()
assert back.type() == HOST and back.data_ptr() != dev.data_ptr() and dev.type() == CUDA
assert dev.to("cpu").type() == HOST and dev.to(torch.ones(1)).type() == HOST

# derived tensors follow their source, through any torch function
for derived in (dev.view(2, 2), dev[1:], dev.float(), dev.clone(), torch.empty_like(dev), dev.new_zeros(2),
                dev + 1, dev * dev, torch.cat([dev, dev[:2]]), torch.stack((dev, dev)), dev.sum(),
                torch.nn.functional.relu(dev), dev.detach(), torch.nn.Parameter(dev)):
    assert derived.type() == CUDA, derived.type()
assert dev.bfloat16().type() == "torch.cuda.BFloat16Tensor" and dev.half().type() == "torch.cuda.HalfTensor"
assert all(t.type() == CUDA for t in torch.split(dev, 2)) and torch.max(dev, 0).values.type() == CUDA
for derived in (host.view(3, 1), host.float(), host.clone(), torch.empty_like(host), host + 1,
                torch.cat([host, host]), torch.empty_like(dev, device="cpu"), dev.new_zeros(2, device="cpu")):
    assert derived.type() == HOST, derived.type()
# `device=t.device` lands where t lives (megatron's deallocate_output_tensor, loss scales, ...)
assert dev.device == torch.device("cpu") and host.device == torch.device("cpu")   # the data is on the host
assert torch.empty(2, device=dev.device).type() == CUDA and host.to(dev.device).type() == CUDA
assert torch.empty(2, device=host.device).type() == HOST and dev.to(host.device).type() == HOST
# a device-to-host copy into a host tensor leaves it a host tensor
host.copy_(dev[:3])
assert host.type() == HOST

# Module.cuda() moves a torch norm's parameters (and buffers) onto the virtual device
norm = torch.nn.LayerNorm(4)
assert norm.weight.type() == HOST and norm.bias.type() == HOST
norm.cuda()
assert isinstance(norm.weight, torch.nn.Parameter) and norm.weight.type() == CUDA and norm.bias.type() == CUDA
assert norm.bfloat16().weight.type() == "torch.cuda.BFloat16Tensor"
# grads come from autograd's C++ backward; a parameter's grad lives where the parameter does
x = torch.randn(2, 4, device="cuda", requires_grad=True)
norm.float()(x).sum().backward()
assert norm.weight.grad.type() == CUDA and x.grad.type() == CUDA
# backward's own Python (custom Functions, as megatron's _AllToAll) allocates on the virtual device
class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.empty(grad.shape, device=torch.cuda.current_device()).copy_(grad) * 2

y = torch.ones(3, device="cuda", requires_grad=True)
Double.apply(y).sum().backward()
assert y.grad.type() == CUDA and y.grad.eq(2).all()
(grad,) = torch.autograd.grad(Double.apply(y).sum(), y)
assert grad.type() == CUDA
plain = torch.nn.Linear(4, 4)
plain(torch.randn(2, 4)).sum().backward()
assert plain.weight.grad.type() == HOST

# megatron threads (the dataset builder's pool) see the virtual device too
from concurrent.futures import ThreadPoolExecutor
in_thread = lambda: (torch.empty(1, device="cuda").type(), torch.empty(1).type())
assert ThreadPoolExecutor(1).submit(in_thread).result() == (CUDA, HOST)
print("placement ok")
'''


@pytest.mark.timeout(200)
def test_virtual_device_placement_and_type_names(tmp_path):
    assert "placement ok" in run_script(tmp_path, PLACEMENT)


# --------------------------------------------------------------------------------------------
# the never-moved-model bug of the H100 run reproduces on CPU
# --------------------------------------------------------------------------------------------
NEVER_MOVED = '''
import torch.distributed as dist
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

dist.init_process_group("gloo")
ps.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1)
config = TransformerConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16,
    pipeline_dtype=torch.bfloat16, bias_activation_fusion=False, bias_dropout_fusion=False,
    masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)


def build(move: bool):
    model = GPTModel(config=config, vocab_size=128, max_sequence_length=16,
                     transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    if move:
        model.cuda(torch.cuda.current_device())     # what train.py (and Megatron-LM's get_model) does
    model = DistributedDataParallel(config=config, module=Float16Module(config, model),
                                    ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0)
    return model, get_megatron_optimizer(opt_config, [model])


# the local spec's torch norms are built on the host: without .cuda() the optimizer refuses them
try:
    build(move=False)
except TypeError as exc:
    assert "Wrapped parameters must be one of torch.cuda.FloatTensor" in str(exc), exc
    assert "Received torch.BFloat16Tensor" in str(exc), exc
else:
    raise AssertionError("the never-moved model was accepted")

# moved first, it builds, and a training step passes clip_grads' main-grad type assertion
model, optimizer = build(move=True)
assert all(p.type() == "torch.cuda.BFloat16Tensor" for p in model.parameters())
config.finalize_model_grads_func = finalize_model_grads
tokens = torch.randint(128, (2, 16), device="cuda")
positions = torch.arange(16, device="cuda")[None].expand(2, -1)
mask = torch.triu(torch.ones(16, 16, dtype=torch.bool, device="cuda"), diagonal=1)[None, None]


def forward_step(data, model):
    output = model(tokens, positions, mask, labels=tokens)
    return output, lambda out: (out.float().sum(), torch.tensor(out.numel(), device="cuda"), {})


model.zero_grad_buffer()
optimizer.zero_grad()
get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=model,
                            num_microbatches=1, seq_length=16, micro_batch_size=2, forward_only=False)
update_ok, grad_norm, _ = optimizer.step()
assert update_ok and grad_norm > 0, (update_ok, grad_norm)
print("never-moved ok")
'''


@pytest.mark.timeout(200)
def test_never_moved_model_fails_as_on_a_gpu_and_moved_model_trains(tmp_path):
    assert "never-moved ok" in run_script(tmp_path, NEVER_MOVED, nproc=1)


# --------------------------------------------------------------------------------------------
# two real gloo ranks: devices in new threads, and the uneven all-gather emulation
# --------------------------------------------------------------------------------------------
COMPAT_CHECK = '''
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

dist.init_process_group("gloo")
ps.initialize_model_parallel(tensor_model_parallel_size=2)
rank = dist.get_rank()
# device="cuda" lands on the CPU
assert torch.empty(3, device="cuda").device.type == "cpu"
assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.ones(2).cuda().device.type == "cpu" and torch.ones(2).to("cuda").device.type == "cpu"
from concurrent.futures import ThreadPoolExecutor   # the mode is thread-local: new threads get it too
assert ThreadPoolExecutor(1).submit(lambda: torch.empty(1, device="cuda").device.type).result() == "cpu"
# uneven all-gather (rank r holds r+1 rows), forward and its reduce-scatter backward
x = torch.full((rank + 1, 3), float(rank + 1), device="cuda", requires_grad=True)
y = gather_from_sequence_parallel_region(x, group=ps.get_tensor_model_parallel_group(), output_split_sizes=[1, 2])
assert y.shape == (3, 3) and y[:1].eq(1).all() and y[1:].eq(2).all(), y
assert y.type() == CUDA, y.type()
y.sum().backward()
assert x.grad.eq(2).all(), x.grad   # each row's gradient summed over the 2 TP ranks
os.write(1, f"compat ok {rank}\\n".encode())   # one write: the ranks share the pipe
'''


@pytest.mark.timeout(200)
def test_cpu_compat_devices_type_names_and_uneven_all_gather(tmp_path):
    out = run_script(tmp_path, COMPAT_CHECK, nproc=2)
    assert sorted(line for line in out.splitlines() if line.startswith("compat ok")) == ["compat ok 0", "compat ok 1"]


# --------------------------------------------------------------------------------------------
# the mark table stays bounded, and a freed storage's mark never leaks to a new one
# --------------------------------------------------------------------------------------------
BOUNDED = '''
keep = [torch.empty(8, device="cuda") for _ in range(100)]
sizes = []
for i in range(50_000):
    dev = torch.empty(64, device="cuda")
    derived = (dev * 2).float().view(8, 8)
    del dev, derived
    fresh = torch.empty(64)                 # may reuse the freed memory, never the freed mark
    assert fresh.type() == HOST
    if i % 1000 == 0:
        sizes.append(len(cpu_compat._MARKED))
assert max(sizes) < 10_000, sizes          # ~100k marks made; live ones are about 100
assert all(t.type() == CUDA for t in keep)  # pruning drops dead marks only
print("bounded ok", max(sizes))
'''


@pytest.mark.timeout(200)
def test_mark_table_stays_bounded(tmp_path):
    assert "bounded ok" in run_script(tmp_path, BOUNDED)
