"""Drawing a campaign's figures (engine.campaign.report): in the terminal with plotext, or as SVG/PNG
with matplotlib (the optional `plot` extra). Both draw the same values: the report's.

A value a member does not have (it did not fit, it failed) is drawn as no bar and named below the
chart ("OOM: ..."), as the paper marks its out-of-memory cases.
"""

from __future__ import annotations

from pathlib import Path

from charllm.engine.campaign.report import Figure, Panel
from charllm.probes.analysis.render import format_figure
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError

SHADES = " ░▒▓█"
IMAGE_SUFFIXES = (".svg", ".png")
TICK_WIDTH = 14          # characters of a category under its bar


def terminal(fig: Figure, width: int = 100, height: int = 20) -> str:
    """The figure as text: one plotext chart per panel (a heatmap as a grid of shades), each with
    its title, window and units, and the members without a value named."""
    out = [fig.title, f"window: {fig.window}"]
    if fig.kind == "heatmap":
        out.append(heatmap_text(fig))
    else:
        for panel in fig.panels:
            out.append(_panel_text(panel, fig.x_axis, width, height))
    out += [f"note: {n}" for n in fig.notes]
    return "\n".join(out) + "\n"


def _panel_text(panel: Panel, x_axis: str, width: int, height: int) -> str:
    import plotext as plt  # deferred: only figures draw with it

    plt.clear_figure()
    plt.plotsize(width, height)
    plt.theme("clear")   # no colours: the chart reads the same in a pipe, a file and a terminal
    if not draw_panel(plt, panel, x_axis):
        return f"{panel.title}: no values"
    text = plt.uncolorize(plt.build())   # plain text: the same in a pipe, a file and a terminal
    below = caption(panel)
    return f"{text}\n{below}" if below else text


def draw_panel(plt, panel: Panel, x_axis: str) -> bool:
    """Draw the panel's bars, title and axis on `plt`: plotext itself, or a textual-plotext widget's
    (the workbench's Campaign screen), so both draw the same; False when it has no category."""
    categories = _categories(panel)
    if not categories:
        return False
    data = [[_value(s, x) for x in categories] for s in panel.series]
    labels = [s.label for s in panel.series]
    ticks = _ticks(categories)
    if len(data) == 1:
        plt.bar(ticks, data[0])
    else:
        plt.multiple_bar(ticks, data, labels=labels)
    plt.title(f"{panel.title} ({panel.unit})" if panel.unit else panel.title)
    plt.xlabel(x_axis)
    return True


def caption(panel: Panel) -> str:
    """What goes under a panel's chart: its tick key and the members it has no value for."""
    return "\n".join(line for line in (tick_key(panel), no_values(panel)) if line)


def tick_key(panel: Panel) -> str:
    """What the panel's numbered ticks stand for ("" when its ticks are its categories)."""
    categories = _categories(panel)
    ticks = _ticks(categories)
    if ticks == [_short(x, TICK_WIDTH) for x in categories]:
        return ""
    return "; ".join(f"{t}: {x}" for t, x in zip(ticks, categories))


def no_values(panel: Panel) -> str:
    """The members the panel has no value for, and why ("" when it has every value)."""
    marks = [f"{s.label} {x}: {why}" for s in panel.series for x, why in s.marks.items()]
    return "no value: " + "; ".join(marks) if marks else ""


def _categories(panel: Panel) -> list[str]:
    return list(dict.fromkeys(x for s in panel.series for x in s.x))


def _ticks(categories: list[str]) -> list[str]:
    """The x tick labels: the categories, shortened; numbers where two would read the same once
    shortened (plotext would merge them, and a reader could not tell them apart)."""
    short = [_short(x, TICK_WIDTH) for x in categories]
    return short if len(set(short)) == len(short) else [str(i) for i in range(1, len(categories) + 1)]


def _value(series, x: str) -> float:
    """The bar's height (0 where the member has none: it is named below the chart)."""
    if x not in series.x:
        return 0.0
    y = series.y[series.x.index(x)]
    return float(y) if y is not None else 0.0


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def heatmap_text(fig: Figure) -> str:
    """A heatmap figure as a grid of shades, GPUs by members, with its scale and the members' names."""
    if not fig.values:
        return "(no per-GPU values)"
    metric = fig.panels[0].metric
    flat = [v for row in fig.values for v in row if v is not None]
    low, high = (min(flat), max(flat)) if flat else (0.0, 1.0)
    span = (high - low) or 1.0
    label_w = max(len(r) for r in fig.rows)
    lines = [f"{metric.replace('_', ' ')}: {SHADES[1]} {format_figure(metric, low)} .. {SHADES[-1]} "
             f"{format_figure(metric, high)}; columns: members"]
    lines += [f"{'':>{label_w}}  " + " ".join(f"{j + 1:>2}" for j in range(len(fig.columns)))]
    for row, values in zip(fig.rows, fig.values):
        cells = []
        for v in values:
            shade = " ·" if v is None else " " + SHADES[1 + min(3, int((v - low) / span * 4))]
            cells.append(shade + " ")
        lines.append(f"{row:>{label_w}}  " + "".join(c[:3] for c in cells))
    lines += [f"  {j + 1:>2}: {name}" for j, name in enumerate(fig.columns)]
    return "\n".join(lines)


def write_image(fig: Figure, path: str | Path) -> Path:
    """The figure as an SVG or PNG file (matplotlib), written whole or not at all."""
    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise UserError(f"--out {str(path)!r}: give a .svg or .png file")
    try:
        import matplotlib  # deferred: the optional plot extra
    except ImportError:
        raise UserError("--out an image needs matplotlib: pip install 'charllm-tui[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: the optional plot extra

    if fig.kind == "heatmap":
        figure, axes = plt.subplots(figsize=(max(6, len(fig.columns) * 0.5 + 3), max(4, len(fig.rows) * 0.3 + 2)))
        data = [[float("nan") if v is None else v for v in row] for row in fig.values] or [[float("nan")]]
        image = axes.imshow(data, aspect="auto", cmap="inferno")
        axes.set_yticks(range(len(fig.rows)), fig.rows)
        axes.set_xticks(range(len(fig.columns)), fig.columns, rotation=60, ha="right")
        figure.colorbar(image, ax=axes, label=fig.panels[0].axis if fig.panels else "")
        axes.set_title(fig.title)
    elif not fig.panels:          # nothing to draw (no member has a value): the image says why
        figure, axes = plt.subplots(figsize=(11, 2))
        axes.axis("off")
        axes.text(0.5, 0.5, "\n".join(fig.notes) or "no values", ha="center", va="center", wrap=True)
        figure.suptitle(f"{fig.title}\n{fig.window}", fontsize=9)
    else:
        figure, grid = plt.subplots(len(fig.panels), 1, figsize=(11, 3.2 * max(1, len(fig.panels))), squeeze=False)
        for axes, panel in zip(grid[:, 0], fig.panels):
            categories = list(dict.fromkeys(x for s in panel.series for x in s.x))
            width = 0.8 / max(1, len(panel.series))
            for k, s in enumerate(panel.series):
                xs = [categories.index(x) + k * width for x in s.x]
                axes.bar(xs, [0.0 if y is None else y for y in s.y], width=width, label=s.label)
                for x, why in s.marks.items():
                    axes.annotate(why, (categories.index(x) + k * width, 0), rotation=90, fontsize=7,
                                  ha="center", va="bottom")
            axes.set_xticks([i + width * (len(panel.series) - 1) / 2 for i in range(len(categories))], categories,
                            rotation=30, ha="right", fontsize=7)
            axes.set_ylabel(panel.axis)
            axes.set_xlabel(fig.x_axis)
            axes.set_title(panel.title, fontsize=9)
            if len(panel.series) > 1:
                axes.legend(fontsize=7)
        figure.suptitle(f"{fig.title}\n{fig.window}", fontsize=9)
    figure.tight_layout()
    fmt = path.suffix.lower()[1:]
    write_atomic(path, lambda tmp: figure.savefig(tmp, format=fmt))
    plt.close(figure)
    return path
