"""Follow a run directory while it is written: new telemetry rows and new iteration-log lines.

Both tails only ever read what is complete: chunk files appear whole (see recorder.py), and an
iteration line counts once it ends with a newline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl

from charllm.probes.rundir import RunDir
from charllm.probes.schema import conform, empty_frame


class TelemetryTail:
    """`poll()` returns the rows of chunk files that appeared since the previous poll."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run = RunDir(Path(run_dir))
        self._last: dict[str, int] = {}  # node -> number of the newest chunk read (numbered in order)

    def poll(self) -> pl.DataFrame:
        frames = []
        for path in self.run.telemetry_files():
            node, number = path.parent.name, int(path.name.split(".")[0])
            if number <= self._last.get(node, -1):
                continue
            try:
                frames.append(conform(pl.read_ipc(path)))
            except FileNotFoundError:
                continue  # removed between listing and reading
            self._last[node] = number
        if not frames:
            return empty_frame()
        return pl.concat(frames, how="vertical").sort("ts_ns", maintain_order=True)


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
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a corrupt line never blocks the ones after it
        return events
