"""The fake-CUDA lane: the workload's CUDA path, built and stepped without a GPU.

Each case runs one rank of a real layout in its own process, on a CUDA build of torch, with every
tensor a FakeTensor on `cuda` and the `fake` process-group backend (tests/fakes_cuda.py says how).
It shows, before any GPU is lent: every parameter, gradient buffer and main_grad is a CUDA tensor
when the optimizer is built; no op of setup, forward, the pipeline schedules, gradient
finalization or the optimizer step mixes devices; the step's host syncs; what SDPA is asked.

What it cannot show (the first GPU run must): the backward pass (stubbed: autograd needs a CUDA
context), anything that reads data to choose a shape (MoE routing gets zeros), kernel choice
(SDPA's backends, cuBLAS), torch.compile's code generation (off here: the fusions run eagerly),
NCCL, numerics, memory and speed.

CI runs these on Python 3.12 with the CUDA build of torch, once for each megatron-core line the
[train] extra allows (tests/run.sh); elsewhere they skip.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from charllm.engine import doctor
from charllm.engine.model.experiment import Experiment, Hardware
from charllm.engine.workload import model_builder
from infra_runs import finish, start

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(torch.version.cuda is None,
                       reason=f"needs a CUDA build of torch (this is {torch.__version__}); CI's Python 3.12 "
                              "environment has one (tests/run.sh)"),
]

TESTS = Path(__file__).resolve().parents[2]

CHILD = '''
import sys
sys.path.insert(0, {tests!r})
import fakes_cuda
fakes_cuda.install(world={world}, rank={rank})
{before}
from charllm.engine.model.experiment import Experiment
raise SystemExit(fakes_cuda.main(Experiment.load({path!r}), [], rank={rank}, world={world}, compiler={compiler!r}))
'''


def llama(*assignments: str) -> Experiment:
    """The Llama-style 1.5B layout `doctor --train` runs (the acceptance kit's g-llama1b): GQA 32/8,
    SwiGLU, RoPE, RMSNorm, bf16, sequence 4096, two micro-batches of 2."""
    exp = doctor.llama_experiment(Hardware.load("h100-sxm-80gb"), 1, micro_batch=2)
    return exp.apply(list(assignments))


def fake_run(tmp_path: Path, exp: Experiment, *, last_rank: bool = False, before: str = "",
             compiler: str | None = "cc (fake)") -> dict:
    """One rank of `exp` (the first, or the last) under fake CUDA: fakes_cuda.run's result."""
    path = tmp_path / "experiment.toml"
    exp.save(path)
    world = exp.world_size
    script = tmp_path / "fake_cuda_case.py"
    script.write_text(CHILD.format(tests=str(TESTS), world=world, rank=world - 1 if last_rank else 0,
                                   before=before, path=str(path), compiler=compiler))
    code, out, err = finish(start([sys.executable, str(script)]), timeout=280)
    assert code == 0, f"exit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return json.loads(out.strip().splitlines()[-1])


def assert_ran_on_cuda(result: dict) -> None:
    assert result["ok"], f"{result['error']}\n{result['traceback']}"
    assert result["not_on_cuda"] == [], result["not_on_cuda"][:5]
    assert len(result["host_reads"]) == 2


# --------------------------------------------------------------------------------------------
# Every layout family the shipped GPU experiments and the acceptance kit use
# --------------------------------------------------------------------------------------------
LAYOUTS = {
    # the kit's Llama-style 1.5B in each precision and recompute it runs
    "dense-gqa-bf16": (lambda: llama(), False),
    "fp32": (lambda: llama("bf16=false", "micro_batch_size=1", "global_batch_size=2"), False),
    "fp16": (lambda: llama("bf16=false", "fp16=true"), False),
    "full-recompute": (lambda: llama("recompute_granularity=full", "recompute_method=uniform",
                                     "recompute_num_layers=1"), False),
    "selective-recompute-dropout": (lambda: llama("recompute_granularity=selective", "hidden_dropout=0.1",
                                                  "attention_dropout=0.1"), False),
    "tp2": (lambda: llama("tensor_model_parallel_size=2", "gpus_per_node=2"), True),
    "pp2-last-stage": (lambda: llama("pipeline_model_parallel_size=2", "gpus_per_node=2",
                                     "global_batch_size=4"), True),
    "dp2-distopt-overlaps": (lambda: llama("gpus_per_node=2", "use_distributed_optimizer=true",
                                           "overlap_grad_reduce=true", "overlap_param_gather=true",
                                           "global_batch_size=8"), True),
    "vp2xpp2-dp2-distopt-overlaps-first-stage": (lambda: llama(
        "pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2", "gpus_per_node=4",
        "use_distributed_optimizer=true", "overlap_grad_reduce=true", "overlap_param_gather=true",
        "global_batch_size=8"), False),
    # the shipped CharLLM-PPT layouts (64 GPUs, one rank here), sequence parallelism and TP overlap
    # left out: both need Transformer Engine, which this lane's node (like the lent GPU's) lacks
    "ppt-gpt3-175b-tp8-pp8-distopt-overlaps": (lambda: Experiment.load("ppt-h100-gpt3-175b-3-10000").apply(
        ["sequence_parallel=false", "tp_comm_overlap=false", "global_batch_size=8"]), True),
    "ppt-llama3-70b-tp8-pp4-dp2-distopt-overlaps": (lambda: Experiment.load("ppt-h100-llama3-70b-1-10000").apply(
        ["sequence_parallel=false", "tp_comm_overlap=false", "global_batch_size=8"]), False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_cuda_path_builds_and_steps_with_every_tensor_on_the_gpu(tmp_path, layout):
    build, last_rank = LAYOUTS[layout]
    result = fake_run(tmp_path, build(), last_rank=last_rank)
    assert_ran_on_cuda(result)
    assert result["implementation"]["device"] == "cuda"
    assert result["model"] == ("HybridModel" if model_builder.hybrid_preferred() else "GPTModel")


def test_moe_goes_as_far_as_routing_lets_it(tmp_path):
    """Mixtral 8x7B's shipped layout (TP8, EP8, the alltoall dispatcher). Routing reads how many
    tokens go to each expert, and with no data that is zero: a release whose dispatcher then meets
    an op of data-dependent shape stops there. Everything before it must be on the GPU."""
    exp = Experiment.load("ppt-h100-mixtral-8x7b-1-00000").apply(
        ["sequence_parallel=false", "tp_comm_overlap=false", "global_batch_size=8"])
    result = fake_run(tmp_path, exp)
    assert result["not_on_cuda"] == [], result["not_on_cuda"][:5]
    if not result["ok"]:
        assert result["error"].startswith(("DynamicOutputShapeException", "DataDependentOutputException")), \
            f"{result['error']}\n{result['traceback']}"


KIT_EXPERIMENTS = sorted((TESTS.parent / "benchmarks" / "gpu" / "experiments").glob("*.toml"))


@pytest.mark.parametrize("path", KIT_EXPERIMENTS, ids=[p.stem for p in KIT_EXPERIMENTS])
def test_the_gpu_kits_experiments_build_and_step_on_the_gpu_path(tmp_path, path):
    """The files the GPU acceptance kit launches first on a lent GPU (benchmarks/gpu/), as they are:
    each starts on the CUDA path here, or the kit would spend its GPU time finding out. MoE goes as
    far as routing lets it (above)."""
    exp = Experiment.load(str(path))
    result = fake_run(tmp_path, exp)
    assert result["not_on_cuda"] == [], result["not_on_cuda"][:5]
    if exp.model.num_moe_experts and not result["ok"]:
        assert result["error"].startswith(("DynamicOutputShapeException", "DataDependentOutputException")), \
            f"{result['error']}\n{result['traceback']}"
    else:
        assert_ran_on_cuda(result)


# --------------------------------------------------------------------------------------------
# The two defects the lane exists to catch, re-introduced
# --------------------------------------------------------------------------------------------
WITHOUT = '''
import inspect
from charllm.engine.workload import train
source = inspect.getsource(train.{function})
assert {line!r} in source, "the workload changed: this test no longer re-introduces the defect"
exec(compile(source.replace({line!r}, "pass"), inspect.getsourcefile(train), "exec"), train.__dict__)
'''


@pytest.mark.parametrize("precision", ["bf16=true", "bf16=false"])
def test_a_model_never_moved_to_the_gpu_fails_the_lane(tmp_path, precision):
    """The H100's first failure: build_model without its .cuda(). In bf16 megatron's optimizer
    refuses the host parameters with the H100's own message; in fp32 nothing in megatron notices
    before an op mixes devices, and the lane's placement check names the parameters either way."""
    before = WITHOUT.format(function="build_model", line="model.cuda(torch.cuda.current_device())")
    result = fake_run(tmp_path, llama(precision), before=before)
    assert not result["ok"]
    assert any(line.startswith("chunk 0 parameter ") and ": cpu " in line for line in result["not_on_cuda"])
    if precision == "bf16=true":
        assert result["error"].startswith("TypeError: Wrapped parameters must be one of torch.cuda."), result["error"]
    else:
        assert result["error"].startswith("FakeTensorDeviceMismatchError"), result["error"]


def test_a_batch_left_on_the_host_fails_the_lane(tmp_path):
    """forward_step without moving the batch to the model's device: the embedding lookup mixes a
    host index with a GPU table, which CUDA refuses (and cpu_compat's virtual device cannot see)."""
    before = WITHOUT.format(function="forward_step",
                            line="batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}")
    result = fake_run(tmp_path, llama(), before=before)
    assert not result["ok"] and result["not_on_cuda"] == []      # the model is where it should be
    assert result["error"].startswith("FakeTensorDeviceMismatchError: Expected all tensors to be on the same "
                                      "device"), result["error"]


# --------------------------------------------------------------------------------------------
# What the review found, on the CUDA path
# --------------------------------------------------------------------------------------------
def test_grouped_query_attention_is_expanded_for_the_fused_kernels(tmp_path):
    """attention_backend = "fused" restricts SDPA to the memory-efficient and cuDNN kernels; torch
    2.13's memory-efficient kernel refuses enable_gqa, so K and V reach it expanded to every head.
    With torch choosing (flash can take GQA) they go as they are."""
    fused = fake_run(tmp_path / "fused", llama("attention_backend=fused"))
    assert_ran_on_cuda(fused)
    assert fused["sdpa_kernels"] == ["CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]
    assert {(c["query_heads"], c["key_heads"], c["enable_gqa"]) for c in fused["sdpa"]} == {(32, 32, False)}
    auto = fake_run(tmp_path / "auto", llama())
    assert auto["sdpa_kernels"] is None
    assert {(c["query_heads"], c["key_heads"], c["enable_gqa"]) for c in auto["sdpa"]} == {(32, 8, True)}


def test_without_te_or_apex_adam_is_fused_and_the_gradient_norm_stays_on_the_gpu(tmp_path):
    """megatron-core's torch fallback builds AdamW unfused and reads every parameter's norm to the
    host; the workload turns fused on and computes the norm on the device. A step then reads the
    device a fixed few times (the NaN checks of 2 micro-batches and 1 bucket, the grad norm, the
    loss), not once per parameter tensor (about 150 here)."""
    result = fake_run(tmp_path, llama())
    assert_ran_on_cuda(result)
    assert result["optimizer"] == {"fused": True, "grad_norm": "device_l2_norm"}
    assert result["implementation"]["optimizer"] == "torch"
    assert result["host_reads"][-1] <= 12, result["host_reads"]


def test_megatrons_own_gradient_norm_fallback_fails_the_lane(tmp_path):
    """Why the workload replaces it: it builds a CUDA tensor from host values read one parameter at a
    time, which needs the data (a sync each) and so cannot run without a GPU."""
    before = "from charllm.engine.workload import train\ntrain.use_torch_fast_paths = lambda exp, optimizer: None"
    result = fake_run(tmp_path, llama(), before=before)
    assert not result["ok"] and result["optimizer"] == {"fused": False, "grad_norm": "local_multi_tensor_l2_norm"}


def test_the_first_step_holds_the_param_all_gather_as_megatron_lm_does(tmp_path):
    """With the distributed optimizer's overlapped param all-gather: the forward pre-hooks and
    param_sync_func (the interleaved schedule's own gathers) are off for the first step and on
    after it (Megatron-LM's training.py, should_disable_forward_pre_hook)."""
    result = fake_run(tmp_path, llama("pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2",
                                      "gpus_per_node=4", "use_distributed_optimizer=true",
                                      "overlap_grad_reduce=true", "overlap_param_gather=true",
                                      "global_batch_size=8"))
    assert_ran_on_cuda(result)
    setup, *after_steps = result["param_sync"]
    assert setup == {"pre_hooks": False, "param_sync_func": False}
    assert after_steps == [{"pre_hooks": True, "param_sync_func": True}] * 2


def test_without_a_compiler_the_fusions_are_off_and_the_run_says_why(tmp_path):
    result = fake_run(tmp_path, llama(), compiler=None)
    assert_ran_on_cuda(result)
    impl = result["implementation"]
    assert "bias_activation_fusion" not in impl["fusions"] and "bias_dropout_fusion" not in impl["fusions"]
    assert any("no working host C compiler" in note for note in impl["notes"])
    with_compiler = fake_run(tmp_path / "cc", llama())["implementation"]
    assert {"bias_activation_fusion", "bias_dropout_fusion"} <= set(with_compiler["fusions"])
    assert with_compiler["notes"] == []
