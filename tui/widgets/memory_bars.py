"""Per-pipeline-stage stacked memory bars against what the allocator may hold on the device.

Input is `engine.model.memory.estimate(exp).to_dict()`; nothing is computed here but the drawing.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from charllm.engine.model.memory import FITS, VERDICT_STYLE
from charllm.probes.core.formatting import size

# breakdown key -> (legend name, colour)
PARTS = {
    "weights": ("weights", "dodger_blue2"),
    "gradients": ("grads", "medium_purple"),
    "optimizer": ("optim", "gold3"),
    "activations": ("activ", "green3"),
    "other": ("other", "grey50"),
}
RESERVE = "yellow3"


class MemoryBars(Widget):
    """One line per PP stage: weights | gradients | optimizer | activations | other | the allocator's
    reserve beyond its peak, and a │ where the allocator's room ends (usable less memory outside it)."""

    DEFAULT_CSS = "MemoryBars { height: auto; text-wrap: nowrap; text-overflow: clip; }"
    report: reactive[dict | None] = reactive(None, layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return 1 + (len(self.report["stages"]) if self.report else 1)

    def render(self) -> Text:
        legend = Text.assemble(*((f"■ {name} ", colour) for name, colour in PARTS.values()),
                               ("░ reserve ", RESERVE), no_wrap=True)
        if not self.report:
            return legend + Text("\n(no estimate yet)", style="dim")
        report = self.report
        usable = report["allocator_bytes"]
        stages = report["stages"]
        scale = max([usable, *(s["total_bytes"] + s["reserve_bytes"] for s in stages)]) or 1
        label_w, suffix_w = 5, 24
        bar_w = max(10, self.size.width - label_w - suffix_w)
        cap_col = min(bar_w - 1, round(usable / scale * bar_w))
        lines = [legend]
        for stage in stages:
            line = Text(f"PP{stage['pp_rank']:<3}", style="bold", no_wrap=True)
            cells: list[tuple[str, str]] = []
            acc = 0.0
            for key, (_, colour) in PARTS.items():
                acc_next = acc + stage["breakdown"].get(key, 0)
                n = round(acc_next / scale * bar_w) - round(acc / scale * bar_w)
                cells.extend([("█", colour)] * n)
                acc = acc_next
            n = round((acc + stage["reserve_bytes"]) / scale * bar_w) - round(acc / scale * bar_w)
            cells.extend([("░", RESERVE)] * n)
            cells.extend([(" ", "")] * (bar_w - len(cells)))
            over = stage["verdict"] != FITS
            if cap_col < len(cells):
                glyph = cells[cap_col][0] if cells[cap_col][0] != " " else "│"
                cells[cap_col] = (glyph if over else "│", "bold red" if over else "bold")
            for glyph, style in cells[:bar_w]:
                line.append(glyph, style)
            headroom = stage["headroom_bytes"]
            line.append(f" {size(stage['total_bytes'], 1, 0):>9} ", "")
            line.append(f"{'+' if headroom >= 0 else ''}{size(headroom, 1, 0)}", VERDICT_STYLE[stage["verdict"]])
            lines.append(line)
        return Text("\n").join(lines)
