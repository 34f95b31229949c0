"""Summary windows: "steady" spans the non-warm-up iterations of the log (falls back to "all",
with a note, when there is no log); "all" is every sample; (start_s, end_s) are seconds after the
run's first sample."""

from __future__ import annotations

from typing import cast

import polars as pl

from charllm.probes.core.errors import UserError

_NS = 1e9


def window_phrase(label: str) -> str:
    """What a summary's `window` label covers, in words (every figure shown names its window)."""
    if label == "steady":
        return "the steady window (non-warm-up iterations)"
    if label == "all":
        return "all samples"
    start, _, end = label.partition(":")
    return f"seconds {start} to {end} after the first sample"

def parse_window(text: str):
    """The CLI's --window: steady | all | START:END (seconds after the run's first sample)."""
    if text in ("steady", "all"):
        return text
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(start), float(end)
    except ValueError:
        raise UserError(f"--window {text!r}: expected steady, all or START:END in seconds, e.g. 10:70") from None


def resolve_window(window, iterations: pl.DataFrame, first_ns: int):
    """(start_ns, end_ns or None for "until the last sample", label, notes) for a window spec."""
    if window == "steady":
        steady = iterations.filter(~pl.col("warmup"))
        if steady.height:
            return cast(int, steady["start_ns"].min()), cast(int, steady["end_ns"].max()), "steady", []
        why = "no iteration log" if iterations.height == 0 else "no steady (non-warm-up) iterations"
        return first_ns, None, "all", [f"{why}: window 'all' used instead of 'steady'"]
    if window == "all":
        return first_ns, None, "all", []
    if isinstance(window, str):
        window = parse_window(window)
    try:
        start_s, end_s = (float(x) for x in window)
    except (TypeError, ValueError):
        raise UserError(f"window = {window!r}: expected 'steady', 'all' or (start_s, end_s)") from None
    label = f"{start_s:g}:{end_s:g}"
    if not 0 <= start_s < end_s:
        raise UserError(f"window {label}: need 0 <= start < end (seconds after the run's first sample)")
    return first_ns + int(start_s * _NS), first_ns + int(end_s * _NS), label, []


def in_window(start_ns: int | None, end_ns: int | None) -> pl.Expr:
    keep = pl.lit(True)
    if start_ns is not None:
        keep &= pl.col("ts_ns") >= start_ns
    if end_ns is not None:
        keep &= pl.col("ts_ns") <= end_ns
    return keep
