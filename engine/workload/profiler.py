"""The profiler window: a PyTorch profiler trace of the experiment's `profile_steps` on the ranks
`engine.model.profiling` names, one Kineto JSON file per rank and step in RUN_DIR/traces/.

    traces/rank00003-step000010.pt.trace.json

Each trace holds the step inside a `ProfilerStep#N` span (as torch.profiler's own schedule marks
steps, which Holistic Trace Analysis reads), and a `charllm` entry: rank, pipeline stage, node and
step, which the kernel summary (probes.analysis.kernels) reads. The file is written under a hidden
name and renamed, so a reader (or the ssh target bringing traces home) sees whole traces only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from charllm.engine.model.profiling import TRACES, trace_name

if TYPE_CHECKING:
    from torch.profiler import profile, record_function

    from charllm.engine.model.experiment import Experiment


class ProfileWindow:
    """Starts the profiler before each profiled step on this rank and writes its trace after; each
    trace written is one "profile" line in the iteration log (`log`, this rank's)."""

    def __init__(self, exp: Experiment, run_dir: Path, place: dict, cuda: bool, log=None) -> None:
        tel = exp.telemetry
        first_of_stage = place["tp_rank"] == place["cp_rank"] == place["dp_rank"] == 0
        records = tel.profile_scope == "all" or first_of_stage
        self.steps = set(tel.profile_steps or []) if records else set()
        self.dir = Path(run_dir) / TRACES
        self.place, self.cuda, self.log = place, cuda, log
        self._profiler: profile | None = None
        self._span: record_function | None = None

    def records(self, iteration: int) -> bool:
        return iteration in self.steps

    def start(self, iteration: int) -> None:
        if not self.records(iteration):
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profiler = profile(activities=activities)
        profiler.__enter__()
        if self.cuda:
            torch.cuda.synchronize()   # the step's kernels only, not the ones still running from the last
        self._span = span = record_function(f"ProfilerStep#{iteration}")
        span.__enter__()

    def stop(self, iteration: int) -> None:
        """Stop, write the trace, and log it with what it cost."""
        if self._profiler is None or self._span is None:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()   # every kernel of the step is in the trace
        self._span.__exit__(None, None, None)
        self._profiler.add_metadata_json("charllm", json.dumps({**self.place, "step": iteration}))
        self._profiler.__exit__(None, None, None)
        started = time.monotonic()
        self.dir.mkdir(exist_ok=True)
        name = trace_name(self.place["rank"], iteration)
        hidden = self.dir / f".{name}.{os.getpid()}"
        self._profiler.export_chrome_trace(str(hidden))
        name_trace(hidden, self.dir / name)
        os.replace(hidden, self.dir / name)
        self._profiler = self._span = None
        self.log.write("profile", iteration=iteration, pp_rank=self.place["pp_rank"], file=f"{TRACES}/{name}",
                       bytes=(self.dir / name).stat().st_size, export_s=round(time.monotonic() - started, 3))


def name_trace(written: Path, final: Path) -> None:
    """Kineto ends a trace with `"traceName": "<the path it was written to>" }`, which Holistic Trace
    Analysis and TensorBoard show: the hidden name. It is made the final one, in the file's last bytes
    (a trace whose end reads otherwise is left as written)."""
    said = b'"traceName": ' + json.dumps(str(written)).encode()
    with open(written, "r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = max(0, size - len(said) - 64)
        fh.seek(start)
        tail = fh.read()
        at = tail.rfind(said)
        if at < 0:
            return
        fh.seek(start + at)
        fh.write(b'"traceName": ' + json.dumps(str(final)).encode() + tail[at + len(said):])
        fh.truncate()
