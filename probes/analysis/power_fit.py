"""The power model of a hardware, fitted to its recorded runs.

`calibrate_power(hardware)` fits idle and full-load power to the finished, real (not simulated)
runs of that hardware: each run's mean power per device (its kept run summary, steady window)
against the share of the board's dynamic range the step-time model says its layout keeps busy
(`engine.model.speed.utilization`). With two or more runs of clearly different utilization both
figures are fitted (least squares); with one, the preset's idle power stays and the full-load power
is fitted. The fit is saved beside the node calibrations (`engine.model.calibration.save_power`)
and every later plan of that hardware uses it, saying "calibrated from N recorded runs". What
finishes a run refits its hardware (`refit_for`, from `summary.keep_summaries`).

Only a completed run counts (an imported crash is a failed one), and only a plausible one: its mean
power at most FULL_LOAD_MAX of the board's limit. A fit whose idle power falls outside IDLE_RANGE of
the limit, or whose full load exceeds FULL_LOAD_MAX of it, is not saved. The saved fit names the runs
it came from and those it left out; `doctor --show` lists it.
"""

from __future__ import annotations

import math

from charllm.engine.model import calibration, speed
from charllm.engine.model.experiment import Hardware
from charllm.probes.analysis.cache import kept_places, read_kept
from charllm.probes.analysis.iterations import read_experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir, list_runs

IDLE_RANGE = (0.05, 0.60)     # a plausible idle power, as shares of the board's limit
FULL_LOAD_MAX = 1.10          # a plausible full load (or a run's mean power), as a share of the limit


def power_points(hardware: str) -> list[tuple[str, float, float]]:
    """(run id, the model's utilization of its layout, its measured mean power per GPU) of every
    finished run of `hardware` with a kept run summary of real (not simulated) GPU telemetry."""
    import numpy as np  # deferred: start-up time (loaded with polars by the callers anyway)

    points = []
    for run in list_runs():
        try:
            point = _point(run, hardware)
        except (UserError, OSError):
            continue                  # a damaged or unreadable run costs only itself
        if point is not None:
            exp, watts = point
            if speed.missing(exp):
                continue                  # no step time, so no utilization to fit against
            times = speed.step_times(exp, speed.layouts_of(exp))
            points.append((run.id, float(speed.utilization(np, times)[0]), watts))
    return points


def _point(run: RunDir, hardware: str | None):
    """(its experiment, its measured mean power per GPU) where `run` is a finished, real run of
    `hardware` (any hardware with a board limit, for None) with a kept run summary; else None."""
    if run.status != "completed":               # a failed run (a crash) says nothing of full load
        return None
    found = read_experiment(run.experiment_path)
    if found is None or not found.experiment.hardware.tdp_w:
        return None
    if hardware is not None and found.experiment.hardware.name != hardware:
        return None
    places = kept_places(run, "steady", ("run",))
    kept = read_kept(*places["run"]) if places else None
    if kept is None or kept.height == 0:
        return None
    row = kept.row(0, named=True)
    watts = row.get("power_mean_w")
    if row.get("simulated") or watts is None or not row.get("iterations") or not math.isfinite(watts):
        return None
    return found.experiment, float(watts)


def refit_for(run: RunDir) -> dict | None:
    """Refit the power model of `run`'s hardware where the run itself can count (finished, real GPU
    telemetry, a board limit, a kept summary); else leave every fit as it is."""
    point = _point(run, None)
    return calibrate_power(point[0].hardware.name) if point else None


def calibrate_power(hardware: str) -> dict | None:
    """Fit `hardware`'s power model to its recorded runs and save it (see the module docstring);
    None, and nothing saved, where there is no run to fit or the fit makes no sense (idle at or above
    full load)."""
    preset = Hardware.load(hardware)
    limit = preset.tdp_w or math.inf
    found = power_points(hardware)
    points = [p for p in found if p[2] <= FULL_LOAD_MAX * limit]
    left_out = [{"run": run, "power_w": round(w, 1), "why": f"above {FULL_LOAD_MAX:.0%} of the {limit:g} W limit"}
                for run, _, w in found if w > FULL_LOAD_MAX * limit]
    if not points:
        return None
    u = [p[1] for p in points]
    w = [p[2] for p in points]
    if len(points) >= 2 and max(u) - min(u) > 0.05:
        mean_u, mean_w = sum(u) / len(u), sum(w) / len(w)
        slope = sum((a - mean_u) * (b - mean_w) for a, b in zip(u, w)) / sum((a - mean_u) ** 2 for a in u)
        idle, top, how = mean_w - slope * mean_u, mean_w + slope * (1 - mean_u), "idle and full load fitted"
    else:
        idle = preset.idle_w
        top = idle + (sum(w) / len(w) - idle) / max(sum(u) / len(u), 1e-3)
        how = f"full load fitted, idle {idle:g} W from the preset"
    if not plausible(idle, top, preset.tdp_w):
        return None
    if preset.tdp_w:
        top = min(top, preset.tdp_w)          # the board holds its power limit
    record = {"idle_w": round(idle, 1), "max_w": round(top, 1), "runs": len(points), "how": how,
              "points": [{"run": run, "utilization": round(a, 4), "power_w": round(b, 1)} for run, a, b in points],
              "left_out": left_out}
    calibration.save_power(hardware, record)
    return record


def plausible(idle_w: float, full_w: float, limit_w: float | None) -> bool:
    """Whether a fitted idle and full-load power are a board's: idle within IDLE_RANGE of its limit,
    full load above idle and at most FULL_LOAD_MAX of the limit (no limit: only the order)."""
    if not 0 <= idle_w < full_w:
        return False
    if not limit_w:
        return True
    return IDLE_RANGE[0] * limit_w <= idle_w <= IDLE_RANGE[1] * limit_w and full_w <= FULL_LOAD_MAX * limit_w
