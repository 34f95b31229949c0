"""What the kernel and rank tests share: checking a kernel breakdown against the trace it came
from (the launch tests record real ones), an iteration log with every rank's timers as the
workload writes it, and the Kineto fixtures."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from charllm.probes.analysis.kernels import CATEGORIES, breakdown, read_trace
from charllm.probes.store.synthetic import T0_NS

KINETO = Path(__file__).resolve().parent / "data" / "kineto"
ARTIFACT_TRACES = KINETO / "charllm_ppt_run" / "4242_kineto"   # two stages' traces in the artifact's layout


def _busy_union(events: list[dict]) -> float:
    """A trace's busy time the plain way: the union of its op and annotation intervals (device
    events where it has them), within its step spans."""
    step = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")] \
        or [(-np.inf, np.inf)]   # no step marked: the whole trace
    device = any(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") for e in events)
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if device else ("cpu_op", "user_annotation")
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in events
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
        b = breakdown(read_trace(f))
        total = sum(b[f"{c}_s"] for c in CATEGORIES)
        raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        busy = _busy_union(json.loads(raw)["traceEvents"])
        assert busy > 0 and total == pytest.approx(busy, rel=0.01), f.name
        assert b["busy_s"] == pytest.approx(busy, rel=0.01) and b["busy_s"] <= b["step_s"] * 1.0001


def rank_log(compute: list[float], *, steps: int = 6, warmup: int = 1, profiled=(), pp: int = 2, step_s: float = 1.0,
        nodes=("n0", "n1")) -> list[dict]:
    """An iteration log as the workload writes it: rank 0's start record naming every rank's place,
    rank 0's and the last rank's step lines, rank 0's carrying every rank's timers."""
    world = len(compute)
    places = [{"rank": r, "node": nodes[r * len(nodes) // world], "local_rank": r % (world // len(nodes)),
               "pp_rank": r * pp // world, "tp_rank": 0, "cp_rank": 0, "dp_rank": r % (world // pp)}
              for r in range(world)]
    rows = [{"event": "start", "rank": 0, "world_size": world, "ranks": places}]
    for i in range(1, steps + 1):
        start = T0_NS + int((i - 1) * step_s * 1e9)
        timers = {"forward_backward_s": [0.8] * world, "compute_s": list(compute),
                  "pipeline_wait_s": [0.8 - c for c in compute], "grad_reduce_s": [0.05] * world,
                  "optimizer_s": [0.1] * world, "step_s": [0.95] * world}
        for rank in (0, world - 1):
            rows.append({"event": "iteration", "iteration": i, "rank": rank, "node": places[rank]["node"],
                         "start_ns": start, "end_ns": start + int(0.95 * step_s * 1e9), "warmup": i <= warmup,
                         "profiled": i in profiled, "timers": timers if rank == 0 else None,
                         "loss": 1.0 if rank == world - 1 else None})
    return rows
