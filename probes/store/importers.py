"""Import other tools' results into our run format, so old results compare with new runs.

CharLLM-PPT / Zeus result directory (sitar-lab/CharLLM-PPT, zeus/zeus/monitor/power.py):
one CSV per metric and global rank, `{metric}_{rank}.csv`, rows `unix_time_s,value`, no
header, one row per 20 Hz tick (every metric of a tick has the same time). What the
artifact's files hold, and what they become here:

| artifact file | read with (NVML) | artifact unit | our column |
|---|---|---|---|
| gpu_power (or power) | field POWER_INSTANT / 1000 | W | power_w |
| mem_power | field POWER_AVERAGE, memory scope / 1000 | W | mem_power_w |
| gpu_thermal, mem_thermal | GetTemperature, field MEMORY_TEMP | °C | temp_gpu_c, temp_mem_c |
| sm_clock, mem_clock | GetClockInfo | MHz (plotted as GHz) | sm_clock_mhz, mem_clock_mhz |
| gpu_util, mem_util | GetUtilizationRates | % | util_gpu_pct, util_mem_pct |
| pcie_tx/rx_bytes | field PCIE_COUNT_TX/RX_BYTES (.uiVal) | bytes, 32-bit counter | pcie_tx/rx_bytes_s (deltas / time) |
| pcie_tx/rx_throughput | GetPcieThroughput | KB/s | pcie_tx/rx_bytes_s (x1024; only without the counters) |
| nvlink_tx/rx_throughput | field NVLINK_THROUGHPUT_RAW_TX/RX (.uiVal) | KiB, 32-bit counter | nvlink_tx/rx_bytes (unwrapped, x1024) |
| system_cpu_usage/idle_rank_R_id_CPU | node_exporter node_cpu_seconds | s, cumulative | cpu_util_pct (host row) |
| system_cpu_temp_rank_R_id_ZONE | node_thermal_zone_temp | °C | temp_cpu_c (hottest zone) |
| system_ib_rx/tx_bytes_rank_R_id_DEV | node_network_*_bytes | bytes, cumulative | ib_rx/tx_bytes (sum over ports) |
| system_memory_used_R / system_memory_free_R | MemTotal (sic) / MemFree | bytes | host_mem_total_bytes / host_mem_used_bytes |

The artifact writes -1 for a failed read; that becomes null. Rank r is node r // gpus_per_node,
device gpu{r % gpus_per_node}. The artifact exports ZEUS_MONITOR_SYS=1 on every rank, so each rank
of a node wrote the same host files: the node's lowest rank gives its host row. What the files
cannot tell us is listed in the manifest (`limitations`) and in LIMITATIONS below.

A results tree (the artifact's `results/<sweep>/<model>/<run>/`) is imported one run per folder
that holds such files (`import_charllm_ppt_tree`), named after its path under the tree.

The artifact's profiler traces come along: NeMo writes them (one Kineto JSON per pipeline stage,
`rank-<global rank>.json`, on each stage's first rank) into `<SLURM job id>_kineto/`; the folder's
newest such directory (the highest job id, as the artifact's figure_10_parse.py picks it) is copied
into the run's traces/, where `summarize --kernels` reads them (probes.analysis.kernels).
"""  # noqa: E501 - the table of the artifact's files reads as a Markdown table

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast

import numpy as np
import polars as pl

from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.files import is_regular, open_regular
from charllm.probes.store.recorder import write_parquet
from charllm.probes.store.rundir import (
    TRACES,
    RunDir,
    check_run_id,
    new_run_id,
    remove_abandoned_staging,
    staging_dir,
    unique_run_dir,
)
from charllm.probes.store.schema import conform

FORMAT = "charllm-ppt"
SAMPLED_STEP = 10   # the step the artifact's sampler recorded (of 11)
# Fewer power samples than this on every rank: the run crashed (or ran out of memory) before its
# sampled step, as the CharLLM-PPT artifact's own analysis scripts treat it (they drop such runs as OOM).
MIN_SAMPLES = 10
CRASHED = "crashed or OOM"
BACKEND = "import:charllm-ppt"

# artifact metric -> (our column, factor to our unit)
_GAUGES = {
    "gpu_power": ("power_w", 1.0), "power": ("power_w", 1.0), "mem_power": ("mem_power_w", 1.0),
    "gpu_thermal": ("temp_gpu_c", 1.0), "mem_thermal": ("temp_mem_c", 1.0),
    "sm_clock": ("sm_clock_mhz", 1.0), "mem_clock": ("mem_clock_mhz", 1.0),
    "gpu_util": ("util_gpu_pct", 1.0), "mem_util": ("util_mem_pct", 1.0),
    "pcie_tx_throughput": ("pcie_tx_bytes_s", 1024.0), "pcie_rx_throughput": ("pcie_rx_bytes_s", 1024.0),
}
_COUNTERS = {  # 32-bit counters, unwrapped: metric -> (our column, bytes per count)
    "nvlink_tx_throughput": ("nvlink_tx_bytes", 1024), "nvlink_rx_throughput": ("nvlink_rx_bytes", 1024),
    "pcie_tx_bytes": ("pcie_tx_bytes_s", 1), "pcie_rx_bytes": ("pcie_rx_bytes_s", 1),
}
GPU_METRICS = tuple(_GAUGES) + tuple(_COUNTERS)

LIMITATIONS = [
    "no throttle reasons: the artifact did not record clocks-event reasons (throttle_* are null)",
    "no energy counter: energy is the trapezoidal integral of sampled instantaneous power",
    "no power limit: spikes over the power limit cannot be counted",
    "no GPU memory use: mem_used_bytes is null",
    "NVLink bytes cover one link: the NVLink throughput field was read without scopeId = all links, "
    "and as a 32-bit KiB counter (unwrapped on import, so a wrap between two samples is assumed once)",
    "one iteration: the artifact sampled one training step (10 of 11), so the whole recording is that step "
    "(the iteration log holds it, from the first sample to the last); tokens/s, TFLOP/s and MFU need the "
    "experiment, which import attaches where the folder names one of the artifact's runs",
    "timestamps are the sampler's wall clock (time.time()); mono_ns is derived from them",
    "system_memory_used holds MemTotal in the artifact; used memory is MemTotal - MemFree",
]

_GPU_FILE = re.compile(r"^(?P<metric>[a-z_]+?)_(?P<rank>\d+)\.csv$")
_SYS_LABELLED = re.compile(r"^system_(?P<metric>[a-z_]+?)_rank_(?P<rank>\d+)_id_(?P<id>[A-Za-z0-9_.-]+)\.csv$")
_SYS_SIMPLE = re.compile(r"^system_(?P<metric>memory_used|memory_free)_(?P<rank>\d+)\.csv$")


def import_charllm_ppt(src: str | Path, *, name: str | None = None, gpus_per_node: int = 8,
                       simulated: bool = False, on_progress=None) -> RunDir:
    """Turn a CharLLM-PPT / Zeus result directory into a new run directory; returns it.

    `simulated` labels data known to be synthetic (e.g. generated CSVs), never real recordings.
    """
    src = Path(src).expanduser()
    if not src.is_dir():
        raise UserError(f"charllm-ppt directory {str(src)!r}: no such directory")
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    gpu_files: dict[int, dict[str, Path]] = {}
    sys_files: dict[int, list[tuple[str, str, Path]]] = {}
    for f in sorted(src.iterdir()):
        if not is_regular(f):   # a pipe or a device under a result's name would block or never end
            continue
        if m := _SYS_LABELLED.match(f.name):
            sys_files.setdefault(int(m["rank"]), []).append((m["metric"], m["id"], f))
        elif m := _SYS_SIMPLE.match(f.name):
            sys_files.setdefault(int(m["rank"]), []).append((m["metric"], "", f))
        elif (m := _GPU_FILE.match(f.name)) and m["metric"] in GPU_METRICS:
            gpu_files.setdefault(int(m["rank"]), {})[m["metric"]] = f
    if not gpu_files:
        raise UserError(f"charllm-ppt directory {str(src)!r}: no {{metric}}_{{rank}}.csv files "
                        f"(metrics {', '.join(GPU_METRICS)})")

    check_run_id(new_run_id(name or src.name))
    paths.runs_dir().mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(paths.runs_dir())
    base = paths.runs_dir() / new_run_id(name or src.name)
    tmp = staging_dir(base)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed import that had the same ids
    rejected: dict[str, list[int]] = {}   # file -> [rows rejected, rows read]
    try:
        run = RunDir.create(tmp, "import")
        # One file per device (numbered as chunks), each written before the next is read: memory
        # holds one rank's samples however long or wide the run.
        ranks: dict[str, list[int]] = {}
        for rank in sorted(gpu_files):
            ranks.setdefault(f"node{rank // gpus_per_node}", []).append(rank)
        first_rank: dict[str, int] = {}          # every rank wrote its node's host files: keep one
        for rank in sorted(sys_files):
            first_rank.setdefault(f"node{rank // gpus_per_node}", rank)
        first: int | None = None
        last: int | None = None
        samples = 0                              # the most power samples a rank holds
        done = 0
        for node in sorted({*ranks, *first_rank}, key=lambda n: int(n.removeprefix("node"))):
            out = run.node_telemetry_dir(node)
            out.mkdir(parents=True, exist_ok=True)
            parts: list[tuple[bool, Callable[[], pl.DataFrame | None]]] = [
                (True, partial(_gpu_rank, gpu_files[rank], node, f"gpu{rank % gpus_per_node}", rank, simulated,
                               rejected))
                for rank in ranks.get(node, [])]
            if node in first_rank:
                parts.append((False, partial(_host, sys_files[first_rank[node]], node, simulated, rejected)))
            chunk = 0
            for is_gpu, part in parts:
                frame = part()
                if is_gpu and frame is not None and "power_w" in frame.columns:
                    samples = max(samples, frame["power_w"].drop_nulls().len())
                if frame is not None and frame.height:
                    write_parquet(conform(frame), out / f"{chunk:06d}.parquet")
                    chunk += 1
                    lo, hi = cast(int, frame["ts_ns"].min()), cast(int, frame["ts_ns"].max())
                    first = lo if first is None else min(first, lo)
                    last = hi if last is None else max(last, hi)
                if is_gpu:
                    done += 1
                    if on_progress:
                        on_progress(done, len(gpu_files))
        traces = _copy_traces(src, run.path / TRACES)
        if first is None or last is None:
            raise UserError(f"charllm-ppt directory {str(src)!r}: its CSV files hold no samples"
                            + (f" that could be kept ({rejection_note(rejected)})" if rejected else ""))
        crash = _crash(samples)
        # The artifact sampled one training step (the 10th of 11): the recording is that step.
        run.iterations_path.write_text(json.dumps({"event": "iteration", "iteration": SAMPLED_STEP, "rank": 0,
                                                   "start_ns": int(first), "end_ns": int(last),
                                                   "warmup": False}) + "\n")
        run.write_manifest(
            {
                "id": base.name,
                "name": name or src.name,
                "kind": "import",
                "status": "failed" if crash else "completed",
                "failure": crash,
                "simulated": simulated,
                "created_ns": int(first),
                "started_ns": int(first),
                "ended_ns": int(last),
                "imported_at": time.time(),
                "imported_from": {
                    "format": FORMAT,
                    "path": str(src.resolve()),
                    "ranks": sorted(gpu_files),
                    "gpus_per_node": gpus_per_node,
                    "files": sum(len(f) for f in gpu_files.values()) + sum(len(f) for f in sys_files.values()),
                    "traces": traces,
                },
                "limitations": LIMITATIONS,
                "rejected_rows": {file: count for file, (count, _) in sorted(rejected.items())},
                "notes": [rejection_note(rejected)] if rejected else [],
            }
        )
        run = RunDir(_rename_into_place(tmp, base))
        if run.id != base.name:
            run.update_manifest(id=run.id)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException, ValueError, OverflowError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise UserError(f"charllm-ppt directory {str(src)!r}: not imported ({first_line})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run


def _crash(samples: int) -> str | None:
    """Why an artifact folder is a crash rather than a run (its manifest's failure), or None. No power
    sample at all (host files only) is no sign of a training step either."""
    if samples >= MIN_SAMPLES:
        return None
    return (f"{CRASHED}: {plural(samples, 'power sample')} on its best rank, under the {MIN_SAMPLES} a sampled "
            f"step holds (the artifact's own scripts drop such runs as OOM)")


_KINETO = re.compile(r"^(\d+)_kineto$")
_KINETO_TRACE = re.compile(r"^rank-\d+\.json(\.gz)?$")


def _copy_traces(src: Path, dest: Path) -> list[str]:
    """The newest `<job>_kineto/rank-R.json` traces of a result folder, copied into `dest`; their names."""
    jobs = sorted((int(m[1]), d) for d in src.iterdir() if (m := _KINETO.match(d.name)) and d.is_dir()
                  and not d.is_symlink())
    if not jobs:
        return []
    folder = jobs[-1][1]
    names = sorted(f.name for f in folder.iterdir() if _KINETO_TRACE.match(f.name) and is_regular(f)
                   and not f.is_symlink())
    if names:
        dest.mkdir(exist_ok=True)
    for name in names:
        with open_regular(folder / name, "trace") as fh, open(dest / name, "wb") as out:
            shutil.copyfileobj(fh, out)
    return [f"{folder.name}/{name}" for name in names]


def _rename_into_place(tmp: Path, base: Path) -> Path:
    """Rename the finished import to `base`'s name, or with a suffix when another run has it
    (a launch or an import in the same second): a rename onto a run that exists fails, and the
    next name is tried."""
    while True:
        final = unique_run_dir(base)
        try:
            tmp.rename(final)
            return final
        except OSError:
            if not final.exists():
                raise


def rejection_note(rejected: dict[str, list[int]]) -> str:
    """One line: how many rows of which files were left out, and why."""
    bad = sum(count for count, _ in rejected.values())
    total = sum(rows for _, rows in rejected.values())
    files = ", ".join(f"{file} ({count:,})" for file, (count, _) in sorted(rejected.items())[:3])
    more = f" and {len(rejected) - 3} more files" if len(rejected) > 3 else ""
    return (f"{bad:,} of {total:,} rows rejected in {files}{more}: a time that is not a finite date "
            f"in {MIN_YEAR}..{MAX_YEAR}, or a value that is not a finite number from 0 to {MAX_VALUE:.0e} "
            "(-1, the artifact's failed read, is kept as no value)")


def is_result_folder(folder: Path) -> bool:
    """Whether `folder` itself holds a result ({metric}_{rank}.csv files of a known metric)."""
    return any((m := _GPU_FILE.match(f.name)) and m["metric"] in GPU_METRICS for f in folder.iterdir()
               if is_regular(f))


def result_folders(root: str | Path) -> list[Path]:
    """Every folder under `root` (itself included) that holds a result, in path order."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UserError(f"charllm-ppt directory {str(root)!r}: no such directory")
    return sorted(d for d in [root, *root.rglob("*")] if d.is_dir() and is_result_folder(d))


def import_charllm_ppt_tree(root: str | Path, *, prefix: str | None = None, gpus_per_node: int = 8,
                            simulated: bool = False, on_folder=None) -> list[tuple[Path, RunDir | UserError]]:
    """Import every result folder under `root` as its own run, named after its path under `root`
    (`<sweep>-<model>-<run>` for the artifact's tree; `prefix`-… when given). A folder that fails is
    returned with its error and does not stop the others. `on_folder(done, total, folder)` reports progress."""
    root = Path(root).expanduser()
    folders = result_folders(root)
    if not folders:
        raise UserError(f"charllm-ppt directory {str(root)!r}: no result folder under it (none holds "
                        f"{{metric}}_{{rank}}.csv files of {', '.join(GPU_METRICS)})")
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    out: list[tuple[Path, RunDir | UserError]] = []
    for i, folder in enumerate(folders):
        relative = "-".join(folder.relative_to(root).parts) or root.name
        name = f"{prefix}-{relative}" if prefix else relative
        try:
            out.append((folder, import_charllm_ppt(folder, name=name, gpus_per_node=gpus_per_node,
                                                   simulated=simulated)))
        except UserError as exc:
            out.append((folder, exc))
        if on_folder:
            on_folder(i + 1, len(folders), folder)
    return out


# A row is kept when its time is a date of this era and its value a plausible reading (every metric
# the artifact records is a count, a rate, a level or a temperature: none below 0, none near 2**63).
MIN_YEAR, MAX_YEAR = 2000, 2100
_MIN_S, _MAX_S = 946_684_800.0, 4_102_444_800.0   # 2000-01-01 and 2100-01-01, UTC
MAX_VALUE = 1e18


def _read(path: Path, rejected: dict[str, list[int]], maximum: float = MAX_VALUE) -> pl.DataFrame:
    """`unix_time_s,value` rows -> ts_ns, v (-1, the artifact's failed read, -> null). A row whose
    time or value no recording could hold (NaN, inf, 1e300, a negative reading, above `maximum`)
    is left out and counted in `rejected[file name]` ([rows left out, rows read])."""
    try:
        with open_regular(path, "CSV file") as fh:
            df = pl.read_csv(fh, has_header=False, new_columns=["t", "v"],
                             schema_overrides={"t": pl.Float64, "v": pl.Float64})
    except (pl.exceptions.ComputeError, pl.exceptions.NoDataError, pl.exceptions.ShapeError,
            pl.exceptions.SchemaError) as exc:
        if path.stat().st_size == 0:
            return pl.DataFrame(schema={"ts_ns": pl.Int64, "v": pl.Float64})
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"{path}: expected `unix_time_s,value` rows without a header ({first[:160]})") from None
    if df.width != 2:
        raise UserError(f"{path}: expected 2 columns `unix_time_s,value`, found {df.width}")
    t, v = pl.col("t"), pl.col("v")
    good = (t.is_not_null() & t.is_finite() & t.is_between(_MIN_S, _MAX_S)
            & (v.is_null() | (v == -1) | (v.is_finite() & v.is_between(0, maximum))))
    kept = df.filter(good)
    if kept.height < df.height:
        rejected[path.name] = [df.height - kept.height, df.height]
    return kept.select(
        (t * 1e9).round().cast(pl.Int64).alias("ts_ns"),
        pl.when(v != -1).then(v).alias("v"),
    )


def _unwrap32(values: pl.Series) -> np.ndarray:
    """A 32-bit counter as a running total since its first sample (nulls carry the last value)."""
    v = values.fill_null(strategy="forward").fill_null(0).cast(pl.Int64).to_numpy()
    d = np.diff(v, prepend=v[:1])
    d[d < 0] += 2**32
    return np.cumsum(d)


def _gpu_rank(files: dict[str, Path], node: str, device: str, rank: int, simulated: bool,
              rejected: dict[str, list[int]]) -> pl.DataFrame:
    columns: dict[str, pl.DataFrame] = {}
    for metric, path in files.items():
        df = _read(path, rejected, 2**32 - 1 if metric in _COUNTERS else MAX_VALUE)   # counters are 32-bit
        if metric in _COUNTERS:
            col, unit = _COUNTERS[metric]
            total = _unwrap32(df["v"]) * unit
            if col.endswith("_bytes_s"):  # a byte counter -> the rate over the interval each sample owns
                t = df["ts_ns"].to_numpy() / 1e9
                rate = np.full(len(total), np.nan)
                if len(total) > 1:
                    rate[:-1] = np.diff(total) / np.maximum(np.diff(t), 1e-9)
                df = df.with_columns(pl.Series("v", rate).fill_nan(None))
            else:
                df = df.with_columns(pl.Series("v", total, dtype=pl.Int64))
        else:
            col, factor = _GAUGES[metric]
            if col in columns:  # `power_{r}.csv` and `gpu_power_{r}.csv`: keep gpu_power
                continue
            if col.startswith("pcie_") and metric.replace("_throughput", "_bytes") in files:
                continue  # the byte counters give exact totals; the throughput is a point sample
            df = df.with_columns(pl.col("v") * factor)
        columns[col] = df.unique("ts_ns", keep="first").rename({"v": col})
    frames = iter(columns.values())
    frame = next(frames)
    for df in frames:  # every metric of a tick shares its time: join on it
        frame = frame.join(df, on="ts_ns", how="full", coalesce=True)
    frame = frame.sort("ts_ns")
    return frame.with_columns(
        (pl.col("ts_ns") - pl.col("ts_ns").min()).alias("mono_ns"),
        pl.lit(node).alias("node"), pl.lit(device).alias("device"),
        pl.lit(f"charllm-ppt-rank{rank}").alias("uuid"), pl.lit(BACKEND).alias("backend"),
        pl.lit(simulated).alias("simulated"),
    )


def _host(files: list[tuple[str, str, Path]], node: str, simulated: bool,
          rejected: dict[str, list[int]]) -> pl.DataFrame | None:
    """One host row per tick from the system_* files of a node's first rank."""
    by_metric: dict[str, list[pl.DataFrame]] = {}
    for metric, ident, path in files:
        by_metric.setdefault(metric, []).append(_read(path, rejected).with_columns(pl.lit(ident).alias("id")))
    parts = []

    def total(metric):  # sum over CPUs / ports / modes at each tick
        return pl.concat(by_metric[metric]).group_by("ts_ns").agg(pl.col("v").sum()).sort("ts_ns")

    if "cpu_usage" in by_metric and "cpu_idle" in by_metric:
        busy, idle = total("cpu_usage"), total("cpu_idle").rename({"v": "idle"})
        if "cpu_iowait" in by_metric:
            idle = idle.join(total("cpu_iowait").rename({"v": "iowait"}), on="ts_ns", how="left").select(
                "ts_ns", (pl.col("idle") + pl.col("iowait").fill_null(0)).alias("idle"))
        both = busy.join(idle, on="ts_ns").sort("ts_ns")
        d_busy, d_idle = pl.col("v").shift(-1) - pl.col("v"), pl.col("idle").shift(-1) - pl.col("idle")
        parts.append(both.select(
            "ts_ns", pl.when(d_busy + d_idle > 0).then(100 * d_busy / (d_busy + d_idle)).alias("cpu_util_pct")))
    if "cpu_temp" in by_metric:
        parts.append(pl.concat(by_metric["cpu_temp"]).group_by("ts_ns").agg(pl.col("v").max().alias("temp_cpu_c")))
    for d in ("rx", "tx"):
        if f"ib_{d}_bytes" in by_metric:
            parts.append(total(f"ib_{d}_bytes").select("ts_ns", pl.col("v").cast(pl.Int64).alias(f"ib_{d}_bytes")))
    if "memory_used" in by_metric:  # the artifact's "memory_used" is MemTotal
        mem = pl.concat(by_metric["memory_used"]).select("ts_ns", pl.col("v").alias("host_mem_total_bytes"))
        if "memory_free" in by_metric:
            free = pl.concat(by_metric["memory_free"]).select("ts_ns", pl.col("v").alias("free"))
            mem = mem.join(free, on="ts_ns", how="left").with_columns(
                (pl.col("host_mem_total_bytes") - pl.col("free")).alias("host_mem_used_bytes")).drop("free")
        parts.append(mem.with_columns(pl.exclude("ts_ns").cast(pl.Int64)))
    if not parts:
        return None
    frame = parts[0]
    for p in parts[1:]:
        frame = frame.join(p, on="ts_ns", how="full", coalesce=True)
    return frame.sort("ts_ns").with_columns(
        (pl.col("ts_ns") - pl.col("ts_ns").min()).alias("mono_ns"), pl.lit(node).alias("node"),
        pl.lit("host").alias("device"), pl.lit(f"host-{node}").alias("uuid"), pl.lit(BACKEND).alias("backend"),
        pl.lit(simulated).alias("simulated"),
    )
