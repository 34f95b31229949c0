"""Per-device statistics: one row per GPU (power, energy, thermals, clocks, throttling,
excursions, traffic) and one per node's host, from samples grouped by device (devices.by_device).
Statistics follow the CharLLM-PPT paper where it defines them:

- Each sample owns the interval until the next sample of its GPU; a time-weighted mean is
  sum(v * dt) / sum(dt) over the samples where v is known (the paper's Σv·Δt/ΣΔt).
- Energy: from the cumulative energy counter (sum of deltas; a negative delta, i.e. a wrap
  or a reset, and any gap fall back to that interval's trapezoid), else the trapezoidal
  integral of power. `energy_source` says which: counter | trapezoid | counter+trapezoid.
- Power excursions: a spike is a maximal run of samples above a threshold (the run's mean
  power, or the GPU's power limit); its size is its highest excess over the threshold.
  `power_max_rise_w_per_s` is the largest rise of power within any one second.
- NVLink bytes: counter deltas; a counter that goes down wrapped at 2**32 when the previous
  value fitted in 32 bits, else at 2**64. PCIe bytes: the byte rate integrated over time.
- Utilization counters (NVML GPM: SM activity and occupancy, tensor-core activity, DRAM
  bandwidth, NVLink bandwidth): time-weighted means (and the NVLink bandwidth's peak), null on a
  device without GPM. Violation time (power, thermal, sync boost): the counter's growth over the
  window as a share of it.
- Host rows (device "host") give per-node CPU utilization, iowait and the busiest core's use
  (the mean over samples of each sample's most used core), CPU frequency and temperature, host
  memory, RAPL energy and network bytes.
"""

from __future__ import annotations

import polars as pl

from charllm.probes.store.schema import THROTTLE_BITS, THROTTLE_PERF_MASK

_NS = 1e9
_MOD32 = 2**32
UTILIZATION = ("sm_active", "sm_occupancy", "tensor_active", "dram_bw_util")   # the GPM percentages
VIOLATIONS = ("power", "thermal", "sync_boost")


def _next(value: pl.Expr) -> pl.Expr:
    """`value` at the device's next sample (null at its last)."""
    return pl.when(pl.col("_dev") == pl.col("_dev").shift(-1)).then(value.shift(-1))


def _dt() -> pl.Expr:
    """The interval each sample owns: until the next sample of its device (the last one owns none)."""
    return ((_next(pl.col("ts_ns")) - pl.col("ts_ns")) / _NS).alias("dt_s")


def _counter_delta(name: str) -> pl.Expr:
    """Bytes counted from this sample to the device's next, across a 32- or 64-bit wrap."""
    cur = pl.col(name).reinterpret(signed=False)
    nxt = _next(pl.col(name)).reinterpret(signed=False)
    raw = nxt - cur  # UInt64 arithmetic wraps modulo 2**64
    wrapped32 = (nxt < cur) & (cur < _MOD32)
    return pl.when(wrapped32).then(raw % _MOD32).otherwise(raw).cast(pl.Float64)


def _per_device(frame: pl.DataFrame, columns: dict[str, pl.Expr], aggs: list[pl.Expr]) -> pl.DataFrame:
    """`aggs` per device (`_dev`) after adding the per-sample `columns` (a `by_device` frame).

    What only uses metrics this frame never measured (all null: most of an import's columns)
    is null without being computed, as computing it would give.
    """
    empty = {c for c in frame.columns if frame[c].null_count() == frame.height}
    schema = pl.LazyFrame(schema=frame.schema).with_columns(**columns).group_by("_dev").agg(aggs).collect_schema()

    def unmeasured(expr: pl.Expr) -> bool:
        metrics = set(expr.meta.root_names()) - {"_dev", "ts_ns", "dt_s"}
        return bool(metrics) and metrics <= empty

    for name, expr in columns.items():
        if unmeasured(expr):
            columns = {**columns, name: pl.lit(None, pl.Float64)}
            empty.add(name)
    aggs = [pl.lit(None, schema[e.meta.output_name()]).alias(e.meta.output_name()) if unmeasured(e) else e
            for e in aggs]
    return frame.lazy().with_columns(**columns).group_by("_dev", maintain_order=True).agg(aggs).collect()


def _only(cond: pl.Expr, value: pl.Expr) -> pl.Expr:
    return pl.when(cond).then(value)


def gpu_stats(gpu: pl.DataFrame, names: pl.DataFrame, temp_limit: float, max_clock: float | None) -> pl.DataFrame:
    """One row of statistics per GPU (`_dev`), after its `names` (from `by_device`)."""
    dt = pl.col("dt_s")
    p, nxt_p = pl.col("power_w"), pl.col("_next_power_w")
    # The time during which a metric was known (all of it for metrics with no gaps: most).
    known_dt = lambda c: dt if gpu[c].null_count() == 0 else _only(pl.col(c).is_not_null(), dt)  # noqa: E731
    tw_mean = lambda c: pl.when(known_dt(c).sum() > 0).then((pl.col(c) * dt).sum() / known_dt(c).sum())  # noqa: E731
    frac = lambda cond, c: pl.when(known_dt(c).sum() > 0).then(_only(cond, dt).sum() / known_dt(c).sum())  # noqa: E731
    known = lambda value, *cols: pl.when(  # noqa: E731 - null, not 0, when nothing was measured
        pl.any_horizontal(pl.col(c).is_not_null().any() for c in cols)).then(value)
    # Without the hardware's maximum clock, the GPU's own highest clock stands in for it.
    clock_max = pl.lit(max_clock, pl.Float64) if max_clock else pl.col("sm_clock_mhz").max()
    throttle = pl.col("throttle_reasons")
    bits = {**{f"throttle_{n}_frac": b for n, b in THROTTLE_BITS.items()}, "throttle_perf_frac": THROTTLE_PERF_MASK}
    d_energy = pl.col("_energy_delta")
    counted = (d_energy >= 0) & dt.is_not_null()
    n_counted, n_intervals = counted.sum(), dt.is_not_null().sum()
    columns = {
        "dt_s": _dt(), "_next_power_w": _next(p), "_energy_delta": _next(pl.col("energy_j")) - pl.col("energy_j"),
        **{f"_nvlink_{d}": _counter_delta(f"nvlink_{d}_bytes") for d in ("tx", "rx")},
    }
    stats = names.join(_per_device(gpu, columns, [
        pl.len().alias("samples"), dt.sum().alias("duration_s"),
        tw_mean("power_w").alias("power_mean_w"), p.max().alias("power_peak_w"),
        p.quantile(0.99, "linear").alias("power_p99_w"),
        known(pl.when(d_energy >= 0).then(d_energy).otherwise((p + nxt_p) / 2 * dt).sum(), "power_w", "energy_j")
        .alias("energy_j"),
        known(pl.when(n_counted == 0).then(pl.lit("trapezoid")).when(n_counted == n_intervals)
              .then(pl.lit("counter")).otherwise(pl.lit("counter+trapezoid")), "power_w", "energy_j")
        .alias("energy_source"),
        pl.col("power_limit_w").max(),
        pl.lit(None, pl.Float64).alias("power_max_rise_w_per_s"),  # _max_rise's, below
        tw_mean("temp_gpu_c").alias("temp_gpu_mean_c"), pl.col("temp_gpu_c").max().alias("temp_gpu_peak_c"),
        tw_mean("temp_mem_c").alias("temp_mem_mean_c"), pl.col("temp_mem_c").max().alias("temp_mem_peak_c"),
        known(_only(pl.col("temp_gpu_c") > temp_limit, dt).sum(), "temp_gpu_c").alias("time_above_temp_limit_s"),
        tw_mean("sm_clock_mhz").alias("sm_clock_mean_mhz"), pl.col("sm_clock_mhz").min().alias("sm_clock_min_mhz"),
        clock_max.alias("max_sm_clock_mhz"),
        frac(pl.col("sm_clock_mhz") < clock_max, "sm_clock_mhz").alias("below_max_clock_frac"),
        *(frac((throttle & bit) != 0, "throttle_reasons").alias(name) for name, bit in bits.items()),
        tw_mean("util_gpu_pct").alias("util_gpu_mean_pct"), tw_mean("util_mem_pct").alias("util_mem_mean_pct"),
        *(tw_mean(f"{c}_pct").alias(f"{c}_mean_pct") for c in UTILIZATION),
        *(tw_mean(f"nvlink_{d}_bytes_s").alias(f"nvlink_{d}_mean_bytes_s") for d in ("tx", "rx")),
        *(pl.col(f"nvlink_{d}_bytes_s").max().alias(f"nvlink_{d}_peak_bytes_s") for d in ("tx", "rx")),
        *(known((pl.col(f"violation_{v}_ns").max() - pl.col(f"violation_{v}_ns").min()) / _NS / dt.sum(),
                f"violation_{v}_ns").alias(f"violation_{v}_frac") for v in VIOLATIONS),
        pl.col("mem_used_bytes").max().alias("mem_used_peak_bytes"),
        *(known(pl.col(f"_nvlink_{d}").sum(), f"nvlink_{d}_bytes").alias(f"nvlink_{d}_bytes") for d in ("tx", "rx")),
        *(known((pl.col(f"pcie_{d}_bytes_s") * dt).sum(), f"pcie_{d}_bytes_s").alias(f"pcie_{d}_bytes")
          for d in ("tx", "rx")),
        pl.lit(1).alias("gpus"),
    ]), on="_dev")
    if gpu["power_w"].null_count() < gpu.height:
        stats = stats.update(_max_rise(gpu), on="_dev")
    return stats


def _max_rise(gpu: pl.DataFrame) -> pl.DataFrame:
    """Per GPU (`_dev`), the largest rise of power within one second: the most any sample's power
    exceeds the lowest of the second up to it, (t - 1 s, t].

    The rolling minimum is the costly part, so it runs only where the maximum can be. Whole
    seconds split each GPU's samples into blocks. A sample's window lies in its block and the
    one before, so no sample of a block rises more than the block's highest power minus the
    lowest of the two. Blocks whose bound does not beat the GPU's largest rise between
    consecutive samples (a sure one) are skipped: in a training run, all but the blocks around
    power steps.
    """
    import numpy as np

    second = 10**9
    rows, in_open = np.zeros(gpu.height, bool), np.zeros(gpu.height, bool)  # rows to roll, rows that count
    devices, floors = [], []
    offset = 0
    for dev, n in gpu["_dev"].rle().struct.unnest().select("value", "len").iter_rows():  # a GPU at a time
        ts = gpu["ts_ns"].slice(offset, n).to_numpy()
        power = gpu["power_w"].slice(offset, n).to_numpy()     # nulls are NaN: fmax/fmin skip them
        # The sure rise: the largest between consecutive samples under a second apart (at least 0,
        # as each window holds its own sample; nan when the GPU has no power at all).
        step = np.diff(power)
        step[np.diff(ts) >= second] = np.nan
        floor = np.nan if np.isnan(power).all() else max(np.fmax.reduce(step, initial=0.0), 0.0)
        sec = ts // second
        starts = np.flatnonzero(np.r_[True, sec[1:] != sec[:-1]])
        hi, lo = np.fmax.reduceat(power, starts), np.fmin.reduceat(power, starts)
        follows = np.r_[False, sec[starts[1:]] == sec[starts[:-1]] + 1]
        bound = hi - np.fmin(lo, np.where(follows, np.r_[np.nan, lo[:-1]], np.nan))
        open_block = bound > floor
        lengths = np.diff(np.r_[starts, n])
        in_open[offset:offset + n] = np.repeat(open_block, lengths)
        rows[offset:offset + n] = np.repeat(open_block | np.r_[open_block[1:], False], lengths)  # and the one before
        devices.append(dev)
        floors.append(floor)
        offset += n
    p = pl.col("power_w")
    rises = (gpu.lazy().select("_dev", "ts_ns", "power_w").filter(pl.Series(rows))
             .with_columns((p - p.rolling_min_by("ts_ns", window_size=f"{second}i").over("_dev")).alias("_rise"))
             .filter(pl.Series(in_open[rows]))
             .group_by("_dev").agg(pl.col("_rise").max()).collect())
    return (pl.DataFrame({"_dev": devices, "_floor": floors}, schema={"_dev": gpu.schema["_dev"], "_floor": pl.Float64})
            .with_columns(pl.col("_floor").fill_nan(None)).join(rises, on="_dev", how="left")
            .select("_dev", pl.when(pl.col("_floor").is_not_null()).then(pl.max_horizontal("_floor", "_rise"))
                    .alias("power_max_rise_w_per_s")))


def excursions(gpu: pl.DataFrame, run_mean_w: float | None) -> pl.DataFrame:
    """Spikes above the run's mean power and above each GPU's power limit, one row per GPU.

    A spike is a run of consecutive samples of a GPU above the threshold; its size is its
    highest excess. Worked out a GPU at a time (numpy views of its samples), so the memory it
    takes is one GPU's.
    """
    import numpy as np

    has_limit = gpu["power_limit_w"].null_count() < gpu.height
    names = [name for name, known in (("mean", run_mean_w is not None), ("limit", has_limit)) if known]
    rows: list[dict] = []
    offset = 0
    for dev, n in gpu["_dev"].rle().struct.unnest().select("value", "len").iter_rows():
        power = gpu["power_w"].slice(offset, n).to_numpy()            # nulls are NaN
        dt = np.diff(gpu["ts_ns"].slice(offset, n).to_numpy()) / _NS  # the last sample owns no time
        row: dict = {"_dev": dev}
        for name in names:
            threshold = run_mean_w if name == "mean" else gpu["power_limit_w"].slice(offset, n).to_numpy()
            excess = power - threshold
            above = excess > 0                                        # NaN (unknown) is not above
            starts = np.flatnonzero(above & ~np.r_[False, above[:-1]])
            known = bool((~np.isnan(excess)).any())
            row[f"spikes_over_{name}_count"] = starts.size if known else None
            row[f"time_over_{name}_s"] = float(dt[above[:-1]].sum()) if known else None
            if starts.size:  # each spike's size: the highest excess from its start to the next's
                sizes = np.maximum.reduceat(np.where(above, excess, -np.inf), starts)
                row[f"spikes_over_{name}_max_excess_w"] = float(sizes.max())
                row[f"spikes_over_{name}_avg_excess_w"] = float(sizes.mean())
        rows.append(row)
        offset += n
    order = [f"{stat}_over_{name}{unit}" for name in ("mean", "limit") for stat, unit in
             (("spikes", "_count"), ("time", "_s"), ("spikes", "_max_excess_w"), ("spikes", "_avg_excess_w"))]
    schema = {"_dev": gpu.schema["_dev"], **{c: pl.UInt32 if c.endswith("_count") else pl.Float64 for c in order}}
    return pl.DataFrame(rows, schema=schema)


def host_stats(host: pl.DataFrame, names: pl.DataFrame) -> pl.DataFrame:
    """One row per node from its host samples (from `by_device`): CPU, memory, RAPL, network."""
    dt = pl.col("dt_s")
    tw_mean = lambda c: pl.when(_only(pl.col(c).is_not_null(), dt).sum() > 0).then(  # noqa: E731
        (pl.col(c) * dt).sum() / _only(pl.col(c).is_not_null(), dt).sum())
    known = lambda value, c: pl.when(pl.col(c).is_not_null().any()).then(value)  # noqa: E731
    energy = ("cpu_energy_j", "dram_energy_j")
    # RAPL counters wrap at a CPU-specific range: a wrapped interval is left out, not guessed.
    columns = {"dt_s": _dt(), **{f"_{c}_delta": _next(pl.col(c)) - pl.col(c) for c in energy},
               "_core_busiest": pl.col("cpu_core_util_pct").list.max()}
    return names.join(_per_device(host, columns, [
        dt.sum().alias("host_duration_s"),
        tw_mean("cpu_util_pct").alias("cpu_util_mean_pct"), tw_mean("cpu_iowait_pct").alias("cpu_iowait_mean_pct"),
        tw_mean("_core_busiest").alias("cpu_core_busiest_mean_pct"), tw_mean("cpu_freq_mhz").alias("cpu_freq_mean_mhz"),
        tw_mean("temp_cpu_c").alias("temp_cpu_mean_c"), pl.col("temp_cpu_c").max().alias("temp_cpu_peak_c"),
        pl.col("host_mem_used_bytes").max().alias("host_mem_used_peak_bytes"),
        *(known(_only(pl.col(f"_{c}_delta") >= 0, pl.col(f"_{c}_delta")).sum(), c).alias(c) for c in energy),
        *(known(_counter_delta(c).sum(), c).alias(c)
          for c in ("ib_tx_bytes", "ib_rx_bytes", "net_tx_bytes", "net_rx_bytes")),
        pl.col("simulated").any().alias("host_simulated"),
    ]), on="_dev").drop("_dev").sort("node")
