"""Play a recorded run's telemetry back, at its own pace or `speed` times faster.

Rows are re-timestamped: `ts_ns`/`mono_ns` become "now" in the replay, keeping the recorded
spacing divided by `speed`, so a live view, recorder or stream treats a replay exactly like a
fresh recording. Everything else is kept as recorded — the node, the device, the iteration
marker, the simulated flag — and the backend reads `replay:<recorded backend>`.
"""

from __future__ import annotations

import time
from typing import Callable

import polars as pl

from charllm.probes.backends.base import Backend, Device
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.rundir import past_damage, resolve_run
from charllm.probes.store.schema import METRIC_COLUMNS

MIN_SPEED, MAX_SPEED = 1e-3, 1e6   # a thousand times slower, a million times faster


class ReplayBackend(Backend):
    simulated = False

    def __init__(self, ref: str, speed: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise UserError(f"speed = {speed!r}: must be between {MIN_SPEED:g} and {MAX_SPEED:g}")
        run = resolve_run(ref)
        skipped: list[str] = []

        def recorded(thorough: bool) -> pl.DataFrame:
            skipped.clear()
            return run.scan_telemetry(skipped, thorough=thorough).sort("ts_ns", "device", maintain_order=True).collect()
        frame = past_damage(recorded)
        if frame.is_empty():
            raise UserError(f"replay run {ref!r}: no telemetry recorded in {run.telemetry_dir}")
        backends = frame["backend"].unique().to_list()
        self.name = f"replay:{backends[0]}" if len(backends) == 1 else "replay"
        self.reason = f"replay: {plural(frame.height, 'row')} from {run.path} at {speed:g}x" + "".join(
            f"; {s}" for s in skipped
        )
        offsets = ((frame["ts_ns"] - frame["ts_ns"].min()) / speed).cast(pl.Int64)
        self._frame = frame.with_columns(
            pl.when(pl.col("backend").str.starts_with("replay:")).then(pl.col("backend"))
            .otherwise(pl.lit("replay:") + pl.col("backend")).alias("backend"),
        ).drop("ts_ns", "mono_ns", "missed_deadlines")
        self._offsets = offsets.to_list()
        self.metrics = tuple(c for c in METRIC_COLUMNS if frame[c].null_count() < frame.height)
        for key in frame.select("device", "uuid").unique(maintain_order=True).iter_rows(named=True):
            self._devices.append(Device(key["device"], key["uuid"], f"recorded {key['device']}"))
        self._clock = clock
        self._start = clock()
        self._wall_start_ns = time.time_ns()
        self._next = 0

    @property
    def finished(self) -> bool:
        return self._next >= len(self._offsets)

    def sample(self) -> list[dict]:
        elapsed_ns = int((self._clock() - self._start) * 1e9)
        stop = self._next
        while stop < len(self._offsets) and self._offsets[stop] <= elapsed_ns:
            stop += 1
        if stop == self._next:
            return []
        rows = self._frame.slice(self._next, stop - self._next).to_dicts()
        mono_start_ns = int(self._start * 1e9)
        for row, offset in zip(rows, self._offsets[self._next:stop]):
            row["ts_ns"] = self._wall_start_ns + offset
            row["mono_ns"] = mono_start_ns + offset
        self._next = stop
        return rows
