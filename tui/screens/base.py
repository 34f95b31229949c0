"""What every workbench screen shares: header, tab bar of screens, footer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, Header, Tab, Tabs

from charllm.tui.screens import SCREENS
from charllm.tui.widgets.form import FOCUS_KEYS


def edited_name(name: str) -> str:
    """The name of an experiment changed in the workbench from one named `name`: no longer that preset
    (its title, its exported flags file and the name suggested when saving say so)."""
    return name if name.endswith("-edited") else f"{name}-edited"


class ScreenTabs(Tabs):
    """The screen switcher (mouse); F2..F8 do the same from the keyboard."""

    can_focus = False

    def __init__(self, active: str):
        super().__init__(*(Tab(f"{title} {key.upper()}", id=mode) for mode, title, key, _ in SCREENS),
                         active=active)

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        event.stop()
        if event.tab.id != self.screen.MODE:
            self.app.switch_mode(event.tab.id)


class WorkbenchScreen(Screen):
    """Header, tab bar, the screen's body (`compose_body`), footer."""

    MODE = ""
    BINDINGS = FOCUS_KEYS

    def compose(self) -> ComposeResult:
        yield Header()
        yield ScreenTabs(self.MODE)
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()
