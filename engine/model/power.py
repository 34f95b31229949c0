"""Power, SM clock and the board's power limit over one training step, predicted from the speed model.

`predict(exp)` lays out one device's step (the busiest pipeline stage) in schedule order from the parts
`speed.step_times` computes: the pipeline's fill, each micro-batch's forward and backward (1:2), each
layer as its GEMM (tensor-core) work then its memory-bound work, the exposed communication and the
host's gaps per micro-batch, the drain, the data-parallel sync and the optimizer. Each phase demands a
power at full clock from its kind and precision; a limiter holds a running average of the power (time
constant LIMITER_TAU_S) at the board's limit by lowering the SM clock, which lengthens the GEMMs, so
the step follows; transients shorter than the average pass above the limit. What NVML would report
(its power sensor's window sampled at the telemetry rate) gives the mean, p99 and peak power, the
share of time the limiter holds the clock (NVML's "SW power cap" throttle reason), the mean SM clock
and the energy per token. A first-order thermal model (THERMAL, per vendor) driven by that power gives the
GPU's steady temperature and its peak over a run of the experiment's train_iters steps.

The free constants were fitted to the one H200 run kept whole (tests/data/gpu_runs/runs/
20261126-045153-m1-llama1b-mbs1) and the fp32 share to the two fp32 runs of tests/data/gpu_runs/
h200-2026-11-26.json: one run is all there is for the limiter (tests/engine/model/test_power.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from charllm.engine.model import memory, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import num_floating_point_operations

# What a large GEMM at full clock demands, as a share of the board's dynamic range (limit - idle), by the
# precision of the linears: tensor-core GEMMs demand more than a 700 W board sustains (the kept H200 run's
# 100 ms readings reach 795 W under a 700 W limit); fp32 runs on the CUDA cores. Fitted: bf16 to the kept
# run (1 run), fp32 to the two fp32 runs; fp16 as bf16 and fp8 as bf16 (assumed: same tensor cores).
GEMM_DEMAND = {"bf16": 1.5, "fp16": 1.5, "fp8": 1.5, "fp32": 0.9}
# The limiter's running average of power (s): fitted to the kept run (1 run); NVIDIA publishes no time
# constant for the SW power cap.
LIMITER_TAU_S = 0.1
# How fast the limiter gives the clock back once the average is under the limit (share of the max clock per
# second): fitted to the kept run (1 run), whose clock stays 1-11% under 1980 MHz through its busy window.
CLOCK_RECOVERY_PER_S = 0.5
# Dynamic power ~ clock^3 (P ~ f V^2 with the voltage following the clock in the DVFS range): assumed.
CLOCK_EXPONENT = 3.0
LOWEST_CLOCK = 0.5              # the limiter's floor, share of the max clock: assumed
# NVML's power reading (NVML_FI_DEV_POWER_INSTANT, the probe's power_w) changes every 100 ms on the kept
# H200 run: taken as the mean over the last 100 ms (measured there; NVML documents only the 1 s average of
# nvmlDeviceGetPowerUsage on Ampere and newer: docs.nvidia.com/deploy/nvml-api, nvmlDeviceGetPowerUsage).
SENSOR_WINDOW_S = 0.1
SAMPLE_HZ = 50.0                # the telemetry rate the kept run was recorded at
RESOLUTION_S = 1e-3             # the timeline's bin, coarser only for steps over 10 s (at most 10,000 bins)
MAX_BINS = 10_000
WARM_S = 2.0                    # seconds of steps measured (at least one), after one that lets the limiter settle
BACKWARD = 2 / 3                # the backward's share of a micro-batch's compute (it runs each GEMM twice)
# The GPU temperature as a first-order lag of its power: tau dT/dt = ambient + R x P - T. Fitted to the kept
# H200 run's 50 Hz temp_gpu_c (1 run, 1.5 s busy: 32 C at 79 W idle, 34 -> 50 C over the busy window, back
# to 35 C within 0.5 s; RMS 1.5 K): its time constant is the die's over its heatsink. The heatsink's own
# warming over minutes is not in one short run, so a long run will run hotter than this says: assumed until
# runs of each hardware calibrate it. AMD: the H200's, assumed (no AMD run recorded).
_H200_THERMAL = {"ambient_c": 29.8, "r_k_per_w": 0.0275, "tau_s": 0.2}
THERMAL = {"nvidia": _H200_THERMAL, "amd": _H200_THERMAL}
THERMAL_SOURCE = {"nvidia": "assumed, fitted to 1 short run (20261126-045153-m1-llama1b-mbs1, H200, 1.5 s busy): "
                            "no heatsink warming",
                  "amd": "assumed, the H200's constants: no AMD run recorded"}
SOURCE = ("calibrated on 1 run, 20261126-045153-m1-llama1b-mbs1 (H200); fp32 demand on 2 runs; "
          "clock exponent assumed")


@dataclass(frozen=True)
class Phase:
    kind: str                   # "gemm", "memory", "communication", "idle"
    seconds: float              # at full clock
    share: float                # demand at full clock, share of the board's dynamic range

    @property
    def clocked(self) -> bool:  # its time scales with the SM clock
        return self.kind == "gemm"


@dataclass(frozen=True)
class PowerReport:
    mean_w: float
    p99_w: float                # of NVML's readings at SAMPLE_HZ
    peak_w: float
    limit_share: float          # share of the step the limiter holds the clock under its max
    sm_clock_mhz: float         # time-weighted mean
    energy_per_token_j: float
    step_s: float               # the speed model's step, lengthened by the throttled GEMMs
    slowdown: float             # step_s over the speed model's
    limit_w: float
    source: str
    temp_steady_c: float | None = None  # the GPU's mean temperature once the steps repeat (THERMAL)
    temp_peak_c: float | None = None    # its highest over the run's train_iters steps, from the idle board's
    temp_source: str | None = None

    def to_dict(self) -> dict:
        return {"mean_w": self.mean_w, "p99_w": self.p99_w, "peak_w": self.peak_w, "limit_share": self.limit_share,
                "sm_clock_mhz": self.sm_clock_mhz, "energy_per_token_j": self.energy_per_token_j,
                "step_s": self.step_s, "slowdown": self.slowdown, "limit_w": self.limit_w, "source": self.source,
                "temp_steady_c": self.temp_steady_c, "temp_peak_c": self.temp_peak_c, "temp_source": self.temp_source}


def tensor_busy(exp: Experiment, times: speed.Times) -> float:
    """How busy the layout's GEMMs keep the tensor cores, relative to large GEMMs (0-1): Megatron's FLOPs
    per device over its GEMM and attention seconds at the large-GEMM rate. Small GEMMs (a small micro
    batch, a narrow model, small experts) fill fewer waves and spend more of their time filling and
    draining, and draw less."""
    precision = speed.linear_precision(exp)
    r = speed.rates(exp, precision)
    flops = num_floating_point_operations(exp.model, exp.training.global_batch_size, exp.seq_length,
                                          exp.parallel.tensor_model_parallel_size) / exp.world_size
    seconds = float(times.matmul_s[0])
    return min(flops / (seconds * r.matmul_flops * r.matmul), 1.0) if seconds > 0 else 0.0


def timeline(exp: Experiment, times: speed.Times | None = None) -> list[Phase]:
    """One device's step in schedule order, at full clock: the busiest stage's micro-batches between the
    pipeline's fill and drain, then the data-parallel sync and the optimizer."""
    if times is None:
        times = speed.step_times(exp, speed.layouts_of(exp))
    act = speed.ACTIVITY
    busy = tensor_busy(exp, times)
    gemm_share = act["memory"] + (GEMM_DEMAND[speed.linear_precision(exp)] - act["memory"]) * busy
    mb = float(exp.num_microbatches)
    stages = speed.stage_features(exp)[0]
    stage = stages[max(range(len(stages)), key=lambda k: float(times.stage_s[0][k]))]   # the busiest
    layers = max(int(stage[speed.DENSE] + stage[speed.MOE] + stage[speed.MTP]), 1)
    compute = float(times.compute_s[0]) / mb
    matmul = min(float(times.matmul_s[0]), float(times.compute_s[0])) / mb
    data_parallel = float(times.data_parallel_s[0])
    comm = (float(times.communication_s[0]) - data_parallel) / mb
    host = float(times.host_s[0]) / mb
    bubble = float(times.bubble_s[0]) / 2

    def passes(share: float) -> list[Phase]:
        """A forward (share 1/3) or backward (2/3): per layer its GEMMs then its memory-bound work, then the
        exposed communication."""
        per_layer = [Phase("gemm", matmul * share / layers, gemm_share),
                     Phase("memory", (compute - matmul) * share / layers, act["memory"])]
        return per_layer * layers + [Phase("communication", comm * share, act["communication"])]

    micro_batch = passes(1 - BACKWARD) + passes(BACKWARD) + [Phase("idle", host, act["idle"])]
    optimizer = float(times.other_s[0]) - speed.FIXED_STEP_S
    phases = ([Phase("idle", bubble, act["idle"])] + micro_batch * int(mb) + [Phase("idle", bubble, act["idle"])]
              + [Phase("communication", data_parallel, act["communication"]),
                 Phase("memory", optimizer, act["memory"]), Phase("idle", speed.FIXED_STEP_S, act["idle"])])
    return [p for p in phases if p.seconds > 0]


def _bins(np, phases: list[Phase], idle_w: float, range_w: float):
    """(bin seconds, watts demanded at full clock, share of each bin's time that the clock sets): the
    phases on a grid of RESOLUTION_S (or step / MAX_BINS), each bin the time-weighted mean of what falls
    in it."""
    seconds = np.asarray([p.seconds for p in phases])
    edges = np.concatenate([[0.0], np.cumsum(seconds)])
    step = float(edges[-1])
    dt = max(RESOLUTION_S, step / MAX_BINS)
    grid = np.linspace(0.0, step, max(int(math.ceil(step / dt)), 1) + 1)

    def binned(per_phase):
        """Per bin: the mean of a per-phase rate over the bin's time."""
        integral = np.concatenate([[0.0], np.cumsum(seconds * per_phase)])
        return np.diff(np.interp(grid, edges, integral)) / np.diff(grid)

    watts = binned(np.asarray([idle_w + range_w * p.share for p in phases]))
    clocked = binned(np.asarray([float(p.clocked) for p in phases]))
    return np.diff(grid), watts, clocked


def _limited(demand: float, clocked: float, f: float, idle_w: float) -> tuple[float, float]:
    """(seconds per full-clock second, mean watts) of a bin at clock share f: its clocked part takes 1/f as
    long at idle + (demand - idle) f^CLOCK_EXPONENT (same energy per unit of work otherwise)."""
    stretch = clocked / f + (1.0 - clocked)
    clocked_w = idle_w + (demand - idle_w) * f ** CLOCK_EXPONENT
    return stretch, (clocked / f * clocked_w + (1.0 - clocked) * demand) / stretch


def simulate(np, dt, demand, clocked, idle_w: float, limit_w: float, passes: int):
    """Run the bins `passes` times through the limiter: per bin (real seconds, watts, clock share). The clock
    recovers at CLOCK_RECOVERY_PER_S; where a bin at that clock would lift the running average (LIMITER_TAU_S)
    over the limit, the clock drops until it does not."""
    n = len(dt)
    real, watts, clock = np.empty(n * passes), np.empty(n * passes), np.empty(n * passes)
    f, average, last = 1.0, idle_w, 0.0
    for i in range(n * passes):
        k = i % n
        full, d, c = float(dt[k]), float(demand[k]), float(clocked[k])
        f = min(1.0, f + CLOCK_RECOVERY_PER_S * last)
        stretch, w = _limited(d, c, f, idle_w)
        keep = 1.0 - math.exp(-full * stretch / LIMITER_TAU_S)
        if average + (w - average) * keep > limit_w and c > 0:
            low, high = LOWEST_CLOCK, f           # the highest clock that keeps the average at the limit
            for _ in range(12):
                mid = (low + high) / 2
                s, p = _limited(d, c, mid, idle_w)
                over = average + (p - average) * (1.0 - math.exp(-full * s / LIMITER_TAU_S)) > limit_w
                low, high = (low, mid) if over else (mid, high)
            f = low
            stretch, w = _limited(d, c, f, idle_w)
            keep = 1.0 - math.exp(-full * stretch / LIMITER_TAU_S)
        last = full * stretch
        average += (w - average) * keep
        real[i], watts[i], clock[i] = last, w, f
    return real, watts, clock


def sensor(np, real, watts, start: float):
    """NVML's readings at SAMPLE_HZ from `start` (s): each the mean power over the SENSOR_WINDOW_S before it."""
    ends = np.concatenate([[0.0], np.cumsum(real)])
    energy = np.concatenate([[0.0], np.cumsum(real * watts)])
    at = np.arange(max(start, SENSOR_WINDOW_S), ends[-1], 1.0 / SAMPLE_HZ)
    return (np.interp(at, ends, energy) - np.interp(at - SENSOR_WINDOW_S, ends, energy)) / SENSOR_WINDOW_S


def temperatures(real, watts, steps: int, idle_w: float, ambient_c: float, r_k_per_w: float,
                 tau_s: float) -> tuple[float, float]:
    """(steady mean, peak over `steps` steps) of the GPU temperature under one step's power (bins of `real`
    seconds at `watts`) repeated from the idle board's temperature. The lag is linear: after k steps the
    step starts at a^k T0 + b (1 - a^k) / (1 - a), and within it each bin's temperature is affine in where
    the step started, rising with it, so the last step holds the peak."""
    decay = [math.exp(-s / tau_s) for s in real]
    a, within, gain, offset = 1.0, 0.0, [], []     # per bin: T = gain x T_start + offset
    for d, w in zip(decay, watts):
        a *= d
        within = within * d + (ambient_c + r_k_per_w * float(w)) * (1.0 - d)
        gain.append(a)
        offset.append(within)
    start = ambient_c + r_k_per_w * idle_w
    k = max(steps - 1, 0)
    last = start * a ** k + (within * (1 - a ** k) / (1 - a) if a < 1.0 else 0.0)
    mean_w = float(sum(s * w for s, w in zip(real, watts)) / sum(real))
    peak = max(max(g * last + o for g, o in zip(gain, offset)), start)
    return ambient_c + r_k_per_w * mean_w, peak


def predict(exp: Experiment, times: speed.Times | None = None, limit_w: float | None = None) -> PowerReport | None:
    """The power, clock and time at the limit of `exp`'s step; None where the hardware gives no board limit
    or the speed model no step time. `limit_w`: a power cap under the board's (nvidia-smi -pl); the demand
    stays the board's."""
    import numpy as np  # deferred: start-up time

    hw = exp.hardware
    model = speed.power_model(exp)
    if model is None or speed.missing(exp) or not hw.tdp_w:
        return None
    if times is None:
        times = speed.step_times(exp, speed.layouts_of(exp), impl=memory.implementation(exp))
    idle_w = model.idle_w
    dt, demand, clocked = _bins(np, timeline(exp, times), idle_w, hw.tdp_w - idle_w)
    limit_w = limit_w or hw.tdp_w
    step = float(dt.sum())
    # the first step lets the limiter settle; the steps after it, at least WARM_S, are measured
    measured = max(1, int(math.ceil(WARM_S / step)))
    real, watts, clock = simulate(np, dt, demand, clocked, idle_w, limit_w, measured + 1)
    first = len(dt)
    readings = sensor(np, real, watts, float(real[:first].sum()))
    real, watts, clock = real[first:], watts[first:], clock[first:]
    seconds = float(real.sum())
    mean = float((real * watts).sum() / seconds)
    step_s = float(times.step_s[0]) * seconds / (step * measured)
    tokens = exp.training.global_batch_size * exp.seq_length
    thermal = THERMAL.get(hw.vendor)
    steady = peak = None
    if thermal:      # one measured step (the last) stands for every step of the run
        last = slice(len(real) - len(dt), len(real))
        steady, peak = temperatures(real[last], watts[last], exp.training.train_iters, idle_w, **thermal)
    return PowerReport(mean_w=mean, p99_w=float(np.percentile(readings, 99)), peak_w=float(readings.max()),
                       limit_share=float(real[clock < 0.999].sum() / seconds),
                       sm_clock_mhz=float((real * clock).sum() / seconds) * hw.max_sm_clock_mhz,
                       energy_per_token_j=mean * exp.world_size * step_s / tokens, step_s=step_s,
                       slowdown=seconds / (step * measured), limit_w=limit_w, source=SOURCE,
                       temp_steady_c=steady, temp_peak_c=peak, temp_source=THERMAL_SOURCE.get(hw.vendor))
