"""Small modal dialogs: ask for a name, confirm a destructive action."""

from __future__ import annotations

from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from charllm.probes.core.errors import UserError
from charllm.tui.widgets.form import FOCUS_KEYS


def free_name(name: str, taken: Callable[[str], bool]) -> str:
    """`name`, or the first of name-2, name-3, ... that is not `taken`: a name the dialog can offer."""
    candidate, n = name, 1
    while taken(candidate):
        n += 1
        candidate = f"{name}-{n}"
    return candidate


class AskName(ModalScreen[str | None]):
    """Ask for a name; dismisses with the name, or None when cancelled. A name `check` refuses
    (it raises UserError) keeps the dialog open with the reason under the field, as an empty one does."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel"), *FOCUS_KEYS]

    def __init__(self, prompt: str, value: str = "", check: Callable[[str], object] | None = None):
        super().__init__()
        self.prompt, self.value, self.check = prompt, value, check

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.prompt)
            yield Input(self.value, id="name", compact=True)
            yield Static(id="name-error", classes="field-error")
            with Horizontal(classes="buttons"):
                yield Button("OK", id="ok", variant="primary", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_input_submitted(self) -> None:
        self._finish()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self._finish() if event.button.id == "ok" else self.dismiss(None)

    def _finish(self) -> None:
        name = self.query_one("#name", Input).value.strip()
        try:
            if not name:
                raise UserError("a name is needed (Escape cancels)")
            if self.check is not None:
                self.check(name)
        except UserError as exc:
            error = self.query_one("#name-error", Static)
            error.update(str(exc))
            error.add_class("shown")
            return
        self.dismiss(name)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    """Yes/no; `y` and `n` answer from the keyboard."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="dialog.yes"),
        Binding("n,escape", "answer(False)", "No", id="dialog.no"),
    ]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", id="yes", variant="error", compact=True)
                yield Button("No (n)", id="no", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)
