"""The workbench: `charllm-tui` with no arguments.

One Textual mode per screen (Compose, Sweep, Launch, Live, Runs, Compare, Doctor, Campaign), each
with its own screen stack, switched with F2..F9, the tab bar or the command palette. The app holds
the state the screens share: the experiment being composed, the run being watched, the campaign shown. Every screen is a
face on the headless API (`charllm.engine`, `charllm.probes`); blocking calls run in workers.

User settings come from `<config_dir>/tui.toml`:

    theme = "gruvbox"                 # any Textual theme name
    [keymap]                          # binding id -> keys (see the help screen for the ids)
    "screen.live" = "f12"
    "compose.save" = "ctrl+w"
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from textual.app import App
from textual.binding import Binding
from textual.dom import DOMNode
from textual.screen import Screen
from textual.widget import Widget

from charllm.engine.model.experiment import Experiment
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, did_you_mean
from charllm.probes.store.rundir import list_runs
from charllm.tui.providers import ActionsProvider, PresetsProvider, RunsProvider, ScreensProvider
from charllm.tui.screens import SCREENS, screen_class
from charllm.tui.screens.dialogs import AskName, Confirm
from charllm.tui.screens.help import HelpScreen

if TYPE_CHECKING:
    from charllm.tui.screens.sweep import SweepDone

DEFAULT_EXPERIMENT = "tiny-local"
# Once the first screen is up and idle, the work other screens' first keys would pay for is done
# (`_when_idle`): the Sweep screen (F3) then opens on a ready table.
IDLE_WORK_AFTER_S = 1.0


def _screen_factory(target: str) -> Callable[[], Screen]:
    """Import a screen module only when its mode is first shown (keeps the first frame fast)."""
    def make() -> Screen:
        screen = screen_class(target)()
        # A new screen is styled from the current stylesheet as it mounts. Textual would first re-parse
        # the whole stylesheet and restyle every node, twice (the screen is not mounted yet when it
        # compares its CSS generation with the app's): 200-400 ms of each screen's first key here.
        # (textual==8.2.8 is pinned; a theme change still restyles every screen.)
        screen._css_update_count = screen.app._css_update_count
        return screen

    return make


def load_settings(path: Path | None = None) -> dict:
    """`tui.toml` as {"theme": str | None, "keymap": {id: keys}}; a bad file is a UserError."""
    path = path or paths.config_dir() / "tui.toml"
    if not path.is_file():
        return {"theme": None, "keymap": {}}
    data = paths.read_toml(path, "settings file")
    unknown = set(data) - {"theme", "keymap"}
    if unknown:
        raise UserError(f"{path}: unknown key {sorted(unknown)[0]!r}; expected 'theme' or [keymap]")
    theme = data.get("theme")
    keymap = data.get("keymap", {})
    if theme is not None and not isinstance(theme, str):
        raise UserError(f"{path}: theme = {theme!r}: must be a theme name (a string)")
    if not isinstance(keymap, dict) or not all(isinstance(v, str) for v in keymap.values()):
        raise UserError(f"{path}: [keymap] must map binding ids to key strings, e.g. \"screen.live\" = \"f12\"")
    known = binding_ids() if keymap else set()
    for binding_id in keymap:
        if binding_id not in known:
            hint = did_you_mean(binding_id, sorted(known), "; the help screen (F1) lists the ids")
            raise UserError(f"{path}: [keymap] {binding_id!r}: no such binding id{hint}")
    return {"theme": theme, "keymap": keymap}


def binding_ids() -> set[str]:
    """Every binding id of the app and its screens (what [keymap] may rebind)."""
    classes: list[type[DOMNode]] = [CharllmApp, HelpScreen, AskName, Confirm,
                                    *(screen_class(target) for *_, target in SCREENS)]
    return {b.id for cls in classes for b in cls.BINDINGS if isinstance(b, Binding) and b.id}


class CharllmApp(App[str | None]):
    """The charllm workbench. What it returns is left in the terminal after it (what goes on)."""

    TITLE = "charllm-tui"
    CSS_PATH = "app.tcss"
    MODES = {mode: _screen_factory(target) for mode, _, _, target in SCREENS}
    DEFAULT_MODE = "compose"
    COMMANDS = App.COMMANDS | {ScreensProvider, PresetsProvider, RunsProvider, ActionsProvider}
    BINDINGS = [
        Binding("f1", "help", "Help", id="help", priority=True),
        Binding("question_mark", "help", "Help", id="help.alt", show=False),
        *(Binding(key, f"switch_mode('{mode}')", title, id=f"screen.{mode}", priority=True,
                  show=False) for mode, title, key, _ in SCREENS),
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True),
    ]

    def __init__(self, experiment: Experiment | None = None, *, settings: dict | None = None,
                 run: Path | None = None, start_mode: str | None = None):
        super().__init__()
        self.settings = settings if settings is not None else {"theme": None, "keymap": {}}
        if experiment is None:
            experiment = Experiment.load(DEFAULT_EXPERIMENT)
        self.experiment: Experiment = experiment
        self.experiment_serial = 0      # bumped when the experiment is replaced from outside Compose
        self.run_path: Path | None = Path(run) if run else None
        self.compare_refs: list[str] = []
        self.campaign_name: str | None = None   # the campaign the Campaign screen shows
        self.runs_focus: str | None = None      # a run the Runs screen puts its cursor on when it shows
        self.swept_ahead: tuple[str, SweepDone] | None = None     # (experiment TOML, it) from the background sweep
        self._start_mode = start_mode or ("live" if run else self.DEFAULT_MODE)

    def on_mount(self) -> None:
        if self.settings["keymap"]:
            self.set_keymap(self.settings["keymap"])
        if self.settings["theme"]:
            if self.settings["theme"] not in self.available_themes:
                self.notify(f"tui.toml: theme = {self.settings['theme']!r}: no such theme; "
                            f"see the command palette's 'Theme' for names", severity="error")
            else:
                self.theme = self.settings["theme"]
        self.switch_mode(self._start_mode)
        self.set_timer(IDLE_WORK_AFTER_S, self._when_idle)

    def _when_idle(self) -> None:
        """What start-up leaves for later: the sweep of the composed experiment and the CSS of the
        other screens' widgets, so that their first key does not pay for them."""
        from charllm.tui.screens.sweep import sweep_ahead  # deferred: see screen_class

        if self.current_mode != "sweep":
            sweep_ahead(self)
        self._parse_widget_css()

    def _parse_widget_css(self) -> None:
        """Parse the default CSS of the widget classes that only other screens mount, while idle.

        Textual adds a widget class's DEFAULT_CSS to the stylesheet the first time one is mounted and
        then parses the whole stylesheet again: measured at 150-300 ms of the first F3 (Sweep) here.
        (`_get_default_css` is Textual's own, textual==8.2.8 is pinned.)"""
        from textual.widgets import DataTable, Log, ProgressBar
        from textual_plotext import PlotextPlot

        widgets: tuple[Widget, ...] = (DataTable(), ProgressBar(), Log(), PlotextPlot())
        for widget in widgets:
            for read_from, css, tie_breaker, scope in widget._get_default_css():
                self.stylesheet.add_source(css, read_from=read_from, is_default_css=True,
                                           tie_breaker=tie_breaker, scope=scope)
        self.stylesheet.parse()

    # -- shared state, changed by any screen ------------------------------------------------
    # The screen of the current mode is told at once; under a dialog (Help, say, with the command palette
    # run from it) it is not `self.screen`, and reads the state when it resumes instead.
    def use_experiment(self, experiment: Experiment, *, show: bool = True) -> None:
        """Replace the experiment being composed (a preset, a sweep pick) and show Compose."""
        self.experiment = experiment
        self.experiment_serial += 1     # Compose re-reads it when it next resumes
        if self.current_mode == "compose":
            from charllm.tui.screens.compose import ComposeScreen  # deferred: its screen is up, its module loaded

            if isinstance(self.screen, ComposeScreen):
                self.screen.sync_from_app()
        elif show:
            self.switch_mode("compose")

    def open_run(self, path: Path | None) -> None:
        """Watch a run (live or recorded) on the Live screen; None shows host telemetry."""
        self.run_path = Path(path) if path else None
        if self.current_mode == "live":
            from charllm.tui.screens.live import LiveScreen  # deferred: its screen is up, its module loaded

            if isinstance(self.screen, LiveScreen):
                self.screen.follow(self.run_path)
        else:
            self.switch_mode("live")    # Live follows app.run_path when it resumes

    def show_in_runs(self, run_id: str) -> None:
        """Show the Runs screen with its cursor on run `run_id`."""
        self.runs_focus = run_id
        if self.current_mode == "runs":
            from charllm.tui.screens.runs import RunsScreen  # deferred: its screen is up, its module loaded

            if isinstance(self.screen, RunsScreen):
                self.screen.action_refresh()
        else:
            self.switch_mode("runs")    # Runs puts its cursor on app.runs_focus when it resumes

    def show_campaign(self, name: str) -> None:
        """Show campaign `name` on the Campaign screen."""
        self.campaign_name = name
        if self.current_mode == "campaign":
            from charllm.tui.screens.campaign import CampaignScreen  # deferred: its screen is up, its module loaded

            if isinstance(self.screen, CampaignScreen):
                self.screen.select(name)
        else:
            self.switch_mode("campaign")    # Campaign selects app.campaign_name when it resumes

    def compare_runs(self, refs: list[str]) -> None:
        self.compare_refs = list(refs)
        if self.current_mode == "compare":
            from charllm.tui.screens.compare import CompareScreen  # deferred: its screen is up, its module loaded

            if isinstance(self.screen, CompareScreen):
                self.screen.load(self.compare_refs)
        else:
            self.switch_mode("compare")

    # -- actions ---------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Quit; when runs or campaigns are going, say first that they go on, and how to stop each (the
        same lines are left in the terminal: what the app returns)."""
        going = in_flight()
        if not going:
            self.exit()
            return
        shown = going[:MAX_SAID] + ([f"… and {len(going) - MAX_SAID} more (charllm-tui runs list, campaign list)"]
                                   if len(going) > MAX_SAID else [])
        said = "These keep running after the workbench quits:\n" + "\n".join(shown)
        if isinstance(self.screen, Confirm) and self.screen.question.startswith(said):
            return                      # asked already
        def quit_if(yes: bool | None) -> None:
            if yes:
                self.exit(said)

        self.push_screen(Confirm(f"{said}\n\nQuit?"), quit_if)


MAX_SAID = 6         # runs and campaigns named when quitting; the rest are counted


def in_flight() -> list[str]:
    """What goes on after the workbench quits: each campaign and each run (not a campaign's member: its
    campaign stops it) that is pending or running, with the command that stops it."""
    from charllm.engine.campaign import state  # deferred: only quitting reads the campaigns

    going: list[str] = []
    members: set[str] = set()
    for name in state.recorded():
        try:
            record = state.Record.load(name)
        except UserError:
            continue
        if record.data.get("status") in ("pending", "running"):
            members.update(m["run"] for m in record.members if m.get("run"))
            going.append(f"campaign {record.progress()} · stop it: charllm-tui campaign cancel {name}")
    for rd in reversed(list_runs()):
        try:
            m = rd.manifest()
        except UserError:
            continue
        if m.status in ("pending", "running") and rd.id not in members:
            going.append(f"run {rd.id} ({m.status_line}, on {m.target_name}) · stop it: "
                         f"charllm-tui runs cancel {rd.id}")
    return going


def main(argv: list[str] | None = None) -> int:
    """Open the workbench (called by `charllm-tui` without a command)."""
    said = CharllmApp(settings=load_settings()).run()
    if said:
        print(said, file=sys.stderr)        # plain: a terminal wraps it, a command stays whole to copy
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
