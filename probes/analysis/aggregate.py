"""Node and run rows from the GPU rows, as the CharLLM-PPT paper aggregates them: averages are
means of the per-GPU values, peaks and p99 the highest per-GPU value, energy and bytes are sums,
minimum clock the lowest; time above the temperature limit is the longest of any GPU. Host
statistics sit beside them (a run with host rows only has node and run rows of those alone)."""

from __future__ import annotations

import polars as pl

from charllm.probes.analysis.devices import KEYS


def combine(accelerators: pl.DataFrame | None, host: pl.DataFrame | None) -> pl.DataFrame | None:
    """Accelerator and host statistics side by side (per node, or one run row each)."""
    if host is None:
        return accelerators
    if accelerators is None:
        return host.rename({"host_simulated": "simulated"})
    if "node" in host.columns:
        both = accelerators.join(host, on="node", how="full", coalesce=True).sort("node")
    else:
        both = pl.concat([accelerators, host], how="horizontal")
    return both.with_columns(pl.any_horizontal("simulated", "host_simulated").alias("simulated")).drop("host_simulated")


def aggregate_hosts(host: pl.DataFrame) -> pl.DataFrame:
    sums = ["cpu_energy_j", "dram_energy_j", "ib_tx_bytes", "ib_rx_bytes", "net_tx_bytes", "net_rx_bytes"]
    return host.select(
        pl.col("host_duration_s").max(),
        *(pl.col(c).mean() for c in ("cpu_util_mean_pct", "cpu_iowait_mean_pct", "cpu_core_busiest_mean_pct",
                                     "cpu_freq_mean_mhz", "temp_cpu_mean_c")),
        *(pl.col(c).max() for c in ("temp_cpu_peak_c", "host_mem_used_peak_bytes")),
        *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum()).alias(c) for c in sums),
        pl.col("host_simulated").any(),
    )


_SUM = ["energy_j", "nvlink_tx_bytes", "nvlink_rx_bytes", "pcie_tx_bytes", "pcie_rx_bytes",
        "spikes_over_mean_count", "spikes_over_limit_count", "samples", "gpus"]
_MAX = [
    "nvlink_tx_peak_bytes_s",
    "nvlink_rx_peak_bytes_s",
    "power_peak_w",
    "power_p99_w",
    "power_max_rise_w_per_s",
    "temp_gpu_peak_c",
    "temp_mem_peak_c",
    "time_above_temp_limit_s",
    "mem_used_peak_bytes",
    "spikes_over_mean_max_excess_w",
    "spikes_over_limit_max_excess_w",
    "duration_s",
    "power_limit_w",
    "max_sm_clock_mhz",
]
_MIN = ["sm_clock_min_mhz"]
_FIRST = ["backend"]


def aggregate_gpus(gpus: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    special = set(_SUM + _MAX + _MIN + _FIRST + KEYS + ["uuid", "simulated", "energy_source"])
    means = [c for c in gpus.columns if c not in special]
    gpu_id = pl.concat_str("node", pl.lit("/"), "device")
    sources = pl.col("energy_source").drop_nulls().unique()
    aggs = [
        *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum()).alias(c) for c in _SUM),
        *(pl.col(c).max() for c in _MAX), *(pl.col(c).min() for c in _MIN), *(pl.col(c).first() for c in _FIRST),
        *(pl.col(c).mean() for c in means),
        pl.col("simulated").any(),
        pl.when(sources.len() == 1).then(sources.first())
        .when(sources.len() > 1).then(pl.lit("counter+trapezoid")).alias("energy_source"),
        # Spread across GPUs: the paper's heatmaps show hot spots by node.
        gpu_id.sort_by("temp_gpu_mean_c", nulls_last=False).last().alias("hottest_gpu"),
        gpu_id.sort_by("temp_gpu_mean_c", nulls_last=True).first().alias("coolest_gpu"),
        (pl.col("temp_gpu_mean_c").max() - pl.col("temp_gpu_mean_c").min()).alias("temp_gpu_spread_c"),
        gpu_id.sort_by("power_mean_w", nulls_last=False).last().alias("highest_power_gpu"),
        gpu_id.sort_by("power_mean_w", nulls_last=True).first().alias("lowest_power_gpu"),
        (pl.col("power_mean_w").max() - pl.col("power_mean_w").min()).alias("power_spread_w"),
    ]
    frame = gpus.lazy()
    if keys:
        lazy = frame.group_by(keys).agg(aggs).sort(keys)
    else:
        lazy = frame.select(aggs).with_columns(pl.lit(None, pl.String).alias("node"))
    out = lazy.with_columns(pl.lit(None, pl.String).alias("device")).collect()
    order = [c for c in gpus.columns if c in out.columns]
    return out.select(order + [c for c in out.columns if c not in order])
