"""Summaries as text and files: figures with their units, tables for a terminal or Markdown,
CSV, JSON and Parquet."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import polars as pl

from charllm.probes.analysis import SUMMARY_FORMATS
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import binary_scale

# Units of the summary's figures, by how their column names end (longest first); each figure is
# shown with its unit at about four significant digits.
_UNITS = (
    ("_samples_per_s_mj", "samples/(s·MJ)"),
    ("tokens_per_s_per_gpu", "tokens/s"),
    ("tokens_per_s", "tokens/s"),
    ("samples_per_s", "samples/s"),
    ("tflops_per_gpu", "TFLOP/s"),
    ("_w_per_s", "W/s"),
    ("_bytes_s", "B/s"),
    ("_bytes", "B"),
    ("_frac", "%"),
    ("_pct", "%"),
    ("_mhz", "MHz"),
    ("_w", "W"),
    ("_c", "°C"),
    ("_j", "J"),
    ("_s", "s"),
)
_COUNTS = ("iterations", "samples", "gpus", "tokens_total")
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"))


def format_figure(metric: str, value) -> str:
    """A summary figure as text with its unit: `1.52049e+09, "energy_j"` -> "1.520 GJ".

    Joules and seconds take SI prefixes, bytes binary ones, fractions show as percentages;
    large figures and counts keep thousands separators.
    """
    if value is None or isinstance(value, str):
        return "" if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if value != value:  # nan
        return "nan"
    unit = next((u for suffix, u in _UNITS if metric.endswith(suffix)), "")
    if unit == "%" and metric.endswith("_frac"):
        value *= 100
    if unit in ("B", "B/s"):
        value, scaled = binary_scale(value)
        unit = scaled + unit[1:]
    elif unit in ("J", "s") and value and not (unit == "s" and abs(value) >= 1):
        scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), _PREFIXES[-1])
        value, unit = value / scale, prefix + unit
    if unit == "tokens/s" or metric in _COUNTS or metric.endswith("_count"):  # tokens/s: as Live and Runs show it
        text = f"{value:,.0f}"
    else:
        text = f"{value:,}" if isinstance(value, int) else _four_digits(value)
    return f"{text}{'' if unit == '%' else ' '}{unit}".rstrip()


# Words of metric names, as a reader says them (metric_label).
_WORDS = {
    "iter": "iteration",
    "temp": "temperature",
    "gpu": "GPU",
    "cpu": "CPU",
    "mem": "memory",
    "util": "utilization",
    "sm": "SM",
    "mfu": "MFU",
    "freq": "frequency",
    "nvlink": "NVLink",
    "pcie": "PCIe",
    "ib": "InfiniBand",
    "net": "network",
    "dram": "DRAM",
    "bw": "bandwidth",
    "iowait": "I/O wait",
    "tx": "sent",
    "rx": "received",
    "hw": "HW",
    "sw": "SW",
    "app": "application",
    "perf": "power or heat",
    "p50": "median",
    "avg": "average",
}
_STATISTICS = ("mean", "peak", "median", "p99", "min", "spread", "total", "count")
_MEASURED = ("temperature", "utilization")       # temp_gpu -> GPU temperature
# Figures whose whole name is their unit.
_UNIT_NAMES = {"tokens_per_s": "tokens per second", "tokens_per_s_per_gpu": "tokens per second per GPU",
               "samples_per_s": "samples per second",
               "tflops_per_gpu": "TFLOP/s per GPU"}


def metric_unit(metric: str) -> str:
    """A summary figure's unit as an axis names it ("W", "°C", "samples/(s·MJ)"; fractions "%")."""
    return next((u for suffix, u in _UNITS if metric.endswith(suffix)), "")


def metric_label(metric: str) -> str:
    """A summary figure's name in words, its statistic last and its unit left to the figure beside it
    (format_figure): "temp_gpu_peak_c" -> "GPU temperature, peak", "tokens_per_s" -> "tokens per second"."""
    if metric in _UNIT_NAMES:
        return _UNIT_NAMES[metric]
    suffix = next((s for s, _ in _UNITS if metric.endswith(s) and len(s) < len(metric)), "")
    words = [_WORDS.get(w, w) for w in metric.removesuffix(suffix).split("_") if w]
    if len(words) > 1 and words[0] in _MEASURED:
        words[0:2] = [words[1], words[0]]
    statistic = words.pop() if len(words) > 1 and words[-1] in _STATISTICS and words[-2] != "over" else None
    if words[0] == "throttle":
        return "throttled: " + " ".join(words[1:])
    if words[0] == "violation":   # the driver's violation-time counters
        return "clocks held down: " + " ".join(words[1:])
    return " ".join(words) + (f", {statistic}" if statistic else "")


def _four_digits(value: float) -> str:
    """About four significant digits, thousands separated, no exponent: 3,355 · 57.73 · 0.0123."""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude == 0:
        return "0"
    decimals = 3 - math.floor(math.log10(magnitude))
    return f"{value:.{min(decimals, 6)}f}"


def render(df: pl.DataFrame, fmt: str, labels: list[str] | None = None) -> str:
    """A summary (or any tidy frame) as text: table | markdown | csv | json. The table forms name
    each row's column by its node and device (a summary's rows), or by `labels` when given."""
    if fmt == "csv":
        return df.write_csv()
    if fmt == "json":
        return df.write_json()
    if fmt == "markdown":
        return text_table(_long(df, labels), markdown=True)
    if fmt == "table":
        return _terminal_table(_long(df, labels))
    raise UserError(f"format {fmt!r}: expected one of table, markdown, csv, json (parquet needs --out FILE)")


def write_summary(df: pl.DataFrame, target: str | os.PathLike, fmt: str | None = None) -> str | None:
    """Render to a format name (returns the text) or write to a file (format from `fmt` or the suffix)."""
    if fmt is None and str(target) in SUMMARY_FORMATS:
        if target == "parquet":
            raise UserError("format 'parquet' is binary: give a file to write it to (--out FILE)")
        return render(df, str(target))
    path = Path(target)
    fmt = fmt or {".parquet": "parquet", ".csv": "csv", ".json": "json", ".md": "markdown",
                  ".txt": "table"}.get(path.suffix.lower())
    if fmt not in SUMMARY_FORMATS:
        raise UserError(f"--out {str(path)!r}: unknown format; use a .parquet, .csv, .json, .md or .txt name, "
                        "or give --format")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, df.write_parquet if fmt == "parquet" else render(df, fmt))
    return None


def _long(df: pl.DataFrame, labels: list[str] | None = None) -> pl.DataFrame:
    """Metrics as rows, one column per GPU / node / run (or per `labels`): readable however many metrics."""
    names = list(labels or [])
    for row in df.iter_rows(named=True) if labels is None else ():
        parts = [row.get("run")] if row.get("level") == "run" or "level" not in df.columns else []
        parts += [row.get(k) for k in ("node", "device") if row.get(k)]
        names.append("/".join(str(p) for p in parts if p) or str(row.get("run", "value")))
    columns: dict[str, list[str]] = {"metric": df.columns}
    for name, values in zip(names, df.iter_rows()):
        columns[name] = [format_figure(metric, v) for metric, v in zip(df.columns, values)]
    return pl.DataFrame(columns)


def _terminal_table(long: pl.DataFrame, width: int | None = None) -> str:
    """`_long`'s table for a terminal: rows that are the same in every column are said once above
    it ("backend: sim"), and the columns are cut into blocks as wide as the terminal."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    names = long.columns[1:]
    same = long.filter(pl.all_horizontal(pl.col(n) == pl.col(names[0]) for n in names)) if len(names) > 1 \
        else long.clear()
    head = "".join(f"{m}: {v}\n" for m, v in same.select("metric", names[0]).iter_rows() if v) if same.height else ""
    rest = long.filter(~pl.col("metric").is_in(same["metric"].to_list()))
    metric_width = max(map(len, rest["metric"].to_list() + ["metric"])) + 3

    def column_width(name: str) -> int:
        return max(map(len, rest[name].to_list() + [name])) + 3

    blocks: list[list[str]] = []
    block: list[str] = []
    used = metric_width
    for name in names:
        if block and used + column_width(name) > width:
            blocks.append(block)
            block, used = [], metric_width
        block.append(name)
        used += column_width(name)
    blocks.append(block)
    return head + "\n".join(text_table(rest.select("metric", *b), markdown=False) for b in blocks)


def text_table(df: pl.DataFrame, markdown: bool) -> str:
    with pl.Config(
        tbl_formatting="MARKDOWN" if markdown else "UTF8_FULL_CONDENSED",
        tbl_hide_column_data_types=True, tbl_hide_dataframe_shape=True,
        tbl_rows=-1, tbl_cols=-1, tbl_width_chars=60_000, fmt_str_lengths=200, tbl_cell_alignment="LEFT",
    ):
        return str(df) + "\n"
