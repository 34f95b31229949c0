"""Follow a run directory while it is written: new telemetry rows, iteration-log lines and log lines.

Each tail reads only what is complete: chunk files appear whole (see recorder.py), and an
iteration-log or log line counts once it ends with a newline. `probes.store.follow` puts them together.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl

from charllm.probes.store.recorder import DEVICE_KEYS
from charllm.probes.store.rundir import RunDir, node_chunks
from charllm.probes.store.schema import conform, empty_frame


class TelemetryTail:
    """`poll()` returns the rows of telemetry files that appeared since the previous poll, each once.

    Chunks are numbered in time order per node. A compacted file (recorder.py) holds chunks
    first..last, grouped by device, each device's rows in chunk order; when some of those chunks
    were already read one by one, as many leading rows of each device as they held are skipped.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run = RunDir(Path(run_dir))
        self._last: dict[str, int] = {}  # node -> number of the newest chunk read
        self._counts: dict[str, dict[int, pl.DataFrame]] = {}  # node -> chunk -> rows per device

    def poll(self) -> pl.DataFrame:
        frames = []
        if self.run.telemetry_dir.is_dir():
            for directory in sorted(d for d in self.run.telemetry_dir.iterdir() if d.is_dir()):
                frames += self._poll_node(directory)
        if not frames:
            return empty_frame()
        return pl.concat(frames, how="vertical").sort("ts_ns", maintain_order=True)

    def _poll_node(self, directory: Path) -> list[pl.DataFrame]:
        node, frames = directory.name, []
        counts = self._counts.setdefault(node, {})
        for first, last, path in node_chunks(directory):
            done = self._last.get(node, -1)
            if last <= done:
                continue
            try:
                frame = conform(pl.read_parquet(path) if path.suffix == ".parquet" else pl.read_ipc(path))
            except FileNotFoundError:
                break  # merged and deleted since the listing: the next poll reads the merged file
            except Exception:  # noqa: BLE001 - a damaged file costs only itself (summaries name it)
                frame = empty_frame()
            if first <= done:  # part of this compacted file was read chunk by chunk
                frame = _skip_read(frame, [counts[n] for n in range(first, done + 1) if n in counts])
            if first == last:
                counts[first] = frame.group_by(DEVICE_KEYS).len()
            frames.append(frame)
            self._last[node] = last
        for n in [n for n in counts if n < self._last.get(node, -1) - 10_000]:
            del counts[n]  # memory stays flat: counts matter only until their chunks are compacted
        return frames


def _skip_read(frame: pl.DataFrame, read: list[pl.DataFrame]) -> pl.DataFrame:
    """`frame` less the leading rows of each device that the `read` chunks (counts) held."""
    if not read:
        return frame
    skip = pl.concat(read).group_by(DEVICE_KEYS).agg(pl.col("len").sum().alias("_skip"))
    return (
        frame.join(skip, on=DEVICE_KEYS, how="left", nulls_equal=True, maintain_order="left")
        .filter(pl.int_range(pl.len()).over(DEVICE_KEYS) >= pl.col("_skip").fill_null(0))
        .drop("_skip")
    )


class IterationTail:
    """`poll()` returns the iteration-log events (dicts) appended since the previous poll."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = RunDir(Path(run_dir)).iterations_path
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # the log was replaced: start over
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read(size - self._offset)
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")  # the last piece is a half line (or b"")
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
                continue  # a corrupt line never blocks the ones after it
            if isinstance(event, dict):
                events.append(event)
        return events


class LogTail:
    """`poll()` returns the complete lines appended to the run's logs (logs/*.log) since the
    previous poll, each as "<log name>: <line>"; a log first seen shows only its last LOG_START bytes."""

    LOG_START = 64_000

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.logs_dir = RunDir(Path(run_dir)).logs_dir
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[str]:
        lines: list[str] = []
        if not self.logs_dir.is_dir():
            return lines
        for path in sorted(self.logs_dir.glob("*.log")):
            start = self._offsets.get(path, 0)
            try:
                size = path.stat().st_size
                if size <= start:
                    continue
                pos = max(start, size - self.LOG_START)     # opening a long log shows only its end
                with open(path, "rb") as fh:
                    fh.seek(pos)
                    data = fh.read(size - pos)
            except OSError:
                continue
            complete, newline, _ = data.rpartition(b"\n")  # a half-written last line waits
            if not newline:
                continue
            self._offsets[path] = pos + len(complete) + 1
            lines += [f"{path.stem}: {line}" for line in complete.decode(errors="replace").splitlines()]
        return lines
