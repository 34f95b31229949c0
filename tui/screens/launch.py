"""Launch: pick a target, see the dry run (commands, a scheduler's job script), launch, then watch it live.

`engine.launch.launcher.launch` runs in a thread worker; its `on_progress` messages are posted to the
screen while it starts. Once the run directory exists the Live screen follows it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.markup import escape
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Button, Label, Log, ProgressBar, Select, Static

from charllm.engine.launch import launcher, targets
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, plural
from charllm.tui.screens.base import WorkbenchScreen, shortest_key

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment


@dataclass
class LaunchProgress(Message):
    text: str


@dataclass
class LaunchDone(Message):
    result: launcher.LaunchResult | None
    error: str | None = None


class LaunchScreen(WorkbenchScreen):
    MODE = "launch"
    BINDINGS = [
        Binding("d", "dry_run", "Dry run", id="launch.dry_run"),
        Binding("l", "launch", "Launch", id="launch.go"),
        Binding("f", "launch(True)", "Launch anyway", id="launch.force", show=False),
    ]

    def __init__(self):
        super().__init__()
        self.targets: dict = {}
        self.target_problems: dict[str, str] = {}   # by target name: why targets.toml could not give it
        self.launching = False
        self.result = None
        self.log_for: tuple | None = None           # (experiment, target) the launch log tells of

    def compose_body(self) -> ComposeResult:
        with Vertical(id="launch"):
            with Horizontal(id="launch-controls"):
                yield Label("target ")
                yield Select([("local (local)", "local")], id="target", compact=True, allow_blank=False)
                yield Button("Dry run d", id="dry", compact=True)
                yield Button("Launch l", id="go", variant="primary", compact=True)
            yield Static(id="launch-summary")
            with VerticalScroll(id="dry-run"):
                yield Static(id="dry-run-text")
            yield ProgressBar(id="launch-progress", show_eta=False)
            yield Log(id="launch-log", max_lines=200)

    def on_mount(self) -> None:
        self.query_one("#launch-progress").display = False
        self.query_one("#launch-log").display = False

    def on_screen_resume(self) -> None:
        self.load_targets()
        self.action_dry_run()

    def load_targets(self) -> None:
        select = self.query_one("#target", Select)
        try:
            self.targets, self.target_problems = targets.load_targets()
        except UserError as exc:  # not TOML at all: only the built-in target is known
            self.targets, self.target_problems = {"local": targets.LOCAL}, {"targets.toml": str(exc)}
        current = select.value
        with self.prevent(Select.Changed):
            select.set_options([(f"{name} ({t.kind})", name) for name, t in self.targets.items()])
            select.value = current if current in self.targets else "local"

    @property
    def target(self):
        return self.targets.get(self.query_one("#target", Select).value)

    def _summary(self, extra: str = "") -> None:
        exp = self.app.experiment
        self.query_one("#launch-summary", Static).update(
            f"[b]{escape(exp.name)}[/b]: {exp.model.name} on {exp.cluster.nodes}×{exp.cluster.gpus_per_node} "
            f"{exp.hardware.name} · {exp.layout_label} · "
            f"{plural(exp.training.train_iters, 'iteration')}{extra}"
            + "".join(f"\n[yellow]not offered: {escape(problem)}[/]" for problem in self.target_problems.values()))

    # -- dry run -------------------------------------------------------------------------------
    @on(Select.Changed, "#target")
    def action_dry_run(self) -> None:
        if self.target is None:
            return
        self._summary()
        if not self.launching and self.log_for != self._launching_what():
            log = self.query_one("#launch-log", Log)   # it told of another experiment or target
            log.clear()
            log.display = False
        self.plan(self.app.experiment.copy(), self.target)

    def _launching_what(self) -> tuple:
        return self.app.experiment.to_toml(), self.target.name

    @work(thread=True, exclusive=True, group="launch-plan")
    def plan(self, exp: Experiment, target) -> None:
        try:
            result = launcher.launch(exp, target, dry_run=True, force=True)
            self.app.call_from_thread(self._show_plan, result)
        except Exception as exc:  # noqa: BLE001 - UserError, a missing API or an engine bug: said on screen
            text = str(exc) if isinstance(exc, UserError) else f"dry run failed: {exc!r}"
            self.app.call_from_thread(self.query_one("#dry-run-text", Static).update, f"[yellow]{escape(text)}[/]")

    def _show_plan(self, result) -> None:
        def short(text: str) -> str:
            """Commands as a reader wants them: $RUNS for the runs directory, the id set at launch."""
            text = text.replace(str(paths.runs_dir()), "$RUNS").replace(result.run_id, "<run-id>")
            return escape(text.replace(sys.executable, "python"))

        parts = [f"[b]Dry run[/b] — nothing starts until you press [b]{self.key('launch.go')}[/b] ($RUNS: the "
                 f"runs directory; <run-id> and {launcher.PORT_AT_LAUNCH}, torchrun's rendezvous port, are picked "
                 "at launch)"]
        if result.forced:
            parts.append(f"\n[b red]This layout has problems[/] (launch refuses it; [b]{self.key('launch.force')}[/b] "
                         "launches anyway):")
            parts += [f"  [red]✗[/] {escape(p)}" for p in result.forced]
        parts.append("\n[b]Commands[/b]")
        parts += [f"  {short(c)}" for c in result.commands]
        if result.job_script:
            parts += [f"\n[b]{result.job_script_label}[/b]", short(result.job_script)]
        self.query_one("#dry-run-text", Static).update("\n".join(parts))

    def key(self, binding_id: str) -> str:
        """The key of one of this screen's bindings, as the footer writes it (tui.toml may move it)."""
        return shortest_key(self.app, next(b for b in self.BINDINGS if isinstance(b, Binding) and b.id == binding_id))

    # -- launch --------------------------------------------------------------------------------
    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_dry_run() if event.button.id == "dry" else self.action_launch()

    def action_launch(self, force: bool = False) -> None:
        if self.launching or self.target is None:
            return
        self.launching = True
        self.log_for = self._launching_what()
        log = self.query_one("#launch-log", Log)
        log.clear()
        log.display = True
        progress = self.query_one("#launch-progress", ProgressBar)
        progress.update(total=None)
        progress.display = True
        self.start(self.app.experiment.copy(), self.target, force)

    @work(thread=True, exclusive=True, group="launch")
    def start(self, exp: Experiment, target, force: bool) -> None:
        def progress(text: str) -> None:
            self.post_message(LaunchProgress(text))

        try:
            result = launcher.launch(exp, target, force=force, on_progress=progress)
            self.post_message(LaunchDone(result))
        except launcher.LayoutRefused as exc:     # the key that launches anyway, not the command line's flag
            self.post_message(LaunchDone(None, f"{exc.problem} ({self.key('launch.force')} launches anyway)"))
        except UserError as exc:
            self.post_message(LaunchDone(None, str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported on screen, the app stays up
            self.post_message(LaunchDone(None, f"launch failed: {exc!r}"))

    def on_launch_progress(self, message: LaunchProgress) -> None:
        self.query_one("#launch-log", Log).write_line(message.text)

    def on_launch_done(self, message: LaunchDone) -> None:
        self.launching = False
        self.query_one("#launch-progress").display = False
        if message.error:
            self.query_one("#launch-log", Log).write_line(f"refused: {message.error}")
            self.notify(message.error, severity="error", timeout=8)
            return
        assert message.result is not None   # no error: launched
        self.result = message.result
        self.query_one("#launch-log", Log).write_line(f"started {message.result.run_dir}")
        self.notify(f"launched {message.result.run_id}")
        self.app.open_run(message.result.run_dir)
