"""Summaries of a run an H200 recorded (tests/data/gpu_runs/runs/: the acceptance kit's m1-llama1b-mbs1 on
megatron-core 0.19.2, NVML at 50 Hz), recomputed here from its telemetry: the figures two independent
NVML readings give must agree, and the run's own records must match what it measured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from charllm.probes.analysis.summary import summarize

RUN = Path(__file__).parents[2] / "data" / "gpu_runs" / "runs" / "20261126-045153-m1-llama1b-mbs1"


@pytest.fixture
def run(tmp_path):
    copy = tmp_path / RUN.name
    shutil.copytree(RUN, copy)
    shutil.rmtree(copy / "summaries")        # recomputed, not read back
    return copy


def test_the_energy_counter_and_the_sampled_power_agree(run):
    row = summarize(run, by="run").row(0, named=True)
    assert row["energy_source"] == "counter" and row["samples"] > 30 and not row["simulated"]
    # NVML's total-energy counter over the steady window, against the mean of the power samples
    assert row["energy_j"] / row["duration_s"] == pytest.approx(row["power_mean_w"], rel=0.03)
    assert 100 < row["power_mean_w"] < 1.2 * row["power_limit_w"]


def test_throughput_and_mfu_follow_from_the_iterations(run):
    row = summarize(run, by="run").row(0, named=True)
    iterations = [json.loads(line) for line in (run / "iterations.jsonl").read_text().splitlines()]
    steady = [r for r in iterations if r.get("event") == "iteration" and not r.get("warmup")]
    rates = [r["tflops_per_gpu"] for r in steady]
    assert row["iterations"] == len(steady) and min(rates) <= row["tflops_per_gpu"] <= max(rates)
    assert row["mfu_pct"] == pytest.approx(100 * row["tflops_per_gpu"] / 989.4, rel=1e-6)    # the bf16 peak
    assert row["energy_per_token_j"] == pytest.approx(row["energy_j"] / sum(r["tokens"] for r in steady), rel=1e-9)
