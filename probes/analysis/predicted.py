"""Predicted against measured: what the plan (`engine.model.speed`) says a run's layout takes and
draws, beside what the run's iteration log and telemetry show, with the error; and the power model
of a hardware fitted to its recorded runs.

`predicted_vs_measured(run)` is the one place the two meet: `summarize`, the Compare screen and a
campaign's summary read it. The prediction is made now, for the experiment the run recorded
(`experiment.toml`), with today's rates (a node calibration, a power fit from `power_fit`), and says
where they come from. Errors are predicted / measured - 1: +10% means the model expected 10% more
than ran.
"""

from __future__ import annotations

import math
import os

import polars as pl

from charllm.engine.model import speed
from charllm.engine.model.experiment import Experiment
from charllm.probes.analysis.iterations import read_experiment
from charllm.probes.analysis.summary import summarize
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir, resolve_run

# (metric, its summary column, the prediction's name, unit) in reading order. Each measured figure is
# the window's mean, as the plan's are: the step is the mean step (the window's time over its steps),
# so tokens/s and MFU (the window's tokens and FLOPs over that time) follow from it as the plan's do.
METRICS = (
    ("step time", "iter_time_mean_s", "step_s", "s"),
    ("tokens/s", "tokens_per_s", "tokens_per_s", "tokens/s"),
    ("MFU", "mfu_pct", "mfu_pct", "%"),
    ("power per GPU", "power_mean_w", "power_w", "W"),
    ("energy per token", "energy_per_token_j", "energy_per_token_j", "J"),
    ("samples/(s·MJ)", "efficiency_samples_per_s_mj", "samples_per_s_mj", "samples/(s·MJ)"),
)

# What the step's timeline through the board's power limiter predicts (engine.model.power), beside the same
# window's NVML figures: (metric, summary column, PowerReport field, unit, scale to the unit). "power per GPU"
# above is the speed model's mean without the limiter; the limiter's mean is the one the board should show.
LIMITER_METRICS = (
    ("power per GPU, limiter", "power_mean_w", "mean_w", "W", 1.0),
    ("power p99", "power_p99_w", "p99_w", "W", 1.0),
    ("power peak", "power_peak_w", "peak_w", "W", 1.0),
    ("at the power limit", "throttle_sw_power_cap_frac", "limit_share", "%", 100.0),
    ("SM clock", "sm_clock_mean_mhz", "sm_clock_mhz", "MHz", 1.0),
    ("GPU temperature", "temp_gpu_mean_c", "temp_steady_c", "°C", 1.0),
    ("GPU temperature peak", "temp_gpu_peak_c", "temp_peak_c", "°C", 1.0),
)


def prediction(exp: Experiment) -> dict:
    """What the speed model predicts for `exp`, by the names of METRICS, with its sources (all None,
    and why, where the hardware lacks a figure the model needs)."""
    fast = speed.estimate(exp)
    if fast is None:
        return {name: None for _, _, name, _ in METRICS} | {"source": speed.unknown(exp)}
    return {"step_s": fast.step_s, "tokens_per_s": fast.tokens_per_s,
            "mfu_pct": 100 * fast.mfu if fast.mfu is not None else None, "power_w": fast.power_w,
            "energy_per_token_j": fast.energy_per_token_j, "samples_per_s_mj": fast.samples_per_s_mj,
            "source": speed.describe(exp)}


def limiter_prediction(exp: Experiment) -> dict:
    """What the power limiter's timeline predicts for `exp`, by the PowerReport fields of LIMITER_METRICS
    scaled to their units, with the source of each metric ({} where it predicts nothing: no board limit,
    or no step time)."""
    from charllm.engine.model import power  # deferred: the limiter's timeline (only for this comparison)

    report = power.predict(exp)      # (None without a board limit or a step time, as speed.estimate)
    if report is None:
        return {}
    figures = report.to_dict()
    out = {}
    for metric, _, name, _, scale in LIMITER_METRICS:
        if figures.get(name) is not None:
            temperature = name.startswith("temp")
            out[metric] = (scale * figures[name], f"temperature: {report.temp_source}" if temperature
                           else f"power limit: {report.source}")
    return out


def predicted_vs_measured(run: RunDir | str | os.PathLike, window="steady") -> pl.DataFrame:
    """One row per METRICS and LIMITER_METRICS entry the run measured: `metric`, `unit`, `predicted`,
    `measured` (the run-level summary over `window`) and `error_pct` ((predicted / measured - 1) x 100),
    and `source` (where the prediction's rates come from; "simulated telemetry" is added where the run's
    telemetry is simulated). A run without an experiment.toml has nothing to predict: UserError."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    found = read_experiment(run.experiment_path)
    if found is None:
        raise UserError(f"run {run.id}: no experiment.toml, so no plan to predict it from")
    predicted = prediction(found.experiment)
    measured = summarize(run, window, by="run").row(0, named=True)
    simulated = "; simulated telemetry" if measured.get("simulated") else ""
    limited = limiter_prediction(found.experiment)
    compared = [(metric, column, unit, predicted[name], predicted["source"]) for metric, column, name, unit in METRICS]
    compared += [(metric, column, unit, *limited[metric]) for metric, column, _, unit, _ in LIMITER_METRICS
                 if metric in limited]
    scales = {metric: scale for metric, _, _, _, scale in LIMITER_METRICS}
    rows = []
    for metric, column, unit, want, source in compared:
        have = measured.get(column)
        if have is None or want is None or not math.isfinite(have) or have <= 0:
            continue
        have *= scales.get(metric, 1.0)
        rows.append({"metric": metric, "unit": unit, "predicted": float(want), "measured": float(have),
                     "error_pct": 100 * (want / have - 1), "source": source + simulated})
    return pl.DataFrame(rows, schema={"metric": pl.String, "unit": pl.String, "predicted": pl.Float64,
                                      "measured": pl.Float64, "error_pct": pl.Float64, "source": pl.String})


def memory_vs_measured(run: RunDir | str | os.PathLike) -> dict | None:
    """The plan's peak memory (the allocator's peak on the busiest pipeline stage, engine.model.memory)
    beside the highest allocator peak any rank of the run reported (`mem_peak_bytes` of its iteration log:
    the workload's, or a command's memory reports), with the error; None where either is unknown: no
    experiment, or no device allocator (a CPU run reports its process size or nothing)."""
    from charllm.engine.model.memory import estimate  # deferred: the memory model (only for this comparison)

    run = run if isinstance(run, RunDir) else resolve_run(run)
    found = read_experiment(run.experiment_path)
    if found is None or found.experiment.hardware.vendor == "cpu":
        return None
    peaks = [r["mem_peak_bytes"] for r in run.iteration_records()
             if isinstance(r, dict) and type(r.get("mem_peak_bytes")) is int and r["mem_peak_bytes"] > 0]
    if not peaks:
        return None
    planned, measured = estimate(found.experiment).peak_bytes, max(peaks)
    return {"planned_bytes": planned, "measured_bytes": measured, "error_pct": 100 * (planned / measured - 1)}


def render(table: pl.DataFrame) -> str:
    """The comparison as an aligned text table, one line per metric, and where the prediction comes from."""
    if table.height == 0:
        return ""
    rows = [("predicted (the plan) against measured", "predicted", "measured", "error")]
    rows += [
        (r["metric"], _figure(r["predicted"], r["unit"]), _figure(r["measured"], r["unit"]), f"{r['error_pct']:+.1f}%")
        for r in table.iter_rows(named=True)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"{row[0]:{widths[0]}s}  " + "  ".join(f"{cell:>{widths[i + 1]}s}" for i, cell in enumerate(row[1:]))
             for row in rows]
    sources = dict.fromkeys(table["source"])                  # each once, in the order the metrics need them
    return "\n".join(lines + [f"({source})" for source in sources]) + "\n"


def _figure(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "°C":
        return f"{value:.1f} °C"
    digits = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{digits} {unit}"
