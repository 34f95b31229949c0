"""Sweep: which layouts of the whole space fit, for the composed experiment.

`engine.model.sweep.sweep` varies the layout of the experiment composed in Compose (its precision,
attention, recompute and optimizer settings stay), in a thread worker, or ahead of time: the app
sweeps the composed experiment once the workbench is idle after start-up (`sweep_ahead`), so that
F3 finds the table ready (the first sweep of a process also pays for importing polars and numpy).
The result (a polars DataFrame, one row per valid
layout, with its memory and its speed as `engine.model.speed` estimates it) feeds a TP × PP
feasibility map (per micro batch and recompute choice, coloured by the best headroom in that cell)
and a table, fitting layouts ranked by tokens/s, sortable by any column (the order chosen stays when
`f` or a dropdown changes what is listed). The micro batch and recompute dropdowns start at the best
layout's: the layouts listed share them, as the layouts of one campaign must ("any" lists all). Enter
on a map cell or a table row loads that layout into Compose through
`engine.model.sweep.layout_to_experiment`. Space marks table rows (the screen opens on the table),
and `c` writes the marked layouts as a new campaign of the composed experiment
(`engine.campaign.spec.from_layouts`), which the Campaign screen then shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import DataTable, Label, ProgressBar, Select, Static

from charllm.engine.campaign import spec as campaigns
from charllm.engine.model import catalog, memory, speed, sweep
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.memory import FITS, TIGHT, VERDICT_STYLE
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import GIB, count, si
from charllm.tui.screens.base import WorkbenchScreen, edited_name
from charllm.tui.screens.dialogs import AskName, free_name

if TYPE_CHECKING:
    import polars as pl

    from charllm.tui.app import CharllmApp

ANY = "any"
# DataFrame column -> table heading, in the order shown: the layout, what it leaves free, then its options
# (at 80 columns the verdict must be on screen before the options)
TABLE_COLUMNS = {
    "rank": "#", "tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP",
    "virtual_pipeline_model_parallel_size": "VP", "context_parallel_size": "CP",
    "expert_model_parallel_size": "EP", "data_parallel_size": "DP", "micro_batch_size": "mbs",
    "tokens_per_s": "tok/s", "headroom_bytes": "spare GiB", "peak_bytes": "peak GiB", "verdict": "verdict",
    "step_s": "step s", "mfu": "MFU", "communication_share": "comm", "bubble_share": "bubble",
    "power_w": "W", "energy_per_token_j": "J/tok",
    "recompute": "recompute", "use_distributed_optimizer": "dist-opt", "sequence_parallel": "SP",
    "params_per_device": "params/dev", "params": "params", "flops_per_iteration": "FLOP/iter",
}
# Never hidden: a layout is named by its rank and TP x PP, and judged by its speed, headroom and verdict
# (other columns are hidden when every layout of the sweep has the same value, and said so once)
ALWAYS_SHOWN = ("rank", "tensor_model_parallel_size", "pipeline_model_parallel_size", "tokens_per_s",
                "headroom_bytes", "peak_bytes", "verdict")
# Rows are added to the table a page at a time, the next page as the cursor or the scroll nears
# the end: a DataTable formats and measures every cell it is given, which for thousands of rows
# takes longer than the sweep itself.
TABLE_PAGE = 100
# The dropdowns over the table: (widget id, column). A sweep sets them to its best layout's values: the
# layouts listed then share them, as the layouts of one campaign must (`c`); "any" lists all.
FILTERS = (("mbs", "micro_batch_size"), ("recompute", "recompute"))
# what `s` cycles through: (column, descending)
SORTS = (("tokens_per_s", True), ("energy_per_token_j", False), ("headroom_bytes", True), ("peak_bytes", False),
         ("data_parallel_size", True), ("tensor_model_parallel_size", False), ("pipeline_model_parallel_size", False),
         ("rank", False))


@dataclass
class SweepDone(Message):
    frame: pl.DataFrame | None
    seconds: float
    error: str | None = None
    basis: str = ""             # the device budget every verdict and the rates every speed assumes, and their sources


def sweep_experiment(exp: Experiment) -> SweepDone:
    """Sweep `exp` (a copy the caller does not change) and say so as a message; errors included."""
    began = time.perf_counter()
    try:
        frame = sweep.sweep(exp)
        basis = memory.budget(exp).describe() + "\n" + speed.describe(exp)
        return SweepDone(frame, time.perf_counter() - began, basis=basis)
    except UserError as exc:
        return SweepDone(None, time.perf_counter() - began, str(exc))
    except Exception as exc:  # noqa: BLE001 - an engine bug is reported on screen, the app stays up
        return SweepDone(None, time.perf_counter() - began, f"sweep failed: {exc!r}")


def sweep_ahead(app: CharllmApp) -> None:
    """Sweep the app's composed experiment in a background thread; the Sweep screen takes the result
    when it opens on the same experiment (`app.swept_ahead`: (experiment TOML, SweepDone))."""
    exp = app.experiment.copy()
    key = exp.to_toml()

    def run() -> None:
        app.swept_ahead = (key, sweep_experiment(exp))

    app.run_worker(run, thread=True, group="sweep-ahead", exit_on_error=False)


def headroom_text(value: float | None, verdict: str | None, compact: bool = False) -> Text:
    """GiB to spare, coloured by the verdict; `compact` (the map) drops the decimal from 10 GiB on."""
    if value is None:
        return Text("·", "dim")
    assert verdict is not None          # a layout's headroom comes with its verdict
    style = "bold green" if verdict == FITS and value >= 8 * GIB else VERDICT_STYLE[verdict]
    gib = value / GIB
    return Text(f"{gib:+.0f}" if compact and abs(gib) >= 10 else f"{gib:+.1f}", style)


def cell_text(column: str, value) -> str | Text:
    """A sweep value as the table shows it."""
    if value is None:
        return "-"
    if column == "peak_bytes":
        return f"{value / GIB:.1f}" if value >= GIB else f"{value / GIB:.2f}"
    if isinstance(value, float) and value != value:      # NaN: the hardware gives no figure for it
        return "-"
    if column in ("mfu", "communication_share", "bubble_share"):
        return f"{value:.0%}"
    if column == "tokens_per_s":
        return f"{value:,.0f}"
    if column in ("step_s", "energy_per_token_j"):
        return f"{value:.3g}"
    if column == "power_w":
        return f"{value:.0f}"
    if column in ("params", "params_per_device"):
        return count(value)
    if column == "flops_per_iteration":
        return si(value, "FLOP")
    if column == "verdict":
        return Text(value, VERDICT_STYLE[value])
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


class SweepScreen(WorkbenchScreen):
    MODE = "sweep"
    AUTO_FOCUS = "#sweep-table"         # Space marks a layout there (on a dropdown it would open it)
    BINDINGS = [
        Binding("r", "run_sweep", "Run sweep", id="sweep.run"),
        Binding("s", "sort", "Sort by column", id="sweep.sort"),
        Binding("f", "toggle_fitting", "Fitting only", id="sweep.fitting"),
        Binding("m", "toggle_map", "Map", id="sweep.map"),
        Binding("space", "mark", "Mark", id="sweep.mark"),
        Binding("c", "campaign", "New campaign", id="sweep.campaign"),
    ]
    # Below this width the map is hidden at first (m shows it), so that the table's verdicts fit.
    MAP_MIN_WIDTH = 100

    def __init__(self):
        super().__init__()
        self.frame: pl.DataFrame | None = None    # the sweep's
        self.fitting_only = True
        self.sort_index = -1            # the entry of SORTS `s` chose last
        self.sort: tuple[str, bool] | None = None   # (column, descending) the table is sorted by; None: ranked
        self.swept_serial = None
        self.basis = ""
        self.table_frame: pl.DataFrame | None = None    # what the table lists (after the fitting-only filter), in order
        self.loaded = 0                 # rows of it added to the table so far
        self.columns = list(TABLE_COLUMNS)  # the columns the table shows
        self.same_everywhere = ""       # the hidden columns and their one value ("EP 1 · SP yes")
        self.map_chosen = False         # the user toggled the map: the width no longer decides
        self.marked: dict[tuple, dict] = {}  # the marked layouts (their sweep rows), in the order marked
        self.marked_for = None          # the experiment they are layouts of (its TOML)

    def compose_body(self) -> ComposeResult:
        with Vertical(id="sweep"):
            with Horizontal(id="sweep-controls"):
                yield Label("micro batch ")
                yield Select([], id="mbs", compact=True, allow_blank=True, prompt=ANY)
                yield Label("  recompute ")
                yield Select([], id="recompute", compact=True, allow_blank=True, prompt=ANY)
            yield Static(id="sweep-status")
            yield ProgressBar(id="sweep-progress", show_eta=False)
            with Horizontal():
                with Vertical(id="map-pane"):
                    yield Label("GiB to spare, TP×PP", classes="hint")
                    yield DataTable(id="feasibility", cursor_type="cell")
                yield DataTable(id="sweep-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#sweep-progress").display = False
        self.watch(self.query_one("#sweep-table", DataTable), "scroll_y", self._scrolled, init=False)

    def on_resize(self) -> None:
        if not self.map_chosen:
            self.query_one("#map-pane").display = self.size.width >= self.MAP_MIN_WIDTH

    def action_toggle_map(self) -> None:
        self.map_chosen = True
        pane = self.query_one("#map-pane")
        pane.display = not pane.display

    def set_columns(self) -> None:
        """Show the columns that tell this sweep's layouts apart; name the others' one value."""
        frame, self.columns, same = self.frame, [], []
        assert frame is not None        # the columns are set once a sweep is shown
        for column, heading in TABLE_COLUMNS.items():
            if column not in ALWAYS_SHOWN and frame.height and frame[column].n_unique() == 1:
                same.append(f"{heading} {cell_text(column, frame[column][0])}")
            else:
                self.columns.append(column)
        self.same_everywhere = " · ".join(same)
        table = self.query_one("#sweep-table", DataTable)
        table.clear(columns=True)
        for column in self.columns:
            table.add_column(TABLE_COLUMNS[column], key=column)

    def on_screen_resume(self) -> None:
        key = self._experiment_key()
        if self.swept_serial == key:
            return
        ahead = self.app.swept_ahead
        if ahead is not None and ahead[0] == key:
            self.swept_serial = key
            self.on_sweep_done(ahead[1])
        else:
            self.action_run_sweep()

    def _experiment_key(self) -> str:
        return self.app.experiment.to_toml()     # any change in Compose changes what the sweep plans

    # -- running --------------------------------------------------------------------------------
    def action_run_sweep(self) -> None:
        exp = self.app.experiment
        self.swept_serial = self._experiment_key()
        self.query_one("#sweep-status", Static).update(
            f"sweeping {exp.model.name} on {exp.cluster.nodes}×{exp.cluster.gpus_per_node} {exp.hardware.name}, "
            f"global batch {exp.training.global_batch_size}, seq {exp.seq_length}…")
        progress = self.query_one("#sweep-progress", ProgressBar)
        progress.update(total=None)
        progress.display = True
        self.run_sweep(exp.copy())

    @work(thread=True, exclusive=True, group="sweep")
    def run_sweep(self, exp: Experiment) -> None:
        self.post_message(sweep_experiment(exp))

    def on_sweep_done(self, message: SweepDone) -> None:
        self.query_one("#sweep-progress").display = False
        status = self.query_one("#sweep-status", Static)
        if message.error:
            status.update(f"[yellow]{message.error}[/]")
            return
        self.frame = message.frame
        assert self.frame is not None   # a sweep without an error has its frame
        self.basis = message.basis
        if self.marked_for != self.swept_serial:    # marks are layouts of the experiment swept before
            self.marked, self.marked_for = {}, self.swept_serial
        self.show_status()
        best = self.frame.row(0, named=True) if self.frame.height else {}
        with self.prevent(Select.Changed):
            for wid, column in FILTERS:
                values = sorted(self.frame[column].unique().to_list(), key=str) if self.frame.height else []
                select = self.query_one(f"#{wid}", Select)
                select.set_options([(str(v), v) for v in values])
                if column in best:      # the best layout's: layouts listed together can make a campaign
                    select.value = best[column]
        self.set_columns()
        self.redraw()

    def show_status(self) -> None:
        frame = self.frame
        assert frame is not None        # the status is of a sweep shown
        counts = frame["verdict"].value_counts() if frame.height else None
        count = {} if counts is None else dict(counts.iter_rows())
        listed = self.table_frame.height if self.table_frame is not None else frame.height
        shown = "fitting only, f: all" if self.fitting_only else "all, f: fitting only"
        if any(self.query_one(f"#{wid}", Select).value is not Select.NULL for wid, _ in FILTERS):
            shown += "; of the micro batch and recompute above"
        same = f"\nin every layout: {escape(self.same_everywhere)}" if self.same_everywhere else ""
        marked = f" · {len(self.marked)} marked, c: a campaign of them" if self.marked else " · space marks"
        order = f"sorted by {sort_text(self.sort)}" if self.sort else "ranked"
        self.query_one("#sweep-status", Static).update(
            f"{frame.height} valid layouts: [{VERDICT_STYLE[FITS]}]{count.get(FITS, 0)} fit[/], "
            f"[{VERDICT_STYLE[TIGHT]}]{count.get(TIGHT, 0)} tight[/] · "
            f"listing {listed} ({shown}), {order} · Enter loads one into "
            f"Compose · s sorts{marked}{same}\n[dim]{escape(self.basis)}[/]")

    @on(Select.Changed)
    def redraw(self) -> None:
        import polars as pl

        if self.frame is None:
            return
        frame = self.frame
        for wid, column in FILTERS:
            value = self.query_one(f"#{wid}", Select).value
            if value is not Select.NULL:
                frame = frame.filter(pl.col(column) == value)
        self.shown = frame
        # Map: rows PP, columns TP, the best headroom among layouts in the cell.
        fmap = self.query_one("#feasibility", DataTable)
        fmap.clear(columns=True)
        tps = sorted(self.frame["tensor_model_parallel_size"].unique().to_list())
        pps = sorted(self.frame["pipeline_model_parallel_size"].unique().to_list())
        best = {}
        if frame.height:
            best_first = frame.sort("headroom_bytes", descending=True)
            cells = best_first.group_by("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                        maintain_order=True).agg(pl.col("headroom_bytes").first(),
                                                                 pl.col("verdict").first())
            best = {(r[0], r[1]): (r[2], r[3]) for r in cells.iter_rows()}
        fmap.add_column("PP\\TP", key="pp")
        for tp in tps:
            fmap.add_column(f"TP{tp}", key=str(tp))
        for pp in pps:
            fmap.add_row(f"PP{pp}", *(headroom_text(*best.get((tp, pp), (None, None)), compact=True) for tp in tps),
                         key=str(pp))
        self.fill_table(frame)

    def fill_table(self, frame) -> None:
        """List `frame`'s layouts (the fitting ones only, unless `f` said all) in the order chosen."""
        import polars as pl

        self.query_one("#sweep-table", DataTable).clear()
        if self.fitting_only:
            frame = frame.filter(pl.col("fits"))
        if self.sort is not None:
            frame = frame.sort(self.sort[0], descending=self.sort[1], nulls_last=True)
        self.table_frame, self.loaded = frame, 0
        self.load_rows()
        self.show_status()

    def load_rows(self) -> None:
        """Add the next page of `table_frame` to the table."""
        table = self.query_one("#sweep-table", DataTable)
        start = self.loaded
        assert self.table_frame is not None     # rows are loaded once the table lists a sweep
        for i, row in enumerate(self.table_frame.slice(start, TABLE_PAGE).iter_rows(named=True), start):
            cells = [headroom_text(row[c], row["verdict"]) if c == "headroom_bytes" else
                     self._rank_text(row) if c == "rank" else cell_text(c, row[c]) for c in self.columns]
            table.add_row(*cells, key=str(i))
        self.loaded = table.row_count

    def _near_the_end(self, row: int) -> None:
        if self.table_frame is not None and self.loaded < self.table_frame.height and row >= self.loaded - 10:
            self.load_rows()

    def _scrolled(self, scroll_y: float) -> None:
        table = self.query_one("#sweep-table", DataTable)
        self._near_the_end(int(scroll_y) + table.size.height)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "sweep-table":
            self._near_the_end(event.cursor_row)

    def table_row(self, index: int) -> dict:
        """The sweep row shown at `index` in the table."""
        assert self.table_frame is not None     # a row is shown: the table lists a sweep
        return self.table_frame.row(index, named=True)

    # -- choosing ----------------------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "sweep-table":
            assert event.row_key.value is not None      # every row is added with its index as key
            self.pick(self.table_row(int(event.row_key.value)))

    def on_data_table_cell_selected(self, event: DataTable.CellSelected) -> None:
        import polars as pl

        if event.data_table.id != "feasibility" or event.cell_key.column_key.value == "pp":
            return
        tp_key, pp_key = event.cell_key.column_key.value, event.cell_key.row_key.value
        assert tp_key is not None and pp_key is not None    # the map's rows and columns are added with keys
        tp, pp = int(tp_key), int(pp_key)
        cell = self.shown.filter((pl.col("tensor_model_parallel_size") == tp)
                                 & (pl.col("pipeline_model_parallel_size") == pp))
        if not cell.height:
            self.notify(f"no valid layout with TP{tp} × PP{pp}", severity="warning")
            return
        self.pick(cell.sort("headroom_bytes", descending=True).row(0, named=True))

    def pick(self, row: dict) -> None:
        try:
            exp = sweep.layout_to_experiment(self.app.experiment, row)
        except UserError as exc:
            self.notify(str(exc), severity="error")
            return
        exp.name = edited_name(exp.name)
        self.app.use_experiment(exp)
        self.notify(f"loaded {exp.layout_label} mbs {row['micro_batch_size']} into Compose")

    def action_sort(self) -> None:
        """Cycle the sort key (clicking a heading sorts by that column)."""
        if self.frame is None:
            return
        self.sort_index = (self.sort_index + 1) % len(SORTS)
        self.sort = SORTS[self.sort_index]
        self.fill_table(self.shown)
        self.notify(f"sorted by {sort_text(self.sort)}", timeout=2)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """A heading sorts by its column; again, the other way round."""
        if event.data_table.id == "sweep-table":
            column = event.column_key.value
            assert column is not None       # every column is added with its name as key
            self.sort = (column, not self.sort[1] if self.sort and self.sort[0] == column else True)
            self.fill_table(self.shown)

    def action_toggle_fitting(self) -> None:
        self.fitting_only = not self.fitting_only
        if self.frame is not None:
            self.fill_table(self.shown)

    # -- marking layouts for a campaign -------------------------------------------------------------
    def _rank_text(self, row: dict) -> str | Text:
        return Text(f"●{row['rank']}", "bold cyan") if _layout_key(row) in self.marked else str(row["rank"])

    def action_mark(self) -> None:
        table = self.query_one("#sweep-table", DataTable)
        if self.table_frame is None or not table.row_count:
            return
        index = table.cursor_row
        row = self.table_row(index)
        key = _layout_key(row)
        if self.marked.pop(key, None) is None:
            self.marked[key] = row
        table.update_cell(str(index), "rank", self._rank_text(row), update_width=True)
        self.show_status()

    def action_campaign(self) -> None:
        """Write the marked layouts as a new campaign of the composed experiment, and show it."""
        if not self.marked:
            self.notify("mark layouts with Space first", severity="warning")
            return
        exp = self.app.experiment.copy()
        base = preset_name(exp)        # the preset it is, unchanged; else it is saved under the campaign's name
        try:
            layouts = [sweep.layout_to_experiment(exp, row) for row in self.marked.values()]
            campaigns.from_layouts(base or exp.name, exp, layouts)       # the layouts' own mistakes, first
        except UserError as exc:
            self.notify(str(exc), severity="error")
            return

        def check(name: str) -> None:
            campaigns.check_name(name)
            if name in campaigns.campaigns():
                raise UserError(f"campaign {name!r}: already exists; choose another name")
            if base is None:           # the composed experiment is saved as a preset of that name too
                catalog.new_user_preset("experiments", name)
                if catalog.is_user("experiments", name):
                    raise UserError(f"experiment preset {name!r}: yours already has that name; choose another")

        def taken(name: str) -> bool:
            try:
                check(name)
            except UserError:
                return True
            return False

        what = f"{len(layouts)} marked layout{'s' if len(layouts) > 1 else ''} of {exp.name}"

        def write(name: str | None) -> None:
            if name:
                self.write_campaign(name, exp, base, layouts, what)

        self.app.push_screen(AskName(f"A campaign of the {what}, named:" if base else
                                     f"A campaign of the {what} (saved as an experiment preset too), named:",
                                     free_name(f"{exp.name.removesuffix('-edited')}-layouts", taken), check),
                             write)

    def write_campaign(self, name: str, exp: Experiment, base: str | None, layouts: list, what: str) -> None:
        saved = None
        try:
            if base is None:
                exp.name = base = name
                saved = catalog.new_user_preset("experiments", name)
                exp.save(saved)
            path = campaigns.save_new(name, campaigns.from_layouts(base, exp, layouts, f"the {what}, from Sweep"))
        except (UserError, OSError) as exc:
            if saved is not None:      # nothing half-written: no experiment without its campaign
                saved.unlink(missing_ok=True)
            self.notify(f"campaign {name!r}: {exc}", severity="error")
            return
        self.notify(f"wrote campaign {name} to {path}" + (f" and experiment preset {name} to {saved}" if saved else ""))
        self.app.show_campaign(name)


def sort_text(sort: tuple[str, bool]) -> str:
    column, descending = sort
    return f"{TABLE_COLUMNS[column]}{' (descending)' if descending else ''}"


def _layout_key(row: dict) -> tuple:
    """What tells one sweep row's layout from another's."""
    return tuple(row[c] for c in sweep.COLUMNS)


def preset_name(exp: Experiment) -> str | None:
    """The name of the experiment preset `exp` is, unchanged (None: it is not a preset as it stands)."""
    if exp.name not in catalog.entries("experiments"):
        return None
    try:
        return exp.name if Experiment.load(exp.name).to_dict() == exp.to_dict() else None
    except UserError:
        return None
