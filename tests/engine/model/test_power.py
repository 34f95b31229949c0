"""Power, clocks and the board's limit predicted from the step's timeline (engine.model.power): the limiter's
physics, and the prediction against the H200 runs (tests/data/gpu_runs/). Run with `-s` for the table."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from charllm.engine.model import power, speed
from charllm.engine.model.experiment import Experiment, Hardware
from charllm.engine.model.sweep import base_experiment

DATA = Path(__file__).parents[2] / "data" / "gpu_runs"
KEPT = DATA / "runs" / "20261126-045153-m1-llama1b-mbs1"
RUNS = json.loads((DATA / "h200-2026-11-26.json").read_text())
# measured (16 runs, mean |error| of the mean power): all 4.0%, bf16 3.8% (12 runs), fp32 0.9% (2 runs, the ones
# its demand was fitted to), MoE 8.2% (2 runs; host-bound steps, the host's gaps drawn as idle)
MEAN_ALL, MEAN_BF16, MEAN_MOE = 0.05, 0.05, 0.09


def experiment(record) -> Experiment:
    return Experiment.from_dict(record["experiment"], source=record["run"])


def running_average(real, watts, tau):
    """The limiter's average after each bin."""
    out, average = [], 75.0                                     # from idle, as the limiter starts
    for seconds, w in zip(real, watts):
        average += (w - average) * (1 - math.exp(-seconds / tau))
        out.append(average)
    return np.asarray(out)


def test_a_sustained_demand_over_the_limit_never_lifts_the_average_over_it():
    dt = np.full(3000, 1e-3)                                    # 3 s of GEMMs demanding 1000 W at full clock
    real, watts, clock = power.simulate(np, dt, np.full(3000, 1000.0), np.ones(3000), 75.0, 700.0, 1)
    assert running_average(real, watts, power.LIMITER_TAU_S).max() <= 700.0 + 1e-6
    assert clock[-1] < 0.9 and watts[-1] == pytest.approx(700.0, abs=1.0)     # held at the limit, clock down
    assert real.sum() > dt.sum() * 1.05                                        # the throttled work took longer


def test_a_transient_shorter_than_the_average_passes_over_the_limit():
    demand = np.concatenate([np.full(500, 150.0), np.full(20, 1000.0), np.full(500, 150.0)])
    real, watts, clock = power.simulate(np, np.full(len(demand), 1e-3), demand, np.ones(len(demand)), 75.0, 700.0, 1)
    assert watts.max() == pytest.approx(1000.0) and clock.min() == 1.0      # 20 ms at 1000 W, unthrottled
    readings = power.sensor(np, real, watts, 0.0)
    assert readings.max() < 700.0                                            # NVML's 100 ms window averages it


def h100_llama70b(micro_batch: int) -> Experiment:
    exp = base_experiment("llama3-70b", "h100-sxm-80gb", 2, 8, 128)
    exp.parallel.tensor_model_parallel_size, exp.parallel.pipeline_model_parallel_size = 1, 16
    exp.training.micro_batch_size = micro_batch
    return exp


def test_a_lower_power_limit_throttles_the_gemms_and_lengthens_the_step():
    exp = h100_llama70b(1)
    free, held, low = (power.predict(exp, limit_w=limit) for limit in (2000.0, None, 500.0))
    assert free.slowdown == pytest.approx(1.0) and free.limit_share == 0.0
    assert free.step_s == pytest.approx(float(speed.estimate(exp).step_s))
    assert 1.0 < held.slowdown < low.slowdown
    assert low.step_s > held.step_s > free.step_s
    assert low.sm_clock_mhz < held.sm_clock_mhz < free.sm_clock_mhz == exp.hardware.max_sm_clock_mhz
    assert low.mean_w < 500.0 < held.mean_w


def test_fp32_draws_less_than_bf16_for_the_same_layout():
    exp = experiment(next(r for r in RUNS if r["run"].endswith("m1-llama1b-mbs1")))
    fp32 = dataclasses.replace(exp, training=dataclasses.replace(exp.training, bf16=False))
    bf16, single = power.predict(exp), power.predict(fp32)
    assert single.p99_w < bf16.p99_w and single.limit_share < bf16.limit_share
    assert single.step_s > bf16.step_s                              # CUDA cores: slower, and not at the limit


def test_llama70b_pp16_micro_batch_sweep_peaks_higher_as_the_bubble_grows():
    """GEMMs of 8192 tokens x 8192 are large at any micro batch (tensor cores 79-80% busy), so what changes is
    the schedule: at a global batch of 128, 128 micro-batches of 1 leave a 9% bubble, 16 of 8 a 43% one. The
    limiter's average falls in the longer idle stretches, the clock recovers, and the GEMMs that follow pass
    over the limit for about the average's time constant: p99 rises; the share of time at the limit falls
    with the share of time in GEMMs."""
    got = [power.predict(h100_llama70b(mb)) for mb in (1, 2, 4, 8)]
    p99 = [g.p99_w for g in got]
    at_limit = [g.limit_share for g in got]
    assert p99 == sorted(p99) and p99[-1] > p99[0] + 20 and p99[-1] > 700.0
    assert at_limit == sorted(at_limit, reverse=True) and at_limit[0] > 0.8
    assert [g.mean_w for g in got] == sorted((g.mean_w for g in got), reverse=True)


def test_the_tiny_model_is_host_bound_on_an_h100_and_never_reaches_the_limit():
    """tiny-local (hidden 64, 4 layers, 32 tokens): its GEMMs are all fill and drain (tensor cores 0.1-1%
    busy), 4% of a step the host sets: a larger micro batch makes each GEMM busier but draws next to nothing
    more, and the board stays far under its limit."""
    tiny = Experiment.load("tiny-local")
    tiny = dataclasses.replace(tiny, hardware=Hardware.load("h100-sxm-80gb"))
    busy, got = [], []
    for mb in (1, 2, 4, 8):
        exp = dataclasses.replace(tiny, training=dataclasses.replace(
            tiny.training, micro_batch_size=mb, global_batch_size=mb * 4 * tiny.data_parallel_size))
        times = speed.step_times(exp, speed.layouts_of(exp))
        busy.append(power.tensor_busy(exp, times))
        got.append(power.predict(exp, times))
    assert busy == sorted(busy) and busy[-1] > 5 * busy[0]
    p99 = [g.p99_w for g in got]
    assert p99 == sorted(p99) and all(g.limit_share == 0.0 and g.p99_w < 300.0 for g in got)


def test_the_kept_h200_run_within_the_issues_targets():
    """The one run kept whole (50 Hz telemetry): its steady window's p99 power, the share of samples with the
    SW power cap on, and the mean SM clock. The limiter's constants were fitted to this run: one run is all
    there is."""
    row = pl.read_parquet(KEPT / "summaries" / "gpu-steady.parquet").row(0, named=True)
    exp = Experiment.load(str(KEPT / "experiment.toml"))
    got = power.predict(exp)
    print(f"\nkept run: p99 {got.p99_w:.0f} vs {row['power_p99_w']:.0f} W, at the limit {got.limit_share:.2f} vs "
          f"{row['throttle_sw_power_cap_frac']:.2f}, SM clock {got.sm_clock_mhz:.0f} vs {row['sm_clock_mean_mhz']:.0f}"
          f" MHz, mean {got.mean_w:.0f} vs {row['power_mean_w']:.0f} W")
    assert got.p99_w == pytest.approx(row["power_p99_w"], rel=0.08)
    assert abs(got.limit_share - row["throttle_sw_power_cap_frac"]) <= 0.1
    assert got.sm_clock_mhz == pytest.approx(row["sm_clock_mean_mhz"], rel=0.03)
    assert got.peak_w > exp.hardware.tdp_w > got.mean_w


def test_mean_power_against_the_16_h200_runs():
    errors: dict[str, list[float]] = {}
    for record in RUNS:
        exp = experiment(record)
        kind = "fp32" if not exp.training.bf16 else "moe" if exp.model.num_moe_experts else "bf16"
        got = power.predict(exp)
        errors.setdefault(kind, []).append(got.mean_w / record["measured"]["power_mean_w"] - 1)
        print(f"{record['run']:40s} {kind:5s} {got.mean_w:4.0f} vs {record['measured']['power_mean_w']:4.0f} W")
    mean = {kind: statistics.mean(abs(e) for e in v) for kind, v in errors.items()}
    print({kind: f"{m:.1%} ({len(errors[kind])} runs)" for kind, m in mean.items()})
    assert statistics.mean(abs(e) for v in errors.values() for e in v) < MEAN_ALL
    assert mean["bf16"] < MEAN_BF16 and mean["moe"] < MEAN_MOE and mean["fp32"] < 0.02


def test_the_temperature_follows_the_power_to_ambient_plus_r_times_p():
    """A first-order lag: a long run at 600 W settles at ambient + R x 600 W; a run shorter than the time
    constant never gets there; a run drawing more runs hotter."""
    c = {"ambient_c": 30.0, "r_k_per_w": 0.03, "tau_s": 0.2}
    real, watts = np.full(100, 1e-3), np.full(100, 600.0)          # a 0.1 s step of 600 W
    steady, peak = power.temperatures(real, watts, 200, 80.0, **c)
    assert steady == pytest.approx(48.0) and peak == pytest.approx(48.0, abs=0.01)
    _, short = power.temperatures(real, watts, 1, 80.0, **c)        # 0.1 s from the idle board's 32.4 C
    assert 32.4 < short < 48.0 - 5
    hot, _ = power.temperatures(real, watts + 100.0, 200, 80.0, **c)
    assert hot == pytest.approx(steady + 3.0)
    bursty = np.concatenate([np.full(50, 1000.0), np.full(50, 200.0)])  # the same mean, in bursts
    same, higher = power.temperatures(real, bursty, 200, 80.0, **c)
    assert same == pytest.approx(steady) and higher > peak + 1                 # 50 ms bursts: +1.5 K


def test_the_kept_h200_runs_temperature():
    """Its steady window (0.86 s) averages 45.9 C and peaks at 50 C, from 32 C idle. THERMAL was fitted to
    this run's own trace: one short run is all there is, and it says nothing of a heatsink warming for
    minutes."""
    row = pl.read_parquet(KEPT / "summaries" / "gpu-steady.parquet").row(0, named=True)
    got = power.predict(Experiment.load(str(KEPT / "experiment.toml")))
    print(f"\nkept run: temperature steady {got.temp_steady_c:.1f} vs window mean {row['temp_gpu_mean_c']:.1f} C, "
          f"peak {got.temp_peak_c:.1f} vs {row['temp_gpu_peak_c']:.1f} C ({got.temp_source})")
    assert got.temp_steady_c == pytest.approx(row["temp_gpu_mean_c"], abs=3.0)
    assert got.temp_peak_c == pytest.approx(row["temp_gpu_peak_c"], abs=3.0)
    assert got.temp_source.startswith("assumed")
    cpu = power.predict(Experiment.load("tiny-local"))
    assert cpu is None                                              # no board limit, no power, no temperature
