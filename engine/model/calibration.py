"""Node calibrations: what `charllm-tui doctor --train` measured on a node, one file per hardware.

    <data dir>/calibrations/<hardware>.json

`plan`, `sweep` and Compose use the calibration of an experiment's hardware in place of the
preset's assumptions: the node's software stack (which transformer implementation "auto" becomes,
what can run there), the memory the allocator can use, and the memory outside it. They say
"calibrated on NODE, DATE" where they would otherwise say "assumed"; the step-time model
(`engine.model.speed`) takes the large-GEMM efficiency the node's train check achieved. A damaged
file counts as no calibration (and says so once on stderr), never as an error that stops planning.

Power calibrations come from recorded runs instead (`probes.analysis.predicted.calibrate_power`):

    <data dir>/calibrations/<hardware>.power.json
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from charllm.engine.model.runtime import Stack, assumed
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError
from charllm.probes.core.files import read_bounded
from charllm.probes.store.rundir import write_json_atomic

VERSION = 1


@dataclass(frozen=True)
class Calibration:
    hardware: str                     # the hardware preset this node was calibrated as
    node: str
    date: str                         # YYYY-MM-DD (UTC) of the measurement
    stack: Stack                      # the node's software
    usable_bytes: int | None          # what the framework could allocate (torch's total capacity)
    outside_allocator_bytes: int | None   # device memory in use outside the caching allocator
    devices: int                      # devices the calibration job trained on (NCCL peers: devices - 1)
    reserve_fraction: float | None    # reserved beyond the allocated peak, per byte of churn (memory.Budget)
    expandable_segments: bool | None  # the allocator setting that figure was measured with
    data: dict                        # the whole record (versions, devices, measurements)
    matmul_efficiency: float | None = None   # share of the dense peak large GEMMs reached (speed model)

    @property
    def source(self) -> str:
        return self.stack.source


def directory() -> Path:
    return paths.data_dir() / "calibrations"


def path_for(hardware: str) -> Path:
    return directory() / f"{hardware}.json"


def save(record: dict) -> Path:
    """Write a calibration record (atomically); `record` as `charllm.engine.doctor` builds it."""
    record = {"version": VERSION, **record}
    target = path_for(record["hardware"])
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, record)
    _cached.cache_clear()
    return target


def load(hardware: str) -> Calibration | None:
    """The calibration for `hardware`, or None (none saved, or the file is damaged)."""
    return _read_by_mtime(path_for(hardware), _cached)


def _read_by_mtime(target: Path, read):
    """`read(target, mtime)`, a cached reader keyed by both, so a file is parsed again only once it has
    changed; None where there is no file."""
    try:
        stamp = target.stat().st_mtime_ns
    except OSError:
        return None
    return read(str(target), stamp)


def _parse(target: Path, data: dict) -> Calibration:
    memory = data.get("memory") or {}
    node, date = str(data["node"]), str(data["date"])
    return Calibration(hardware=str(data["hardware"]), node=node, date=date,
                       stack=Stack.from_dict(data["stack"], source=f"calibrated on {node}, {date}"),
                       usable_bytes=_int(memory.get("usable_bytes")),
                       outside_allocator_bytes=_int(memory.get("outside_allocator_bytes")),
                       devices=int(memory.get("devices") or 1),
                       reserve_fraction=_fraction(memory.get("reserve_fraction")),
                       expandable_segments=memory.get("expandable_segments") if isinstance(
                           memory.get("expandable_segments"), bool) else None, data=data,
                       matmul_efficiency=_share((data.get("speed") or {}).get("matmul_efficiency")))


def _share(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and 0 < value <= 1 else None


def _fraction(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and 0 <= value < 10 else None


def _int(value) -> int | None:
    return int(value) if isinstance(value, (int, float)) and value >= 0 else None


@functools.lru_cache(maxsize=32)   # keyed by path and mtime: a new calibration is seen at once
def _cached(target: str, stamp: int) -> Calibration | None:
    try:
        data = json.loads(read_bounded(target, 2**20, "calibration"))
        return _parse(Path(target), data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, UserError) as exc:
        print(f"charllm-tui: warning: {target}: not a usable calibration ({exc.__class__.__name__}: {exc}); "
              "ignored (run `charllm-tui doctor --train` again)", file=sys.stderr)
        return None


def delete(hardware: str) -> bool:
    try:
        os.remove(path_for(hardware))
    except FileNotFoundError:
        return False
    _cached.cache_clear()
    return True


def for_planning(hardware) -> Stack:
    """The stack of the node calibrated for this hardware (`charllm-tui doctor`), else assumed."""
    found = load(hardware.name)
    return found.stack if found else assumed(hardware)


# --------------------------------------------------------------------------------------------
# Power, from recorded runs
# --------------------------------------------------------------------------------------------
def power_path(hardware: str) -> Path:
    return directory() / f"{hardware}.power.json"


def save_power(hardware: str, record: dict) -> Path:
    """Write a power calibration (`probes.analysis.predicted.calibrate_power` builds it) atomically."""
    target = power_path(hardware)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, {"version": VERSION, "hardware": hardware, **record})
    _power.cache_clear()
    return target


def drop_power(hardware: str) -> bool:
    """Forget `hardware`'s power calibration; False where none is saved."""
    try:
        power_path(hardware).unlink()
    except FileNotFoundError:
        return False
    _power.cache_clear()
    return True


def saved_power() -> list[dict]:
    """Every saved power calibration ({hardware, idle_w, max_w, runs, points, ...}), by hardware."""
    suffix = ".power.json"
    names = sorted(p.name[: -len(suffix)] for p in directory().glob(f"*{suffix}")) if directory().is_dir() else []
    return [{"hardware": name, **fit} for name in names if (fit := load_power(name)) is not None]


def load_power(hardware: str) -> dict | None:
    """{idle_w, max_w, runs, ...} fitted to `hardware`'s recorded runs, or None (none, or damaged)."""
    return _read_by_mtime(power_path(hardware), _power)


@functools.lru_cache(maxsize=32)   # keyed by path and mtime, as _cached
def _power(target: str, stamp: int) -> dict | None:
    try:
        data = json.loads(read_bounded(target, 2**20, "power calibration"))
        idle, top, runs = float(data["idle_w"]), float(data["max_w"]), int(data["runs"])
        if not (0 <= idle < top < 100_000) or runs < 1:
            raise ValueError(f"idle {idle} W, max {top} W, {runs} runs")
        return {**data, "idle_w": idle, "max_w": top, "runs": runs}
    except (OSError, ValueError, KeyError, TypeError, RecursionError, UserError) as exc:
        print(f"charllm-tui: warning: {target}: not a usable power calibration ({exc.__class__.__name__}: {exc}); "
              "ignored", file=sys.stderr)
        return None
