"""The telemetry and iteration-log schemas: the one place they are defined.

Telemetry is wide: one row per (timestamp, node, device), one column per metric, the unit in
the column name. A metric a device does not support is null, never 0 or -1. The host itself is
a device too (`device = "host"`, `backend = "host"`), so host metrics sit in the same table.
"""

from __future__ import annotations

from typing import TypeVar

import polars as pl

# Identity columns, always present and never null.
ID_COLUMNS: dict[str, pl.DataType] = {
    "ts_ns": pl.Int64(),         # wall clock, ns since the epoch
    "mono_ns": pl.Int64(),       # monotonic clock of the sampling node, ns
    "node": pl.String(),         # node name (hostname, or the name the launcher gave)
    "device": pl.String(),       # "gpu0".., "gcd0".. for accelerators, "host" for the node itself
    "uuid": pl.String(),         # stable device id (GPU UUID; host: "host-<hostname>")
    "backend": pl.String(),      # nvml | amdsmi | host | sim | replay:<source backend>
    "simulated": pl.Boolean(),   # True for every row produced by the sim backend
}

# Accelerator metrics.
GPU_METRICS: dict[str, pl.DataType] = {
    "power_w": pl.Float64(),            # instant (NVML) / current socket (AMD) power
    "power_avg_w": pl.Float64(),        # driver's 1 s average power
    "mem_power_w": pl.Float64(),        # memory-scope power where supported
    "energy_j": pl.Float64(),           # cumulative energy counter since driver load (may wrap)
    "temp_gpu_c": pl.Float64(),         # GPU die (AMD: edge)
    "temp_hotspot_c": pl.Float64(),     # junction / hotspot
    "temp_mem_c": pl.Float64(),         # HBM
    "sm_clock_mhz": pl.Float64(),       # SM (AMD: GFX) clock
    "mem_clock_mhz": pl.Float64(),
    "util_gpu_pct": pl.Float64(),
    "util_mem_pct": pl.Float64(),
    "mem_used_bytes": pl.Int64(),
    "mem_total_bytes": pl.Int64(),
    "power_limit_w": pl.Float64(),      # enforced power limit / cap
    "throttle_reasons": pl.Int64(),     # NVML clocks-event reasons bitmask (see THROTTLE_BITS)
    "pcie_tx_bytes_s": pl.Float64(),
    "pcie_rx_bytes_s": pl.Float64(),
    "nvlink_tx_bytes": pl.Int64(),      # cumulative counter over all links (may wrap); AMD: XGMI
    "nvlink_rx_bytes": pl.Int64(),
    # What the GPU was doing (NVML GPM, Hopper and newer; null elsewhere), each the mean over the
    # interval since the previous GPM sample (at least 100 ms apart, NVML's rule).
    "sm_active_pct": pl.Float64(),      # SMs busy (GPM SM_UTIL)
    "sm_occupancy_pct": pl.Float64(),   # warps resident against the SMs' maximum (GPM SM_OCCUPANCY)
    "tensor_active_pct": pl.Float64(),  # SM time on any tensor-core op (GPM ANY_TENSOR_UTIL)
    "dram_bw_util_pct": pl.Float64(),   # DRAM bandwidth used against its peak (GPM DRAM_BW_UTIL)
    "nvlink_tx_bytes_s": pl.Float64(),  # NVLink bandwidth over all links (GPM NVLINK_TOTAL_*_PER_SEC)
    "nvlink_rx_bytes_s": pl.Float64(),
    # Time the driver held clocks down for a reason, cumulative since driver load (NVML violation
    # status; AMD: PVIOL/TVIOL's share of each interval, added up since the probe started).
    "violation_power_ns": pl.Int64(),
    "violation_thermal_ns": pl.Int64(),
    "violation_sync_boost_ns": pl.Int64(),
}

# Node (host) metrics, on the row with device == "host".
HOST_METRICS: dict[str, pl.DataType] = {
    "cpu_util_pct": pl.Float64(),
    "cpu_iowait_pct": pl.Float64(),     # CPU time idle while waiting on I/O, over all cores
    "cpu_core_util_pct": pl.List(pl.Float64()),   # each core's utilization, in the kernel's core order
    "cpu_freq_mhz": pl.Float64(),
    "host_mem_used_bytes": pl.Int64(),
    "host_mem_total_bytes": pl.Int64(),
    "cpu_energy_j": pl.Float64(),       # RAPL package energy, cumulative (may wrap)
    "dram_energy_j": pl.Float64(),      # RAPL DRAM energy, cumulative (may wrap)
    "temp_cpu_c": pl.Float64(),         # hottest CPU sensor
    "ib_tx_bytes": pl.Int64(),          # InfiniBand port counters, summed over ports
    "ib_rx_bytes": pl.Int64(),
    "net_tx_bytes": pl.Int64(),         # all non-loopback NICs, cumulative
    "net_rx_bytes": pl.Int64(),
}

# Sampler bookkeeping, on every row.
SAMPLER_COLUMNS: dict[str, pl.DataType] = {
    "iteration": pl.Int64(),            # training iteration in progress at ts_ns, if known
    "missed_deadlines": pl.Int64(),     # cumulative count of ticks the sampler missed
    "errors": pl.Int64(),               # cumulative transient backend errors on this device
}

TELEMETRY_SCHEMA: dict[str, pl.DataType] = {**ID_COLUMNS, **GPU_METRICS, **HOST_METRICS, **SAMPLER_COLUMNS}
METRIC_COLUMNS: tuple[str, ...] = tuple(GPU_METRICS) + tuple(HOST_METRICS)

# NVML clocks-event reason bits (nvmlClocksEventReason*); AMD and sim map onto the same bits.
THROTTLE_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "app_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}
# The reasons that mean "performance lost to power or heat".
THROTTLE_PERF_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def empty_frame() -> pl.DataFrame:
    return pl.DataFrame(schema=TELEMETRY_SCHEMA)


Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


def conform(frame: Frame) -> Frame:
    """Add missing columns as nulls and cast to the schema, in schema order (eager or lazy)."""
    present = set(frame.collect_schema().names())
    cols = []
    for name, dtype in TELEMETRY_SCHEMA.items():
        if name in present:
            cols.append(pl.col(name).cast(dtype))
        else:
            cols.append(pl.lit(None, dtype=dtype).alias(name))
    return frame.select(cols)


# The iteration log (run_dir/iterations.jsonl): one JSON object per line, written by rank 0 and
# by the last rank. `event` is "iteration" for a finished training step; other events are
# "start" (workload begins; carries world_size, layout, seed, runtime: what actually runs, see
# engine.model.runtime, and on rank 0's, ranks: every rank's node, local rank and pp/tp/cp/dp
# coordinates), "end" (carries status and memory: per pipeline stage, the highest allocated and
# reserved peaks of its ranks) and "profile" (a profiler trace written, by the rank that wrote it:
# iteration, pp_rank, file under the run, bytes, export_s; engine.workload.profiler). A command's own
# log read into it (probes.store.trainlogs) adds "memory" (a memory report: rank, iteration, allocated
# and reserved bytes, the peaks as mem_peak_bytes and mem_reserved_bytes) and an "end" per node from the
# command's runner (engine.launch.command: status, exit_code); its lines carry `source`, no `rank`.
ITERATION_FIELDS: dict[str, type] = {
    "event": str,              # "start" | "iteration" | "end"
    "iteration": int,          # 1-based training step
    "rank": int,               # global rank that wrote the line
    "node": str,
    "start_ns": int,           # wall clock, ns since the epoch
    "end_ns": int,
    "loss": float,             # lm loss (last rank; null on ranks that do not compute it)
    "grad_norm": float,
    "samples": int,            # global batch size of this step
    "tokens": int,             # samples * seq_length
    "mem_peak_bytes": int,     # highest CUDA allocator peak of any rank so far; max process RSS on CPU
    "mem_reserved_bytes": int, # highest CUDA allocator reserved peak of any rank; null on CPU
    "tflops_per_gpu": float,   # model TFLOP/s per GPU (Megatron's FLOP count)
    "warmup": bool,            # True for the warm-up iterations (excluded from steady state)
    "profiled": bool,          # True for a step some rank recorded a profiler trace of (it ran slower)
    "timers": dict,            # rank 0's line: every rank's step timers, {field: [rank 0's, rank 1's, ...]}
                               # (RANK_TIMERS; engine.workload.timers); null on the other lines
    "source": str,             # the log format a command's line was read in (megatron, torchtitan, nemo, a regex)
    "loss_scale": float,       # as the command logged them, where its format has them
    "skipped_iterations": int,
    "nan_iterations": int,
}
# What only a command's lines hold (read from its log, probes.store.trainlogs); the workload's have the rest.
COMMAND_FIELDS = ("source", "loss_scale", "skipped_iterations", "nan_iterations")
# The step timers each rank reports (seconds in the step; null where not measured), in `timers`.
RANK_TIMERS = ("forward_backward_s", "compute_s", "pipeline_wait_s", "grad_reduce_s", "optimizer_s", "step_s")
ITERATION_SCHEMA: dict[str, pl.DataType] = {
    "event": pl.String(), "iteration": pl.Int64(), "rank": pl.Int64(), "node": pl.String(),
    "start_ns": pl.Int64(), "end_ns": pl.Int64(), "loss": pl.Float64(), "grad_norm": pl.Float64(),
    "samples": pl.Int64(), "tokens": pl.Int64(), "mem_peak_bytes": pl.Int64(), "mem_reserved_bytes": pl.Int64(),
    "tflops_per_gpu": pl.Float64(), "warmup": pl.Boolean(), "profiled": pl.Boolean(),
}
