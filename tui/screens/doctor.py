"""Doctor: check this node (versions, devices, telemetry, sampling rate), train briefly and save
its calibration, as `charllm-tui doctor` does.

`engine.doctor.gather` runs in a thread worker; its progress lines and the finished report come
back as messages. The report is drawn by the command's renderer (`tui.commands.doctor.render`).
With no check run yet, the screen shows the saved calibrations.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from rich.markup import escape
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Button, Log, ProgressBar, Static

from charllm.engine import doctor
from charllm.probes.core.errors import UserError
from charllm.tui.commands.doctor import render
from charllm.tui.screens.base import WorkbenchScreen

HINT = ("[b]r[/b] checks this node · [b]t[/b] also trains a short job and saves the calibration "
        "(Compose, Sweep and plan use it for this hardware)")


@dataclass
class DoctorProgress(Message):
    text: str


@dataclass
class DoctorDone(Message):
    report: dict | None
    saved: str | None = None           # the calibration file written
    error: str | None = None


class DoctorScreen(WorkbenchScreen):
    MODE = "doctor"
    BINDINGS = [
        Binding("r", "check", "Check node", id="doctor.check"),
        Binding("t", "check(True)", "Train + calibrate", id="doctor.train"),
    ]
    DEFAULT_CSS = """
    #doctor { height: 1fr; }
    #doctor-controls { height: auto; }
    #doctor-controls Button { margin-right: 1; }
    #doctor-status { height: auto; padding: 0 1; }
    #doctor-progress { height: auto; }
    #doctor-log { height: 6; border: round $foreground 30%; }
    #doctor-report { height: 1fr; padding: 0 1; }
    """

    def __init__(self):
        super().__init__()
        self.running = False
        self.report: dict | None = None
        self.stop = threading.Event()

    def compose_body(self) -> ComposeResult:
        with Vertical(id="doctor"):
            with Horizontal(id="doctor-controls"):
                yield Button("Check r", id="doctor-check", compact=True)
                yield Button("Train + calibrate t", id="doctor-train", variant="primary", compact=True)
            yield Static(id="doctor-status")
            yield ProgressBar(id="doctor-progress", show_eta=False)
            yield Log(id="doctor-log", max_lines=200)
            with VerticalScroll(id="doctor-report"):
                yield Static(id="doctor-report-text")

    def on_mount(self) -> None:
        self.query_one("#doctor-progress").display = False
        self.query_one("#doctor-log").display = False

    def on_screen_resume(self) -> None:
        if self.report is None and not self.running:
            self.show_saved()

    def on_unmount(self) -> None:
        self.stop.set()   # a train check still running stops its job

    # -- saved calibrations ------------------------------------------------------------------------
    def show_saved(self) -> None:
        status = self.query_one("#doctor-status", Static)
        records = doctor.saved_calibrations()
        if not records:
            status.update(f"No calibration saved yet. {HINT}")
            return
        listed = ", ".join(f"{escape(r['hardware'])} ({escape(r['node'])}, {escape(r['date'])})" for r in records)
        status.update(f"Saved calibrations: {listed}; the newest below. {HINT}")
        self._show(records[0])

    def _show(self, report: dict) -> None:
        self.query_one("#doctor-report-text", Static).update(render(report))

    # -- checks ----------------------------------------------------------------------------------
    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_check(event.button.id == "doctor-train")

    def action_check(self, train: bool = False) -> None:
        if self.running:
            self.notify("a check is already running")
            return
        self.running = True
        log = self.query_one("#doctor-log", Log)
        log.clear()
        log.display = True
        progress = self.query_one("#doctor-progress", ProgressBar)
        progress.update(total=None)
        progress.display = True
        self.query_one("#doctor-status", Static).update(
            "Training a short job and checking this node…" if train else "Checking this node…")
        self.run_checks(train)

    @work(thread=True, exclusive=True, group="doctor")
    def run_checks(self, train: bool) -> None:
        def progress(text: str) -> None:
            self.post_message(DoctorProgress(text))

        try:
            report = doctor.gather(train=train, stop=self.stop, progress=progress)
            saved = str(doctor.save_calibration(report)) if train and not report["errors"] else None
            self.post_message(DoctorDone(report, saved))
        except UserError as exc:
            self.post_message(DoctorDone(None, error=str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported on screen, the app stays up
            self.post_message(DoctorDone(None, error=f"doctor failed: {exc!r}"))

    def on_doctor_progress(self, message: DoctorProgress) -> None:
        self.query_one("#doctor-log", Log).write_line(message.text)

    def on_doctor_done(self, message: DoctorDone) -> None:
        self.running = False
        self.query_one("#doctor-progress").display = False
        status = self.query_one("#doctor-status", Static)
        if message.report is None:
            status.update(f"[red]{escape(message.error or 'doctor failed')}[/]")
            self.notify(message.error or "doctor failed", severity="error", timeout=8)
            return
        self.report = message.report
        self._show(message.report)
        errors = message.report["errors"]
        self.query_one("#doctor-log").display = bool(errors)   # the report needs the room; a failure its log
        if message.saved:
            status.update(f"[green]Calibration saved[/] for {escape(message.report['hardware'])}: Compose, Sweep and "
                          f"plan now say \"calibrated on {escape(message.report['node'])}, "
                          f"{escape(message.report['date'])}\".")
            self.notify(f"calibration saved: {message.saved}")
        elif errors:
            status.update(f"[red]{escape(errors[0])}[/]")
        else:
            status.update(f"Checked {escape(message.report['node'])}: nothing saved. {HINT}")
