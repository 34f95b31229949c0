"""Runs: every run directory with status, target, experiment and headline numbers.

The list comes from `probes.store.rundir.list_runs`; the headline numbers from `probes.analysis.summary.summarize`
(by="run"), in a thread worker: first every summary kept in the run directories (a Parquet read
each), then the others, top row first; each row is filled in as its numbers arrive, and keeps
them across refreshes. While the screen is shown the runs are read again every few seconds
(`RunsScreen.watch_runs`): a new run, or one that finished, shows without a key. `/` searches the rows'
text, `f` shows one status only, `s` (or a click on a heading) sorts by another column; newest first
until then. `c` cancels the run meant (the one under the cursor when it runs, else the only one
running), once asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Input, Static
from textual.worker import get_current_worker

from charllm.engine.launch import launcher
from charllm.probes.analysis import baselines, summary
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import local_time
from charllm.probes.store.rundir import Manifest, RunDir, command_line, list_runs, ran_line, run_id_name
from charllm.tui.commands.runs import HEADLINE, WINDOW, WINDOW_TEXT
from charllm.tui.screens.base import WorkbenchScreen, shortest_key
from charllm.tui.screens.dialogs import AskName, Confirm, free_name

WATCH_S = 2.0          # how often the runs are read again while the screen is shown
STATUS_STYLE = {"running": "bold green", "pending": "yellow", "completed": "", "failed": "bold red",
                "cancelled": "magenta", "unknown": "yellow"}
COLUMNS = ("run", "status", *(h for h, _ in HEADLINE.values()), "target", "experiment", "started")
# The keys the footer has no room for at 80 columns first; this line stays under the run's details.
# Groups of (binding id, what it does), shown with the keys the user's [keymap] gives them.
KEYS_LINE = ((("runs.baseline", "save as baseline"),), (("runs.search", "search"), ("runs.filter", "status"),
                                                          ("runs.sort", "sort")),
             (("runs.mark", "mark"), ("runs.compare", "compare")), (("runs.open", "open"),),
             (("runs.cancel", "cancel"),), (("runs.delete", "delete"),))
# `f` shows the runs of one status: all, then each of these in turn.
STATUS_FILTERS = (None, "running", "completed", "failed", "cancelled")
# `s` sorts by each of these in turn: column -> (the order in words, whether larger values come first).
# A run without the figure sorts last; newest first is the list as it opens.
SORTS = {"started": ("newest first", True), "tokens/s": ("fastest first", True), "J/token": ("least first", False),
         "peak W": ("highest first", True), "peak °C": ("hottest first", True), "status": ("a-z", False),
         "experiment": ("a-z", False), "run": ("a-z", False)}


@dataclass
class Headline(Message):
    run_id: str
    values: dict            # summary column -> value; empty when there is nothing to summarize
    note: str = ""


@dataclass
class Relisted(Message):
    """The runs as the watcher read them, when any was added, deleted or changed status."""

    runs: dict[str, Path]
    manifests: dict[str, Manifest]


def read_runs(known: dict[str, Manifest] | None = None) -> tuple[dict[str, Path], dict[str, Manifest]]:
    """Every run directory, newest first, and its manifest (a run whose supervisor died is finished
    first); a finished run's manifest in `known` is taken as it is."""
    runs, manifests = {}, {}
    for rd in reversed(list_runs()):        # newest first
        if known and rd.id in known and known[rd.id].final:
            m = known[rd.id]
        else:
            try:
                launcher.reconcile(rd)   # a run whose supervisor died is finished now
                m = rd.manifest()
            except UserError:                       # a damaged manifest costs only its own row
                m = Manifest(status="damaged")
        runs[rd.id] = rd.path
        manifests[rd.id] = m
    return runs, manifests


def headline(run_id: str, path: Path) -> Headline:
    """A run's headline figures, summarized now (`charllm-tui runs list`'s), or why there are none."""
    try:
        return Headline(run_id, summary.summarize(path, window=WINDOW, by="run").row(0, named=True))
    except UserError as exc:
        return Headline(run_id, {}, str(exc))
    except Exception as exc:  # noqa: BLE001 - one unreadable run must not hide the others
        return Headline(run_id, {}, f"summary failed: {exc!r}")


class RunsScreen(WorkbenchScreen):
    MODE = "runs"
    AUTO_FOCUS = "#runs-table"                  # not the search box, hidden until /
    BINDINGS = [
        Binding("enter", "open", "Open", id="runs.open"),
        Binding("space", "mark", "Mark", id="runs.mark"),
        Binding("m", "compare", "Compare marked", id="runs.compare"),
        Binding("c", "cancel_run", "Cancel run", id="runs.cancel"),
        # on the keys line (KEYS_LINE): the 80-column footer is full
        Binding("b", "save_baseline", "Save as baseline", id="runs.baseline", show=False),
        Binding("d,delete", "delete", "Delete", id="runs.delete"),   # d first: the footer shows it
        Binding("r", "refresh", "Refresh", id="runs.refresh"),
        Binding("slash", "search", "Search", id="runs.search", show=False),
        Binding("f", "filter", "Status filter", id="runs.filter", show=False),
        Binding("s", "sort", "Sort", id="runs.sort", show=False),
    ]

    def __init__(self):
        super().__init__()
        self.runs: dict[str, Path] = {}
        self.marked: list[str] = []
        self.notes: dict[str, str] = {}
        self.shown: dict[str, dict] = {}        # run id -> the headline values last shown
        self.manifests: dict[str, Manifest] = {}
        self.search = ""                        # rows whose text holds this (any case)
        self.status_filter: str | None = None   # only runs of this status
        self.sort_by = "started"

    def compose_body(self) -> ComposeResult:
        search = Input(id="runs-search", placeholder="search runs: id, experiment, target, status (Esc clears)",
                       compact=True)
        search.display = False                  # shown by /
        yield search
        yield Static(id="runs-view", classes="hint")
        yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="runs-detail", classes="hint")
        yield Static(id="runs-keys", classes="hint")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for name in COLUMNS:
            table.add_column(name, key=name)
        self.query_one("#runs-keys", Static).update(self.keys_text())

    def keys_text(self) -> str:
        """KEYS_LINE with the keys bound now (a [keymap] in tui.toml moves them), as the footer has them."""
        bindings = {b.id: b for b in self.BINDINGS if isinstance(b, Binding)}
        return " · ".join(", ".join(f"{shortest_key(self.app, bindings[bid])} {what}" for bid, what in group)
                          for group in KEYS_LINE)

    def on_screen_resume(self) -> None:
        self.action_refresh(newest_first=True)
        self.watch_runs()

    def on_screen_suspend(self) -> None:
        self.workers.cancel_group(self, "runs-watch")

    # -- listing -----------------------------------------------------------------------------
    def action_refresh(self, newest_first: bool = False) -> None:
        """Read every run's manifest again, then show them (searched, filtered and sorted); with
        `newest_first`, a run new since the list was last read gets the cursor (the one just launched)."""
        before = set(self.runs)
        self.runs, self.manifests = read_runs()
        new = [run_id for run_id in self.runs if run_id not in before] if before and newest_first else []
        self._fill()
        self._focus_asked_for(new[0] if new else None)
        self.headlines(list(self.runs.items()))

    @work(thread=True, exclusive=True, group="runs-watch")
    def watch_runs(self) -> None:
        """While the screen is shown, read the runs again every WATCH_S: a new or deleted run, or one whose
        status changed (a run that finished), is shown within seconds, and a finished run's figures are
        summarized again. Finished runs' manifests are not read again (their status is final)."""
        worker = get_current_worker()
        known = dict(self.manifests)
        while True:
            waited = time.monotonic() + WATCH_S
            while time.monotonic() < waited:
                if worker.is_cancelled:
                    return
                time.sleep(0.1)
            runs, manifests = read_runs(known)
            changed = [run_id for run_id, m in manifests.items()
                       if run_id not in known or m.status_line != known[run_id].status_line]
            if changed or set(manifests) != set(known):
                self.post_message(Relisted(runs, manifests))
                for run_id in changed:          # a new run's figures so far; a finished run's, whole
                    if (run_id not in known or manifests[run_id].final) and not worker.is_cancelled:
                        self.post_message(headline(run_id, runs[run_id]))
            known = manifests

    def on_relisted(self, message: Relisted) -> None:
        self.runs, self.manifests = message.runs, message.manifests
        self._fill()

    def _focus_asked_for(self, new_run: str | None = None) -> None:
        """Put the cursor on the run another screen asked to show (app.runs_focus: a campaign's
        member), else on `new_run`, clearing the search and the status filter if they hide it."""
        run_id, self.app.runs_focus = self.app.runs_focus or new_run, None
        if run_id not in self.runs:
            return
        table = self.query_one(DataTable)
        if run_id not in table.rows:
            self.search, self.status_filter = "", None
            self.query_one("#runs-search", Input).value = ""
            self._fill()
        table.move_cursor(row=table.get_row_index(run_id))
        table.focus()

    def _fill(self) -> None:
        """The rows that pass the search and the status filter, in the chosen order."""
        table = self.query_one(DataTable)
        cursor = self.current_run()
        table.clear()
        for run_id, m in self.manifests.items():
            if self._passes(run_id, m):
                table.add_row(self._mark(run_id), Text(m.status_line, STATUS_STYLE.get(m.status, "")),
                              *self._headline_cells(self.shown.get(run_id)),
                              m.target_name, m.name or "-",
                              local_time(m.started_ns or m.created_ns, "%Y-%m-%d %H:%M"),
                              key=run_id)
        self._sort()
        if cursor is not None and cursor in table.rows:
            table.move_cursor(row=table.get_row_index(cursor))
        self.query_one("#runs-detail", Static).update(
            "no runs yet: launch one from the Launch screen (F4)" if not self.runs else
            "no run matches; Esc in the search box clears it, f shows every status" if not table.row_count else
            WINDOW_TEXT)
        self.query_one("#runs-keys").display = bool(self.runs)
        self._show_view()

    def _passes(self, run_id: str, m: Manifest) -> bool:
        if self.status_filter == "running" and m.status not in ("running", "pending"):
            return False
        if self.status_filter not in (None, "running") and m.status != self.status_filter:
            return False
        words = (run_id, m.name, m.target_name, m.status_line)
        return not self.search or any(self.search.lower() in str(w).lower() for w in words)

    def _sort(self) -> None:
        """Order the rows by `sort_by`, runs without that figure last."""
        _, larger_first = SORTS[self.sort_by]        # every larger-first column is a number
        figure = next((column for column, (heading, _) in HEADLINE.items() if heading == self.sort_by), None)

        def key(run_cell: Text):
            run_id = run_cell.plain[2:]              # the run cell: a mark, a space, the id
            m = self.manifests[run_id]
            value: Any = ((self.shown.get(run_id) or {}).get(figure) if figure else
                     {"started": m.started_ns or m.created_ns, "status": m.status, "experiment": m.name,
                      "run": run_id}[self.sort_by])
            return value is None, (-value if larger_first and value is not None else value or "")

        self.query_one(DataTable).sort("run", key=key)

    def _show_view(self) -> None:
        """One line naming what narrows or orders the list, when anything does."""
        parts = []
        if self.search:
            parts.append(f"search {self.search!r}")
        if self.status_filter:
            parts.append(f"status {self.status_filter}")
        if self.sort_by != "started":
            parts.append(f"sorted by {self.sort_by}, {SORTS[self.sort_by][0]}")
        shown = self.query_one(DataTable).row_count
        line = f"{shown} of {len(self.runs)} runs · " + " · ".join(parts) if parts else ""
        view = self.query_one("#runs-view", Static)
        view.update(line)
        view.display = bool(line)

    def action_search(self) -> None:
        box = self.query_one("#runs-search", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#runs-search")
    def _search_changed(self, event: Input.Changed) -> None:
        self.search = event.value.strip()
        self._fill()

    @on(Input.Submitted, "#runs-search")
    def _search_done(self) -> None:
        self.query_one(DataTable).focus()

    def on_key(self, event) -> None:
        box = self.query_one("#runs-search", Input)
        if event.key == "escape" and box.has_focus:     # Esc in the box: no search, back to the list
            event.stop()
            box.value = ""
            box.display = False
            self.query_one(DataTable).focus()

    def action_filter(self) -> None:
        self.status_filter = STATUS_FILTERS[(STATUS_FILTERS.index(self.status_filter) + 1) % len(STATUS_FILTERS)]
        self._fill()

    def action_sort(self, column: str | None = None) -> None:
        sorts = list(SORTS)
        self.sort_by = column or sorts[(sorts.index(self.sort_by) + 1) % len(sorts)]
        self._fill()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        if event.column_key.value in SORTS:
            self.action_sort(event.column_key.value)

    @staticmethod
    def _headline_cells(values: dict | None) -> list[str]:
        if values is None:
            return ["…"] * len(HEADLINE)
        return ["—" if values.get(column) is None else fmt.format(values[column])
                for column, (_, fmt) in HEADLINE.items()]

    def _mark(self, run_id: str) -> Text:
        return Text(("● " if run_id in self.marked else "  ") + run_id,
                    "bold cyan" if run_id in self.marked else "")

    @work(thread=True, exclusive=True, group="headlines")
    def headlines(self, runs: list[tuple[str, Path]]) -> None:
        worker = get_current_worker()
        to_compute = []
        for run_id, path in runs:      # kept summaries first: the whole screen fills at once
            if worker.is_cancelled:    # a newer refresh took over
                return
            try:
                kept = summary.cached_summary(path, window=WINDOW, by="run")
            except Exception:  # noqa: BLE001 - computed below, which names what is wrong
                kept = None
            if kept is None:
                to_compute.append((run_id, path))
            else:
                self.post_message(Headline(run_id, kept.row(0, named=True)))
        for run_id, path in to_compute:
            if worker.is_cancelled:
                return
            self.post_message(headline(run_id, path))

    def on_headline(self, message: Headline) -> None:
        table = self.query_one(DataTable)
        if message.run_id not in self.runs:
            return
        self.notes[message.run_id] = message.note
        self.shown[message.run_id] = message.values
        if message.run_id not in table.rows:          # searched or filtered out
            return
        for (heading, _), cell in zip(HEADLINE.values(), self._headline_cells(message.values)):
            table.update_cell(message.run_id, heading, cell)
        if self.sort_by in (heading for heading, _ in HEADLINE.values()):   # its place may change
            cursor = self.current_run()
            assert cursor is not None       # the table lists the run just updated
            self._sort()
            table.move_cursor(row=table.get_row_index(cursor))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        run_id = event.row_key.value if event.row_key else None
        if run_id in self.runs:
            note = self.notes.get(run_id)
            run = RunDir(self.runs[run_id])
            ran, manifest = run.runtime(), run.manifest()
            said = ran_line(manifest, ran) if ran or command_line(manifest) else ""
            self.query_one("#runs-detail", Static).update(
                f"[b]{run_id}[/b]" + (f"  [dim]{note}[/]" if note else "")
                + (f"\n{escape(said)}" if said else "") + f"\n[dim]{WINDOW_TEXT}[/]")

    def current_run(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    # -- actions -------------------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_open(self) -> None:
        run_id = self.current_run()
        if run_id:
            self.app.open_run(self.runs[run_id])

    def action_mark(self) -> None:
        run_id = self.current_run()
        if not run_id:
            return
        if run_id in self.marked:
            self.marked.remove(run_id)
        elif len(self.marked) >= 4:
            self.notify("compare takes at most 4 runs; unmark one first", severity="warning")
            return
        else:
            self.marked.append(run_id)
        self.query_one(DataTable).update_cell(run_id, "run", self._mark(run_id))

    def action_compare(self) -> None:
        refs = self.marked or ([run] if (run := self.current_run()) else [])
        if not refs:
            self.notify("mark runs with Space first", severity="warning")
            return
        self.app.compare_runs([str(self.runs[r]) for r in refs])

    def action_cancel_run(self) -> None:
        """Cancel the run meant, once the user says yes to its name: the one under the cursor when it is
        running, else the only one running (the cursor may have stayed on an older run)."""
        running = [run_id for run_id, m in self.manifests.items() if m.status in ("running", "pending")]
        cursor = self.current_run()
        if cursor in running:
            run_id = cursor
        elif len(running) == 1:
            run_id = running[0]
        else:
            status = self.manifests[cursor].status if cursor else ""
            self.notify(f"no run is running{f' ({cursor} is {status})' if cursor else ''}" if not running else
                        f"{len(running)} runs are running: put the cursor on the one to cancel", severity="warning")
            return
        m = self.manifests[run_id]

        def answer(yes: bool | None) -> None:
            if yes:
                self.notify(f"cancelling {run_id}…")
                self.cancel_run(self.runs[run_id])

        self.app.push_screen(Confirm(f"Cancel run {run_id} ({m.status_line}, on {m.target_name}): stop every "
                                     f"process it runs, on every node?"), answer)

    @work(thread=True, group="cancel")
    def cancel_run(self, path: Path) -> None:
        try:
            status = launcher.cancel(path)
            self.app.call_from_thread(self.notify, f"{path.name}: {status}")
        except UserError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="error")
        self.app.call_from_thread(self.action_refresh)

    def action_save_baseline(self) -> None:
        run_id = self.current_run()
        if not run_id:
            return

        def check(name: str) -> None:
            baselines.check_name(name)
            if baselines.exists(name):
                raise UserError(f"baseline {name!r}: already exists; pick another name")

        suggested = free_name(run_id_name(run_id) or run_id, baselines.exists)
        def save(name: str | None) -> None:
            if name:
                self.save_baseline(self.runs[run_id], name)

        self.app.push_screen(AskName(f"Save run {run_id} as baseline:", suggested, check), save)

    @work(thread=True, group="baseline")
    def save_baseline(self, path: Path, name: str) -> None:
        """`charllm-tui baseline save` (a summary pass over the run: off the UI thread)."""
        try:
            baselines.save(str(path), name)
            self.app.call_from_thread(self.notify, f"saved baseline {name!r}; pick it on Compare with b")
        except UserError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="error")

    def action_delete(self) -> None:
        run_id = self.current_run()
        if not run_id:
            return
        rd = RunDir(self.runs[run_id])
        try:
            rd.check_deletable()
        except UserError as exc:
            self.notify(str(exc), severity="error")
            return

        def answer(yes: bool | None) -> None:
            if yes:
                try:
                    rd.delete()
                except UserError as exc:  # it started running while the dialog was open
                    self.notify(str(exc), severity="error")
                    return
                self.marked = [m for m in self.marked if m != run_id]
                self.notify(f"run {run_id}: deleted")
                self.action_refresh()

        self.app.push_screen(Confirm(f"Delete run {run_id} and all its files?"), answer)
