"""Compare: 2–4 runs and/or a baseline side by side.

The table is `probes.analysis.compare.compare(refs, baseline)`'s, figures formatted with their units as
`charllm-tui compare` prints them. The baseline selector offers the runs compared and the saved
baselines, and always shows the baseline the figures are measured against. The overlaid charts
show each run per training iteration (from its telemetry's `iteration` column): mean GPU power
and temperature, or, when no run recorded an accelerator (a CPU run), its iteration time and
mean CPU utilization. Under the status, each run's plan (`probes.analysis.predicted`: the step
time and power the speed model gives its layout) stands beside what it measured, with the error.
Runs come from the Runs screen (Space marks, m compares) or the palette. Each series is told apart by
glyph as well as colour, and the baseline is marked (a saved one is drawn as the level of its figure).
Below 36 rows the table has the room and `c` shows each chart in its place in turn.

`k` shows instead each run's profiled step by kernel category (probes.analysis.kernels), `g` a
GPUs x runs matrix (probes.analysis.matrix: temperature, then power, clock, throttling and link
bytes on each press), and the status names each run's stragglers (probes.analysis.ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import DataTable, Label, Select, Static
from textual.widgets.select import NoSelection

from charllm.probes.analysis import baselines, compare, predicted
from charllm.probes.analysis.kernels import compare_kernels, kernels_side_by_side
from charllm.probes.analysis.matrix import MATRICES, gpus_by_runs, render_matrix
from charllm.probes.analysis.ranks import rank_summary, straggler_line
from charllm.probes.analysis.render import metric_label
from charllm.probes.analysis.summary import per_iteration
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.rundir import resolve_run, run_id_name
from charllm.tui.screens.base import WorkbenchScreen
from charllm.tui.widgets.charts import Chart

if TYPE_CHECKING:
    import polars as pl

FIRST_RUN = "(first run)"
MAX_DIFF_LINES = 3
# Per-iteration charts: (curve, title). GPU power and heat when any run recorded an accelerator,
# else what a CPU run records: its iteration time and CPU utilization.
GPU_CHARTS = (("power_w", "mean GPU power (W) per iteration"),
              ("temp_gpu_c", "mean GPU temperature (°C) per iteration"))
HOST_CHARTS = (("iter_time_s", "iteration time (s) per iteration"),
               ("cpu_util_pct", "mean CPU utilization (%) per iteration"))
NO_CHARTS = "no charts: none of these runs recorded telemetry per training iteration"


@dataclass
class Compared(Message):
    result: object | None          # probes.analysis.compare.CompareResult
    curves: dict                   # curve -> {run label: (iterations, values)}, runs with data only
    error: str | None = None
    stragglers: list[str] | None = None   # "run: stragglers ..." for each run that logged its ranks' timers
    planned: dict | None = None    # run label -> predicted.predicted_vs_measured(run), runs with an experiment
    baseline: str | None = None    # the baseline's series in `curves` (a saved baseline's: its level)


@dataclass
class SideBySide(Message):
    view: str                      # "kernels" or a matrix name
    table: pl.DataFrame | None     # text cells, first column the row names
    lines: list[str]               # what it covers, and notes


class CompareScreen(WorkbenchScreen):
    MODE = "compare"
    AUTO_FOCUS = "#compare-table"      # the arrows move through the metrics (and scroll them sideways); b: baseline
    BINDINGS = [
        Binding("r", "reload", "Reload", id="compare.reload"),
        Binding("b", "pick_baseline", "Baseline", id="compare.baseline"),
        Binding("k", "kernels", "Kernels", id="compare.kernels"),
        Binding("g", "gpu_matrix", "GPU matrix", id="compare.gpu_matrix"),
        Binding("c", "charts", "Charts", id="compare.charts"),
    ]
    # Below this height the charts take the table's place in turn on `c` (under it, neither would be legible).
    CHARTS_BELOW_MIN_HEIGHT = 36
    MATRIX_ORDER = tuple(MATRICES)

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.choices: dict[str, str] = {}       # the selector's: value (a ref) -> label
        self.loaded: tuple | None = None
        self.result = None
        self.view = "metrics"          # the table shows: metrics | kernels | a matrix name
        self.straggler_lines: list[str] = []
        self.charts_pressed = 0        # c steps through the views of table and charts (_layout)
        self.has_charts = False        # the runs have per-iteration curves to chart

    def compose_body(self) -> ComposeResult:
        with Vertical(id="compare"):
            with Horizontal(id="compare-controls"):
                yield Label("baseline ")
                yield Select([], id="baseline", compact=True, allow_blank=True, prompt=FIRST_RUN)
            yield Static(id="compare-status")
            yield Static(id="compare-predicted")
            yield DataTable(id="compare-table", zebra_stripes=True, cursor_type="row")
            with Horizontal(id="compare-charts"):
                for i, (_, title) in enumerate(GPU_CHARTS, start=1):  # retitled for host charts
                    yield Chart(title, xlabel="iteration", id=f"cmp-chart-{i}")

    def on_screen_resume(self) -> None:
        self.load_options(self.app.compare_refs)
        if (tuple(self.app.compare_refs), self._baseline()) != self.loaded:
            self.load(self.app.compare_refs)

    def load_options(self, refs: list[str]) -> None:
        """The selector's choices: the runs compared, then the saved baselines (the current one kept)."""
        select = self.query_one("#baseline", Select)
        try:
            names = [b["name"] for b in baselines.list()]
        except UserError:
            names = []
        choices = {ref: f"{Path(ref).name} (run)" for ref in refs}
        choices.update({f"baseline:{n}": f"{n} (saved baseline)" for n in names if f"baseline:{n}" not in choices})
        self.choices = choices
        current = select.value
        with self.prevent(Select.Changed):
            select.set_options([(label, value) for value, label in choices.items()])
            if current in choices:
                select.value = current

    def _baseline(self) -> str | None:
        value = self.query_one("#baseline", Select).value
        return None if isinstance(value, NoSelection) else value     # Select.NULL is the one NoSelection

    def load(self, refs: list[str]) -> None:
        if list(refs) != self.refs:
            self.load_options(refs)
        self.refs = list(refs)
        baseline = self._baseline()
        self.loaded = (tuple(self.refs), baseline)
        status = self.query_one("#compare-status", Static)
        if not self.refs and not baseline:
            status.update("Nothing to compare yet: mark 2–4 runs on the Runs screen (F6, Space) and press m, "
                          "or pick a baseline (b).")
            return
        status.update(f"comparing {len(self.refs)} run(s){' against ' + baseline if baseline else ''}…")
        self.view = "metrics"
        self.compare(self.refs, baseline)

    @on(Select.Changed, "#baseline")
    def action_reload(self) -> None:
        self.load(self.refs)

    def action_pick_baseline(self) -> None:
        self.query_one("#baseline", Select).focus()

    @work(thread=True, exclusive=True, group="compare")
    def compare(self, refs: list[str], baseline: str | None) -> None:
        error: str | None
        try:
            result = compare.compare(refs, baseline=baseline)
        except UserError as exc:
            result, error = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - reported on screen, the app stays up
            result, error = None, f"compare failed: {exc!r}"
        else:
            error = None
        curves = per_iteration_curves(refs)
        baseline = baseline_series(result, refs, curves) if result is not None else None
        self.post_message(Compared(result, curves, error, straggler_lines(refs), planned_figures(refs), baseline))

    def on_compared(self, message: Compared) -> None:
        status = self.query_one("#compare-status", Static)
        table = self.query_one("#compare-table", DataTable)
        table.clear(columns=True)
        charts = (GPU_CHARTS if any(message.curves.get(c) for c, _ in GPU_CHARTS) else
                  HOST_CHARTS if any(message.curves.get(c) for c, _ in HOST_CHARTS) else ())
        if message.error:
            status.update(f"[yellow]{escape(message.error)}[/]")
        else:
            result = self.result = message.result
            self.straggler_lines = message.stragglers or []
            self.view = "metrics"
            self._show_baseline(result)
            status.update("\n".join(self._status_lines(result) + [escape(line) for line in self.straggler_lines]
                                    + ([] if charts else [f"[dim]{NO_CHARTS}[/]"])))
            self._fill(table, result)
        planned = self.query_one("#compare-predicted", Static)
        planned.display = bool(message.planned) and not message.error
        planned.update(planned_text(message.planned or {}))
        self.has_charts = bool(charts)
        for (curve, title), chart in zip(charts, self.query(Chart)):
            chart.title = title
            chart.show(message.curves.get(curve, {}), baseline=message.baseline)
        self._layout()

    # -- layout ------------------------------------------------------------------------------------
    def on_resize(self) -> None:
        self._layout()

    def _layout(self) -> None:
        """The table above the charts, side by side, where the screen is tall enough, and `c` hides
        them; on a short one (80x24) the table alone, and `c` puts each chart in its place in turn."""
        short = self.size.height < self.CHARTS_BELOW_MIN_HEIGHT
        view = self.charts_pressed % (3 if short else 2)       # short: table, chart 1, chart 2; else: all, table
        shown = self.has_charts and (view > 0 if short else view == 0)
        self.query_one("#compare-charts").display = shown
        self.query_one("#compare-table").display = not (shown and short)
        for i, chart in enumerate(self.query(Chart), start=1):
            chart.display = not short or view == i

    def action_charts(self) -> None:
        if not self.has_charts:
            self.notify(NO_CHARTS, severity="warning")
            return
        self.charts_pressed += 1
        self._layout()

    def _show_baseline(self, result) -> None:
        """Point the selector at the baseline the figures are measured against."""
        select = self.query_one("#baseline", Select)
        if result.baseline_ref in self.choices:
            with self.prevent(Select.Changed):
                select.value = result.baseline_ref
            self.loaded = (tuple(self.refs), result.baseline_ref)

    def _status_lines(self, result) -> list[str]:
        lines = [f"baseline [b]{escape(result.baseline)}[/b] · {escape(result.window_text)} · "
                 f"[green]better[/] / [red]worse[/] beyond ±{result.threshold_pct:g}%"]
        diffs = result.experiment_diff.to_dicts()
        shown = 1 if self.size.height < self.CHARTS_BELOW_MIN_HEIGHT else MAX_DIFF_LINES   # the table's room
        shown += len(diffs) == shown + 1          # the last one in the place of "… 1 more"
        for row in diffs[:shown]:
            field = row.pop("field", "")
            lines.append(f"[dim]{escape(str(field))}:[/] " + " | ".join(escape(str(v)) for v in row.values()))
        if len(diffs) > shown:
            lines.append(f"[dim]… {plural(len(diffs) - shown, 'more experiment difference')} "
                         f"(charllm-tui compare shows them all)[/]")
        return lines + [f"[yellow]note:[/] {escape(n)}" for n in result.notes]

    # -- kernels and GPU matrices, in place of the metrics ---------------------------------------
    def action_kernels(self) -> None:
        """Each run's profiled step by kernel category; again: the metrics."""
        self._switch("metrics" if self.view == "kernels" else "kernels")

    def action_gpu_matrix(self) -> None:
        """A GPUs x runs matrix: temperature, then power, clock, throttling, link bytes; then the metrics."""
        order = self.MATRIX_ORDER
        self._switch(order[0] if self.view not in order else
                     order[order.index(self.view) + 1] if self.view != order[-1] else "metrics")

    def _switch(self, view: str) -> None:
        runs = [ref for ref in self.refs if not ref.startswith("baseline:")]
        if view == "metrics" or not runs:
            self.view = "metrics"
            if self.result is not None:
                table = self.query_one("#compare-table", DataTable)
                table.clear(columns=True)
                self._fill(table, self.result)
                self.query_one("#compare-status", Static).update(
                    "\n".join(self._status_lines(self.result) + [escape(line) for line in self.straggler_lines]))
            return
        self.view = view
        self.query_one("#compare-status", Static).update(
            f"reading the runs' {view if view == 'kernels' else view + ' per GPU'}…"
        )
        self.side_by_side(runs, view)

    @work(thread=True, exclusive=True, group="compare-side")
    def side_by_side(self, runs: list[str], view: str) -> None:
        labels = run_labels([rd.id for rd in resolved_runs(runs)])
        try:
            if view == "kernels":
                df, notes = compare_kernels(runs)
                table = kernels_side_by_side(df, labels) if df.height else None
                lines = ["each run's profiled step by kernel category, mean over its pipeline stages "
                         "(share of the step, time); k: back to the metrics", *notes]
            else:
                matrix = gpus_by_runs(runs, view)
                table = render_matrix(matrix, view).rename(lambda c: labels.get(c, c))
                what, unit, _ = MATRICES[view]
                lines = [f"{what} per GPU ({unit}), each run's steady window; g: the next figure"]
        except UserError as exc:
            table, lines = None, [str(exc)]
        self.post_message(SideBySide(view, table, lines))

    def on_side_by_side(self, message: SideBySide) -> None:
        if message.view != self.view:
            return   # switched again meanwhile
        self.query_one("#compare-status", Static).update("\n".join(escape(line) for line in message.lines))
        table = self.query_one("#compare-table", DataTable)
        table.clear(columns=True)
        if message.table is None:
            return
        rows = [[Text(str(v), justify="left" if i == 0 else "right") for i, v in enumerate(row)]
                for row in message.table.iter_rows()]
        for i, column in enumerate(message.table.columns):
            table.add_column(column, key=column, width=max([len(column), *(row[i].cell_len for row in rows)]))
        for cells in rows:
            table.add_row(*cells)

    @staticmethod
    def _fill(table: DataTable, result) -> None:
        """The comparison as rows: metrics in words, figures with units. Each column is as wide as
        its widest cell from the start (the table's own measuring waits for an idle moment, and the
        first comparison after start-up could show before it, cut to the headings' widths)."""
        flags = {(r["metric"], r["ref"]): r["flag"] for r in result.table.iter_rows(named=True)}
        wide = result.wide()
        short = run_labels(result.labels)      # run ids without their stamp: the table fits 80 columns
        rows = []
        for row in wide.iter_rows(named=True):
            cells = []
            for column, value in row.items():
                ref = column.removesuffix(" vs base")
                flag = flags.get((row["metric"], ref)) if column.endswith(" vs base") else None
                style = {"better": "green", "worse": "bold red", "changed": "yellow"}.get(flag or "", "")
                figure = column not in ("metric", "better") and not column.endswith(" vs base")
                text = metric_label(value) if column == "metric" else "—" if value in (None, "") else str(value)
                cells.append(Text(text, style, justify="right" if figure else "left"))
            rows.append(cells)
        for i, column in enumerate(wide.columns):
            ref = column.removesuffix(" vs base")
            heading = column.replace(ref, short[ref]) if ref in short else column
            table.add_column(heading, key=column,
                             width=max([len(heading), *(row[i].cell_len for row in rows)]))
        for cells in rows:
            table.add_row(*cells)


# The summary metric of each chart's curve: a saved baseline has no curve, and is drawn as the level
# of that figure over its window.
CURVE_METRICS = {"power_w": "power_mean_w", "temp_gpu_c": "temp_gpu_mean_c", "iter_time_s": "iter_time_mean_s",
                 "cpu_util_pct": "cpu_util_mean_pct"}


def baseline_series(result, refs: list[str], curves: dict) -> str | None:
    """The label, in `curves`, of the series the charts mark as the baseline: a run's own; for a saved
    baseline, a level line of its figure added to each curve that has runs (None: not drawable)."""
    if not result.baseline.startswith("baseline:"):
        return run_labels([rd.id for rd in resolved_runs(refs)]).get(result.baseline)
    name = result.baseline.removeprefix("baseline:")
    figures = {r["metric"]: r["value"] for r in result.table.iter_rows(named=True) if r["ref"] == result.baseline}
    for curve, series in curves.items():
        level = figures.get(CURVE_METRICS[curve])
        if series and level is not None:
            xs = sorted({x for xs, _ in series.values() for x in xs})
            series[name] = (xs, [level] * len(xs))
    return name


def resolved_runs(refs: list[str]):
    """The run directories of the refs that name a run (a baseline or a run gone since is left out)."""
    runs = []
    for ref in refs:
        try:
            runs.append(resolve_run(ref))
        except UserError:
            continue
    return runs


def straggler_lines(refs: list[str]) -> list[str]:
    """Each run's stragglers in a line (runs whose workload logged every rank's timers)."""
    runs = resolved_runs([ref for ref in refs if not ref.startswith("baseline:")])
    labels = run_labels([rd.id for rd in runs])
    lines = []
    for rd in runs:
        try:
            lines.append(f"{labels[rd.id]}: {straggler_line(rank_summary(rd))}")
        except UserError:
            continue
    return lines


# What the plan line of each run shows: (metric of probes.analysis.predicted, its short name)
PLANNED = (("step time", "step"), ("power per GPU", "power"))


def planned_figures(refs: list[str]) -> dict:
    """run label -> its predicted_vs_measured table, for the runs (not baselines) that recorded an experiment."""
    runs = resolved_runs(refs)
    labels = run_labels([rd.id for rd in runs])
    out = {}
    for rd in runs:
        try:
            table = predicted.predicted_vs_measured(rd)
        except UserError:
            continue
        if table.height:
            out[labels[rd.id]] = table
    return out


def planned_text(planned: dict) -> str:
    """One line per run: the plan's step time and power beside the measured ones, with the errors;
    then where the plan's rates come from."""
    lines = []
    for label, table in planned.items():
        by = {r["metric"]: r for r in table.iter_rows(named=True)}
        parts = [f"{short} {by[m]['predicted']:.3g}/{by[m]['measured']:.3g} {by[m]['unit']} "
                 f"({by[m]['error_pct']:+.0f}%)" for m, short in PLANNED if m in by]
        if parts:      # a line each at 80 columns: what the figures are is said once, below
            lines.append(f"[b]{escape(label)}[/b]: " + " · ".join(parts))
    source = next(iter(planned.values()))["source"][0] if planned else ""
    return "\n".join(lines + ([f"[dim]planned/measured (error) · {escape(source)}[/]"] if lines else []))


def per_iteration_curves(refs: list[str]) -> dict:
    """curve -> {run id: (iterations, values)} for GPU_CHARTS and HOST_CHARTS, each run in the
    curves it has data for: means over GPUs (or hosts) and samples within each iteration, and
    each iteration's time from the iteration log."""
    curves: dict[str, dict] = {curve: {} for curve, _ in (*GPU_CHARTS, *HOST_CHARTS)}
    runs = resolved_runs(refs)
    labels = run_labels([rd.id for rd in runs])
    for rd in runs:
        label = labels[rd.id]
        per_it = per_iteration(rd)  # a finished run's is kept: reopening Compare reads no telemetry
        for curve in ("power_w", "temp_gpu_c", "cpu_util_pct"):
            points = per_it.select("iteration", curve).drop_nulls()
            if points.height:
                curves[curve][label] = (points["iteration"].to_list(), points[curve].to_list())
        its = rd.read_steps()
        if its.height:
            curves["iter_time_s"][label] = (its["iteration"].to_list(),
                                            ((its["end_ns"] - its["start_ns"]) / 1e9).to_list())
    return curves


def run_labels(run_ids: list[str]) -> dict[str, str]:
    """Each run's label in legends and headings: its name without the id's 'YYYYMMDD-HHMMSS-' stamp,
    or, where runs share a name (two tiny-local runs), the id without its date, then the whole id,
    so that no two runs ever read the same. A baseline ('baseline:NAME') keeps its label."""
    def name(run_id: str) -> str:
        return run_id_name(run_id) or run_id

    def undated(run_id: str) -> str:
        return run_id.partition("-")[2] if run_id_name(run_id) else run_id

    for form in (name, undated, str):
        labels = {run_id: form(run_id) for run_id in run_ids}
        if len(set(labels.values())) == len(labels):
            return labels
    return {run_id: run_id for run_id in run_ids}
