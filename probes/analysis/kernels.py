"""Where a step's time goes: PyTorch profiler traces (Kineto JSON) split into kernel categories per
pipeline stage or rank, as the CharLLM-PPT paper's Figures 10 and 15 split them.

Categories, in the order that decides an instant when several run at once (two streams, or a
compute thread beside a communication thread):

    compute        matmul, attention, norm, elementwise, optimizer, other
    memory         memcpy (and memset)
    communication  SendRecv, AllGather, ReduceScatter, AllReduce, AllToAll, OtherComm

The paper's eight (matmul, SendRecv, AllGather, ReduceScatter, AllReduce, elementwise, norm,
other) plus attention, optimizer and memcpy; AllToAll (MoE token dispatch) and OtherComm (any
other collective) keep communication apart from compute. As the artifact's figure scripts do
(scripts/visualization/figure_10_2.py), a broadcast counts as SendRecv.

What is classified:
- A GPU trace (it has `kernel`, `gpu_memcpy` or `gpu_memset` events): the device's kernels, by name,
  as Holistic Trace Analysis tells them apart (NCCL kernels are communication, Memcpy/Memset
  memory, the rest compute), the NCCL kernel's collective from its `Collective name` argument where
  the trace has it (all-to-all runs as SendRecv kernels) else from its name, and a kernel launched
  from inside an `Optimizer.step#...` annotation counted as optimizer (by its launch's correlation id).
- A CPU trace (a CPU run: gloo and aten ops): every thread's ops and annotations, nested, each
  instant given to the innermost op that has a category (or, failing one, the nearest enclosing
  op that has), communication (gloo:*, c10d::*) always as itself, everything inside an
  optimizer step as optimizer.

Per trace, over its step (the `ProfilerStep#N` spans; else the whole trace), per category:
`time_s`, the time the category held the device (or the rank's threads) with nothing ahead of it
running, so the categories add up to `busy_s`, the time anything ran; and `kernel_s`, the sum of
its kernels' (ops') own durations as the artifact's figure scripts add them (overlaps counted
twice). Besides: `step_s`, `idle_s` (step - busy), `compute_s`, `comm_s` (the time any compute,
any communication ran), `overlap_s` (both at once) and `overlap_frac` (overlap_s / comm_s: how
much of the communication was hidden behind compute). A trace of several steps gives per-step
means.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from charllm.probes.analysis.cache import keep, kept_place, read_kept
from charllm.probes.analysis.render import format_figure
from charllm.probes.core.errors import UserError
from charllm.probes.core.files import open_regular
from charllm.probes.store.rundir import RunDir, resolve_run

COMPUTE = ("matmul", "attention", "norm", "elementwise", "optimizer", "other")
MEMORY = ("memcpy",)
COMMUNICATION = ("SendRecv", "AllGather", "ReduceScatter", "AllReduce", "AllToAll", "OtherComm")
CATEGORIES = COMPUTE + MEMORY + COMMUNICATION     # precedence: first wins an instant
MAX_TRACE_BYTES = 8 * 2**30    # the artifact's GPU traces run to a few GiB

# -- names ---------------------------------------------------------------------------------------
_COLLECTIVES = (   # (pattern in a name or a `Collective name`, category); first match wins
    (re.compile(r"all_?to_?all", re.I), "AllToAll"),
    (re.compile(r"all_?reduce", re.I), "AllReduce"),
    (re.compile(r"reduce_?scatter", re.I), "ReduceScatter"),
    (re.compile(r"all_?gather", re.I), "AllGather"),
    (re.compile(r"send|recv|broadcast", re.I), "SendRecv"),
)
_ATTENTION = re.compile(r"flash|fmha|sdpa|scaled_dot_product|attention|attn|masked_softmax", re.I)
_NORM = re.compile(r"(layer|rms|group|batch)_?norm|\bln_(fwd|bwd)|norm_(fwd|bwd)|normalization", re.I)
_OPTIMIZER = re.compile(r"adam|multi_tensor|l2norm|optimizer|\blamb|muon|sgd", re.I)
_MATMUL_KERNEL = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|matmul|Kernel2|splitKreduce|tensorop", re.I)
_ELEMENTWISE_KERNEL = re.compile(r"elementwise|vectorized|unrolled|reduce_kernel|fill|gelu|silu|swiglu|glu|relu|"
                                 r"dropout|bias|add|mul|copy|cast|triton_(poi|red|per)|transpose|permute|softmax", re.I)
_MATMUL_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|dot|einsum)$|"
                        r"(Mm|Addmm|Bmm|Baddbmm|Linear\w*)Backward|Linear", re.I)
_ELEMENTWISE_OP = re.compile(r"^aten::(add|sub|mul|div|neg|abs|exp|log|sqrt|rsqrt|pow|sigmoid|tanh|gelu|silu|relu|"
                             r"dropout|native_dropout|fill|zero|where|masked_fill|clamp|sum|mean|max|min|"
                             r"linalg_vector_norm|_foreach_\w+|addcmul|addcdiv|lerp|mul|sign|square|"
                             r"gelu_backward|silu_backward|threshold_backward|softmax|_softmax)_?$|"
                             r"^(Add|Sub|Mul|Div|Neg|Gelu|Silu|Relu|Pow|Sum|Mean|Dropout|NativeDropout|Where)"
                             r"\w*Backward|AccumulateGrad", re.I)
_MEMCPY_OP = re.compile(r"^aten::(copy_|_to_copy|to|clone|contiguous|cat|_copy_from)$", re.I)
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_OPTIMIZER_SPAN = re.compile(r"^Optimizer\.step#")
_LAUNCHES = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def collective(text: str) -> str:
    """The communication category a collective's name says ("OtherComm" for any other)."""
    return next((category for pattern, category in _COLLECTIVES if pattern.search(text)), "OtherComm")


def classify_kernel(name: str, args: dict | None = None, cat: str = "kernel") -> str:
    """A device event's category: its kernel's name (and, for NCCL, its `Collective name`)."""
    if cat in ("gpu_memcpy", "gpu_memset") or name.startswith(("Memcpy", "Memset")):
        return "memcpy"
    if "nccl" in name.lower() or "userbuffers" in name.lower():   # NCCL, and TE's TP-overlap buffers
        named = (args or {}).get("Collective name")
        return collective(named if isinstance(named, str) and named else name)
    for pattern, category in ((_ATTENTION, "attention"), (_NORM, "norm"), (_OPTIMIZER, "optimizer"),
                              (_MATMUL_KERNEL, "matmul"), (_ELEMENTWISE_KERNEL, "elementwise")):
        if pattern.search(name):
            return category
    return "other"


def classify_op(name: str) -> str | None:
    """A host op's or annotation's own category; None for one that says nothing by itself (views,
    allocations, autograd's wrappers): it takes the category of the op around it."""
    if name.startswith(("gloo:", "c10d::", "nccl:")) or name == "record_param_comms":
        return collective(name.partition(":")[2] if ":" in name else name)
    if _OPTIMIZER_SPAN.match(name) or name.startswith("Optimizer.zero_grad#") or "_fused_adam" in name:
        return "optimizer"
    if name.startswith("autograd::engine::evaluate_function: "):
        return classify_op(name.removeprefix("autograd::engine::evaluate_function: "))
    for pattern, category in ((_ATTENTION, "attention"), (_NORM, "norm"), (_MATMUL_OP, "matmul"),
                              (_MEMCPY_OP, "memcpy"), (_ELEMENTWISE_OP, "elementwise")):
        if pattern.search(name):
            return category
    if name.startswith(("aten::embedding", "aten::cross_entropy", "aten::nll_loss", "aten::index", "aten::gather",
                        "aten::scatter", "aten::topk", "aten::sort", "aten::randint", "aten::arange")):
        return "other"
    return None


# -- reading -------------------------------------------------------------------------------------
@dataclass
class Trace:
    """One Kineto JSON trace of one rank: its events and who recorded it."""

    path: Path
    events: list[dict]
    rank: int | None = None
    pp_rank: int | None = None
    node: str | None = None
    steps: list[int] = field(default_factory=list)


def read_trace(path: str | os.PathLike) -> Trace:
    """A trace file (.json or .json.gz). Its rank and stage come from the `charllm` entry the
    workload writes, else `distributedInfo` (Kineto's) and a `rank-R.json` / `rankR-...` name."""
    path = Path(path)
    try:
        with open_regular(path, "trace") as fh:
            if os.fstat(fh.fileno()).st_size > MAX_TRACE_BYTES:
                raise UserError(f"trace {str(path)!r}: larger than {MAX_TRACE_BYTES // 2**30} GiB")
            raw = gzip.decompress(fh.read()) if path.suffix == ".gz" else fh.read()
        data = json.loads(raw)
    except (ValueError, EOFError, OSError, RecursionError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:120]
        raise UserError(f"trace {str(path)!r}: not a readable Kineto JSON trace ({why})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise UserError(f"trace {str(path)!r}: not a Kineto JSON trace (no traceEvents list)")
    ours: dict = data["charllm"] if isinstance(data.get("charllm"), dict) else {}
    dist: dict = data["distributedInfo"] if isinstance(data.get("distributedInfo"), dict) else {}
    named = re.search(r"rank-?(\d+)", path.name)
    rank = next((v for v in (ours.get("rank"), dist.get("rank"), int(named[1]) if named else None)
                 if isinstance(v, int) and not isinstance(v, bool)), None)
    pp = ours.get("pp_rank")
    events = [e for e in data["traceEvents"] if isinstance(e, dict)]
    steps = sorted({int(m[1]) for e in events if e.get("ph") == "X" and (m := _STEP.match(str(e.get("name"))))})
    return Trace(path, events, rank, pp if isinstance(pp, int) else None,
                 ours.get("node") if isinstance(ours.get("node"), str) else None, steps)


# -- intervals -----------------------------------------------------------------------------------
def _measure(starts: np.ndarray, ends: np.ndarray) -> float:
    """The length of the union of intervals [start, end)."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > reach[:-1]]           # a new merged run starts here
    run = np.cumsum(new) - 1
    run_start = s[new]
    run_end = np.zeros(run_start.size)
    np.maximum.at(run_end, run, e)
    return float((run_end - run_start).sum())


@dataclass
class _Segments:
    """Time segments, each with a category, clipped to the step window (µs)."""

    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)   # the artifact's sum of durations
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, start: float, end: float, category: str) -> None:
        if end > start:
            self.start.append(start)
            self.end.append(end)
            self.category.append(category)


def _window(events: list[dict]) -> list[tuple[float, float]]:
    """The ProfilerStep#N spans (µs), or the whole trace's span when it marks none."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
             if e.get("ph") == "X" and _STEP.match(str(e.get("name"))) and _timed(e)]
    if spans:
        return spans
    timed = [e for e in events if e.get("ph") == "X" and _timed(e) and e.get("cat") not in ("Trace",)]
    if not timed:
        return []
    return [(min(float(e["ts"]) for e in timed), max(float(e["ts"]) + float(e["dur"]) for e in timed))]


def _timed(e: dict) -> bool:
    ts, dur = e.get("ts"), e.get("dur", 0)
    return isinstance(ts, (int, float)) and isinstance(dur, (int, float)) and not isinstance(dur, bool) and dur >= 0


def _clip(start: float, end: float, window: list[tuple[float, float]]):
    for lo, hi in window:
        s, e = max(start, lo), min(end, hi)
        if e > s:
            yield s, e


def _device_segments(events: list[dict], window) -> _Segments:
    optimizer = _optimizer_launches(events)
    out = _Segments()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in _DEVICE_CATS or not _timed(e):
            continue
        args: dict = e["args"] if isinstance(e.get("args"), dict) else {}
        category = classify_kernel(str(e.get("name", "")), args, e["cat"])
        if category in COMPUTE and args.get("correlation") in optimizer:
            category = "optimizer"
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        inside = list(_clip(start, end, window))
        for s, t in inside:
            out.add(s, t, category)
        if inside:
            out.durations[category] = out.durations.get(category, 0.0) + sum(t - s for s, t in inside)
            out.counts[category] = out.counts.get(category, 0) + 1
    return out


def _optimizer_launches(events: list[dict]) -> set:
    """Correlation ids of the kernel launches made inside an optimizer step (per host thread)."""
    spans: dict = {}
    for e in events:
        if e.get("ph") == "X" and _OPTIMIZER_SPAN.match(str(e.get("name"))) and _timed(e):
            spans.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"]))
    if not spans:
        return set()
    found = set()
    for e in events:
        if e.get("cat") in _LAUNCHES and _timed(e) and isinstance(e.get("args"), dict):
            for lo, hi in spans.get((e.get("pid"), e.get("tid")), ()):
                if lo <= e["ts"] <= hi:
                    found.add(e["args"].get("correlation"))
    return found


def _host_segments(events: list[dict], window) -> _Segments:
    """Every host thread's ops and annotations as non-overlapping self-time segments, each with
    the category of the innermost op that has one (communication always itself; everything in an
    optimizer step optimizer)."""
    threads: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and _timed(e) \
                and not _STEP.match(str(e.get("name"))):
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = _Segments()
    for thread in threads.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))   # a parent before the children it starts with
        stack: list[list] = []                               # [end, category, optimizer?, cursor]

        def close(until: float) -> None:
            """Pop the ops that end by `until`, giving each its time after its last child."""
            while stack and stack[-1][0] <= until:
                end, category, _, cursor = stack.pop()
                for s, t in _clip(cursor, end, window):
                    out.add(s, t, category)
                if stack:
                    stack[-1][3] = max(stack[-1][3], end)

        for e in thread:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            close(start)
            if stack:   # the parent's time up to this child is its own
                parent = stack[-1]
                for s, t in _clip(parent[3], start, window):
                    out.add(s, t, parent[1])
                parent[3] = max(parent[3], start)   # (gloo's annotations may outlast the op that began them)
            own = classify_op(str(e.get("name", "")))
            in_optimizer = bool(stack and stack[-1][2]) or own == "optimizer"
            inherited = stack[-1][1] if stack else None
            if own in COMMUNICATION:
                category = own
            elif in_optimizer:
                category = "optimizer"
            else:
                category = own or inherited or "other"
            if any(True for _ in _clip(start, end, window)):
                out.counts[category] = out.counts.get(category, 0) + 1
            stack.append([end, category, in_optimizer, start])
        close(float("inf"))
    for s, t, category in zip(out.start, out.end, out.category):   # self times, threads added up
        out.durations[category] = out.durations.get(category, 0.0) + (t - s)
    return out


def breakdown(trace: Trace) -> dict:
    """One trace's step split into categories (see the module's docstring); times in seconds."""
    window = _window(trace.events)
    device = any(e.get("cat") in _DEVICE_CATS for e in trace.events)
    segments = _device_segments(trace.events, window) if device else _host_segments(trace.events, window)
    steps = max(1, len(trace.steps))
    starts, ends = np.asarray(segments.start, float), np.asarray(segments.end, float)
    cats = np.asarray(segments.category, dtype=object)
    out: dict = {"source": "device" if device else "host", "steps": steps}
    covered = 0.0
    for i, category in enumerate(CATEGORIES):
        upto = np.isin(cats, CATEGORIES[: i + 1])
        through = _measure(starts[upto], ends[upto])
        out[f"{category}_s"] = (through - covered) / 1e6 / steps
        out[f"{category}_kernel_s"] = segments.durations.get(category, 0.0) / 1e6 / steps
        out[f"{category}_count"] = segments.counts.get(category, 0) / steps
        covered = through
    compute, comm = np.isin(cats, COMPUTE), np.isin(cats, COMMUNICATION)
    compute_s, comm_s = _measure(starts[compute], ends[compute]), _measure(starts[comm], ends[comm])
    both = _measure(starts[compute | comm], ends[compute | comm])
    step_s = sum(hi - lo for lo, hi in window)
    out.update(step_s=step_s / 1e6 / steps, busy_s=covered / 1e6 / steps, idle_s=(step_s - covered) / 1e6 / steps,
               compute_s=compute_s / 1e6 / steps, comm_s=comm_s / 1e6 / steps,
               overlap_s=(compute_s + comm_s - both) / 1e6 / steps)
    out["overlap_frac"] = out["overlap_s"] / out["comm_s"] if out["comm_s"] > 0 else None
    return out


# -- a run's traces --------------------------------------------------------------------------------
def trace_files(folder: Path) -> list[Path]:
    """The trace files in `folder` (a run's traces/, or an artifact's <job>_kineto/), by name."""
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if not f.name.startswith(".")
                  and f.name.endswith((".json", ".json.gz")) and f.is_file())


BY = ("stage", "rank")


def breakdowns(files: list[Path]) -> pl.DataFrame:
    """One row per trace: rank, pipeline stage, node, step(s) and its breakdown. A trace that names
    no stage (an imported one) takes its place among the ranks: one trace per stage, whose first
    ranks grow with the stage (Megatron's rank order)."""
    rows = []
    traces = [read_trace(f) for f in files]
    unstaged = sorted({t.rank for t in traces if t.pp_rank is None and t.rank is not None})
    for trace in traces:
        pp = trace.pp_rank if trace.pp_rank is not None else \
            unstaged.index(trace.rank) if trace.rank in unstaged else None
        rows.append({"file": trace.path.name, "rank": trace.rank, "pp_rank": pp, "node": trace.node,
                     "step": trace.steps[0] if len(trace.steps) == 1 else None, **breakdown(trace)})
    if not rows:
        return pl.DataFrame()
    return pl.DataFrame(rows, infer_schema_length=None)


def by_group(per_trace: pl.DataFrame, by: str) -> pl.DataFrame:
    """Per pipeline stage (or rank): the mean over its traces (its ranks and steps) of each figure,
    with each category's share of the step."""
    if by not in BY:
        raise UserError(f"--by {by!r}: the kernel summary is per stage or per rank (stage, rank)")
    key = "pp_rank" if by == "stage" else "rank"
    figures = [c for c in per_trace.columns if c not in ("file", "rank", "pp_rank", "node", "step", "source", "steps")]
    other = pl.col("rank").drop_nulls().unique().sort().cast(pl.String).str.join(", ").alias("ranks") \
        if by == "stage" else pl.col("pp_rank").first()
    out = (per_trace.group_by(key).agg(pl.len().alias("traces"), other, pl.col("source").first(),
                                       pl.col("node").drop_nulls().first(), *(pl.col(c).mean() for c in figures))
           .sort(key))
    return out.with_columns(*(pl.when(pl.col("step_s") > 0).then(pl.col(f"{c}_s") / pl.col("step_s"))
                              .alias(f"{c}_frac") for c in CATEGORIES),
                            (pl.col("busy_s") / pl.col("step_s")).alias("busy_frac"))


def run_traces(run) -> list[Path]:
    """The profiler traces a run holds (RUN_DIR/traces/, engine.model.profiling)."""
    return trace_files(run.traces_dir)


def kernel_summary(run, by: str = "stage") -> pl.DataFrame:
    """The run's traces split into categories per pipeline stage (or rank): see by_group. A finished
    run's result is kept in RUN_DIR/summaries/ (remade when its traces change)."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    if by not in BY:
        raise UserError(f"--by {by!r}: the kernel summary is per stage or per rank (stage, rank)")
    files = run_traces(run)
    if not files:
        raise UserError(f"run {run.id}: no profiler traces under {run.traces_dir} (set telemetry.profile_steps, "
                        "e.g. --set profile_steps=[10], to record some)")
    traces = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    place = kept_place(run, f"kernels-by-{by}", traces=traces)
    if place is not None and (df := read_kept(*place)) is not None:
        return df
    df = by_group(breakdowns(files), by).with_columns(pl.lit(run.id).alias("run"), pl.lit(by).alias("level"))
    if place is not None:
        keep(df, *place)
    return df


def kernel_table(summary: pl.DataFrame) -> pl.DataFrame:
    """A kernel summary for reading: one row per figure, one column per stage (or rank): the step,
    busy and idle time, each category's time with its share of the step, and the overlap."""
    by = summary["level"][0] if "level" in summary.columns else "stage"
    key = "pp_rank" if by == "stage" else "rank"
    labels = [f"{by} {k}" for k in summary[key]]
    rows = [("step", "step_s"), ("busy", "busy_s"), ("idle", "idle_s")]
    rows += [(c, f"{c}_s") for c in CATEGORIES if summary[f"{c}_s"].fill_null(0).sum() > 0]
    rows += [("compute (any)", "compute_s"), ("communication (any)", "comm_s"), ("overlap", "overlap_s")]
    table: dict[str, list[str]] = {"time per step": [name for name, _ in rows]}
    for label, row in zip(labels, summary.iter_rows(named=True)):
        cells = []
        for name, column in rows:
            value = row[column]
            text = format_figure(column, value)
            if column == "overlap_s" and row.get("overlap_frac") is not None:
                text += f" ({100 * row['overlap_frac']:.0f}% of comm.)"
            elif name not in ("step",) and row["step_s"] and value is not None:
                text += f" ({100 * value / row['step_s']:.1f}%)"
            cells.append(text)
        table[label] = cells
    return pl.DataFrame(table)


def compare_kernels(refs: list[str]) -> tuple[pl.DataFrame, list[str]]:
    """Runs side by side: each run's kernel summary, averaged over its pipeline stages (as the
    artifact's Figure 10 divides by the pipeline degree), one row per run; and a note for each
    ref that has no traces."""
    rows, notes = [], []
    for ref in refs:
        try:
            run = resolve_run(ref)
            per_stage = kernel_summary(run, "stage")
        except UserError as exc:
            notes.append(str(exc))
            continue
        figures = [c for c in per_stage.columns if c.endswith(("_s", "_frac", "_count"))]
        rows.append(per_stage.select(pl.lit(run.id).alias("run"), pl.len().alias("stages"),
                                     pl.col("source").first(), *(pl.col(c).mean() for c in figures)))
    return (pl.concat(rows, how="diagonal_relaxed") if rows else pl.DataFrame()), notes


def kernels_side_by_side(overview: pl.DataFrame, labels: dict[str, str] | None = None) -> pl.DataFrame:
    """compare_kernels' rows for reading: one row per figure, one column per run; each category's
    share of the step and its time per step."""
    labels = labels or {}
    rows = [("step", "step_s"), ("busy", "busy_s"), ("idle", "idle_s")]
    rows += [(c, f"{c}_s") for c in CATEGORIES if overview[f"{c}_s"].fill_null(0).sum() > 0]
    rows += [("compute (any)", "compute_s"), ("communication (any)", "comm_s"), ("overlap", "overlap_s")]
    table: dict[str, list[str]] = {"mean per stage": [name for name, _ in rows]}
    for row in overview.iter_rows(named=True):
        cells = []
        for name, column in rows:
            value = row[column]
            share = (
                f"{100 * value / row['step_s']:.1f}% " if name != "step" and row["step_s"] and value is not None else ""
            )
            cells.append(f"{share}({format_figure(column, value)})" if share else format_figure(column, value))
        table[labels.get(row["run"], row["run"])] = cells
    return pl.DataFrame(table)
