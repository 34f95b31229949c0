"""How sizes, durations and times read, in every command and screen.

Sizes are binary (1 GiB = 2**30 bytes). Durations are seconds. Times are shown in this machine's
local time zone — `runs list`, `runs show` and the Runs screen alike — while what is stored stays
zone-free (nanoseconds since the epoch; run ids carry a UTC stamp).
"""

from __future__ import annotations

import math
import time

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def gib(n: float, digits: int = 2, unit: bool = True) -> str:
    """`n` bytes in GiB, whatever its size: "0.04 GiB", "79.65 GiB" ("79.65" without the unit: a table
    whose heading says GiB)."""
    return f"{n / GIB:.{digits}f}" + (" GiB" if unit else "")


def size(n: float, digits: int = 2, mib_digits: int = 1) -> str:
    """`n` bytes in GiB, or in MiB below one GiB (a CPU run's model is small): "1.50 GiB", "12.0 MiB"."""
    return f"{n / GIB:.{digits}f} GiB" if abs(n) >= GIB else f"{n / MIB:.{mib_digits}f} MiB"


def binary_scale(n: float) -> tuple[float, str]:
    """`n` bytes in the largest binary unit it reaches: (1.5, "GiB"); (512, "B") below one KiB."""
    return next(((n / s, u) for s, u in ((TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")) if abs(n) >= s),
                (float(n), "B"))


def number(value: float) -> str:
    """A bound or limit as messages write it: integers with separators ("10,000"), other numbers in
    their shortest form ("100", "0.5")."""
    return f"{value:,}" if isinstance(value, int) else f"{value:,g}"


def duration(seconds: float, digits: int = 1) -> str:
    """A span of time in seconds, `digits` decimals, and below a second at least three significant
    digits: "12.5 s", "0.0821 s" (never "0.1 s"); "about 10 s left" keeps the 0 decimals it asks for."""
    if seconds and math.isfinite(seconds) and abs(seconds) < 1:
        digits = max(digits, 2 - math.floor(math.log10(abs(seconds))))
    return f"{seconds:.{digits}f} s"


def seconds(value: float) -> str:
    """A step time, three significant digits: "0.0531 s", "13.5 s"."""
    return f"{value:.3g} s"


def si(value: float, unit: str, digits: int = 3) -> str:
    """An amount in SI prefixes, `digits` significant: "471 PFLOP", "4.71 EFLOP"."""
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}"


def count(value: float, digits: int = 3) -> str:
    """A parameter count as models are named: "70.6B", "335M", "12.3K"."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g}{suffix}"
    return f"{value:.{digits}g}"


def local_time(ns: int | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """A stored time (ns since the epoch) in the local zone; "-" when there is none, "?" for one
    no calendar holds (a damaged record)."""
    if not ns:
        return "-"
    try:
        return time.strftime(fmt, time.localtime(ns / 1e9))
    except (OverflowError, OSError, ValueError):
        return "?"


def clock(ns: int | None = None) -> str:
    """The local time of day, "14:03:07", of `ns` (ns since the epoch) or of now; "?" for a time
    no calendar holds."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(None if ns is None else ns / 1e9))
    except (OverflowError, OSError, ValueError):
        return "?"
