"""Following a run: the one way every view watches a run directory while it is written.

`RunFollower.poll()` makes one pass over the run and returns what changed since the previous pass
as typed events: the status, new telemetry rows, new iteration-log lines, new log lines.
`follow()` repeats it until the run has ended. The command line (`launch --follow`, `runs logs -f`)
follows with `follow()`, settling each pass with the launcher's `reconcile`; the Live screen calls
`poll()` at its own pace.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Union

import polars as pl

from charllm.probes.store.rundir import Manifest, RunDir
from charllm.probes.store.tail import IterationTail, LogTail, TelemetryTail


@dataclass(frozen=True)
class StatusChanged:
    """The run's status differs from the previous pass's (the first pass always has one)."""

    status: str
    manifest: Manifest


@dataclass(frozen=True)
class NewIterations:
    """Iteration-log lines (start, iteration and end events, every rank's), as written."""

    events: list[dict]


@dataclass(frozen=True)
class NewTelemetry:
    """Telemetry rows recorded since the previous pass, every node's, by time (never empty)."""

    rows: pl.DataFrame


@dataclass(frozen=True)
class NewLogLines:
    """Complete lines added to logs/*.log, each "<log name>: <line>"."""

    lines: list[str]


Event = Union[StatusChanged, NewIterations, NewTelemetry, NewLogLines]


class RunFollower:
    """One run's tails and its last status. `settle(run)`, when given, runs before the manifest
    is read on each pass (the launcher finishes a run whose supervisor died there)."""

    def __init__(self, run_dir: str | os.PathLike | RunDir, *,
                 settle: Callable[[RunDir], object] | None = None) -> None:
        self.run = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        self.settle = settle
        self.manifest: Manifest | None = None    # as of the latest pass
        self._telemetry = TelemetryTail(self.run.path)
        self._iterations = IterationTail(self.run.path)
        self._logs = LogTail(self.run.path)

    def poll(self) -> list[Event]:
        """What changed since the previous pass; status first, read before the data, so a final
        status is followed by the last of the data in the same pass."""
        if self.settle is not None:
            self.settle(self.run)
        manifest = self.run.manifest()
        events: list[Event] = []
        if self.manifest is None or manifest.status != self.manifest.status:
            events.append(StatusChanged(manifest.status, manifest))
        self.manifest = manifest
        if lines := self._iterations.poll():
            events.append(NewIterations(lines))
        rows = self._telemetry.poll()
        if rows.height:
            events.append(NewTelemetry(rows))
        if logs := self._logs.poll():
            events.append(NewLogLines(logs))
        return events

    @property
    def ended(self) -> bool:
        return self.manifest is not None and self.manifest.final


def follow(run_dir: str | os.PathLike | RunDir, *, settle: Callable[[RunDir], object] | None = None,
           interval: float = 0.5) -> Iterator[Event]:
    """The run's events, a pass every `interval` seconds, until a pass finds it ended (that pass's
    data included). A damaged manifest raises its UserError."""
    follower = RunFollower(run_dir, settle=settle)
    while True:
        yield from follower.poll()
        if follower.ended:
            return
        time.sleep(interval)
