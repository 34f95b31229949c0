"""Telemetry a device at a time: which devices a run holds, batches of them that fit in memory,
and their samples grouped by device in time order.

How it stays fast (an hour of 64 GPUs at 20 Hz is 4.6M rows): one scan of the run reads only
the columns used; devices are ordered by copying the per-device runs of the recorder's
compacted files (never assumed: interleaved chunks are sorted instead); every statistic of
every GPU is then one group_by over contiguous slices (device_stats), shifts masked at device
boundaries.
"""

from __future__ import annotations

import polars as pl

KEYS = ["node", "device"]

GPU_COLUMNS = [
    "ts_ns", "node", "device", "power_w", "energy_j",
    "temp_gpu_c", "temp_mem_c", "sm_clock_mhz", "util_gpu_pct", "util_mem_pct", "mem_used_bytes",
    "power_limit_w", "throttle_reasons", "pcie_tx_bytes_s", "pcie_rx_bytes_s",
    "nvlink_tx_bytes", "nvlink_rx_bytes",
    "sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_bw_util_pct", "nvlink_tx_bytes_s",
    "nvlink_rx_bytes_s", "violation_power_ns", "violation_thermal_ns", "violation_sync_boost_ns",
]


# What names a GPU's row besides node and device (read in the first pass, `scan_devices`).
GPU_LABELS = {"uuid": pl.col("uuid").first(), "backend": pl.col("backend").first(),
              "simulated": pl.col("simulated").any()}

HOST_COLUMNS = [
    "ts_ns",
    "node",
    "device",
    "simulated",
    "cpu_util_pct",
    "cpu_iowait_pct",
    "cpu_core_util_pct",
    "cpu_freq_mhz",
    "temp_cpu_c",
    "host_mem_used_bytes",
    "cpu_energy_j",
    "dram_energy_j",
    "ib_tx_bytes",
    "ib_rx_bytes",
    "net_tx_bytes",
    "net_rx_bytes",
]


BATCH_ROWS = 5_000_000  # samples summarized at once: an hour of 64 GPUs at 20 Hz in a few hundred MB


def scan_devices(scan: pl.LazyFrame) -> pl.DataFrame:
    """One row per device: its samples and names (a streaming pass over the identity columns only)."""
    return scan.group_by("node", "device").agg(pl.len().alias("rows"), **GPU_LABELS).sort("node", "device").collect(
        engine="streaming")


def device_batches(devices: pl.DataFrame) -> list[tuple[list[str], list[str] | None]]:
    """(nodes, their devices or None for all) to summarize together, each batch at most
    BATCH_ROWS samples where a node allows (one device is never split)."""
    batches: list[tuple[list[str], list[str] | None]] = []
    size = BATCH_ROWS + 1
    for (d,), part in devices.group_by("node", maintain_order=True):
        rows = int(part["rows"].sum())
        if rows > BATCH_ROWS:  # a big node: its devices in groups
            group: list[str] = []
            group_rows = 0
            for device, n in part.group_by("device", maintain_order=True).agg(pl.col("rows").sum()).iter_rows():
                if group and group_rows + n > BATCH_ROWS:
                    batches.append(([d], group))
                    group, group_rows = [], 0
                group.append(device)
                group_rows += n
            batches.append(([d], group))
            size = BATCH_ROWS + 1
        elif size + rows > BATCH_ROWS or batches[-1][1] is not None:
            batches.append(([d], None))
            size = rows
        else:
            batches[-1][0].append(d)
            size += rows
    return batches


def device_key(devices: pl.DataFrame) -> tuple[pl.Expr, pl.DataFrame]:
    """(an expression giving each sample its device's key `_key`, the devices with theirs).

    The key is a 64-bit hash of the node and device names: far cheaper than the strings, which
    are then never held per sample.
    """
    key = pl.col("node").hash(1) ^ pl.col("device").hash(2)
    keyed = devices.with_columns(key.alias("_key"))
    if keyed["_key"].n_unique() < keyed.height:  # a hash collision: never seen, but be exact
        key = pl.concat_str("node", pl.lit("\0"), "device")
        keyed = devices.with_columns(key.alias("_key"))
    return key, keyed


def by_device(samples: pl.DataFrame, devices: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the samples (keyed by `_key`, see device_key) grouped by device, each device's in time
    order, with a device id `_dev` counting from 0 in place of the key; the `devices` rows
    (with `_key`) of those ids).

    Every per-device statistic is then a column expression over the whole frame (shifts masked
    at device boundaries) aggregated by contiguous slices, one group_by for all devices.
    """
    # Finished files group rows by device (recorder.py): an import's samples arrive grouped
    # already; a recording's compacted files hold a minute each, whose runs are copied together
    # (a stable sort by device at a fraction of its cost).
    runs = samples["_key"].rle().struct.unnest().rename({"value": "_key"})
    if runs["_key"].n_unique() < runs.height:  # a device's samples lie in several runs
        if runs.height <= max(1024, samples.height // 256):
            runs = runs.with_columns((pl.col("len").cum_sum() - pl.col("len")).alias("offset"),
                                     pl.int_range(pl.len()).alias("run"))
            runs = runs.with_columns(pl.col("run").min().over("_key").alias("first")).sort("first", "run")
            samples = pl.concat([samples.slice(o, n) for o, n in zip(runs["offset"], runs["len"])], rechunk=True)
        else:  # 1-s chunks, devices interleaved
            samples = samples.sort("_key", maintain_order=True)
        runs = samples["_key"].rle().struct.unnest().rename({"value": "_key"})
    keys = runs.select("_key")
    samples = samples.select(pl.col("_key").rle_id().alias("_dev"), pl.exclude("_key"))  # each device is one run now
    # Files hold chunks in time order; only a clock step disorders a device's samples.
    if samples.select(((pl.col("_dev") == pl.col("_dev").shift(1)) & (pl.col("ts_ns").diff() < 0)).any()).item():
        samples = samples.sort(["_dev", "ts_ns"], maintain_order=True)
    names = keys.with_row_index("_dev").join(devices, on="_key", how="left", maintain_order="left").drop("_key")
    return samples.with_columns(pl.col("_dev").set_sorted()), names
