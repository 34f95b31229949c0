"""Compare: 2–4 runs and/or a baseline side by side.

The table is `probes.compare.compare(refs, baseline)`'s; the overlaid charts show each run's mean
GPU power and temperature per training iteration (from its telemetry's `iteration` column).
Runs come from the Runs screen (Space marks, m compares) or the command palette.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import DataTable, Label, Select, Static

from charllm.probes.errors import UserError
from charllm.tui.screens.base import MissingAPI, WorkbenchScreen, api
from charllm.tui.widgets.charts import Chart

NO_BASELINE = "(no baseline)"
MAX_DIFF_LINES = 3


@dataclass
class Compared(Message):
    result: object | None          # probes.compare.CompareResult
    curves: dict                   # metric -> {run label: (iterations, values)}
    error: str | None = None


class CompareScreen(WorkbenchScreen):
    MODE = "compare"
    BINDINGS = [
        Binding("r", "reload", "Reload", id="compare.reload"),
        Binding("b", "pick_baseline", "Baseline", id="compare.baseline"),
    ]

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.loaded: tuple | None = None
        self.result = None

    def compose_body(self) -> ComposeResult:
        with Vertical(id="compare"):
            with Horizontal(id="compare-controls"):
                yield Label("baseline ")
                yield Select([], id="baseline", compact=True, allow_blank=True, prompt=NO_BASELINE)
            yield Static(id="compare-status")
            yield DataTable(id="compare-table", zebra_stripes=True, cursor_type="row")
            with Horizontal(id="compare-charts"):
                yield Chart("mean GPU power (W) per iteration", xlabel="iteration", id="cmp-power")
                yield Chart("mean GPU temperature (°C) per iteration", xlabel="iteration", id="cmp-temp")

    def on_screen_resume(self) -> None:
        self.load_baselines()
        if (tuple(self.app.compare_refs), self._baseline()) != self.loaded:
            self.load(self.app.compare_refs)

    def load_baselines(self) -> None:
        select = self.query_one("#baseline", Select)
        try:
            names = [b["name"] for b in api("probes.baselines").list()]
        except (MissingAPI, UserError):
            names = []
        current = select.value
        with self.prevent(Select.Changed):
            select.set_options([(n, n) for n in names])
            if current in names:
                select.value = current

    def _baseline(self) -> str | None:
        value = self.query_one("#baseline", Select).value
        return None if value is Select.NULL else value

    def load(self, refs: list[str]) -> None:
        self.refs = list(refs)
        baseline = self._baseline()
        self.loaded = (tuple(self.refs), baseline)
        status = self.query_one("#compare-status", Static)
        if not self.refs and not baseline:
            status.update("Nothing to compare yet: mark 2–4 runs on the Runs screen (F6, Space) and press m, "
                          "or pick a baseline (b).")
            return
        status.update(f"comparing {len(self.refs)} run(s){' against ' + baseline if baseline else ''}…")
        self.compare(self.refs, baseline)

    @on(Select.Changed, "#baseline")
    def action_reload(self) -> None:
        self.load(self.refs)

    def action_pick_baseline(self) -> None:
        self.query_one("#baseline", Select).focus()

    @work(thread=True, exclusive=True, group="compare")
    def compare(self, refs: list[str], baseline: str | None) -> None:
        try:
            result = api("probes.compare").compare(refs, baseline=baseline)
        except (MissingAPI, UserError) as exc:
            result, error = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - reported on screen, the app stays up
            result, error = None, f"compare failed: {exc!r}"
        else:
            error = None
        self.post_message(Compared(result, per_iteration_curves(refs), error))

    def on_compared(self, message: Compared) -> None:
        status = self.query_one("#compare-status", Static)
        table = self.query_one("#compare-table", DataTable)
        table.clear(columns=True)
        if message.error:
            status.update(f"[yellow]{escape(message.error)}[/]")
        else:
            result = self.result = message.result
            flags = {(r["metric"], r["ref"]): r["flag"] for r in result.table.iter_rows(named=True)}
            lines = [f"baseline [b]{escape(result.baseline)}[/b] · {escape(result.window_text)} · "
                     f"[green]better[/] / [red]worse[/] beyond ±{result.threshold_pct:g}%"]
            diffs = result.experiment_diff.to_dicts()
            for row in diffs[:MAX_DIFF_LINES]:
                field = row.pop("field", "")
                lines.append(f"[dim]{escape(str(field))}:[/] " + " | ".join(escape(str(v)) for v in row.values()))
            if len(diffs) > MAX_DIFF_LINES:
                lines.append(f"[dim]… {len(diffs) - MAX_DIFF_LINES} more experiment differences "
                             f"(charllm-tui compare shows them all)[/]")
            lines += [f"[yellow]note:[/] {escape(n)}" for n in result.notes]
            status.update("\n".join(lines))
            wide = result.wide()
            for column in wide.columns:
                table.add_column(column, key=column)
            for row in wide.iter_rows(named=True):
                cells = []
                for column, value in row.items():
                    ref = column.removesuffix(" vs base")
                    flag = flags.get((row["metric"], ref)) if column.endswith(" vs base") else None
                    style = {"better": "green", "worse": "bold red", "changed": "yellow"}.get(flag or "", "")
                    cells.append(Text("—" if value in (None, "") else str(value), style))
                table.add_row(*cells)
        self.query_one("#cmp-power", Chart).show(message.curves.get("power_w", {}))
        self.query_one("#cmp-temp", Chart).show(message.curves.get("temp_gpu_c", {}))


def per_iteration_curves(refs: list[str]) -> dict:
    """metric -> {run id: (iterations, mean over GPUs and samples in that iteration)}."""
    import polars as pl

    from charllm.probes.rundir import resolve_run

    curves: dict[str, dict] = {"power_w": {}, "temp_gpu_c": {}}
    for ref in refs:
        try:
            rd = resolve_run(ref)
        except UserError:
            continue
        per_it = (rd.scan_telemetry().filter((pl.col("device") != "host") & pl.col("iteration").is_not_null())
                  .group_by("iteration").agg(pl.col("power_w").mean(), pl.col("temp_gpu_c").mean())
                  .sort("iteration").collect())
        for metric in curves:
            curves[metric][short_id(rd.id)] = (per_it["iteration"].to_list(), per_it[metric].to_list())
    return curves


def short_id(run_id: str) -> str:
    """A run id without its 'YYYYMMDD-HHMMSS-' stamp (chart legends are narrow)."""
    stamp, _, rest = run_id.partition("-")
    time_part, _, name = rest.partition("-")
    return name if stamp.isdigit() and time_part.isdigit() and name else run_id[-24:]
