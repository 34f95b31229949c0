"""Crash-safe telemetry recording: Arrow IPC files that are complete or invisible.

Every `write(df)` produces one chunk: written as a hidden `.NNNNNN.arrow.PID.tmp`, fsynced, then
atomically renamed to `NNNNNN.arrow`. A reader (polars, TelemetryTail) therefore only ever sees
whole files, and `kill -9` of the sampler loses at most the rows not yet handed to `write` —
the sampler hands over a batch at least every second.

A chunk a second makes thousands of files an hour, and opening them dominates every later read,
so every `compact_every` chunks the closed ones are merged into one compacted file
`NNNNNN-MMMMMM.parquet` (chunks NNNNNN..MMMMMM) in the one format of finished telemetry
(`write_parquet`, which importers use too): zstd Parquet with dictionary-encoded names and
without the all-null columns (a reader inserts them), about 12 bytes per sample of three NVML
metrics, and row-group statistics that let a time window or a device skip data.
Its rows are grouped by device, each device's in chunk (time) order: whoever reads a device's
series (summaries: every statistic) then copies long runs instead of gathering every row.
The merge is written hidden, fsynced and renamed into place *before* the chunks it holds are
deleted, and readers (`rundir.node_chunks`) skip a chunk inside a compacted file's span, so a
reader sees every row exactly once at any moment, and a crash at any point leaves a consistent
set (a restarted writer deletes what a compacted file already holds and stale .tmp files).
The merged chunks are deleted at the next compaction, not at once, so a reader that listed them
just before still finds them; `close()` merges what is left and deletes at once.
Memory stays flat: at most `compact_every` chunks are held, and only while merging.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, is_disk_full, mount_point
from charllm.probes.store.rundir import chunk_span, node_chunks
from charllm.probes.store.schema import ID_COLUMNS, TELEMETRY_SCHEMA, conform

if TYPE_CHECKING:
    from polars._typing import IpcCompression

log = logging.getLogger(__name__)

DEVICE_KEYS = ["node", "device"]
COMPACT_EVERY = 60  # chunks (seconds at the sampler's flush interval) per compacted file
ROW_GROUP_ROWS = 1 << 17  # a few MB a column: parallel reads and statistics worth pruning by
_SCHEMA = pl.Schema(TELEMETRY_SCHEMA)


def compact_frame(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` as finished telemetry holds it: grouped by device, each device's rows in the order
    given (time order), without the metric columns that hold no value (ID columns always stay)."""
    frame = frame if frame.schema == _SCHEMA else conform(frame)
    counts = frame.null_count().row(0, named=True)
    keep = [c for c in frame.columns if c in ID_COLUMNS or counts[c] < frame.height]
    return frame.select(keep).sort(DEVICE_KEYS, maintain_order=True)


def write_parquet(frame: pl.DataFrame, path: Path, *, sync_dir: bool = False) -> Path:
    """Write finished telemetry (`compact_frame`) to `path` atomically: hidden, fsynced, renamed.

    A failed write (a full disk) removes its hidden file and raises; nothing half-written stays.
    """
    return _write_atomic(path, lambda tmp: compact_frame(frame).write_parquet(
        tmp, compression="zstd", row_group_size=ROW_GROUP_ROWS, statistics=True), sync_dir=sync_dir)


class DiskFull(UserError):
    """The telemetry's disk is full: recording stops, and what was written before stays readable."""

    def __init__(self, directory: Path) -> None:
        mount = mount_point(directory.resolve())
        super().__init__(f"disk full: cannot write telemetry to {directory} (filesystem {mount}, "
                         f"{shutil.disk_usage(mount).free} bytes free); recording stopped, what was "
                         "written before is kept")


def _first_chunk(path: Path) -> int:
    span = chunk_span(path.name)
    assert span is not None, path        # only chunk files are ever open
    return span[0]


def _write_atomic(final: Path, write, sync_dir: bool = False) -> Path:
    try:
        return write_atomic(final, write, sync_dir=sync_dir)
    except Exception as exc:  # polars reports a full disk as its own error too
        if is_disk_full(exc):
            raise DiskFull(final.parent) from None
        raise


class ChunkWriter:
    """Writes numbered chunks into one node's telemetry directory, continuing after existing ones."""

    def __init__(self, directory: str | os.PathLike, compression: IpcCompression = "zstd",
                 compact_every: int | None = COMPACT_EVERY) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.compact_every = compact_every
        self.rows_written = 0
        self.bytes_written = 0
        self.chunks_written = 0
        self.compactions = 0
        self._merged: list[Path] = []  # chunks already in a compacted file, deleted at the next compaction
        self._recover()

    def _recover(self) -> None:
        """Continue after the files a previous writer left, finishing what a crash interrupted."""
        names = os.listdir(self.dir)
        for name in names:
            if name.startswith(".") and name.endswith(".tmp"):
                (self.dir / name).unlink(missing_ok=True)  # never renamed: no reader saw it
        live = node_chunks(self.dir)
        kept = {path.name for _, _, path in live}
        for name in names:  # held by a compacted file that was renamed into place before the crash
            if chunk_span(name) and name not in kept:
                (self.dir / name).unlink(missing_ok=True)
        self._next = max((last for _, last, _ in live), default=-1) + 1
        self._open = [path for first, last, path in live if path.suffix == ".arrow"]  # not yet compacted

    def write(self, frame: pl.DataFrame) -> Path | None:
        """Write `frame` (conformed to TELEMETRY_SCHEMA) as the next chunk; returns its path."""
        if frame.is_empty():
            return None
        if frame.schema != _SCHEMA:  # the sampler's frames already conform
            frame = conform(frame)
        final = _write_atomic(self.dir / f"{self._next:06d}.arrow",
                              lambda tmp: frame.write_ipc(tmp, compression=self.compression))
        self._next += 1
        self.rows_written += frame.height
        self.bytes_written += final.stat().st_size
        self.chunks_written += 1
        self._open.append(final)
        if self.compact_every and len(self._open) >= self.compact_every:
            self.compact()
        return final

    def compact(self, delete_now: bool = False) -> Path | None:
        """Merge the chunks not yet compacted into one file; returns it (None if there are none)."""
        self._delete(self._merged)
        self._merged = []
        if not self._open:
            return None
        first, last = _first_chunk(self._open[0]), _first_chunk(self._open[-1])
        frames = []
        for p in self._open:
            try:
                frames.append(conform(pl.read_ipc(p)))
            except Exception:  # noqa: BLE001 - a damaged chunk (left by a crash) costs only itself
                log.warning("telemetry chunk %s is unreadable; left out of %s's compaction", p, self.dir)
        if not frames:
            return None
        frame = pl.concat(frames)
        # sync_dir: the compacted file is durable before any chunk it holds goes
        merged = write_parquet(frame, self.dir / f"{first:06d}-{last:06d}.parquet", sync_dir=True)
        self.compactions += 1
        self._merged, self._open = self._open, []
        if delete_now:
            self._delete(self._merged)
            self._merged = []
        return merged

    def close(self) -> None:
        """Compact what is left, so a finished recording is a few large files."""
        self.compact(delete_now=True)

    @staticmethod
    def _delete(paths: list[Path]) -> None:
        for p in paths:
            p.unlink(missing_ok=True)
