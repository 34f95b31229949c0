"""What every workbench screen shares: header, tab bar of screens, footer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import getters
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Tab, Tabs

from charllm.tui.screens import SCREENS
from charllm.tui.widgets.form import FOCUS_KEYS

if TYPE_CHECKING:
    from charllm.tui.app import CharllmApp


def edited_name(name: str) -> str:
    """The name of an experiment changed in the workbench from one named `name`: no longer that preset
    (its title, its exported flags file and the name suggested when saving say so)."""
    return name if name.endswith("-edited") else f"{name}-edited"


def bound_keys(app: CharllmApp, binding: Binding) -> list[str]:
    """The keys a binding answers to now, as the footer writes them ("plus,equals_sign" -> "+", "="):
    the user's [keymap] keys for its id (tui.toml), else its own."""
    keys = app.settings["keymap"].get(binding.id, binding.key) if binding.id else binding.key
    return [app.get_key_display(Binding(key.strip(), "")) for key in keys.split(",")]


def shortest_key(app: CharllmApp, binding: Binding) -> str:
    """The shortest of a binding's keys, named keys capitalized ("F9", "Enter"), for hint lines."""
    key = min(bound_keys(app, binding), key=len)
    return key.capitalize() if key.isalnum() and len(key) > 1 else key


class ScreenTabs(Tabs):
    """The screen switcher (mouse); F2..F8 (or the keys tui.toml gives) do the same from the keyboard."""

    can_focus = False

    if TYPE_CHECKING:
        app = getters.app(CharllmApp)   # the app's own type, as Textual types `app` itself

    def __init__(self, active: str, app: CharllmApp):
        bindings = {b.id: b for b in type(app).BINDINGS if isinstance(b, Binding)}
        super().__init__(*(Tab(f"{title} {shortest_key(app, bindings[f'screen.{mode}'])}", id=mode)
                           for mode, title, _, _ in SCREENS), active=active)

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        event.stop()
        assert isinstance(self.screen, WorkbenchScreen) and event.tab.id is not None   # every tab has a mode id
        if event.tab.id != self.screen.MODE:
            self.app.switch_mode(event.tab.id)


class WorkbenchScreen(Screen):
    """Header, tab bar, the screen's body (`compose_body`), footer."""

    MODE = ""
    BINDINGS = FOCUS_KEYS
    # Below 90 columns the tab bar's tabs lose their right padding: all of them then fit in 80.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide")]
    if TYPE_CHECKING:
        app = getters.app(CharllmApp)   # the app's own type, as Textual types `app` itself

    def compose(self) -> ComposeResult:
        yield Header()
        yield ScreenTabs(self.MODE, self.app)
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()
