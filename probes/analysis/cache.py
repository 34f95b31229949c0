"""Kept summaries: a finished run never changes, so what is computed from it is kept in
RUN_DIR/summaries/ and recomputed when the experiment, the iteration log or a telemetry
directory changes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError
from charllm.probes.core.files import open_regular, read_bounded
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir, write_json_atomic

if TYPE_CHECKING:
    import polars as pl

# Bump when a statistic changes meaning, so cached summaries of finished runs are recomputed.
SUMMARY_VERSION = 1


MAX_KEY_BYTES = 4 * 2**20   # a key lists a run's telemetry directories: a few KiB


def read_kept(cache: Path, meta: Path, key: dict) -> pl.DataFrame | None:
    """The kept result if its key file says it is current and it has the columns that file
    recorded; None otherwise (a damaged or foreign file is recomputed, never an error)."""
    import polars as pl  # deferred: loads polars (a listing reads kept_row, without it)

    try:
        kept = _current_key(meta, key)
        if kept is None:
            return None
        with open_regular(cache, "kept summary") as fh:
            df = pl.read_parquet(fh)
        return df if _schema(df) == kept.get("schema") else None
    except (OSError, ValueError, RecursionError, UserError, pl.exceptions.PolarsError, pl.exceptions.PanicException):
        return None


def _current_key(meta: Path, key: dict) -> dict | None:
    """The key file's contents if it says the kept result is the one `key` describes, else None."""
    kept = json.loads(read_bounded(meta, MAX_KEY_BYTES, "kept summary key"))
    if not isinstance(kept, dict) or {k: v for k, v in kept.items() if k not in ("schema", "row")} != key:
        return None
    return kept


def kept_row(cache: Path, meta: Path, key: dict) -> dict | None:
    """A kept one-row result (a run-level summary) as its key file also holds it, when current:
    what a listing shows, read without polars; None where there is none (then read_kept)."""
    try:
        kept = _current_key(meta, key)
    except (OSError, ValueError, RecursionError, UserError):
        return None
    row = kept.get("row") if kept else None
    return row if isinstance(row, dict) else None


def _schema(df: pl.DataFrame) -> dict[str, str]:
    return {name: str(dtype) for name, dtype in df.schema.items()}


def kept_places(run: RunDir, window, levels) -> dict[str, tuple[Path, Path, dict]] | None:
    """Per level of `levels`, where a finished run's summary over `window` is kept (see kept_place);
    None while it runs."""
    span = window if isinstance(window, str) else f"{window[0]:g}-{window[1]:g}"
    spec = list(window) if isinstance(window, tuple) else window
    places = {by: kept_place(run, f"{by}-{span}", window=spec, by=by) for by in levels}
    kept = {by: place for by, place in places.items() if place is not None}
    return kept if len(kept) == len(places) else None


def kept_place(run: RunDir, name: str, **spec) -> tuple[Path, Path, dict] | None:
    """(the kept file, its key file, the key that says it is current) of a finished run's result
    `name` computed as `spec` says; None while it runs, or where nothing may be kept (a directory
    charllm-tui did not make, see RunDir.ours)."""
    files = run_files(run)
    if files is None or not run.ours() or (run.path / "summaries").is_symlink():
        return None   # writes go only into runs of ours, never through a link out of one
    kept = run.path / "summaries" / f"{name}.parquet"
    return kept, kept.with_suffix(".json"), {"version": SUMMARY_VERSION, **spec, "files": files}


def run_files(run: RunDir) -> list | None:
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


def keep(df: pl.DataFrame, cache: Path, meta: Path, key: dict) -> None:
    """Keep a finished run's result (atomically; a read-only run directory keeps nothing)."""
    try:
        cache.parent.mkdir(exist_ok=True)
        write_atomic(cache, df.write_parquet)
        row = {"row": {k: _json_value(v) for k, v in df.row(0, named=True).items()}} if df.height == 1 else {}
        write_json_atomic(meta, {**key, "schema": _schema(df), **row})
    except OSError:
        pass


def _json_value(value):
    """A summary value as JSON holds it (NaN and infinities as null, as a listing shows them: "-")."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
