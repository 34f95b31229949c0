"""Run summaries: power, energy, thermals, clocks, throttling, excursions, traffic, speed.

`summarize(run, window, by)` returns a tidy polars DataFrame, one row per GPU, node or run,
units in column names. One pass over the run's telemetry reads it a batch of devices at a time
(devices), computes each device's statistics (device_stats), aggregates them per node and run
(aggregate) and adds the iteration statistics of the window (windows, iterations). Summaries of
finished runs are kept (cache); render turns them into text and files.
"""

from __future__ import annotations

import os
from typing import cast

import polars as pl

from charllm.engine.model.experiment import Hardware
from charllm.probes.analysis import power_fit
from charllm.probes.analysis.aggregate import aggregate_gpus, aggregate_hosts, combine
from charllm.probes.analysis.cache import keep, kept_place, kept_places, read_kept
from charllm.probes.analysis.device_stats import excursions, gpu_stats, host_stats
from charllm.probes.analysis.devices import (
    GPU_COLUMNS,
    GPU_LABELS,
    HOST_COLUMNS,
    KEYS,
    by_device,
    device_batches,
    device_key,
    scan_devices,
)
from charllm.probes.analysis.iterations import iteration_stats, read_experiment, with_iteration_stats
from charllm.probes.analysis.windows import in_window, parse_window, resolve_window
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import duration
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir, past_damage, resolve_run
from charllm.probes.store.schema import TELEMETRY_SCHEMA

BY = ("gpu", "node", "run")
_NS = 1e9


def summarize(run: RunDir | str | os.PathLike, window="steady", by: str = "gpu") -> pl.DataFrame:
    """The run's summary; a finished run's summary is kept in RUN_DIR/summaries/ (see _cached).

    `by="auto"` means per GPU, or per node when the run has no accelerator telemetry (a CPU run).
    """
    run = run if isinstance(run, RunDir) else resolve_run(run)
    if by == "auto":
        by = "gpu" if has_accelerators(run) else "node"
    if by not in BY:
        raise UserError(f"by = {by!r}: expected one of {', '.join(BY)}")
    if isinstance(window, str) and window not in ("steady", "all"):
        window = parse_window(window)
    return _cached(run, window, by)


def has_accelerators(run: RunDir) -> bool:
    """Whether the run recorded any device besides the host (reads one column)."""
    def some(thorough: bool) -> bool:
        scan = run.scan_telemetry(thorough=thorough)
        return scan.select("device").filter(pl.col("device") != "host").head(1).collect().height > 0
    return past_damage(some)


def cached_summary(run: RunDir | str | os.PathLike, window="steady", by: str = "gpu") -> pl.DataFrame | None:
    """The kept summary of a finished run, or None (running, never summarized, or changed since):
    a Parquet read, for listings that must show something at once."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    places = kept_places(run, window, BY)
    return read_kept(*places[by]) if places else None


def keep_summaries(run: RunDir | str | os.PathLike) -> None:
    """Summarize a finished run now, as lists and comparisons show it (every level of the steady
    window, and the per-iteration curves), so that they read kept results instead of telemetry,
    and refit its hardware's power model with it (`power_fit.refit_for`). What finishes a run calls
    it (the supervisor, import); a run with nothing to summarize, or not finished, keeps nothing."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    if run.status not in FINAL_STATUSES:
        return
    try:
        summarize(run, "steady", by="run")
    except UserError:
        return
    per_iteration(run)
    power_fit.refit_for(run)


def _cached(run: RunDir, window, by: str) -> pl.DataFrame:
    """A finished run never changes, so its summaries are kept (keyed by its files and directories).

    Comparing runs, or reopening one in the TUI, then costs a Parquet read instead of a pass
    over every telemetry chunk; the pass that makes one level (per GPU, node, run) keeps all
    three, so a baseline (run and GPU levels) or a compare after the Runs list reads the
    telemetry once. Running runs are always summarized afresh.
    """
    places = kept_places(run, window, BY)
    if places is None:
        return _level(past_damage(lambda thorough: _summarize(run, window, (by,), thorough)), run, by)
    df = read_kept(*places[by])
    if df is not None:
        return df
    levels = past_damage(lambda thorough: _summarize(run, window, BY, thorough))
    for level, df in levels.items():
        keep(df, *places[level])
    return _level(levels, run, by)


def per_iteration(run: RunDir | str | os.PathLike) -> pl.DataFrame:
    """One row per training iteration the telemetry names (its `iteration` column): the mean
    over the GPUs' samples in it of `power_w` and `temp_gpu_c`, and over the hosts' of
    `cpu_util_pct` (the Compare screen's curves). One pass over those columns; a finished run's
    result is kept in RUN_DIR/summaries/ like its summaries (see _cached)."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    place = kept_place(run, "per-iteration")
    if place is not None:
        df = read_kept(*place)
        if df is not None:
            return df
    def curves(thorough: bool) -> pl.DataFrame:
        held: set[str] = set()
        scan = run.scan_telemetry(columns=held, thorough=thorough)
        if "iteration" not in held:  # no file names an iteration (an import): nothing to read
            scan = scan.clear()
        host = pl.col("device") == "host"
        return (scan.filter(pl.col("iteration").is_not_null())
                .group_by("iteration")
                .agg(pl.col("power_w").filter(~host).mean(), pl.col("temp_gpu_c").filter(~host).mean(),
                     pl.col("cpu_util_pct").filter(host).mean())
                .sort("iteration").collect())
    df = past_damage(curves)
    if place is not None:
        keep(df, *place)
    return df


def _level(levels: dict[str, pl.DataFrame], run: RunDir, by: str) -> pl.DataFrame:
    if by not in levels:  # only "gpu" can be missing
        raise UserError(f"run {run.id}: no accelerator telemetry (host only); use --by node or --by run")
    return levels[by]


def _summarize(run: RunDir, window, levels, thorough: bool = False) -> dict[str, pl.DataFrame]:
    """The summary at each of `levels` ("gpu", "node", "run") from one pass over the telemetry;
    "gpu" is left out for a run without accelerator telemetry. `thorough`: see past_damage."""
    exp_file = read_experiment(run.experiment_path)
    exp = exp_file.experiment if exp_file else None
    iterations = run.read_steps()
    skipped: list[str] = []
    held: set[str] = set()
    scan = run.scan_telemetry(skipped, columns=held, thorough=thorough)
    devices = scan_devices(scan)
    if devices.height == 0:
        if skipped:
            raise UserError(f"run {run.id}: no readable telemetry under {run.telemetry_dir} (nothing to "
                            f"summarize): {skipped[0]}")
        raise UserError(f"run {run.id}: no telemetry under {run.telemetry_dir} (nothing to summarize)")
    key, keyed = device_key(devices)
    gpu_names = keyed.filter(pl.col("device") != "host").select("_key", *KEYS, *GPU_LABELS)
    host_names = keyed.filter(pl.col("device") == "host").select("_key", "node")
    metrics = [c for c in {*GPU_COLUMNS, *HOST_COLUMNS} - {"node", "device"} if c in held]
    # Comparing every sample's device name to "host" is skipped when the run has no host rows.
    host_row = pl.col("device") == "host" if host_names.height else pl.lit(False)
    # Devices are summarized a batch at a time (whole nodes, or a big node's devices in groups),
    # so memory stays bounded however long or wide the run; spikes above the run's mean power
    # need that mean first, so a run of several batches is read twice.
    batches = device_batches(devices)

    def read(batch, keep: pl.Expr) -> pl.DataFrame:
        """The samples of one batch that `keep` selects: a device key, whether it is a host, the metrics."""
        rows = scan.filter(keep)
        if len(batches) > 1:
            nodes, devs = batch
            rows = rows.filter(pl.col("node").is_in(nodes))  # pushed down to the files' statistics
            if devs is not None:
                rows = rows.filter(pl.col("device").is_in(devs))
        return rows.select(key.alias("_key"), host_row.alias("_host"), *sorted(metrics)).collect(engine="streaming")

    def load(frame: pl.DataFrame) -> tuple[tuple[pl.DataFrame, pl.DataFrame] | None,
                                           tuple[pl.DataFrame, pl.DataFrame] | None]:
        """((GPU samples by device, their names), or None; host samples likewise) of one batch's samples."""
        # Columns no file holds are all null: never read, added as (unallocated) constants.
        frame = frame.with_columns(pl.lit(None, dtype).alias(c) for c, dtype in TELEMETRY_SCHEMA.items()
                                   if c not in frame.columns and c in {*GPU_COLUMNS, *HOST_COLUMNS})
        gpu_cols, host_cols = (["_key", *(c for c in cols if c not in KEYS)] for cols in (GPU_COLUMNS, HOST_COLUMNS))
        if not frame["_host"].any():
            gpu, host = frame.select(gpu_cols), frame.clear().select(host_cols)
        else:
            gpu, host = frame.filter(~pl.col("_host")).select(gpu_cols), frame.filter("_host").select(host_cols)
        del frame
        return (by_device(gpu, gpu_names) if gpu.height else None,
                by_device(host, host_names) if host.height else None)

    # One batch (the usual case) is read once, whole: its times are the run's span, and the
    # window is cut from it in memory. Several batches need the span first, to read each one's window.
    whole = read(batches[0], pl.lit(True)) if len(batches) == 1 else None
    span = whole.lazy() if whole is not None else scan
    first_ns, last_ns = span.select(pl.col("ts_ns").min().alias("first"),
                                    pl.col("ts_ns").max().alias("last")).collect().row(0)
    start_ns, end_ns, label, notes = resolve_window(window, iterations, first_ns)
    notes = skipped + notes
    temp_limit = (exp.hardware.temp_limit_c if exp else None) or Hardware.temp_limit_c
    max_clock = (exp.hardware.max_sm_clock_mhz or None) if exp else None
    in_span = in_window(start_ns, end_ns)

    gpu_parts, host_parts, loaded = [], [], None
    for batch in batches:
        loaded = gpu_batch = host_batch = None  # one batch in memory at a time
        loaded = load(whole.filter(in_span) if whole is not None else read(batch, in_span))
        whole = None
        gpu_batch, host_batch = loaded
        if gpu_batch is not None:
            gpu_parts.append(gpu_stats(*gpu_batch, temp_limit, max_clock))
        if host_batch is not None:
            host_parts.append(host_stats(*host_batch))
    if not gpu_parts and not host_parts:
        raise UserError(
            f"run {run.id}: window {label}: no telemetry samples in it (the run's samples span "
            f"0 to {duration((last_ns - first_ns) / _NS)})"
        )
    host = pl.concat(host_parts).sort("node") if host_parts else None
    gpus = None
    durations = [cast(float, f["duration_s"].max()) for f in gpu_parts] \
        + [cast(float, f["host_duration_s"].max()) for f in host_parts]
    if max(durations) == 0:
        raise UserError(
            f"run {run.id}: window {label}: only one sample per device; at least two are needed to weight by time"
        )
    if end_ns is None:
        end_ns = last_ns
    if gpu_parts:
        run_mean_w = cast(float | None, pl.concat(gpu_parts)["power_mean_w"].mean())
        spikes = []
        gpu = None
        for batch in batches:
            if len(batches) > 1:
                loaded = gpu = None
            gpu = (loaded or load(read(batch, in_span)))[0]
            if gpu is not None:
                spikes.append(excursions(gpu[0], run_mean_w))
        del loaded, gpu
        gpus = pl.concat(stats.join(s, on="_dev", how="left").drop("_dev")
                         for stats, s in zip(gpu_parts, spikes)).sort(KEYS)
    elif levels == ("gpu",):
        raise UserError(f"run {run.id}: no accelerator telemetry (host only); use --by node or --by run")
    else:
        notes.append("no accelerator telemetry: host statistics only")

    it, it_notes = iteration_stats(iterations, start_ns, end_ns, exp_file, gpus.height if gpus is not None else None,
                                   (run.runtime() or {}).get("tf32"))
    notes += it_notes

    def level(by: str) -> pl.DataFrame:
        table = gpus if by == "gpu" else \
            combine(aggregate_gpus(gpus, ["node"] if by == "node" else []) if gpus is not None else None,
                    (host if by == "node" else aggregate_hosts(host)) if host is not None else None)
        assert table is not None    # a window without samples was refused above, and "gpu" is asked for with GPUs only
        if by != "gpu":
            if by == "run":
                table = table.with_columns(pl.lit(None, pl.String).alias("node"))
            table = table.with_columns(pl.lit(None, pl.String).alias("device"))
        table = with_iteration_stats(table, it)
        head = {
            "run": run.id, "level": by, "window": label,
            "window_start_s": (start_ns - first_ns) / _NS, "window_end_s": (end_ns - first_ns) / _NS,
            "temp_limit_c": float(temp_limit),
            "notes": "; ".join(notes) or None,
        }
        table = table.with_columns(pl.lit(v).alias(k) for k, v in head.items())
        first = ["run", "level", "node", "device", "gpus", "simulated", "backend", "window",
                 "window_start_s", "window_end_s", "duration_s", "samples"]
        present = [c for c in first if c in table.columns]
        return table.select(present + [c for c in table.columns if c not in present])

    return {by: level(by) for by in levels if by != "gpu" or gpus is not None}
