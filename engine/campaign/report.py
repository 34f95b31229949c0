"""The paper's figures from a campaign, as data: which values, on which axes, in which units.

Four kinds, as the CharLLM-PPT study reads its runs (Go et al., MICRO'25):
- parallelism: per layout (grouped by model) the GPU temperature, power (mean and peak), SM clock and
  efficiency (samples/(s·MJ)); a member that did not run is marked (OOM: its plan did not fit);
- optimization: per model and layout, a metric for each of the four variants (base, overlap,
  recompute, both), optionally normalised per model (divided by the model's best);
- microbatch: a metric against the micro batch size, one line per layout;
- heatmap: a per-GPU metric, GPUs (by node) x members;
- kernels: per layout, each kernel category's share of the profiled step, the mean over its
  pipeline stages (the paper's Figures 10 and 15; probes.analysis.kernels), one panel a category.

Every value is a member's run-level (or, for the heatmap, GPU-level) summary of the steady window,
exactly as `summarize` gives it; the drawing (terminal or SVG/PNG) is the command line's and the
workbench's (tui/figures.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import polars as pl

from charllm.engine.campaign.spec import VARIANTS, Campaign
from charllm.engine.campaign.state import QUEUED, Record
from charllm.engine.campaign.summary import WINDOW, campaign_summary, member_summary
from charllm.probes.analysis.kernels import CATEGORIES, compare_kernels
from charllm.probes.analysis.predicted import METRICS as PREDICTED, prediction
from charllm.probes.analysis.render import metric_label, metric_unit
from charllm.probes.core.errors import UserError, did_you_mean
from charllm.probes.store.importers import CRASHED

KINDS = ("parallelism", "optimization", "microbatch", "heatmap", "kernels")
PARALLELISM_METRICS = ("temp_gpu_mean_c", "temp_gpu_peak_c", "power_mean_w", "power_peak_w", "sm_clock_mean_mhz",
                       "efficiency_samples_per_s_mj")
DEFAULT_METRIC = {"optimization": "efficiency_samples_per_s_mj", "microbatch": "power_peak_w",
                  "heatmap": "temp_gpu_mean_c"}


@dataclass
class Series:
    label: str
    x: list[str]                          # the categories (layouts, variants, micro batch sizes)
    y: list[float | None]                 # None: no value (see `marks`)
    marks: dict[str, str] = field(default_factory=dict)   # x -> why there is no value ("OOM", "failed")
    members: list[int] = field(default_factory=list)      # the member (index) each x is


@dataclass
class Panel:
    title: str
    metric: str                           # the summary column plotted
    series: list[Series]

    @property
    def unit(self) -> str:
        return metric_unit(self.metric)

    @property
    def axis(self) -> str:
        """The value axis' label: the metric in words and its unit."""
        unit = self.unit
        return f"{metric_label(self.metric)} ({unit})" if unit else metric_label(self.metric)


@dataclass
class Figure:
    kind: str
    campaign: str
    title: str
    window: str
    x_axis: str = ""                      # what the categories are ("layout", "micro batch size")
    panels: list[Panel] = field(default_factory=list)
    # heatmap only: rows (GPUs), columns (members), values[row][column]
    rows: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    values: list[list[float | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def figure(record: Record, kind: str, metric: str | None = None, normalize: bool = False) -> Figure:
    _check_kind(kind)
    summary = campaign_summary(record)
    if kind != "heatmap":
        _check_metric(metric, summary)
    window = f"steady window of each member (summaries' {WINDOW!r})"
    return {"parallelism": _parallelism, "optimization": _optimization, "microbatch": _microbatch,
            "heatmap": _heatmap, "kernels": _kernels}[kind](record, summary, metric, normalize, window)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UserError(f"--figure {kind!r}: expected one of {', '.join(KINDS)}{did_you_mean(kind, KINDS)}")


def _check_metric(metric: str | None, summary: pl.DataFrame) -> None:
    if metric is not None and metric not in summary.columns:
        valid = [c for c, kind in summary.schema.items() if kind.is_numeric() and c != "member"]
        raise UserError(f"--metric {metric!r}: not a campaign figure{did_you_mean(metric, valid)} (the figures: "
                        f"{', '.join(valid)})")


# -- predicted: the same figures from the plans, before any run -----------------------------------
PREDICTED_KINDS = ("parallelism", "optimization", "microbatch")      # a plan is per layout, not per GPU
PREDICTED_PARALLELISM = ("power_mean_w", "tokens_per_s", "iter_time_mean_s", "efficiency_samples_per_s_mj")
PLANNED = "planned"          # a predicted member's status: its plan fits (no run is implied)


def predicted_figure(campaign: Campaign, kind: str, metric: str | None = None, normalize: bool = False) -> tuple:
    """A figure of `kind` drawn from the campaign's plans (the speed model's prediction of every
    member, probes.analysis.predicted), and the in-memory record of members it was drawn for."""
    _check_kind(kind)
    if kind not in PREDICTED_KINDS:
        raise UserError(f"--figure {kind} --predicted: a plan predicts per layout, not per GPU or kernel; "
                        f"predicted figures: {', '.join(PREDICTED_KINDS)}")
    plans = campaign.plan()
    record = Record.new(campaign, plans, {}, include_oom=False, max_parallel=1)     # never saved
    summary = predicted_summary(record, {p.member.key: p.member.experiment for p in plans})
    _check_metric(metric, summary)
    window = "the plans (engine.model.speed), before any run"
    # The metrics the plans predict a value for (a CPU has no board limit, so no power).
    predicted = [c for c in PREDICTED_PARALLELISM if summary[c].drop_nulls().len()] or [PREDICTED_PARALLELISM[0]]
    if kind == "parallelism" and metric is None:
        fig = _parallelism(record, summary, None, normalize, window, tuple(predicted))
    else:
        default = DEFAULT_METRIC[kind] if DEFAULT_METRIC[kind] in predicted else predicted[0]
        fig = {"parallelism": _parallelism, "optimization": _optimization, "microbatch": _microbatch}[kind](
            record, summary, metric or default, normalize, window)
    fig.title = f"{fig.title} (predicted)"
    return fig, record


def predicted_summary(record: Record, experiments: dict) -> pl.DataFrame:
    """One row per member, as campaign_summary's, with the speed model's predictions in the columns
    they predict (predicted.METRICS); a member planned not to run has none, and says why."""
    rows = []
    for m in record.members:
        runs = m["status"] == QUEUED
        figures = prediction(experiments[m["key"]]) if runs else {}
        rows.append({"member": m["index"] + 1, "name": m["name"], "status": PLANNED if runs else m["status"],
                     "layout": m.get("layout"), "run": None, "verdict": m.get("verdict"),
                     "why": None if runs else m.get("reason"),
                     **{column: figures.get(name) for _, column, name, _ in PREDICTED}})
    schema = {"member": pl.Int64, "name": pl.String, "status": pl.String, "layout": pl.String, "run": pl.String,
              "verdict": pl.String, "why": pl.String, **{column: pl.Float64 for _, column, _, _ in PREDICTED}}
    return pl.DataFrame(rows, schema=schema)


def entries(record: Record, fig: Figure) -> list[dict]:
    """The figure as data, one entry per member it draws: who the member is (its name, model,
    layout, varied settings, verdict) and its value for each panel's metric (None where it has
    none, with the mark saying why)."""
    by_index = {m["index"]: m for m in record.members}
    out: dict[int, dict] = {}
    for panel in fig.panels:
        for s in panel.series:
            for x, y, index in zip(s.x, s.y, s.members):
                m = by_index[index]
                entry = out.setdefault(index, {
                    "member": index + 1, "name": m["name"], "model": m.get("model"), "layout": m.get("layout"),
                    "varied": m.get("varied", {}), "verdict": m.get("verdict"), "x": x, "values": {}, "marks": {}})
                entry["values"][panel.metric] = y
                if x in s.marks:
                    entry["marks"][panel.metric] = s.marks[x]
    return [out[i] for i in sorted(out)]


def _mark(row: dict) -> str:
    """Why a member has no value: its plan did not fit (OOM, as the paper marks it), its run crashed
    (an imported folder without its sampled step), or its run did not complete."""
    if row["status"] == "skipped":
        return "OOM"
    if (row.get("why") or "").startswith(CRASHED):
        return CRASHED
    if row["status"] == PLANNED:
        return "not predicted"            # the speed model lacks a figure of its hardware
    return row["status"] if row["status"] != "completed" else "no data"


def _parallelism(record, summary, metric, normalize, window, metrics=PARALLELISM_METRICS) -> Figure:
    rows = summary.to_dicts()
    fig = Figure("parallelism", record.name, f"{record.name}: per layout", window, "layout")
    models = list(dict.fromkeys(m.get("model") or "?" for m in record.members))
    for metric_name in ((metric,) if metric else metrics):
        series = []
        for model in models:
            members = [(m, r) for m, r in zip(record.members, rows) if (m.get("model") or "?") == model]
            s = Series(model, [], [])
            for m, r in members:
                x = _layout_x(m)
                s.x.append(x)
                s.y.append(r.get(metric_name))
                s.members.append(m["index"])
                if r.get(metric_name) is None:
                    s.marks[x] = _mark(r)
            series.append(s)
        fig.panels.append(Panel(metric_label(metric_name), metric_name, series))
    return fig


def _layout_x(member: dict) -> str:
    """A member's x label: its layout, and what else it varies when that is not the layout."""
    extra = [f"{k}={v}" for k, v in member.get("varied", {}).items() if not k.endswith("parallel_size")]
    return " ".join([member.get("layout") or member["name"], *extra])


def _optimization(record, summary, metric, normalize, window) -> Figure:
    metric = metric or DEFAULT_METRIC["optimization"]
    rows = summary.to_dicts()
    fig = Figure("optimization", record.name, f"{record.name}: optimization variants"
                 + (" (normalised per model: 1 = the model's best)" if normalize else ""), window, "layout")
    for model in dict.fromkeys(m.get("model") or "?" for m in record.members):
        pairs = [(m, r) for m, r in zip(record.members, rows) if (m.get("model") or "?") == model]
        best = max((r[metric] for _, r in pairs if r.get(metric) is not None), default=None)
        layouts = list(dict.fromkeys(m.get("layout") or m["name"] for m, _ in pairs))
        series = []
        for variant in VARIANTS:
            s = Series(variant, [], [])
            for layout in layouts:
                found = [(m, r) for m, r in pairs if (m.get("layout") or m["name"]) == layout
                         and m.get("variant") == variant]
                if not found:
                    continue
                m, r = found[0]
                value = r.get(metric)
                if value is not None and normalize and best:
                    value = value / best
                s.x.append(layout)
                s.y.append(value)
                s.members.append(m["index"])
                if value is None:
                    s.marks[layout] = _mark(r)
            if s.x:
                series.append(s)
        fig.panels.append(Panel(f"{model}: {metric_label(metric)}" + (" / best" if normalize else ""), metric,
                                series))
    return fig


def _microbatch(record, summary, metric, normalize, window) -> Figure:
    metric = metric or DEFAULT_METRIC["microbatch"]
    rows = summary.to_dicts()
    fig = Figure("microbatch", record.name, f"{record.name}: against the micro batch size", window,
                 "micro batch size")
    lines: dict[str, Series] = {}
    for m, r in zip(record.members, rows):
        label = f"{m.get('model') or '?'} {m.get('layout') or ''}".strip()
        s = lines.setdefault(label, Series(label, [], []))
        x = str(m.get("micro_batch_size") or "?")
        s.x.append(x)
        s.y.append(r.get(metric))
        s.members.append(m["index"])
        if r.get(metric) is None:
            s.marks[x] = _mark(r)
    fig.panels.append(Panel(metric_label(metric), metric, list(lines.values())))
    return fig


def _heatmap(record, summary, metric, normalize, window) -> Figure:
    metric = metric or DEFAULT_METRIC["heatmap"]
    fig = Figure("heatmap", record.name, f"{record.name}: {metric_label(metric)} per GPU", window, "member")
    per_member = {}
    for m in record.members:
        df = member_summary(record, m, by="gpu")
        if df is None:
            continue
        if metric not in df.columns:
            valid = [c for c, kind in df.schema.items() if kind.is_numeric()]
            raise UserError(f"--metric {metric!r}: not a per-GPU figure{did_you_mean(metric, valid)} (the figures: "
                            f"{', '.join(valid)})")
        per_member[m["index"]] = {f"{r['node']}/{r['device']}": r[metric] for r in df.iter_rows(named=True)}
    if not per_member:
        fig.notes.append("no member has a completed run with GPU telemetry yet")
        return fig
    gpus = sorted({g for values in per_member.values() for g in values}, key=_gpu_order)
    fig.rows = gpus
    fig.columns = [next(m["name"] for m in record.members if m["index"] == i) for i in per_member]
    fig.values = [[per_member[i].get(g) for i in per_member] for g in gpus]
    fig.panels.append(Panel(metric_label(metric), metric, []))
    skipped = [m["name"] for m in record.members if m["index"] not in per_member]
    if skipped:
        fig.notes.append(f"not shown (no completed run): {', '.join(skipped[:5])}"
                         + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""))
    return fig


def _kernels(record, summary, metric, normalize, window) -> Figure:
    """Per layout (grouped by model), each category's share of the profiled step (% of it), a panel
    per category any member has; a member without traces is marked."""
    fig = Figure("kernels", record.name, f"{record.name}: profiled step by kernel category, mean over stages",
                 "the profiled steps of each member (telemetry.profile_steps)", "layout")
    rows = summary.to_dicts()
    members = [(m, r) for m, r in zip(record.members, rows)]
    overview, _ = compare_kernels([r["run"] for _, r in members if r.get("run") and r["status"] == "completed"])
    by_run = {row["run"]: row for row in overview.iter_rows(named=True)} if overview.height else {}
    present = [c for c in CATEGORIES if any((row.get(f"{c}_s") or 0) > 0 for row in by_run.values())]
    for category in present:
        series: dict[str, Series] = {}
        for m, r in members:
            s = series.setdefault(m.get("model") or "?", Series(m.get("model") or "?", [], []))
            x = _layout_x(m)
            found = by_run.get(r.get("run"))
            share = 100 * found[f"{category}_s"] / found["step_s"] if found and found["step_s"] else None
            s.x.append(x)
            s.y.append(share)
            s.members.append(m["index"])
            if share is None:
                s.marks[x] = "no traces" if r["status"] == "completed" else _mark(r)
        fig.panels.append(Panel(f"{category}, share of the step", f"{category}_pct", list(series.values())))
    if not present:
        fig.notes.append("no member's run holds profiler traces (set telemetry.profile_steps to record some)")
    return fig


def _gpu_order(label: str):
    """node0/gpu2 before node0/gpu10, nodes in order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]


def values_of(fig: Figure) -> dict[tuple[str, str, str], float | None]:
    """(panel metric, series, x) -> value, or (metric, gpu, member) -> value for a heatmap: what
    is drawn, for checks against the summaries."""
    if fig.kind == "heatmap":
        return {(fig.panels[0].metric, g, c): fig.values[i][j]
                for i, g in enumerate(fig.rows) for j, c in enumerate(fig.columns)}
    return {(p.metric, s.label, x): y for p in fig.panels for s in p.series for x, y in zip(s.x, s.y)}

