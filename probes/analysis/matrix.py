"""Per-GPU matrices, as the CharLLM-PPT paper's heatmaps show them: GPUs x time (one run) and
GPUs x runs (several), for temperature, power, SM clock, throttling and link bytes.

GPUs x time: each GPU's samples in equal time buckets over the window, each cell the mean
of the bucket's samples (temperature, power, clock), the share of samples throttled for
power or heat (throttle), or the NVLink bytes (sent + received) counted in it (link: the counters'
growth between consecutive samples, a counter that went down counting nothing). GPUs x runs: each
GPU's figure from each run's summary (the steady window): its mean, throttled share or link bytes.
"""

from __future__ import annotations

from functools import partial

import polars as pl

from charllm.probes.analysis.render import format_figure
from charllm.probes.analysis.summary import summarize
from charllm.probes.analysis.windows import in_window, parse_window, resolve_window
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir, past_damage, resolve_run
from charllm.probes.store.schema import THROTTLE_PERF_MASK

# name -> (what a cell holds, its unit, the summary column per GPU)
MATRICES = {
    "temperature": ("GPU temperature", "°C", "temp_gpu_mean_c"),
    "power": ("GPU power", "W", "power_mean_w"),
    "clock": ("SM clock", "MHz", "sm_clock_mean_mhz"),
    "throttle": ("time throttled for power or heat", "%", "throttle_perf_frac"),
    "link": ("NVLink bytes sent + received", "B", "nvlink_bytes"),
}


def check(name: str) -> str:
    if name not in MATRICES:
        raise UserError(f"--matrix {name!r}: expected one of {', '.join(MATRICES)}")
    return name


def sample_value(name: str) -> pl.Expr:
    """Each sample's value for matrix `name` (link: the bytes from this sample to the next, per device)."""
    if name == "throttle":
        return ((pl.col("throttle_reasons") & THROTTLE_PERF_MASK) != 0).cast(pl.Float64) * 100
    if name == "link":
        total = pl.col("nvlink_tx_bytes").fill_null(0) + pl.col("nvlink_rx_bytes").fill_null(0)
        grew = total.diff().over("node", "device", order_by="ts_ns")
        known = pl.col("nvlink_tx_bytes").is_not_null() | pl.col("nvlink_rx_bytes").is_not_null()
        return pl.when(known & (grew >= 0)).then(grew.cast(pl.Float64))
    return pl.col({"temperature": "temp_gpu_c", "power": "power_w", "clock": "sm_clock_mhz"}[name])


def gpus_by_time(run: RunDir | str, name: str, buckets: int = 12, window="all") -> pl.DataFrame:
    """One row per GPU (`gpu`: node/device), one column per time bucket ("0-30 s"), each cell the
    bucket's figure (see the module's docstring); null where the GPU reported nothing in it."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    check(name)
    if not 1 <= buckets <= 200:
        raise UserError(f"--buckets {buckets}: must be from 1 to 200")
    if isinstance(window, str) and window not in ("steady", "all"):
        window = parse_window(window)
    columns = ["ts_ns", "node", "device", "simulated", "temp_gpu_c", "power_w", "sm_clock_mhz", "throttle_reasons",
               "nvlink_tx_bytes", "nvlink_rx_bytes"]

    def read(thorough: bool) -> pl.DataFrame:
        return (run.scan_telemetry(thorough=thorough).select(columns).filter(pl.col("device") != "host")
                .collect())
    samples = past_damage(read)
    if samples.height == 0:
        raise UserError(f"run {run.id}: no GPU telemetry (a per-GPU matrix needs GPUs)")
    first = int(samples["ts_ns"].min())
    start_ns, end_ns, _, _ = resolve_window(window, run.read_steps(), first)
    samples = samples.filter(in_window(start_ns, end_ns))
    if samples.height == 0:
        raise UserError(f"run {run.id}: no GPU samples in the window")
    lo, hi = int(samples["ts_ns"].min()), int(samples["ts_ns"].max())
    width = max(1, -(-(hi - lo + 1) // buckets))
    value = sample_value(name)
    agg = pl.col("_v").sum() if name == "link" else pl.col("_v").mean()
    cells = (samples.with_columns(value.alias("_v"), ((pl.col("ts_ns") - lo) // width).alias("_b"))
             .group_by("node", "device", "_b").agg(agg.alias("_v"), pl.col("_v").is_not_null().any().alias("_k"))
             .with_columns(pl.when("_k").then("_v").alias("_v")))
    labels = {b: f"{(b * width) / 1e9:.3g}-{((b + 1) * width) / 1e9:.3g} s" for b in range(buckets)}
    wide = (cells.pivot(on="_b", index=["node", "device"], values="_v", sort_columns=True)
            .sort("node", "device"))
    for b in range(buckets):   # every bucket a column, an empty one too
        if str(b) not in wide.columns:
            wide = wide.with_columns(pl.lit(None, pl.Float64).alias(str(b)))
    gpu = pl.concat_str("node", pl.lit("/"), "device").alias("gpu")
    simulated = samples.group_by("node", "device").agg(pl.col("simulated").any())
    return (wide.join(simulated, on=["node", "device"], how="left")
            .select(gpu, "simulated", *(pl.col(str(b)).alias(labels[b]) for b in range(buckets))))


def gpus_by_runs(refs: list[str], name: str, window="steady") -> pl.DataFrame:
    """One row per GPU (node/device), one column per run, each cell that GPU's figure in that run's
    summary; null where the run had no such GPU or it reported nothing."""
    check(name)
    column = MATRICES[name][2]
    out: pl.DataFrame | None = None
    for ref in refs:
        run = resolve_run(ref)
        gpus = summarize(run, window, by="gpu")
        if name == "link":
            gpus = gpus.with_columns(
                pl.when(pl.col("nvlink_tx_bytes").is_not_null() | pl.col("nvlink_rx_bytes").is_not_null())
                .then(pl.col("nvlink_tx_bytes").fill_null(0) + pl.col("nvlink_rx_bytes").fill_null(0))
                .alias(column)
            )
        elif name == "throttle":
            gpus = gpus.with_columns(pl.col(column) * 100)
        part = gpus.select(pl.concat_str("node", pl.lit("/"), "device").alias("gpu"),
                           pl.col("simulated").alias("_sim"), pl.col(column).alias(run.id))
        out = (
            part
            if out is None
            else (
                out.join(part, on="gpu", how="full", coalesce=True)
                .with_columns(pl.any_horizontal("_sim", "_sim_right").alias("_sim"))
                .drop("_sim_right")
            )
        )
    if out is None:
        raise UserError("no runs to compare")
    return out.rename({"_sim": "simulated"}).select("gpu", "simulated", pl.exclude("gpu", "simulated")).sort("gpu")


def render_matrix(matrix: pl.DataFrame, name: str) -> pl.DataFrame:
    """The matrix with each cell as text in its unit (a terminal or Markdown table)."""
    _, unit, _ = MATRICES[name]
    suffix = {"°C": "_c", "W": "_w", "MHz": "_mhz", "%": "_pct", "B": "_bytes"}[unit]
    gpu = pl.when(pl.col("simulated")).then(pl.col("gpu") + " (SIMULATED)").otherwise("gpu") \
        if "simulated" in matrix.columns else pl.col("gpu")
    return matrix.select(gpu, *(pl.col(c).map_elements(partial(format_figure, suffix), return_dtype=pl.String)
                                .fill_null("—").alias(c) for c in matrix.columns if c not in ("gpu", "simulated")))
