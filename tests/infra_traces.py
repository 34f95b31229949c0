"""Checking a kernel breakdown against the trace it came from (the kernel tests and the launch
tests that record real traces share it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from charllm.probes.analysis.kernels import CATEGORIES, breakdown, read_trace


def _busy_union(trace) -> float:
    """The trace's busy time the plain way: the union of its op and annotation intervals (device
    events where it has them), within its step spans."""
    step = [(e["ts"], e["ts"] + e["dur"]) for e in trace.events if str(e.get("name", "")).startswith("ProfilerStep#")] \
        or [(-np.inf, np.inf)]   # no step marked: the whole trace
    device = any(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") for e in trace.events)
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if device else ("cpu_op", "user_annotation")
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in trace.events
                   if e.get("ph") == "X" and e.get("cat") in cats and not str(e["name"]).startswith("ProfilerStep#")
                   for lo, hi in step if min(e["ts"] + e["dur"], hi) > max(e["ts"], lo))
    total, reach = 0.0, -np.inf
    for s, t in spans:
        if t > reach:
            total += t - max(s, reach)
            reach = t
    return total / 1e6


def check_sums_to_busy(files: list[Path]) -> None:
    """Categories add up to the trace's busy time within 1% (and that busy time is the union of the
    trace's own events), for every trace given."""
    for f in files:
        trace = read_trace(f)
        b = breakdown(trace)
        total = sum(b[f"{c}_s"] for c in CATEGORIES)
        busy = _busy_union(trace)
        assert busy > 0 and total == pytest.approx(busy, rel=0.01), f.name
        assert b["busy_s"] == pytest.approx(busy, rel=0.01) and b["busy_s"] <= b["step_s"] * 1.0001
