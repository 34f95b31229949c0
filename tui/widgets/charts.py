"""The chart adapters over textual-plotext: metrics over time (or iterations), several series
(`Chart`), and a campaign figure's panel of bars (`FigurePanel`).

Chart callers hand over raw points; the adapter downsamples each series to the widget's braille
resolution (two points per cell, mean per bucket) and draws them as braille points — at that
density they read as lines, at a tenth of the cost of plotext's interpolated lines. It draws only
while visible and at most `MAX_FPS` times a second, so a 20 Hz feed of many GPUs stays cheap.
A FigurePanel draws what `campaign report` draws in the terminal (tui/figures.draw_panel).
"""

from __future__ import annotations

import math
import time
from itertools import cycle, repeat
from typing import Sequence

from textual_plotext import PlotextPlot

MAX_FPS = 4.0
MAX_LEGEND = 4
# The series of a chart with a legend are told apart by glyph as well as by colour (the legend shows each);
# without one (more series than MAX_LEGEND), all are braille points.
MARKERS = ("braille", "x", "+", "o")
SPARSE_POINTS = 400
MAX_POINTS = 400           # per chart: plotext's build time grows with points; many series share them
Series = dict[str, tuple[Sequence[float], Sequence[float]]]


def downsample(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    """Mean of x and y per bucket of equal x span; points with y None are skipped."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) <= buckets or buckets < 1:
        return [p[0] for p in pts], [p[1] for p in pts]
    lo, hi = pts[0][0], pts[-1][0]
    span = (hi - lo) / buckets or 1.0
    sums: dict[int, list[float]] = {}
    for x, y in pts:
        b = min(buckets - 1, int((x - lo) / span))
        acc = sums.setdefault(b, [0.0, 0.0, 0])
        acc[0] += x
        acc[1] += y
        acc[2] += 1
    cols = sorted(sums.values())
    return [c[0] / c[2] for c in cols], [c[1] / c[2] for c in cols]


def nice_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """As many round values from `lo` to `hi` as fit in `most` (1, 2, 2.5 or 5 times a power of ten
    apart); a lone value when the range is a point."""
    if not hi > lo:
        return [lo]
    power = 10 ** math.floor(math.log10((hi - lo) / max(1, most - 1)))
    steps = [m * power * scale for scale in (0.1, 1, 10) for m in (1, 2, 2.5, 5)]
    counts = [math.floor(hi / s + 1e-9) - math.ceil(lo / s - 1e-9) + 1 for s in steps]
    pick = next(i for i, n in enumerate(counts) if n <= most)
    step = steps[pick - 1 if counts[pick] < 2 and pick else pick]        # two at least, where the range allows
    first = math.ceil(lo / step - 1e-9)
    return [(first + i) * step for i in range(math.floor(hi / step + 1e-9) - first + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Ticks written with the decimals their spacing needs (0.05 apart: two; 2.5: one; 50: none)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else abs(ticks[0]) or 1.0
    decimals = next(d for d in range(12) if abs(round(step, d) - step) <= abs(step) * 1e-6 or d == 11)
    return [f"{t:,.{decimals}f}" for t in ticks]


class _KeptPlot(PlotextPlot):
    """A plot that builds its figure again only when its data, size or theme change."""

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes)
        self._drawn = 0                   # bumped by every _draw: the figure's data changed
        self._built: tuple | None = None  # (drawn, size, theme) -> the figure textual-plotext built

    def render(self):
        # textual-plotext rebuilds the whole plotext figure on every repaint, and a layout
        # refresh anywhere on the screen repaints every chart: keep the last build until the
        # data, the size or the theme change.
        key = (self._drawn, self.size, self.app.theme)
        if self._built is None or self._built[0] != key:
            self._built = (key, super().render())
        return self._built[1]


class Chart(_KeptPlot):
    """A titled line chart of several series; `show()` new data, it redraws when due."""

    def __init__(self, title: str, *, xlabel: str = "", id: str | None = None):
        super().__init__(id=id)
        self.title = title
        self.xlabel = xlabel
        self._series: Series = {}
        self._last_draw = 0.0
        self._pending = False
        self._stale = False
        self._note = ""
        self._baseline: str | None = None

    def show(self, series: Series, *, note: str = "", baseline: str | None = None) -> None:
        """Plot `series` (label -> points); `baseline` names the one the others are measured against
        (drawn first, "(baseline)" in the legend)."""
        self._series = series
        self._note = note
        self._baseline = baseline
        if not self.display:
            self._stale = True
            return
        due = self._last_draw + 1.0 / MAX_FPS - time.monotonic()
        if due <= 0:
            self._draw()
        elif not self._pending:
            self._pending = True
            self.set_timer(due, self._draw)

    def _draw(self) -> None:
        self._pending = self._stale = False
        self._last_draw = time.monotonic()
        self._drawn += 1
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(f"{self.title}{self._note}")
        if self.xlabel:
            plt.xlabel(self.xlabel)
        per_cell = max(10, (self.size.width - 8) * 2)
        buckets = max(10, min(per_cell, MAX_POINTS // max(1, len(self._series))))
        legend = len(self._series) <= MAX_LEGEND       # more labels than that would cover the plot
        first = sorted(self._series, key=lambda label: label != self._baseline)    # the baseline first
        series = {label: downsample(*self._series[label], buckets) for label in first}
        sparse = sum(len(dx) for dx, _ in series.values()) <= SPARSE_POINTS
        draw = plt.plot if sparse else plt.scatter      # few points: join them; many: they join by density
        for marker, (label, (dx, dy)) in zip(cycle(MARKERS) if legend else repeat("braille"), series.items()):
            if dx:
                name = f"{label} (baseline)" if label == self._baseline else label
                draw(dx, dy, label=name if legend else None, marker=marker)
        values = [y for _, dy in series.values() for y in dy if math.isfinite(y)]
        if values:
            lo, hi = min(values), max(values)
            if legend:
                plt.ylim(*self._with_legend_room(lo, hi, legend_rows=len(series)))
            ticks = nice_ticks(lo, hi, most=max(3, min(6, (self.size.height - 4) // 3)))
            plt.yticks(ticks, tick_labels(ticks))        # round figures, none beyond the data (no 102.22%)
        self.refresh()

    def _with_legend_room(self, lo: float, hi: float, legend_rows: int) -> tuple[float, float]:
        """The y range with the plot's top rows left to the legend (plotext draws it top left, over the
        data: a CPU at 100% ran under the labels)."""
        rows = max(2, self.size.height - 4 - bool(self.xlabel))     # title, x axis and its labels, xlabel
        span = (hi - lo) or abs(hi) * 0.1 or 1.0
        free = min(legend_rows + 1, rows - 1)
        return lo, hi + span * free / max(1, rows - free)

    def on_resize(self) -> None:
        self._draw()

    def watch_display(self, display: bool) -> None:  # hidden charts skip drawing
        if display and self._stale:
            self._draw()


class FigurePanel(_KeptPlot):
    """One panel of a campaign figure (engine.campaign.report.Panel), drawn as `campaign report`
    draws it in the terminal: the same values, bars, title, units and axis."""

    def __init__(self, panel, x_axis: str, *, classes: str | None = None):
        from charllm.tui.figures import draw_panel  # deferred: loads polars (Live's charts need neither)

        super().__init__(classes=classes)
        self.panel = panel
        if not draw_panel(self.plt, panel, x_axis):
            self.plt.title(f"{panel.title}: no values")
