"""The per-node sampler: one loop samples every local device on absolute deadlines.

Tick k is due at start + k / hz, so the rate never drifts however long a tick takes. A tick
that starts late but before the next deadline still counts; when whole periods have passed the
skipped deadlines are added to `missed_deadlines` (a cumulative column on every row).

Samples flow three ways:
- in-process consumers: `on_sample(rows)` is called with each tick's rows (keep it quick), and
  `subscribe()` hands out a bounded queue of the same (a slow reader loses the oldest ticks);
- the run directory: at least every `flush_s` seconds the buffered rows go, on a writer thread,
  to a ChunkWriter (`RUN_DIR/telemetry/<node>/NNNNNN.arrow`);
- a byte stream (`stream=`, e.g. stdout for SSH) in stream.py's format, in batches of at most
  STREAM_S seconds so a remote consumer sees each sample well within a second.

Iteration markers: the sampler tails RUN_DIR/iterations.jsonl (written by the workload) and puts
the iteration in progress on every row: after a "start" event 1, after "iteration" N it is N+1,
after "end" none.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable

import polars as pl

from charllm.probes.backends.base import DEFAULT_HZ, Backend, check_hz, hostname
from charllm.probes.core.errors import plural
from charllm.probes.store.recorder import ChunkWriter
from charllm.probes.store.rundir import RunDir
from charllm.probes.store.schema import TELEMETRY_SCHEMA
from charllm.probes.store.stream import StreamWriter
from charllm.probes.store.tail import IterationTail

log = logging.getLogger(__name__)

ITERATION_POLL_S = 0.1
STREAM_S = 0.25         # stream batch interval (chunks still close every flush_s)


class IterationMarker:
    """The training iteration in progress, learned from the run's iteration log."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.tail = IterationTail(run_dir)
        self.current: int | None = None

    def poll(self) -> int | None:
        for event in self.tail.poll():
            kind = event.get("event")
            if kind == "start":
                self.current = 1
            elif kind == "iteration" and isinstance(event.get("iteration"), int) and self.current is not None:
                self.current = max(self.current, event["iteration"] + 1)
            elif kind == "iteration" and isinstance(event.get("iteration"), int):
                self.current = event["iteration"] + 1  # joined a run whose start we did not see
            elif kind == "end":
                self.current = None
        return self.current


class Sampler:
    def __init__(self, backends: list[Backend], hz: float = DEFAULT_HZ, node: str | None = None,
                 run_dir: str | os.PathLike | None = None, on_sample: Callable[[list[dict]], object] | None = None,
                 *, stream: BinaryIO | None = None, flush_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backends = backends
        self.hz = check_hz(hz)
        self.node = node or hostname()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.flush_s = flush_s
        self.clock = clock
        self.writer = ChunkWriter(RunDir(self.run_dir).node_telemetry_dir(self.node)) if self.run_dir else None
        self.stream = StreamWriter(stream) if stream is not None else None
        self.marker = IterationMarker(self.run_dir) if self.run_dir else None
        self._consumers: list[Callable[[list[dict]], object]] = [on_sample] if on_sample else []
        # A backend slower than the tick rate (the host: psutil costs ~0.3 ms) is sampled every n-th tick.
        self._every = [max(1, math.ceil(self.hz / b.max_hz - 1e-9)) if b.max_hz else 1
                       for b in backends]
        self.ticks = 0
        self.missed_deadlines = 0
        self.rows = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Bounded: if the disk stalls for half a minute the sampler waits (and counts missed
        # deadlines) rather than growing without limit.
        self._handoff_s = min(flush_s, STREAM_S) if stream is not None else flush_s
        self._batches_per_chunk = max(1, round(flush_s / self._handoff_s))
        self._batches: queue.Queue = queue.Queue(maxsize=max(1, int(30 / self._handoff_s)))
        self._flush_error: BaseException | None = None
        self._failed_backends: set[str] = set()

    def backend_hz(self, backend: Backend) -> float:
        """The rate `backend` is actually sampled at (a slow backend only every n-th tick)."""
        return self.hz / self._every[self.backends.index(backend)]

    def slower_backends(self) -> list[str]:
        """One phrase per backend sampled below the asked rate: its rate and why."""
        return [f"{b.name} at {self.backend_hz(b):g} Hz ({b.max_hz_why or f'at most {b.max_hz:g} Hz'})"
                for b, every in zip(self.backends, self._every) if every > 1]

    def achieved(self, seconds: float) -> str:
        """What the loop achieved over `seconds`: its tick rate, and why it fell short if it did."""
        rate = f"{self.ticks / seconds:.4g} Hz" if seconds > 0 else "no time"
        why = ": a tick took longer than its period (a busy machine or a slow backend)" if self.missed_deadlines else ""
        return f"{rate} ({self.hz:g} Hz asked, {plural(self.missed_deadlines, 'missed deadline')}{why})"

    # -- consumers -------------------------------------------------------------------------
    def subscribe(self, maxsize: int = 256) -> queue.Queue:
        """A queue receiving each tick's rows; when full, the oldest tick is dropped."""
        q: queue.Queue = queue.Queue(maxsize=maxsize)

        def put(rows: list[dict]) -> None:
            while True:
                try:
                    q.put_nowait(rows)
                    return
                except queue.Full:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        pass

        self._consumers.append(put)
        return q

    # -- running ---------------------------------------------------------------------------
    def start(self, duration: float | None = None) -> None:
        """Run in a background thread (for in-process use); `stop()` ends it."""
        self._thread = threading.Thread(target=self.run, args=(duration,), name="charllm-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    def run(self, duration: float | None = None) -> None:
        """Sample until `duration` seconds, `stop()`, or a replay runs out; then flush everything."""
        flusher = threading.Thread(target=self._flush_loop, name="charllm-flush", daemon=True)
        flusher.start()
        start = self.clock()
        last_flush, next_poll = start, start
        buffer: list[dict] = []
        k = 0
        try:
            while not self._stop.is_set():
                if duration is not None and k / self.hz >= duration:
                    break
                wait = start + k / self.hz - self.clock()
                if wait > 0 and self._sleep(wait):
                    break
                now = self.clock()
                if self.marker and now >= next_poll:
                    self.marker.poll()
                    next_poll = now + ITERATION_POLL_S
                rows = self._tick(k)
                buffer.extend(rows)
                for consume in self._consumers:
                    consume(rows)
                if self._flush_error:
                    raise self._flush_error
                if all(b.finished for b in self.backends):
                    break
                now = self.clock()
                if now - last_flush >= self._handoff_s:
                    self._batches.put(buffer)
                    buffer, last_flush = [], now
                # Deadlines that passed entirely while we worked are skipped, not caught up on.
                latest_due = int((now - start) * self.hz)
                if latest_due > k + 1:
                    self.missed_deadlines += latest_due - (k + 1)
                    k = latest_due
                else:
                    k += 1
        finally:
            self._batches.put(buffer)
            self._batches.put(None)
            flusher.join()
        if self._flush_error:
            raise self._flush_error

    def _sleep(self, seconds: float) -> bool:
        """Wait until the next deadline; True if stopped meanwhile (benchmarks override it to
        compress time together with an injected clock)."""
        # time.sleep is cheaper than Event.wait; slices of at most 0.1 s keep stop() prompt at low rates.
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self._stop.is_set():
            time.sleep(min(left, 0.1))
        return self._stop.is_set()

    def _tick(self, k: int) -> list[dict]:
        ts_ns, mono_ns = time.time_ns(), time.monotonic_ns()
        common = {"ts_ns": ts_ns, "mono_ns": mono_ns, "node": self.node,
                  "iteration": self.marker.current if self.marker else None,
                  "missed_deadlines": self.missed_deadlines}
        rows: list[dict] = []
        for backend, every in zip(self.backends, self._every):
            if k % every:
                continue
            try:
                sampled = backend.sample()
            except Exception:  # noqa: BLE001 - a backend bug must not end the recording
                self._backend_failed(backend)
                continue
            for row in sampled:
                for key, value in common.items():
                    row.setdefault(key, value)
                rows.append(row)
        self.ticks += 1
        self.rows += len(rows)
        return rows

    def _backend_failed(self, backend: Backend) -> None:
        """Count an unexpected backend exception as an error on each of its devices; say it once."""
        for device in backend.devices():
            device.errors += 1
        if backend.name not in self._failed_backends:
            self._failed_backends.add(backend.name)
            log.warning("%s backend raised while sampling; counted in `errors`, sampling goes on",
                        backend.name, exc_info=True)

    def _flush_loop(self) -> None:
        """Writer thread: turns handed-over rows into DataFrames for the stream and the chunks."""
        pending: list[pl.DataFrame] = []
        batches = 0
        while True:
            rows = self._batches.get()
            final = rows is None
            if self._flush_error:
                if final:
                    return
                continue  # keep draining so the sampler never blocks on a dead writer
            try:
                if rows:
                    frame = pl.from_dicts(rows, schema=TELEMETRY_SCHEMA)
                    if self.stream:
                        self.stream.write(frame)
                    pending.append(frame)
                batches += not final
                if pending and (final or batches >= self._batches_per_chunk):
                    if self.writer:
                        self.writer.write(pl.concat(pending) if len(pending) > 1 else pending[0])
                    pending, batches = [], 0
                if final and self.writer:
                    self.writer.close()  # a clean stop leaves compacted files (recorder.py)
            except BaseException as exc:  # noqa: BLE001 - surfaced by run()
                self._flush_error = exc
            if final:
                return
