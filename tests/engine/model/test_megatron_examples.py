"""NVIDIA's Llama-3 8B FP8 example (examples/llama/train_llama3_8b_h100_fp8.sh), planned from the command
it launches (tests/data/megatron_examples/).

As shipped (CP_SIZE=1) it is planned over an H100: the allocated peak is while the loss runs, with all
32 layers' activations held (29.6 GiB at sequence 8192) and the fused cross-entropy's logits (bf16, its
fp32 copy and exp: 10 bytes for each of 8192 x 128256 logits, 9.8 GiB). Each of those terms is checked
on Megatron-LM's own measurements (test_memory_validation: FP8 parameters in the native_fp8 cases,
within 1.6%; the fused cross-entropy as the peak of the cross_entropy_loss_fusion cases and of the
258k-vocabulary DeepSeek-V3 proxy, within 0.4%). The layout NVIDIA measured, in the README beside the
script, is CP 2 (GA 32): that one fits, and its planned throughput is checked against theirs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from charllm.engine.model.megatron import import_megatron_args
from charllm.engine.model.memory import DOES_NOT_FIT, FITS, estimate
from charllm.engine.model.speed import estimate as speed_estimate

LINE = (Path(__file__).parents[2] / "data" / "megatron_examples" / "train_llama3_8b_h100_fp8.txt").read_text()
# examples/llama/README.md, "FP8 Performance": LLAMA3-8B, 8 GPUs, GBS 128, MBS 1, seq 8192, CP 2, GA 32
NVIDIA_TOKENS_PER_GPU_S, NVIDIA_TFLOPS_PER_GPU = 13812, 800
GiB = 2**30


def imported(cp: int):
    line = LINE.replace("--context-parallel-size 1", f"--context-parallel-size {cp}")
    return import_megatron_args(line, hardware="h100-sxm-80gb").experiment


def test_as_shipped_it_does_not_fit_and_the_loss_sets_the_peak():
    exp = imported(1)
    assert (exp.world_size, exp.parallel.context_parallel_size, exp.training.fp8_param_gather) == (8, 1, True)
    stage = estimate(exp).stages[0]
    assert stage.verdict == DOES_NOT_FIT
    assert stage.total_bytes > stage.allocator_bytes
    assert stage.activations == pytest.approx(29.6 * GiB, rel=0.01)           # all 32 layers held
    assert stage.other - stage.workspace == pytest.approx(10 * 8192 * 128256, rel=0.01)   # the logits, 10 B each


def test_nvidias_measured_layout_fits_and_runs_near_their_throughput():
    exp = imported(2)
    assert exp.data_parallel_size == 4 and exp.num_microbatches == 32       # the README's GA 32
    assert estimate(exp).stages[0].verdict == FITS
    speed = speed_estimate(exp)
    tokens_per_gpu = speed.tokens_per_s / exp.world_size
    assert tokens_per_gpu == pytest.approx(NVIDIA_TOKENS_PER_GPU_S, rel=0.15)
    tflops = speed.flops_per_iteration / speed.step_s / exp.world_size / 1e12
    assert tflops == pytest.approx(NVIDIA_TFLOPS_PER_GPU, rel=0.15)
