"""Command-palette providers: screens, presets (experiments, models, hardware), runs, and actions."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import list_runs
from charllm.tui.screens import SCREENS

if TYPE_CHECKING:
    from charllm.tui.app import CharllmApp


class _ListProvider(Provider):
    """A provider over a list of (text, help, callback) built once per palette opening."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands: list[tuple[str, str, Callable[[], object]]] = []

    if TYPE_CHECKING:
        # The app's own type. Textual's Provider.app says App[object], and App is invariant in what it returns:
        # no App[str | None] is an App[object] to mypy.
        @property
        def app(self) -> CharllmApp:  # type: ignore[override]
            ...

    def items(self) -> list[tuple[str, str, Callable[[], object]]]:
        raise NotImplementedError

    async def startup(self) -> None:
        self.commands = await asyncio.to_thread(self.items)   # catalog / run-dir reads are I/O

    async def discover(self) -> Hits:
        for text, help_text, command in self.commands:
            yield DiscoveryHit(text, command, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, help_text, command in self.commands:
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), command, text=text, help=help_text)


class ScreensProvider(_ListProvider):
    def items(self):
        return [(f"Go to {title}", f"show the {title} screen ({key.upper()})",
                 partial(self.app.switch_mode, mode)) for mode, title, key, _ in SCREENS]


class PresetsProvider(_ListProvider):
    """Experiment presets replace the composed experiment; a model or hardware preset goes into it, as
    Compose's pickers put one in."""

    def items(self):
        return [
            *((f"Load experiment {name}", "compose this experiment preset", partial(self._load, name))
              for name in catalog.entries("experiments")),
            *((f"Use model {name}", "compose this model on the layout and hardware composed",
               partial(self._use, "model", name)) for name in catalog.entries("models")),
            *((f"Use hardware {name}", "compose the layout on this hardware", partial(self._use, "hardware", name))
              for name in catalog.entries("hardware")),
        ]

    def _load(self, name: str) -> None:
        try:
            self.app.use_experiment(Experiment.load(name))
        except UserError as exc:
            self.app.notify(str(exc), severity="error")

    def _use(self, kind: str, name: str) -> None:
        from charllm.tui.screens.compose import with_preset  # deferred: a screen's module loads when it shows

        try:
            self.app.use_experiment(with_preset(self.app.experiment, kind, name))
        except UserError as exc:
            self.app.notify(str(exc), severity="error")


class RunsProvider(_ListProvider):
    def items(self):
        return [(f"Open run {run.id}", f"{run.status} · watch or replay it on the Live screen",
                 partial(self.app.open_run, run.path)) for run in reversed(list_runs())]


class ActionsProvider(_ListProvider):
    def items(self):
        app = self.app
        return [
            ("Host telemetry", "watch this machine's telemetry on the Live screen", partial(app.open_run, None)),
            ("Run layout sweep", "feasibility of every layout for the composed experiment",
             partial(self._on, "sweep", "run_sweep")),
            ("Dry-run launch", "show the commands a launch would run", partial(self._on, "launch", "dry_run")),
            ("Save experiment preset", "save the composed experiment", partial(self._on, "compose", "save")),
            ("Export Megatron flags", "copy and write the Megatron-LM arguments",
             partial(self._on, "compose", "export")),
            ("Compare marked runs", "compare the runs marked on the Runs screen",
             partial(self._on, "runs", "compare")),
            ("Save run as baseline", "keep the selected run's summary as a named baseline (Runs: b)",
             partial(self._on, "runs", "save_baseline")),
            ("Check this node", "versions, devices, telemetry and sampling rate (Doctor: r)",
             partial(self._on, "doctor", "check")),
            ("Calibrate this node", "a short training job, then save the node calibration (Doctor: t)",
             partial(self._on, "doctor", "check(True)")),
            ("Campaign of marked layouts", "write the layouts marked on Sweep as a new campaign (Sweep: c)",
             partial(self._on, "sweep", "campaign")),
        ]

    def _on(self, mode: str, action: str) -> None:
        """Show `mode`'s screen, then run its action once it is active."""
        app = self.app

        async def run() -> None:
            await app.run_action(action, app.screen)

        if app.current_mode != mode:
            app.switch_mode(mode)
        app.call_after_refresh(run)
