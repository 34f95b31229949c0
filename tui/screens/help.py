"""The help screen (F1 or ?): the flow in a few lines and every key, with its id for tui.toml."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from charllm.tui.screens import SCREENS, screen_class
from charllm.tui.screens.base import bound_keys

FLOW = """\
# charllm-tui

**Compose** a layout (model, hardware, cluster, parallelism, batch, recompute): every edit is
validated and its memory estimated per pipeline stage. **Sweep** maps every layout that fits;
Enter on a row loads it into Compose, Space marks rows and `c` makes a campaign of them. **Launch**
shows the dry run and starts the run (local, SSH or Slurm). **Live** shows power, temperatures, SM
clock and throttling per GPU, iteration speed and the log (or, `p`, the processes on this machine's
GPUs); with no run it shows this machine's host telemetry. **Runs** lists runs, kept up to date
(search, one status, sort; open, cancel, delete, mark for compare). **Compare** puts runs and a
baseline side by side.
**Doctor** checks this node (versions, devices, telemetry, sampling rate) and, with a short
training job, saves the calibration that Compose, Sweep and plan use for its hardware.
**Campaign** lists campaigns (many experiments as one job) with their progress, the chosen one's
members live (Enter opens a member's run on Live, `o` on Runs), and its figures (`g`); `r` runs it,
`c` cancels it.

A dropdown opens with Space or Enter, moves with the arrows and chooses with Enter. Ctrl+P opens
the command palette (screens, experiment, model and hardware presets, runs, actions). Keys can be
changed in `<config>/tui.toml` under `[keymap]` by binding id; `theme = "..."` picks a theme.
"""


def _rows(app, title: str, bindings) -> list[str]:
    """The keys as the footer writes them ("+, =", not "plus,equals_sign"), moved by tui.toml's [keymap]."""
    rows = [f"\n## {title}\n", "| key | action | id |", "|---|---|---|"]
    for b in bindings:
        if isinstance(b, Binding) and b.id:
            keys = ", ".join(f"`{key}`" for key in bound_keys(app, b))
            rows.append(f"| {keys} | {b.description} | `{b.id}` |")
    return rows


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close", id="help.close")]

    def compose(self) -> ComposeResult:
        lines = [FLOW, *_rows(self.app, "Everywhere", type(self.app).BINDINGS)]
        for _, title, _, target in SCREENS:
            lines += _rows(self.app, title, screen_class(target).BINDINGS)
        with VerticalScroll(id="help"):
            yield Markdown("\n".join(lines))
