"""Megatron-style step timers for one rank: what its step spent where.

megatron-core's schedules, P2P communication and gradient finalization time themselves through
`config.timers(name, log_level)` when it is set (Megatron-LM's `--timing-log-level 2` names:
forward-backward, forward-compute, backward-compute, forward-recv, ..., all-grads-sync); the
workload times the optimizer step as Megatron-LM's training loop does ('optimizer'). `StepTimers`
is that callable, with the interface megatron.core.timers.Timers gives the schedules (start, stop,
elapsed, reset), and `read()` sums each step's timers into the iteration log's groups:

    forward_backward_s  the whole schedule: compute, pipeline waits and the gradient reduce in it
    compute_s           this rank's own forward and backward work (forward-compute + backward-compute)
    pipeline_wait_s     in pipeline sends and receives (waiting for the neighbouring stage)
    grad_reduce_s       finalize_model_grads: the data-parallel gradient reduce and embedding syncs
    optimizer_s         the optimizer step (with the distributed optimizer, its parameter all-gather)

Unlike Megatron's Timer, these never synchronize the device or the ranks (a barrier would hide the
waits this measures): on a GPU each start and stop records a CUDA event on the current stream, and
`read()` (after the step, which ends in a sync anyway) sums the elapsed times the device measured;
on CPU, where every op has finished when it returns, the host's clock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GROUPS: dict[str, tuple[str, ...]] = {
    "forward_backward_s": ("forward-backward",),
    "compute_s": ("forward-compute", "backward-compute"),
    "pipeline_wait_s": ("forward-recv", "backward-recv", "forward-send", "backward-send",
                        "forward-send-backward-recv", "backward-send-forward-recv", "forward-send-forward-recv",
                        "backward-send-backward-recv", "forward-backward-send-forward-backward-recv"),
    "grad_reduce_s": ("all-grads-sync", "conditional-embedder-grads-all-reduce",
                      "non-tensor-parallel-grads-all-reduce", "embedding-grads-all-reduce"),
    "optimizer_s": ("optimizer",),
}
FIELDS = tuple(GROUPS)


class _HostTimer:
    """Host clock: right where every op is synchronous (CPU)."""

    def __init__(self, name: str) -> None:
        self.name, self.total = name, 0.0
        self._started: float | None = None

    def start(self, barrier: bool = False) -> None:
        self._started = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        assert self._started is not None, f"timer {self.name} was not started"   # as Megatron's Timer
        self.total += time.perf_counter() - self._started
        self._started = None

    def seconds(self) -> float:
        return self.total

    def reset(self) -> None:
        self.total, self._started = 0.0, None

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        value = self.seconds()
        if reset:
            self.reset()
        return value


class _DeviceTimer(_HostTimer):
    """CUDA events on the current stream: the device's own measure of the span, no sync to take it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._event: torch.cuda.Event | None = None     # the start of the span being timed
        self.spans: list[tuple] = []

    def start(self, barrier: bool = False) -> None:
        import torch

        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record()

    def stop(self, barrier: bool = False) -> None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        assert self._event is not None, f"timer {self.name} was not started"
        self.spans.append((self._event, end))
        self._event = None

    def seconds(self) -> float:
        for start, end in self.spans:
            end.synchronize()
            self.total += start.elapsed_time(end) / 1e3   # ms
        self.spans = []
        return self.total

    def reset(self) -> None:
        super().reset()
        self.spans = []


class StepTimers:
    """`timers(name, log_level=None)`: the named timer (megatron.core.timers.Timers' call)."""

    def __init__(self, cuda: bool) -> None:
        self.kind = _DeviceTimer if cuda else _HostTimer
        self.timers: dict[str, _HostTimer] = {}

    def __call__(self, name: str, log_level: int | None = None):
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = self.kind(name)
        return timer

    def read(self) -> dict[str, float]:
        """Seconds per group (GROUPS) since the last read; the timers start over."""
        out = {}
        for group, names in GROUPS.items():
            out[group] = sum(self.timers[n].elapsed() for n in names if n in self.timers)
        for timer in self.timers.values():   # and those outside every group
            timer.reset()
        return out
