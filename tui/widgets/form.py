"""Form controls that lose no key, however fast keys come, and read without colour.

Textual runs a control's own key bindings (ctrl+k in a field, space on a checkbox) only once the
key has bubbled back up to the app, while the characters typed after it are handled in the control
at once; and Tab moves the focus only after the same trip, so the keys sent after it still reach the
control it leaves. Sent in one go (a paste, tmux send-keys, a fast typist), `ctrl+a ctrl+k 1 6 Tab`
in a field holding 8 typed "16", then went home and deleted it: the field was left empty while the
experiment held 16. Here a control runs its own bindings where its keys arrive, in order with the
characters around them, and the screens bind Tab with priority (`FOCUS_KEYS`), so that the focus
moves before the next key is handed to a control.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import events
from textual.binding import Binding, BindingType
from textual.widget import Widget
from textual.widgets import Checkbox, Input, Select

# Tab and Shift+Tab move the focus as the app receives them (priority), not after the keys before them.
FOCUS_KEYS: list[BindingType] = [
    Binding("tab", "app.focus_next", "Next field", show=False, priority=True),
    Binding("shift+tab", "app.focus_previous", "Previous field", show=False, priority=True),
]


# A mixin for controls: typed as a widget, made a plain class (a Widget base would add a CSS type name).
if TYPE_CHECKING:
    _Control = Widget
else:
    _Control = object


class InOrderKeys(_Control):
    """Runs the control's own key bindings as its keys arrive, in order with typed characters.
    Only its own keys: those bubbling up from a part of it that has the focus (a Select's open list) are
    that part's (Down and Enter move and choose there)."""

    async def _on_key(self, event: events.Key) -> None:
        if not self.has_focus:
            return
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            if not binding.priority:
                event.stop()
                event.prevent_default()       # the base class's key handler must not see it too
                await self.run_action(binding.action)
                return


class FormInput(InOrderKeys, Input):
    """A text field that keeps every key."""


class FormSelect(InOrderKeys, Select):
    """A choice that keeps every key."""


class FormCheckbox(InOrderKeys, Checkbox):
    """A checkbox that keeps every key and shows its state in the glyph, not only in colour:
    ✓ when on, blank when off (Textual's draws an X either way)."""

    @property
    # Textual's class attribute, per value here (and never assigned): mypy cannot see a property may stand
    # for a plain class attribute that is only read
    def BUTTON_INNER(self) -> str:  # type: ignore[override]
        return "✓" if self.value else " "
