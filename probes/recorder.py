"""Crash-safe telemetry recording: Arrow IPC chunk files that are complete or invisible.

Every `write(df)` produces one chunk: written as a hidden `.NNNNNN.arrow.tmp`, fsynced, then
atomically renamed to `NNNNNN.arrow`. A reader (polars, TelemetryTail) therefore only ever sees
whole files, and `kill -9` of the sampler loses at most the rows not yet handed to `write` —
the sampler hands over a batch at least every second. Nothing is buffered here, so memory stays
flat however long the recording runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl

from charllm.probes.schema import TELEMETRY_SCHEMA, conform

CHUNK_NAME = re.compile(r"^(\d{6,})\.arrow$")
_SCHEMA = pl.Schema(TELEMETRY_SCHEMA)


class ChunkWriter:
    """Writes numbered chunks into one node's telemetry directory, continuing after existing ones."""

    def __init__(self, directory: str | os.PathLike, compression: str = "zstd") -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        numbers = [int(m.group(1)) for p in self.dir.iterdir() if (m := CHUNK_NAME.match(p.name))]
        self._next = max(numbers, default=-1) + 1
        self.rows_written = 0
        self.bytes_written = 0
        self.chunks_written = 0

    def write(self, frame: pl.DataFrame) -> Path | None:
        """Write `frame` (conformed to TELEMETRY_SCHEMA) as the next chunk; returns its path."""
        if frame.is_empty():
            return None
        name = f"{self._next:06d}.arrow"
        final, tmp = self.dir / name, self.dir / f".{name}.tmp"
        if frame.schema != _SCHEMA:  # the sampler's frames already conform
            frame = conform(frame)
        frame.write_ipc(tmp, compression=self.compression)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        self._next += 1
        self.rows_written += frame.height
        self.bytes_written += final.stat().st_size
        self.chunks_written += 1
        return final

    def close(self) -> None:
        """Nothing is held open between chunks; kept so callers can treat it like a file."""
