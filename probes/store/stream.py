"""Telemetry over a byte pipe (stdout → SSH → the launcher), batch by batch.

Wire format: a sequence of frames, each an 8-byte little-endian length followed by that many
bytes of one complete Arrow IPC *stream* (schema + one record batch + end marker), as polars
writes with `write_ipc_stream`. The length prefix lets a reader hand over each batch as soon as
it arrives (polars has no incremental IPC stream reader), and a truncated last frame — the
sender was killed mid-write — is simply dropped.
"""

from __future__ import annotations

import io
import struct
from typing import BinaryIO, Callable

import polars as pl

from charllm.probes.store.schema import TELEMETRY_SCHEMA, conform

_LENGTH = struct.Struct("<Q")
_SCHEMA = pl.Schema(TELEMETRY_SCHEMA)


class StreamWriter:
    def __init__(self, binary_file: BinaryIO) -> None:
        self.file = binary_file

    def write(self, frame: pl.DataFrame) -> None:
        if frame.is_empty():
            return
        buf = io.BytesIO()
        (frame if frame.schema == _SCHEMA else conform(frame)).write_ipc_stream(buf, compression="zstd")
        payload = buf.getvalue()
        self.file.write(_LENGTH.pack(len(payload)))
        self.file.write(payload)
        self.file.flush()


def read_stream(binary_file: BinaryIO, on_batch: Callable[[pl.DataFrame], object]) -> int:
    """Call `on_batch(df)` for every batch until end of file; returns the number of rows read."""
    rows = 0
    while True:
        header = _read_exactly(binary_file, _LENGTH.size)
        if header is None:
            return rows
        payload = _read_exactly(binary_file, _LENGTH.unpack(header)[0])
        if payload is None:
            return rows  # the sender died mid-frame
        frame = pl.read_ipc_stream(io.BytesIO(payload))
        rows += frame.height
        on_batch(frame)


def _read_exactly(binary_file: BinaryIO, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = binary_file.read(remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
