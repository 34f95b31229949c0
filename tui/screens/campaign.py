"""Campaign: many experiments as one job (engine.campaign): every campaign with its progress, the
chosen one's members, live, and its figures.

The list holds the campaigns shipped, the user's, and those with a record in the runs directory.
While the screen is shown, a thread worker (`CampaignScreen.poll`) reads them about once a second,
each record through `queue.refresh` as `campaign status` does, and posts what changed; the UI thread
only draws. The chosen campaign's members show their status and their run (a campaign that has not
run shows its plan, each member's verdict; `p` shows the plan of one that has). Enter opens a
member's run on Live, `o` on Runs. `g` shows the report's figures in turn: the values
`engine.campaign.report.figure` gives (parallelism, optimization, micro batch, heatmap, kernels),
drawn by the code that draws `campaign report` in the terminal (tui/figures.py), here with
textual-plotext (a heatmap is its grid of shades), then the findings (`campaign report --findings`);
`m` picks the metric, `n` normalises the optimization figure per model. `r` runs the campaign
(resumes one that ran: its members without a completed run), `c` cancels it; both ask first.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from rich.markup import escape
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Static
from textual.worker import get_current_worker

from charllm.engine.campaign import queue, spec, state
from charllm.engine.campaign.findings import describe, findings
from charllm.engine.campaign.report import DEFAULT_METRIC, KINDS, Figure, figure
from charllm.engine.campaign.summary import FIGURES
from charllm.engine.launch.targets import get_target
from charllm.engine.model.memory import VERDICT_STYLE
from charllm.probes.analysis.render import metric_label
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError
from charllm.tui.commands.campaign import queued_line
from charllm.tui.figures import heatmap_text, no_values, tick_key
from charllm.tui.screens.base import WorkbenchScreen, shortest_key
from charllm.tui.screens.dialogs import Confirm
from charllm.tui.screens.runs import STATUS_STYLE
from charllm.tui.widgets.charts import FigurePanel

POLL_S = 1.0
FINDINGS = "findings"           # after the figures, `g` shows the findings (engine.campaign.findings)
MIN_PANEL_ROWS = 12            # a figure panel shorter than this scrolls instead
STYLE = {**STATUS_STYLE, **VERDICT_STYLE, state.QUEUED: "dim", state.SKIPPED: "yellow", state.INVALID: "red",
         state.MISSING: "bold red", state.DAMAGED: "bold red", state.REFUSED: "red"}
# `m` steps through these: the paper's six at once (parallelism only), then each figure of a summary row.
METRICS = tuple(m for m in FIGURES if m not in ("gpus", "simulated"))
LIST_COLUMNS = {"campaign": "campaign", "members": "members", "progress": "progress"}
MEMBER_COLUMNS = {"index": "#", "name": "member", "layout": "layout", "status": "status", "note": "note"}
# The keys line under the members: (binding id, what it does), with the keys the user's [keymap] gives them.
KEYS_LINE = (("campaign.live", "Live"), ("campaign.runs", "Runs"), ("campaign.figure", "figures"),
             ("campaign.metric", "metric"), ("campaign.normalize", "normalise"), ("campaign.plan", "plan"),
             ("campaign.run", "run"), ("campaign.cancel", "cancel"))


@dataclass(frozen=True)
class Wanted:
    """What the screen shows now, which the poller reads: a campaign, its plan or record, a figure."""

    name: str | None = None
    plan: bool = False                  # its plan, though it has a record
    kind: str | None = None             # a figure kind, or None: the members
    metric: str | None = None
    normalize: bool = False
    serial: int = 0                     # bumped by every change: what is posted for an older one is dropped


@dataclass
class Listed(Message):
    rows: list[tuple[str, str, str]]    # campaign, members, progress


@dataclass
class Shown(Message):
    """The chosen campaign as the poller read it."""

    serial: int                         # of the Wanted it answers
    name: str
    plan: bool                          # rows are its plan (it has no record, or `p`)
    description: str = ""
    progress: str = ""
    status: str | None = None           # its record's status; None: it has not run
    has_file: bool = True               # a campaign file to run (an imported or deleted one has none)
    target: str = "local"               # where `r` runs it
    max_parallel: int = 1
    runnable: int = 0
    rows: list[tuple] = field(default_factory=list)   # (index, name, layout, status, note, run)
    error: str = ""


@dataclass
class Drawn(Message):
    wanted: Wanted
    figure: Figure | None
    error: str = ""
    text: str = ""                      # the findings, where they were asked for


class CampaignScreen(WorkbenchScreen):
    MODE = "campaign"
    AUTO_FOCUS = "#campaign-list"
    BINDINGS = [
        Binding("enter", "open", "Open in Live", id="campaign.live", show=False),
        Binding("o", "open_in_runs", "Show in Runs", id="campaign.runs"),
        Binding("g", "next_figure", "Figures", id="campaign.figure"),
        Binding("m", "next_metric", "Metric", id="campaign.metric", show=False),
        Binding("n", "normalize", "Normalise", id="campaign.normalize", show=False),
        Binding("p", "plan", "Plan", id="campaign.plan", show=False),
        Binding("r", "run", "Run", id="campaign.run"),
        Binding("c", "cancel", "Cancel", id="campaign.cancel"),
    ]

    def __init__(self):
        super().__init__()
        self.wanted = Wanted()
        self.shown: Shown | None = None          # the chosen campaign, as last read
        self.drawn: Drawn | None = None          # the figure on screen
        self.metrics: dict[str | None, str | None] = {kind: DEFAULT_METRIC.get(kind) for kind in KINDS}
        self.wake = threading.Event()            # set: the poller reads again now

    def compose_body(self) -> ComposeResult:
        with Vertical(id="campaign"):
            yield DataTable(id="campaign-list", cursor_type="row")
            yield Static(id="campaign-status")
            yield DataTable(id="campaign-members", cursor_type="row", zebra_stripes=True)
            yield Static(id="campaign-detail", classes="hint")
            with Vertical(id="campaign-figure"):
                yield Static(id="figure-head")
                yield VerticalScroll(id="figure-panels")
                with VerticalScroll(id="figure-below"):
                    yield Static(id="figure-text")
            yield Static(id="campaign-keys", classes="hint")

    def on_mount(self) -> None:
        for table, columns in (("#campaign-list", LIST_COLUMNS), ("#campaign-members", MEMBER_COLUMNS)):
            for key, heading in columns.items():
                self.query_one(table, DataTable).add_column(heading, key=key)
        self.query_one("#campaign-figure").display = False
        bindings = {b.id: b for b in self.BINDINGS if isinstance(b, Binding)}
        self.query_one("#campaign-keys", Static).update(
            " · ".join(f"{shortest_key(self.app, bindings[bid])} {what}" for bid, what in KEYS_LINE))

    def on_screen_resume(self) -> None:
        if self.app.campaign_name and self.app.campaign_name != self.wanted.name:
            self.select(self.app.campaign_name)
        self.poll()

    def on_screen_suspend(self) -> None:
        self.workers.cancel_group(self, "campaign-poll")
        self.wake.set()

    def want(self, **changes) -> None:
        """Change what is shown, and have the poller read it at once."""
        self.wanted = Wanted(**{**self.wanted.__dict__, **changes, "serial": self.wanted.serial + 1})
        self.wake.set()

    # -- reading (worker thread) -----------------------------------------------------------------
    @work(thread=True, exclusive=True, group="campaign-poll")
    def poll(self) -> None:
        worker = get_current_worker()
        files: dict[str, tuple] = {}         # name -> (mtime, campaign or error, members or error)
        plans: dict[str, tuple] = {}         # name -> (mtime, plans or error)
        posted: dict[str, object] = {}       # what was posted last, by message kind
        first = True
        while not worker.is_cancelled:
            self.wake.clear()
            wanted = self.wanted
            try:
                self._read(wanted, files, plans, posted, count_all=not first)
                first = False
            except Exception as exc:  # noqa: BLE001 - shown on screen; the poller goes on
                self.post_message(Shown(wanted.serial, wanted.name or "", False,
                                        error=f"reading campaigns failed: {exc!r}"))
            self.wake.wait(POLL_S)

    def _read(self, wanted: Wanted, files: dict, plans: dict, posted: dict, count_all: bool = True) -> None:
        """One pass: the list (with the member counts known so far), the chosen campaign, its figure,
        then, with `count_all`, the list again with every count. Expanding all the shipped campaigns'
        members takes a few hundred milliseconds of CPU, which the UI thread would share while it
        draws the chosen one's members: the first pass leaves it to the next, and a choice made
        meanwhile stops it."""
        catalog, recorded = spec.campaigns(), set(state.recorded())
        records: dict[str, state.Record | str] = {}
        for name in sorted(recorded):
            try:
                records[name] = queue.refresh(state.Record.load(name))
            except UserError as exc:
                records[name] = f"damaged: {exc}"
        names = sorted(set(catalog) | recorded)
        self._post(posted, "listed", Listed([_row(name, catalog, files, records, read=False) for name in names]))
        if wanted.name is not None:
            record = records.get(wanted.name)
            record = record if isinstance(record, state.Record) else None
            self._post(posted, "shown", self._shown(wanted, catalog, files, plans, record))
            if wanted.kind is not None:
                key = (wanted, record and [(m["status"], m.get("run")) for m in record.members])
                if key != posted.get("drawn"):
                    posted["drawn"] = key
                    self.post_message(_draw(wanted, record))
        if count_all:
            self._post(posted, "listed", Listed([_row(name, catalog, files, records, read=not self.wake.is_set())
                                                 for name in names]))

    def _post(self, posted: dict, kind: str, message: Message) -> None:
        """Post `message` unless it says what the last one of its kind said."""
        if message != posted.get(kind):
            posted[kind] = message
            self.post_message(message)

    def _shown(self, wanted: Wanted, catalog: dict, files: dict, plans: dict, record) -> Shown:
        name = wanted.name
        assert name is not None             # _read asks only for a chosen campaign
        campaign, members = _campaign(name, catalog, files) if name in catalog else (None, None)
        out = Shown(wanted.serial, name, plan=record is None or wanted.plan)
        if isinstance(campaign, spec.Campaign):
            out.description = campaign.description
            out.target = campaign.target or "local"
            out.max_parallel = campaign.max_parallel
        elif name in catalog:
            out.error = str(campaign)
        else:
            out.has_file = False
            out.description = (record.data.get("description") if record else "") or "its campaign file is gone"
        if not out.plan:
            out.progress, out.status = record.progress(), record.data.get("status")
            for m in record.members:
                status = state.member_status(record, m)
                out.rows.append((m["index"] + 1, m["name"], m.get("layout") or "", status, state.member_note(m, status),
                                 m.get("run")))
            return out
        if record is not None:
            out.status = record.data.get("status")
        if not isinstance(members, list):
            out.error = out.error or (str(members) if members else "no campaign file: nothing to plan")
            return out
        mtime, planned = plans.get(name, (None, None))
        if mtime != files[name][0]:
            try:
                planned = campaign.plan()
            except UserError as exc:
                planned = str(exc)
            plans[name] = (files[name][0], planned)
        if isinstance(planned, str):
            out.error = planned
            return out
        out.progress = f"plan: {spec.describe(planned)}"
        out.runnable = sum(p.runnable for p in planned)
        out.rows = [(p.member.index + 1, p.member.experiment.name, p.member.layout_label, p.verdict,
                     p.reason, None) for p in planned]
        return out

    # -- drawing (UI thread) ---------------------------------------------------------------------
    def on_listed(self, message: Listed) -> None:
        table = self.query_one("#campaign-list", DataTable)
        with self.prevent(DataTable.RowHighlighted):      # a new row under the cursor chooses nothing
            _sync(table, [(name, (name, count, progress)) for name, count, progress in message.rows])
            if self.wanted.name is not None and self.wanted.name in table.rows:
                table.move_cursor(row=table.get_row_index(self.wanted.name))
        if self.wanted.name is None and message.rows:
            self.select(message.rows[0][0])

    def select(self, name: str) -> None:
        """Show campaign `name`'s members (its record, else its plan)."""
        self.app.campaign_name = name
        if name == self.wanted.name:
            return
        self.shown = None
        self.query_one("#campaign-members", DataTable).clear()
        self.query_one("#campaign-status", Static).update(f"[b]{escape(name)}[/b] · reading…")
        self.query_one("#campaign-detail", Static).update("")
        self.want(name=name, plan=False)
        table = self.query_one("#campaign-list", DataTable)
        if name in table.rows:
            table.move_cursor(row=table.get_row_index(name))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "campaign-list" and event.row_key is not None and event.row_key.value is not None:
            self.select(event.row_key.value)
        elif event.data_table.id == "campaign-members":
            self._show_detail()

    def on_shown(self, message: Shown) -> None:
        if message.serial != self.wanted.serial:
            return
        self.shown = message
        lines = [
            f"[b]{escape(message.name)}[/b]" + (f" · {escape(message.description)}" if message.description else "")
        ]
        if message.error:
            lines.append(f"[yellow]{escape(message.error)}[/]")
        elif message.plan and message.status is None:
            lines.append(f"{escape(message.progress)} · not run: r runs it on {escape(message.target)}, at most "
                         f"{message.max_parallel} at once")
        elif message.plan:
            lines.append(f"{escape(message.progress)} · p: its record")
        else:
            lines.append(escape(message.progress))
        self.query_one("#campaign-status", Static).update("\n".join(lines))
        _sync(self.query_one("#campaign-members", DataTable),
              [(str(index), (str(index), name, layout, Text(status, STYLE.get(status, "")), note))
               for index, name, layout, status, note, _ in message.rows])
        self._show_detail()

    def _show_detail(self) -> None:
        member = self.current_member()
        detail = self.query_one("#campaign-detail", Static)
        if member is None:
            detail.update("")
            return
        index, name, _, status, note, run = member
        where = f"run {run}" if run else "no run"
        detail.update(f"[b]{index}[/b] {escape(name)} · {escape(where)}" + (f"\n{escape(note)}" if note else ""))

    def current_member(self) -> tuple | None:
        table = self.query_one("#campaign-members", DataTable)
        if self.shown is None or not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next((row for row in self.shown.rows if str(row[0]) == key), None)

    # -- figures -----------------------------------------------------------------------------------
    def action_next_figure(self) -> None:
        """The members, then each figure kind in turn, then the members again."""
        kinds = (None, *KINDS, FINDINGS)
        kind = kinds[(kinds.index(self.wanted.kind) + 1) % len(kinds)]
        self.want(kind=kind, metric=self.metrics.get(kind))
        self._show_view()

    def action_next_metric(self) -> None:
        if self.wanted.kind is None:
            self.notify("g shows a figure first; m then picks its metric", timeout=3)
            return
        if self.wanted.kind == "kernels":
            self.notify("the kernels figure has a panel for each kernel category, and no metric", timeout=3)
            return
        if self.wanted.kind == FINDINGS:
            self.notify("the findings say every figure the runs have, and take no metric", timeout=3)
            return
        choices = ((None,) if self.wanted.kind == "parallelism" else ()) + METRICS
        current = self.wanted.metric if self.wanted.metric in choices else choices[0]
        metric = choices[(choices.index(current) + 1) % len(choices)]
        self.metrics[self.wanted.kind] = metric
        self.want(metric=metric)
        self._figure_head()

    def action_normalize(self) -> None:
        self.want(normalize=not self.wanted.normalize)
        self._figure_head()

    def _show_view(self) -> None:
        figure_view = self.wanted.kind is not None
        for wid in ("#campaign-list", "#campaign-members", "#campaign-detail"):  # the figure takes their room
            self.query_one(wid).display = not figure_view
        self.query_one("#campaign-figure").display = figure_view
        if figure_view:
            self._figure_head()

    def _figure_head(self, fig: Figure | None = None) -> None:
        w = self.wanted
        if w.kind == "kernels":
            parts = [f"[b]{w.kind}[/b] · each kernel category's share of the profiled step"]
        elif w.kind == FINDINGS:
            parts = [f"[b]{w.kind}[/b] · what the runs show, each between members alike but for one thing "
                     "(campaign report --findings)"]
        else:
            metric = "the paper's six" if w.kind == "parallelism" and w.metric is None else metric_label(w.metric or "")
            parts = [f"[b]{w.kind}[/b] · {escape(metric)} (m: next)"]
        if w.kind == "optimization":
            parts.append("normalised per model (n: off)" if w.normalize else "n: normalise per model")
        parts.append("g: next figure")
        lines = [" · ".join(parts)]
        if fig is not None:
            lines.append(f"[dim]{escape(fig.title)} · window: {escape(fig.window)}[/]")
        self.query_one("#figure-head", Static).update("\n".join(lines))

    def on_drawn(self, message: Drawn) -> None:
        if message.wanted != self.wanted:
            return
        self.drawn = message
        panels = self.query_one("#figure-panels", VerticalScroll)
        panels.remove_children()
        text = self.query_one("#figure-text", Static)
        fig = message.figure
        self._figure_head(fig)
        if fig is None:
            text.update(Text(message.text) if message.text else f"[yellow]{escape(message.error)}[/]")
            panels.display = False
            self.query_one("#campaign-figure").set_class(True, "-text-only")
            return
        below = []
        if fig.kind == "heatmap":
            below.append(heatmap_text(fig))
        else:
            panels.mount_all([FigurePanel(panel, fig.x_axis) for panel in fig.panels])
            for say in (tick_key, no_values):     # a line all panels share is said once
                lines = {panel.title: say(panel) for panel in fig.panels}
                if len(set(lines.values())) == 1:
                    below += [line for line in lines.values()][:1]
                else:
                    below += [f"{title}: {line}" for title, line in lines.items() if line]
            below = [line for line in below if line]
        below += [f"note: {n}" for n in fig.notes]
        panels.display = fig.kind != "heatmap" and bool(fig.panels)
        self.query_one("#campaign-figure").set_class(not panels.display, "-text-only")
        text.update(Text("\n".join(below)))
        self._layout_panels()

    def on_resize(self) -> None:
        self._layout_panels()

    def _layout_panels(self) -> None:
        """Panels side by side in two columns where the screen is wide; each at least MIN_PANEL_ROWS
        high (the panels scroll when there is no room for that)."""
        panels = self.query_one("#figure-panels", VerticalScroll)
        count = len(panels.children)
        if not count:
            return
        columns = 2 if count > 1 and self.size.width >= 120 else 1
        rows = math.ceil(count / columns)
        # from the screen's height, not the pane's: the pane's is 0 or stale until its own layout, and
        # a choice made from it differed with when that came (the same 80x24 screen drew two ways)
        room = max(MIN_PANEL_ROWS, self.size.height - 12)
        panels.styles.grid_size_columns = columns
        panels.styles.grid_rows = "1fr" if room // rows >= MIN_PANEL_ROWS else str(MIN_PANEL_ROWS)

    # -- acting on a member ------------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "campaign-list":
            self.query_one("#campaign-members", DataTable).focus()
        else:
            self.action_open()

    def _member_run(self) -> str | None:
        member = self.current_member()
        if member is None:
            return None
        if not member[5]:
            self.notify(f"member {member[0]} ({member[1]}) has no run: {member[3]}", severity="warning")
            return None
        return member[5]

    def action_open(self) -> None:
        if self.focused is self.query_one("#campaign-list", DataTable):
            self.query_one("#campaign-members", DataTable).focus()
            return
        run = self._member_run()
        if run:
            self.app.open_run(paths.runs_dir() / run)

    def action_open_in_runs(self) -> None:
        run = self._member_run()
        if run:
            self.app.show_in_runs(run)

    def action_plan(self) -> None:
        shown = self.shown
        if shown is not None and shown.status is None:
            self.notify(f"campaign {shown.name} has not run: its plan is what is shown", timeout=3)
            return
        self.want(plan=not self.wanted.plan)

    # -- running -----------------------------------------------------------------------------------
    def action_run(self) -> None:
        shown = self.shown
        if shown is None:
            return
        if shown.status in ("pending", "running"):
            self.notify(f"campaign {shown.name} is {shown.status}; c cancels it", severity="warning")
            return
        if shown.error or not shown.has_file:
            self.notify(f"campaign {shown.name}: {shown.error or 'no campaign file to run (imported, or deleted)'}",
                        severity="error")
            return
        resume = shown.status is not None
        question = (f"Resume campaign {shown.name} on {shown.target}: run its members that have no completed run, "
                    f"at most {shown.max_parallel} at once?" if resume else
                    f"Run campaign {shown.name} on {shown.target}: {shown.runnable} of {len(shown.rows)} members, "
                    f"at most {shown.max_parallel} at once?")
        def start(yes: bool | None) -> None:
            if yes:
                self.start_campaign(shown.name, shown.target, resume)

        self.app.push_screen(Confirm(question), start)

    @work(thread=True, group="campaign-start")
    def start_campaign(self, name: str, target_name: str, resume: bool) -> None:
        """`charllm-tui campaign run NAME [--resume] --detach`: plan, record, hand the queue over."""
        try:
            target = get_target(target_name)
            record = queue.start(spec.Campaign.load(name), target, resume=resume)
            self.app.call_from_thread(self.notify, queued_line(record, target.name))
        except UserError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="error")
        self.wake.set()

    def action_cancel(self) -> None:
        shown = self.shown
        if shown is None:
            return
        if shown.status not in ("pending", "running"):
            self.notify(f"campaign {shown.name} is not running", severity="warning")
            return
        def cancel(yes: bool | None) -> None:
            if yes:
                self.cancel_campaign(shown.name)

        self.app.push_screen(Confirm(f"Cancel campaign {shown.name}: stop every member that runs, and its queue?"),
                             cancel)

    @work(thread=True, group="campaign-cancel")
    def cancel_campaign(self, name: str) -> None:
        self.app.call_from_thread(self.notify, f"campaign {name}: cancelling…")
        try:
            self.app.call_from_thread(self.notify, queue.cancel(name).progress())
        except UserError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="error")
        self.wake.set()


def _campaign(name: str, catalog: dict, files: dict, read: bool = True) -> tuple:
    """(campaign or the error reading it, its members or the error expanding them), read again only
    when its file changes; (None, None) for a campaign whose file is gone, and, with `read` false,
    for one not read yet."""
    if name not in catalog:
        return None, None
    try:
        mtime = catalog[name].stat().st_mtime_ns
    except OSError as exc:
        return str(exc), None
    if files.get(name, (None,))[0] != mtime:
        if not read:
            return None, None
        try:
            campaign = spec.Campaign.load(name)
        except UserError as exc:
            files[name] = (mtime, str(exc), None)
        else:
            try:
                files[name] = (mtime, campaign, campaign.members())
            except UserError as exc:
                files[name] = (mtime, campaign, str(exc))
    return files[name][1], files[name][2]


def _row(name: str, catalog: dict, files: dict, records: dict, read: bool = True) -> tuple[str, str, str]:
    """A campaign's row in the list: its name, members and progress ("…" for a count not read yet)."""
    campaign, members = _campaign(name, catalog, files, read)
    record = records.get(name)
    progress = "not run" if record is None else record if isinstance(record, str) else \
        record.progress().split(": ", 1)[1]
    if isinstance(members, list):
        count = str(len(members))
    elif name not in catalog:                # imported, or its file deleted: its record's count
        count = str(len(record.members)) if isinstance(record, state.Record) else "-"
    else:
        count = "…" if campaign is None else "-"
    if isinstance(campaign, str):
        progress = f"invalid: {campaign}"
    return name, count, progress


def _draw(wanted: Wanted, record) -> Drawn:
    """The figure `wanted` asks for, as `campaign report` computes it."""
    assert wanted.kind is not None          # _read draws only a figure kind
    if record is None:
        return Drawn(wanted, None, f"campaign {wanted.name} has not run: no figure yet (r runs it)")
    try:
        if wanted.kind == FINDINGS:
            return Drawn(wanted, None, text="\n".join(describe(record, findings(record))))
        return Drawn(wanted, figure(record, wanted.kind, wanted.metric, wanted.normalize))
    except UserError as exc:
        return Drawn(wanted, None, str(exc))


def _sync(table: DataTable, rows: list[tuple[str, tuple]]) -> None:
    """Make `table` hold `rows` ((key, cells) in order), changing only the cells that differ when its
    rows are the same ones (the cursor and scroll stay); a column widens to a longer cell ("completed"
    where "queued" was: it showed "comple"). A string is shown as written, never read as markup (a
    campaign file's values and descriptions are the user's: `[/]` is text)."""
    rows = [(key, tuple(Text(c) if isinstance(c, str) else c for c in cells)) for key, cells in rows]
    keys = [key for key, _ in rows]
    if [k.value for k in table.rows] == keys:
        columns = list(table.columns)
        for key, cells in rows:
            for column, cell in zip(columns, cells):
                if table.get_cell(key, column) != cell:
                    table.update_cell(key, column, cell, update_width=True)
        return
    cursor = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value if table.row_count else None
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    if cursor in keys:
        table.move_cursor(row=keys.index(cursor))
