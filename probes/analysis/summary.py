"""Run summaries: power, energy, thermals, clocks, throttling, excursions, traffic, speed.

`summarize(run, window, by)` returns a tidy polars DataFrame, one row per GPU, node or run,
units in column names. Statistics follow the CharLLM-PPT paper where it defines them:

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
- Node and run rows aggregate the GPU rows as the paper does: averages are means of the
  per-GPU values, peaks and p99 the highest per-GPU value, energy and bytes are sums,
  minimum clock the lowest; time above the temperature limit is the longest of any GPU.
- Iteration statistics (run-wide) come from the iteration log, iterations that lie wholly
  inside the window: TFLOP/s per GPU uses Megatron's FLOP count (`engine.model.flops`), MFU is
  against the hardware's dense BF16 peak, efficiency is samples/s per MJ of energy per
  iteration (the paper's samples/(s·MJ)).
- Host rows (device "host") give per-node CPU utilisation and frequency, CPU temperature, host
  memory, RAPL energy and network bytes; a run with host rows only (a local CPU run) has node
  and run rows with those and the iteration statistics.

Summaries of finished runs are cached in RUN_DIR/summaries/ and recomputed when the
experiment, the iteration log or a telemetry directory changes.

How it stays fast (an hour of 64 GPUs at 20 Hz is 4.6M rows): one scan of the run reads only
the columns used; devices are ordered by copying the per-device runs of the recorder's
compacted files (never assumed: interleaved chunks are sorted instead); every statistic of
every GPU is then one group_by over contiguous slices, shifts masked at device boundaries.

Windows: "steady" spans the non-warm-up iterations of the log (falls back to "all", with a
note, when there is no log); "all" is every sample; (start_s, end_s) are seconds after the
run's first sample.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from charllm.engine.model.experiment import Experiment, Hardware
from charllm.engine.model.flops import flops_per_iteration
from charllm.probes.core import paths
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import binary_scale
from charllm.probes.store.rundir import FINAL_STATUSES, resolve_run, RunDir, write_json_atomic
from charllm.probes.store.schema import TELEMETRY_SCHEMA, THROTTLE_BITS, THROTTLE_PERF_MASK

BY = ("gpu", "node", "run")
FORMATS = ("table", "markdown", "csv", "json", "parquet")
KEYS = ["node", "device"]
_NS = 1e9
_MOD32 = 2**32

_GPU_COLUMNS = [
    "ts_ns", "node", "device", "power_w", "energy_j",
    "temp_gpu_c", "temp_mem_c", "sm_clock_mhz", "util_gpu_pct", "util_mem_pct", "mem_used_bytes",
    "power_limit_w", "throttle_reasons", "pcie_tx_bytes_s", "pcie_rx_bytes_s",
    "nvlink_tx_bytes", "nvlink_rx_bytes",
]


# What names a GPU's row besides node and device (read in the first pass, `_devices`).
_GPU_LABELS = {"uuid": pl.col("uuid").first(), "backend": pl.col("backend").first(),
               "simulated": pl.col("simulated").any()}

_HOST_COLUMNS = [
    "ts_ns", "node", "device", "simulated", "cpu_util_pct", "cpu_freq_mhz", "temp_cpu_c", "host_mem_used_bytes",
    "cpu_energy_j", "dram_energy_j", "ib_tx_bytes", "ib_rx_bytes", "net_tx_bytes", "net_rx_bytes",
]


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
def summarize(run: RunDir | str | os.PathLike, window="steady", by: str = "gpu") -> pl.DataFrame:
    """The run's summary; a finished run's summary is cached in RUN_DIR/summaries/ (see _cached).

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
    devices = run.scan_telemetry().select("device").filter(pl.col("device") != "host").head(1)
    return devices.collect().height > 0


# Bump when a statistic changes meaning, so cached summaries of finished runs are recomputed.
SUMMARY_VERSION = 1


def cached_summary(run: RunDir | str | os.PathLike, window="steady", by: str = "gpu") -> pl.DataFrame | None:
    """The kept summary of a finished run, or None (running, never summarized, or changed since):
    a Parquet read, for listings that must show something at once."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    places = _cache_places(run, window)
    return _read_cache(*places[by]) if places else None


def _read_cache(cache: Path, meta: Path, key: dict) -> pl.DataFrame | None:
    try:
        if meta.is_file() and cache.is_file() and json.loads(meta.read_text()) == key:
            return pl.read_parquet(cache)
    except (OSError, ValueError, pl.exceptions.PolarsError):
        pass  # a damaged cache is recomputed
    return None


def _cache_places(run: RunDir, window) -> dict[str, tuple[Path, Path, dict]] | None:
    """Per level, (summary file, its key file, the key that says it is current) of a finished
    run's summaries; None while it runs."""
    files = _run_files(run)
    if files is None:
        return None
    span = window if isinstance(window, str) else f"{window[0]:g}-{window[1]:g}"
    places = {}
    for by in BY:
        key = {"version": SUMMARY_VERSION, "window": list(window) if isinstance(window, tuple) else window,
               "by": by, "files": files}
        cache = run.path / "summaries" / f"{by}-{span}.parquet"
        places[by] = (cache, cache.with_suffix(".json"), key)
    return places


def _run_files(run: RunDir) -> list | None:
    """What says a finished run's cached results are current: its experiment, iteration log and
    telemetry directories (names, sizes or entries, mtimes); None while it runs."""
    if run.status not in FINAL_STATUSES:
        return None
    # Chunks are added by atomic renames, which change their directory's mtime; listing a
    # directory is far cheaper than a stat per chunk (a run holds one per node per second).
    stat = [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
            for f in (run.experiment_path, run.iterations_path) if f.exists()]
    if run.telemetry_dir.is_dir():
        stat += [[d.name, d.stat().st_mtime_ns, len(os.listdir(d))]
                 for d in sorted(run.telemetry_dir.iterdir()) if d.is_dir()]
    return stat


def _write_cache(df: pl.DataFrame, cache: Path, meta: Path, key: dict) -> None:
    """Keep a finished run's result (atomically; a read-only run directory keeps nothing)."""
    try:
        cache.parent.mkdir(exist_ok=True)
        write_atomic(cache, df.write_parquet)
        write_json_atomic(meta, key)
    except OSError:
        pass


def _cached(run: RunDir, window, by: str) -> pl.DataFrame:
    """A finished run never changes, so its summaries are kept (keyed by its files and directories).

    Comparing runs, or reopening one in the TUI, then costs a Parquet read instead of a pass
    over every telemetry chunk; the pass that makes one level (per GPU, node, run) keeps all
    three, so a baseline (run and GPU levels) or a compare after the Runs list reads the
    telemetry once. Running runs are always summarized afresh.
    """
    places = _cache_places(run, window)
    if places is None:
        return _level(_summarize(run, window, (by,)), run, by)
    df = _read_cache(*places[by])
    if df is not None:
        return df
    levels = _summarize(run, window, BY)
    for level, df in levels.items():
        _write_cache(df, *places[level])
    return _level(levels, run, by)


def per_iteration(run: RunDir | str | os.PathLike) -> pl.DataFrame:
    """One row per training iteration the telemetry names (its `iteration` column): the mean
    over the GPUs' samples in it of `power_w` and `temp_gpu_c`, and over the hosts' of
    `cpu_util_pct` (the Compare screen's curves). One pass over those columns; a finished run's
    result is kept in RUN_DIR/summaries/ like its summaries (see _cached)."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    files = _run_files(run)
    place = None
    if files is not None:
        cache = run.path / "summaries" / "per-iteration.parquet"
        place = (cache, cache.with_suffix(".json"), {"version": SUMMARY_VERSION, "files": files})
        df = _read_cache(*place)
        if df is not None:
            return df
    held: set[str] = set()
    scan = run.scan_telemetry(columns=held)
    if "iteration" not in held:  # no file names an iteration (an import): nothing to read
        scan = scan.clear()
    host = pl.col("device") == "host"
    df = (scan.filter(pl.col("iteration").is_not_null())
          .group_by("iteration")
          .agg(pl.col("power_w").filter(~host).mean(), pl.col("temp_gpu_c").filter(~host).mean(),
               pl.col("cpu_util_pct").filter(host).mean())
          .sort("iteration").collect())
    if place is not None:
        _write_cache(df, *place)
    return df


def _level(levels: dict[str, pl.DataFrame], run: RunDir, by: str) -> pl.DataFrame:
    if by not in levels:  # only "gpu" can be missing
        raise UserError(f"run {run.id}: no accelerator telemetry (host only); use --by node or --by run")
    return levels[by]


def _summarize(run: RunDir, window, levels) -> dict[str, pl.DataFrame]:
    """The summary at each of `levels` ("gpu", "node", "run") from one pass over the telemetry;
    "gpu" is left out for a run without accelerator telemetry."""
    exp_file = read_experiment(run.experiment_path)
    exp = exp_file.experiment if exp_file else None
    iterations = run.read_steps()
    skipped: list[str] = []
    held: set[str] = set()
    scan = run.scan_telemetry(skipped, columns=held)
    devices = _devices(scan)
    if devices.height == 0:
        raise UserError(f"run {run.id}: no telemetry under {run.telemetry_dir} (nothing to summarize)")
    first_ns, last_ns = devices["first_ns"].min(), devices["last_ns"].max()
    start_ns, end_ns, label, notes = _window(window, iterations, first_ns)
    notes = skipped + notes
    temp_limit = (exp.hardware.temp_limit_c if exp else None) or Hardware.temp_limit_c
    max_clock = (exp.hardware.max_sm_clock_mhz or None) if exp else None
    in_window = _in_window(start_ns, end_ns)
    key, keyed = _device_key(devices)
    gpu_names = keyed.filter(pl.col("device") != "host").select("_key", *KEYS, *_GPU_LABELS)
    host_names = keyed.filter(pl.col("device") == "host").select("_key", "node")
    metrics = [c for c in {*_GPU_COLUMNS, *_HOST_COLUMNS} - {"node", "device"} if c in held]
    # Comparing every sample's device name to "host" is skipped when the run has no host rows.
    host_row = pl.col("device") == "host" if host_names.height else pl.lit(False)

    def load(batch):
        """((GPU samples by device, their names), or None; host samples likewise) of one batch."""
        nodes, devs = batch
        rows = scan.filter(in_window, pl.col("node").is_in(nodes))  # pushed down to the files' statistics
        if devs is not None:
            rows = rows.filter(pl.col("device").is_in(devs))
        frame = rows.select(key.alias("_key"), host_row.alias("_host"), *sorted(metrics)).collect(engine="streaming")
        # Columns no file holds are all null: never read, added as (unallocated) constants.
        frame = frame.with_columns(pl.lit(None, dtype).alias(c) for c, dtype in TELEMETRY_SCHEMA.items()
                                   if c not in frame.columns and c in {*_GPU_COLUMNS, *_HOST_COLUMNS})
        gpu_cols, host_cols = (["_key", *(c for c in cols if c not in KEYS)] for cols in (_GPU_COLUMNS, _HOST_COLUMNS))
        if not frame["_host"].any():
            gpu, host = frame.select(gpu_cols), frame.clear().select(host_cols)
        else:
            gpu, host = frame.filter(~pl.col("_host")).select(gpu_cols), frame.filter("_host").select(host_cols)
        del frame
        return (_by_device(gpu, gpu_names) if gpu.height else None,
                _by_device(host, host_names) if host.height else None)

    # Devices are summarized a batch at a time (whole nodes, or a big node's devices in groups),
    # so memory stays bounded however long or wide the run; spikes above the run's mean power
    # need that mean first, so a run of several batches is read twice.
    batches = _batches(devices)
    gpu_parts, host_parts, loaded = [], [], None
    for batch in batches:
        loaded = gpu = host = None  # one batch in memory at a time
        loaded = load(batch)
        gpu, host = loaded
        if gpu is not None:
            gpu_parts.append(_gpu_stats(*gpu, temp_limit, max_clock))
        if host is not None:
            host_parts.append(_host_stats(*host))
    if not gpu_parts and not host_parts:
        raise UserError(
            f"window {label}: no telemetry samples in it (the run's samples span "
            f"0 to {(last_ns - first_ns) / _NS:.1f} s)"
        )
    host = pl.concat(host_parts).sort("node") if host_parts else None
    gpus = None
    durations = [f["duration_s"].max() for f in gpu_parts] + [f["host_duration_s"].max() for f in host_parts]
    if max(durations) == 0:
        raise UserError(
            f"window {label}: only one sample per device; at least two are needed to weight by time"
        )
    if end_ns is None:
        end_ns = last_ns
    if gpu_parts:
        run_mean_w = pl.concat(gpu_parts)["power_mean_w"].mean()
        spikes = []
        gpu = None
        for batch in batches:
            if len(batches) > 1:
                loaded = gpu = None
            gpu = (loaded or load(batch))[0]
            if gpu is not None:
                spikes.append(_excursions(gpu[0], run_mean_w))
        del loaded, gpu
        gpus = pl.concat(stats.join(s, on="_dev", how="left").drop("_dev")
                         for stats, s in zip(gpu_parts, spikes)).sort(KEYS)
    elif levels == ("gpu",):
        raise UserError(f"run {run.id}: no accelerator telemetry (host only); use --by node or --by run")
    else:
        notes.append("no accelerator telemetry: host statistics only")

    it, it_notes = _iteration_stats(iterations, start_ns, end_ns, exp_file, gpus.height if gpus is not None else None)
    notes += it_notes

    def level(by: str) -> pl.DataFrame:
        if by == "gpu":
            table = gpus
        else:
            table = _combine(_aggregate(gpus, ["node"] if by == "node" else []) if gpus is not None else None,
                             (host if by == "node" else _aggregate_host(host)) if host is not None else None)
            if by == "run":
                table = table.with_columns(pl.lit(None, pl.String).alias("node"))
            table = table.with_columns(pl.lit(None, pl.String).alias("device"))
        table = _with_iteration_stats(table, it)
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


# --------------------------------------------------------------------------------------------
# Window and iteration log
# --------------------------------------------------------------------------------------------
def window_phrase(label: str) -> str:
    """What a summary's `window` label covers, in words (every figure shown names its window)."""
    if label == "steady":
        return "the steady window (non-warm-up iterations)"
    if label == "all":
        return "all samples"
    start, _, end = label.partition(":")
    return f"seconds {start} to {end} after the first sample"


# Units of the summary's figures, by how their column names end (longest first); each figure is
# shown with its unit at about four significant digits.
_UNITS = (("_samples_per_s_mj", "samples/(s·MJ)"), ("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"),
          ("tflops_per_gpu", "TFLOP/s"), ("_w_per_s", "W/s"), ("_bytes", "B"), ("_frac", "%"), ("_pct", "%"),
          ("_mhz", "MHz"), ("_w", "W"), ("_c", "°C"), ("_j", "J"), ("_s", "s"))
_COUNTS = ("iterations", "samples", "gpus", "tokens_total")
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"))


def format_figure(metric: str, value) -> str:
    """A summary figure as text with its unit: `1.52049e+09, "energy_j"` -> "1.520 GJ".

    Joules and seconds take SI prefixes, bytes binary ones, fractions show as percentages;
    large figures and counts keep thousands separators.
    """
    if value is None or isinstance(value, str):
        return "" if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if value != value:  # nan
        return "nan"
    unit = next((u for suffix, u in _UNITS if metric.endswith(suffix)), "")
    if unit == "%" and metric.endswith("_frac"):
        value *= 100
    if unit == "B":
        value, unit = binary_scale(value)
    elif unit in ("J", "s") and value and not (unit == "s" and abs(value) >= 1):
        scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), _PREFIXES[-1])
        value, unit = value / scale, prefix + unit
    if unit == "tokens/s" or metric in _COUNTS or metric.endswith("_count"):  # tokens/s: as Live and Runs show it
        text = f"{value:,.0f}"
    else:
        text = f"{value:,}" if isinstance(value, int) else _four_digits(value)
    return f"{text}{'' if unit == '%' else ' '}{unit}".rstrip()


def _four_digits(value: float) -> str:
    """About four significant digits, thousands separated, no exponent: 3,355 · 57.73 · 0.0123."""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude == 0:
        return "0"
    decimals = 3 - math.floor(math.log10(magnitude))
    return f"{value:.{min(decimals, 6)}f}"


def parse_window(text: str):
    """The CLI's --window: steady | all | START:END (seconds after the run's first sample)."""
    if text in ("steady", "all"):
        return text
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(start), float(end)
    except ValueError:
        raise UserError(f"--window {text!r}: expected steady, all or START:END in seconds, e.g. 10:70") from None


def _window(window, iterations: pl.DataFrame, first_ns: int):
    """(start_ns, end_ns or None for "until the last sample", label, notes) for a window spec."""
    if window == "steady":
        steady = iterations.filter(~pl.col("warmup"))
        if steady.height:
            return int(steady["start_ns"].min()), int(steady["end_ns"].max()), "steady", []
        why = "no iteration log" if iterations.height == 0 else "no steady (non-warm-up) iterations"
        return first_ns, None, "all", [f"{why}: window 'all' used instead of 'steady'"]
    if window == "all":
        return first_ns, None, "all", []
    if isinstance(window, str):
        window = parse_window(window)
    try:
        start_s, end_s = (float(x) for x in window)
    except (TypeError, ValueError):
        raise UserError(f"window = {window!r}: expected 'steady', 'all' or (start_s, end_s)") from None
    label = f"{start_s:g}:{end_s:g}"
    if not 0 <= start_s < end_s:
        raise UserError(f"window {label}: need 0 <= start < end (seconds after the run's first sample)")
    return first_ns + int(start_s * _NS), first_ns + int(end_s * _NS), label, []


@dataclass(frozen=True)
class ExperimentFile:
    """A run's experiment.toml as the typed Experiment, and the tables the file itself gives. The engine
    writes it fully resolved; a hand-written one may leave the cluster or the global batch out, which
    are then unknown (the telemetry's devices count, the iteration log's samples), not defaults."""

    experiment: Experiment
    data: dict

    def gives(self, section: str, name: str | None = None) -> bool:
        table = self.data.get(section)
        return isinstance(table, dict) and bool(table) and (name is None or table.get(name) is not None)


def read_experiment(path: Path) -> ExperimentFile | None:
    """The experiment at `path` (RUN_DIR/experiment.toml); None when the run has none."""
    path = Path(path)
    if not path.is_file():
        return None
    data = paths.read_toml(path, "experiment file")
    return ExperimentFile(Experiment.from_dict(data, source=str(path)), data)


def _iteration_stats(iterations, start_ns, end_ns, exp_file: ExperimentFile | None, n_gpus: int | None):
    its = iterations.filter((pl.col("start_ns") >= start_ns) & (pl.col("end_ns") <= end_ns))
    if its.height == 0:
        return {}, [] if iterations.height == 0 else ["no whole iteration inside the window"]
    notes = []
    exp = exp_file.experiment if exp_file else None
    seq = exp.seq_length if exp else None
    gbs = exp.training.global_batch_size if exp and exp_file.gives("training", "global_batch_size") else None
    its = its.with_columns(
        ((pl.col("end_ns") - pl.col("start_ns")) / _NS).alias("time_s"),
        pl.col("samples").fill_null(pl.lit(gbs, dtype=pl.Int64)),  # gbs is None without experiment.toml
    ).with_columns(pl.col("tokens").fill_null(pl.col("samples") * seq))
    total_s = its["time_s"].sum()
    samples, tokens = its["samples"].sum(), its["tokens"].sum()
    out = {
        "iterations": its.height,
        "iter_time_mean_s": its["time_s"].mean(),
        "iter_time_p50_s": its["time_s"].quantile(0.5, "linear"),
        "iter_time_p99_s": its["time_s"].quantile(0.99, "linear"),
        "samples_total": samples or None, "tokens_total": tokens or None,
        "samples_per_s": samples / total_s if samples and total_s > 0 else None,
        "tokens_per_s": tokens / total_s if tokens and total_s > 0 else None,
    }
    world = (exp.world_size if exp and exp_file.gives("cluster") else None) or n_gpus
    tflops = None
    if exp and world and total_s > 0 and its["samples"].null_count() == 0:
        flops = sum(flops_per_iteration(exp, int(s)) for s in its["samples"])
        tflops = flops / total_s / world / 1e12
    elif its["tflops_per_gpu"].null_count() < its.height:
        tflops = its["tflops_per_gpu"].mean()
        notes.append("TFLOP/s from the iteration log (no experiment.toml)")
    peak = (exp.hardware.bf16_tflops or None) if exp else None
    out["tflops_per_gpu"] = tflops
    out["mfu_pct"] = 100 * tflops / peak if tflops is not None and peak else None
    return out, notes


def _with_iteration_stats(table: pl.DataFrame, it: dict) -> pl.DataFrame:
    names = ["iterations", "iter_time_mean_s", "iter_time_p50_s", "iter_time_p99_s", "samples_total",
             "tokens_total", "samples_per_s", "tokens_per_s", "tflops_per_gpu", "mfu_pct"]
    table = table.with_columns(
        pl.lit(it.get(n), pl.Int64 if n in ("iterations", "samples_total", "tokens_total") else pl.Float64).alias(n)
        for n in names
    )
    energy = pl.col("energy_j") if "energy_j" in table.columns else pl.lit(None, pl.Float64)  # host-only runs
    per_iter = energy / pl.col("iterations")
    return table.with_columns(
        per_iter.alias("energy_per_iteration_j"),
        (energy / pl.col("tokens_total")).alias("energy_per_token_j"),
        (pl.col("samples_per_s") / (per_iter / 1e6)).alias("efficiency_samples_per_s_mj"),
    ).drop("samples_total")


# --------------------------------------------------------------------------------------------
# Per GPU
# --------------------------------------------------------------------------------------------
def _in_window(start_ns: int | None, end_ns: int | None) -> pl.Expr:
    keep = pl.lit(True)
    if start_ns is not None:
        keep &= pl.col("ts_ns") >= start_ns
    if end_ns is not None:
        keep &= pl.col("ts_ns") <= end_ns
    return keep


BATCH_ROWS = 5_000_000  # samples summarized at once: an hour of 64 GPUs at 20 Hz in a few hundred MB


def _devices(scan: pl.LazyFrame) -> pl.DataFrame:
    """One row per device: its samples, first and last time, and names (a streaming pass over
    the identity columns only)."""
    return scan.group_by("node", "device").agg(
        pl.len().alias("rows"), pl.col("ts_ns").min().alias("first_ns"), pl.col("ts_ns").max().alias("last_ns"),
        **_GPU_LABELS,
    ).sort("node", "device").collect(engine="streaming")


def _batches(devices: pl.DataFrame) -> list[tuple[list[str], list[str] | None]]:
    """(nodes, their devices or None for all) to summarize together, each batch at most
    BATCH_ROWS samples where a node allows (one device is never split)."""
    batches: list[tuple[list[str], list[str] | None]] = []
    size = BATCH_ROWS + 1
    for (d,), part in devices.group_by("node", maintain_order=True):
        rows = part["rows"].sum()
        if rows > BATCH_ROWS:  # a big node: its devices in groups
            group, group_rows = [], 0
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


def _device_key(devices: pl.DataFrame) -> tuple[pl.Expr, pl.DataFrame]:
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


def _by_device(samples: pl.DataFrame, devices: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the samples (keyed by `_key`, see _device_key) grouped by device, each device's in time
    order, with a device id `_dev` counting from 0 in place of the key; the `devices` rows
    (with `_key`) of those ids).

    Every per-device statistic is then a column expression over the whole frame (shifts masked
    at device boundaries) aggregated by contiguous slices, one group_by for all devices.
    """
    # Finished files group rows by device (recorder.py): an import's samples arrive grouped
    # already; a recording's compacted files hold a minute each, whose runs are copied together
    # (a stable sort by device at a fraction of its cost).
    import numpy as np

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
    dev = np.repeat(np.arange(runs.height, dtype=np.uint32), runs["len"].to_numpy())
    samples = samples.drop("_key").insert_column(0, pl.Series("_dev", dev))
    # Files hold chunks in time order; only a clock step disorders a device's samples.
    if samples.select(((pl.col("_dev") == pl.col("_dev").shift(1)) & (pl.col("ts_ns").diff() < 0)).any()).item():
        samples = samples.sort(["_dev", "ts_ns"], maintain_order=True)
    names = keys.with_row_index("_dev").join(devices, on="_key", how="left", maintain_order="left").drop("_key")
    return samples.with_columns(pl.col("_dev").set_sorted()), names


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
    """`aggs` per device (`_dev`) after adding the per-sample `columns` (a `_by_device` frame).

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


def _gpu_stats(gpu: pl.DataFrame, names: pl.DataFrame, temp_limit: float, max_clock: float | None) -> pl.DataFrame:
    """One row of statistics per GPU (`_dev`), after its `names` (from `_by_device`)."""
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


def _excursions(gpu: pl.DataFrame, run_mean_w: float | None) -> pl.DataFrame:
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


def _host_stats(host: pl.DataFrame, names: pl.DataFrame) -> pl.DataFrame:
    """One row per node from its host samples (from `_by_device`): CPU, memory, RAPL, network."""
    dt = pl.col("dt_s")
    tw_mean = lambda c: pl.when(_only(pl.col(c).is_not_null(), dt).sum() > 0).then(  # noqa: E731
        (pl.col(c) * dt).sum() / _only(pl.col(c).is_not_null(), dt).sum())
    known = lambda value, c: pl.when(pl.col(c).is_not_null().any()).then(value)  # noqa: E731
    energy = ("cpu_energy_j", "dram_energy_j")
    # RAPL counters wrap at a CPU-specific range: a wrapped interval is left out, not guessed.
    columns = {"dt_s": _dt(), **{f"_{c}_delta": _next(pl.col(c)) - pl.col(c) for c in energy}}
    return names.join(_per_device(host, columns, [
        dt.sum().alias("host_duration_s"),
        tw_mean("cpu_util_pct").alias("cpu_util_mean_pct"), tw_mean("cpu_freq_mhz").alias("cpu_freq_mean_mhz"),
        tw_mean("temp_cpu_c").alias("temp_cpu_mean_c"), pl.col("temp_cpu_c").max().alias("temp_cpu_peak_c"),
        pl.col("host_mem_used_bytes").max().alias("host_mem_used_peak_bytes"),
        *(known(_only(pl.col(f"_{c}_delta") >= 0, pl.col(f"_{c}_delta")).sum(), c).alias(c) for c in energy),
        *(known(_counter_delta(c).sum(), c).alias(c)
          for c in ("ib_tx_bytes", "ib_rx_bytes", "net_tx_bytes", "net_rx_bytes")),
        pl.col("simulated").any().alias("host_simulated"),
    ]), on="_dev").drop("_dev").sort("node")


def _combine(accelerators: pl.DataFrame | None, host: pl.DataFrame | None) -> pl.DataFrame:
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


def _aggregate_host(host: pl.DataFrame) -> pl.DataFrame:
    sums = ["cpu_energy_j", "dram_energy_j", "ib_tx_bytes", "ib_rx_bytes", "net_tx_bytes", "net_rx_bytes"]
    return host.select(
        pl.col("host_duration_s").max(),
        *(pl.col(c).mean() for c in ("cpu_util_mean_pct", "cpu_freq_mean_mhz", "temp_cpu_mean_c")),
        *(pl.col(c).max() for c in ("temp_cpu_peak_c", "host_mem_used_peak_bytes")),
        *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum()).alias(c) for c in sums),
        pl.col("host_simulated").any(),
    )


# --------------------------------------------------------------------------------------------
# Per node / per run
# --------------------------------------------------------------------------------------------
_SUM = ["energy_j", "nvlink_tx_bytes", "nvlink_rx_bytes", "pcie_tx_bytes", "pcie_rx_bytes",
        "spikes_over_mean_count", "spikes_over_limit_count", "samples", "gpus"]
_MAX = ["power_peak_w", "power_p99_w", "power_max_rise_w_per_s", "temp_gpu_peak_c", "temp_mem_peak_c",
        "time_above_temp_limit_s", "mem_used_peak_bytes", "spikes_over_mean_max_excess_w",
        "spikes_over_limit_max_excess_w", "duration_s", "power_limit_w", "max_sm_clock_mhz"]
_MIN = ["sm_clock_min_mhz"]
_FIRST = ["backend"]


def _aggregate(gpus: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
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
        out = frame.group_by(keys).agg(aggs).sort(keys)
    else:
        out = frame.select(aggs).with_columns(pl.lit(None, pl.String).alias("node"))
    out = out.with_columns(pl.lit(None, pl.String).alias("device")).collect()
    order = [c for c in gpus.columns if c in out.columns]
    return out.select(order + [c for c in out.columns if c not in order])


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------
def render(df: pl.DataFrame, fmt: str) -> str:
    """A summary (or any tidy frame) as text: table | markdown | csv | json."""
    if fmt == "csv":
        return df.write_csv()
    if fmt == "json":
        return df.write_json()
    if fmt == "markdown":
        return text_table(_long(df), markdown=True)
    if fmt == "table":
        return _terminal_table(_long(df))
    raise UserError(f"format {fmt!r}: expected one of table, markdown, csv, json (parquet needs --out FILE)")


def write_summary(df: pl.DataFrame, target: str | os.PathLike, fmt: str | None = None) -> str | None:
    """Render to a format name (returns the text) or write to a file (format from `fmt` or the suffix)."""
    if fmt is None and str(target) in FORMATS:
        if target == "parquet":
            raise UserError("format 'parquet' is binary: give a file to write it to (--out FILE)")
        return render(df, str(target))
    path = Path(target)
    fmt = fmt or {".parquet": "parquet", ".csv": "csv", ".json": "json", ".md": "markdown",
                  ".txt": "table"}.get(path.suffix.lower())
    if fmt not in FORMATS:
        raise UserError(f"--out {str(path)!r}: unknown format; use a .parquet, .csv, .json, .md or .txt name, "
                        "or give --format")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, df.write_parquet if fmt == "parquet" else render(df, fmt))
    return None


def _long(df: pl.DataFrame) -> pl.DataFrame:
    """Metrics as rows, one column per GPU / node / run: readable however many metrics."""
    names = []
    for row in df.iter_rows(named=True):
        parts = [row.get("run")] if row.get("level") == "run" or "level" not in df.columns else []
        parts += [row.get(k) for k in ("node", "device") if row.get(k)]
        names.append("/".join(str(p) for p in parts if p) or str(row.get("run", "value")))
    columns = {"metric": df.columns}
    for name, row in zip(names, df.iter_rows()):
        columns[name] = [format_figure(metric, v) for metric, v in zip(df.columns, row)]
    return pl.DataFrame(columns)


def _terminal_table(long: pl.DataFrame, width: int | None = None) -> str:
    """`_long`'s table for a terminal: rows that are the same in every column are said once above
    it ("backend: sim"), and the columns are cut into blocks as wide as the terminal."""
    import shutil

    width = width or shutil.get_terminal_size((120, 24)).columns
    names = long.columns[1:]
    same = long.filter(pl.all_horizontal(pl.col(n) == pl.col(names[0]) for n in names)) if len(names) > 1 \
        else long.clear()
    head = "".join(f"{m}: {v}\n" for m, v in same.select("metric", names[0]).iter_rows() if v) if same.height else ""
    rest = long.filter(~pl.col("metric").is_in(same["metric"].to_list()))
    metric_width = max(map(len, rest["metric"].to_list() + ["metric"])) + 3

    def column_width(name: str) -> int:
        return max(map(len, rest[name].to_list() + [name])) + 3

    blocks, block, used = [], [], metric_width
    for name in names:
        if block and used + column_width(name) > width:
            blocks.append(block)
            block, used = [], metric_width
        block.append(name)
        used += column_width(name)
    blocks.append(block)
    return head + "\n".join(text_table(rest.select("metric", *b), markdown=False) for b in blocks)


def text_table(df: pl.DataFrame, markdown: bool) -> str:
    with pl.Config(
        tbl_formatting="MARKDOWN" if markdown else "UTF8_FULL_CONDENSED",
        tbl_hide_column_data_types=True, tbl_hide_dataframe_shape=True,
        tbl_rows=-1, tbl_cols=-1, tbl_width_chars=60_000, fmt_str_lengths=200, tbl_cell_alignment="LEFT",
    ):
        return str(df) + "\n"
