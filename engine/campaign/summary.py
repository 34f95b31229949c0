"""A campaign's numbers: one row per member, from each member run's kept summary.

The figures are the run-level summary of the steady window (probes.analysis.summary), which the
run's supervisor keeps when it ends: reading 200 members reads 200 small Parquet files. A member
without a completed run (skipped, invalid, failed, still queued) has its status and no figures.
"""

from __future__ import annotations

import polars as pl

from charllm.engine.campaign.state import Record, member_note, member_status
from charllm.probes.analysis.predicted import METRICS
from charllm.probes.analysis.summary import cached_summary, summarize
from charllm.probes.core.errors import UserError

# The run-level summary's columns a campaign row shows, in reading order (units in the names).
FIGURES = (
    "iter_time_mean_s",
    "iter_time_p50_s",
    "tokens_per_s",
    "mfu_pct",
    "energy_per_token_j",
    "efficiency_samples_per_s_mj",
    "power_mean_w",
    "power_peak_w",
    # the paper's bursts: how high and how fast power rises, and how often and how far it leaves the
    # run's mean and the board limit (probes.analysis.device_stats.excursions)
    "power_p99_w",
    "power_max_rise_w_per_s",
    "spikes_over_mean_count",
    "spikes_over_limit_count",
    "spikes_over_limit_max_excess_w",
    "time_over_limit_s",
    "temp_gpu_mean_c",
    "temp_gpu_peak_c",
    "sm_clock_mean_mhz",
    "throttle_perf_frac",
    "throttle_sw_power_cap_frac",
    "throttle_hw_slowdown_frac",
    "throttle_sw_thermal_frac",
    "nvlink_tx_bytes",
    "nvlink_rx_bytes",
    "pcie_tx_bytes",
    "pcie_rx_bytes",
    "gpus",
    "simulated",
)
WINDOW = "steady"


def member_summary(record: Record, member: dict, by: str = "run") -> pl.DataFrame | None:
    """The member's summary at level `by` (its kept one, else made now and kept), or None when it
    has no completed run or nothing to summarize."""
    rd = record.run_dir(member)
    if rd is None or member_status(record, member) != "completed":
        return None
    try:
        kept = cached_summary(rd, WINDOW, by)
        return kept if kept is not None else summarize(rd, WINDOW, by=by)
    except UserError:
        return None


def campaign_summary(record: Record) -> pl.DataFrame:
    """One row per member: index, name, status, layout, the varied settings, the figures, and why a
    member has none (its plan's verdict, or its run's failure)."""
    varied_keys = list(dict.fromkeys(k for m in record.members for k in m.get("varied", {})))
    rows = []
    for m in record.members:
        status = member_status(record, m)
        row = {"member": m["index"] + 1, "name": m["name"], "status": status, "layout": m.get("layout"),
               **{k: _text(m.get("varied", {}).get(k)) for k in varied_keys},
               "run": m.get("run"), "verdict": m.get("verdict"),
               "why": member_note(m, status) or None}
        df = member_summary(record, m)
        figures = df.row(0, named=True) if df is not None and df.height else {}
        row.update({name: figures.get(name) for name in FIGURES})
        row.update(_planned(m.get("planned") or {}, figures))
        rows.append(row)
    schema = {"member": pl.Int64, "name": pl.String, "status": pl.String, "layout": pl.String,
              **{k: pl.String for k in varied_keys}, "run": pl.String, "verdict": pl.String, "why": pl.String}
    frame = pl.DataFrame(rows, schema_overrides=schema, infer_schema_length=None)
    numbers = [c for c in (*FIGURES, *(p for row in PLANNED for p in row[2:])) if c not in ("gpus", "simulated")]
    return frame.with_columns(pl.col(c).cast(pl.Int64 if c.endswith("_count") else pl.Float64) for c in numbers)


# The plan beside the measurement (engine.model.speed at the campaign's start), each against the
# figure probes.analysis.predicted compares it with, and its error as predicted gives it (planned /
# measured - 1).
_MEASURED = {name: column for _, column, name, _ in METRICS}
PLANNED = (("step_s", _MEASURED["step_s"], "planned_step_s", "step_error_pct"),
           ("power_w", _MEASURED["power_w"], "planned_power_w", "power_error_pct"))


def _planned(planned: dict, measured: dict) -> dict:
    out = {}
    for name, column, shown, error in PLANNED:
        value, real = planned.get(name), measured.get(column)
        out[shown] = value
        out[error] = 100 * (value / real - 1) if value is not None and real else None
    return out


def _text(value) -> str | None:
    return None if value is None else str(value)
