"""Every rank's step, and the slowest ranks named, as Megatron's StragglerDetector names them.

Each rank's step timers (engine.workload.timers, in the iteration log: RunDir.rank_steps) over the
window's steps, per rank or per pipeline stage: the median over steps of each timer. A rank's own
work is `compute_s` (its forward and backward compute, timed on its device); a straggler has more
of it than the others, and the others wait for it (their pipeline_wait_s and grad_reduce_s grow,
their compute does not). So ranks are compared by compute: `vs_median` is a rank's compute over
the median of its peers' (the ranks of its pipeline stage, which do the same work, where the stage
has several; else all ranks, so that one stage's heavier share shows too), and a rank more than
STRAGGLER_RATIO times that median is a straggler.
Megatron-LM's StragglerDetector (megatron/core/utils.py) likewise times each rank's own compute
and reports the slowest and fastest ranks with their power, temperature, utilization and clock;
where the run has GPU telemetry, each rank's GPU (gpu<local rank> on its node) gives those here.

Profiled steps (a profiler trace slows them) and warm-up steps are left out of the steady window.
"""

from __future__ import annotations

import os
from typing import cast

import polars as pl

from charllm.probes.analysis.summary import has_accelerators, summarize
from charllm.probes.analysis.windows import resolve_window
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.rundir import RunDir, rank_rows, resolve_run
from charllm.probes.store.schema import RANK_TIMERS

STRAGGLER_RATIO = 1.1     # compute 10 % above the median rank's
BY = ("rank", "stage")
GPU_FIGURES = ("power_mean_w", "temp_gpu_mean_c", "sm_clock_mean_mhz", "util_gpu_mean_pct")


def rank_steps(run: RunDir, window="steady") -> tuple[pl.DataFrame, str, list[str]]:
    """The window's (rank, step) rows, its label, and notes (the damaged lines skipped first)."""
    skipped: list[str] = []
    steps = run.rank_steps(skipped)
    if steps.height == 0:
        raise UserError(f"run {run.id}: no per-rank step timers in its iteration log (the workload of this "
                        "version logs them on rank 0's lines; an import or an older run has none)"
                        + "".join(f"; {line}" for line in skipped))
    rows, label, notes = choose_steps(steps, window, run.id)
    return rows, label, skipped + notes


def choose_steps(steps: pl.DataFrame, window="steady", name: str = "run") -> tuple[pl.DataFrame, str, list[str]]:
    """The (rank, step) rows (RunDir.rank_steps) inside `window`, its label and notes: "steady"
    leaves out warm-up and profiled steps."""
    every = steps.group_by("iteration").agg(pl.col("start_ns").min(), pl.col("end_ns").max(),
                                            pl.col("warmup").fill_null(False).any(),
                                            pl.col("profiled").fill_null(False).any())
    iterations = every.drop_nulls(["start_ns", "end_ns"])
    notes = [f"{plural(every.height - iterations.height, 'step')} without a start and end time left out"] \
        if iterations.height < every.height else []
    if window == "steady":
        clean = iterations.filter(~pl.col("profiled"))
        if clean.height < iterations.height:
            notes.append(
                f"{plural(iterations.height - clean.height, 'profiled step')} left out (the profiler slows them)"
            )
        iterations = clean
    if iterations.height == 0:
        raise UserError(f"{name}: no step to summarize ({'; '.join(notes) or 'none logged'})")
    start_ns, end_ns, label, more = resolve_window(window, iterations, cast(int, iterations["start_ns"].min()))
    notes += more
    chosen = iterations.filter((pl.col("start_ns") >= start_ns) & (pl.col("end_ns") <= (end_ns or 2**63 - 1)))
    if chosen.height == 0:
        raise UserError(f"{name}: window {label}: no whole step in it")
    return steps.join(chosen.select("iteration"), on="iteration"), label, notes


def rank_summary(run: RunDir | str | os.PathLike, window="steady", by: str = "rank") -> pl.DataFrame:
    """Per rank (or pipeline stage): the median over the window's steps of each step timer, the
    compute against the median rank's (`vs_median`), `straggler`, and (per rank, where the run has
    GPU telemetry) its GPU's mean power, temperature, SM clock and utilization. Sorted slowest first."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    if by not in BY:
        raise UserError(f"--by {by!r}: step timers are per rank or per stage (rank, stage)")
    steps, label, notes = rank_steps(run, window)
    per_rank = rank_table(steps, by)
    if by == "rank":
        per_rank = _with_gpus(run, per_rank, window)
    return (per_rank.sort("vs_median", descending=True, nulls_last=True)
            .with_columns(pl.lit(run.id).alias("run"), pl.lit(by).alias("level"), pl.lit(label).alias("window"),
                          pl.lit("; ".join(notes) or None, pl.String).alias("notes")))


def rank_table(steps: pl.DataFrame, by: str = "rank") -> pl.DataFrame:
    """Per rank (or stage) of the chosen steps: each timer's median over steps, `vs_median` and
    `straggler` (see the module's docstring), slowest first."""
    timers = [c for c in RANK_TIMERS if c in steps.columns]
    per_rank = (steps.group_by("rank").agg(pl.col("node", "local_rank", "pp_rank", "tp_rank", "dp_rank").first(),
                                           pl.len().alias("steps"), *(pl.col(t).median() for t in timers))
                .sort("rank"))
    median = per_rank["compute_s"].median()
    peers = pl.when(pl.len().over("pp_rank") > 1).then(pl.col("compute_s").median().over("pp_rank")) \
        .otherwise(pl.lit(median, pl.Float64))
    per_rank = per_rank.with_columns(peers.alias("peers_compute_s"))
    if by == "stage":
        per_rank = (per_rank.group_by("pp_rank").agg(pl.len().alias("ranks"), pl.col("steps").max(),
                                                     pl.col("node").unique().sort().str.join(", ").alias("nodes"),
                                                     *(pl.col(t).mean() for t in timers))
                    .sort("pp_rank").with_columns(pl.lit(median, pl.Float64).alias("peers_compute_s")))
    per_rank = per_rank.with_columns(
        pl.when(pl.col("peers_compute_s") > 0).then(pl.col("compute_s") / pl.col("peers_compute_s")).alias("vs_median"))
    per_rank = per_rank.with_columns((pl.col("vs_median") > STRAGGLER_RATIO).fill_null(False).alias("straggler"))
    return per_rank.sort("vs_median", descending=True, nulls_last=True)


def _with_gpus(run: RunDir, ranks: pl.DataFrame, window) -> pl.DataFrame:
    """Each rank's GPU figures (gpu<local rank> on its node), where the run recorded GPUs."""
    try:
        if not has_accelerators(run):
            return ranks
        gpus = summarize(run, window, by="gpu").select("node", "device", *(c for c in GPU_FIGURES))
    except UserError:
        return ranks
    keyed = ranks.with_columns(pl.concat_str(pl.lit("gpu"), pl.col("local_rank").cast(pl.String)).alias("device"))
    return keyed.join(gpus, on=["node", "device"], how="left")


def stragglers(summary: pl.DataFrame, most: int = 3) -> list[str]:
    """The slowest ranks (or stages), each as a line: who, where, and how much slower."""
    lines = []
    rows = summary.filter(pl.col("straggler")).head(most).iter_rows(named=True)
    for row in rows:
        who = f"rank {row['rank']}" if "rank" in row else f"stage {row['pp_rank']}"
        where = []
        if row.get("node"):
            where.append(f"node {row['node']}")
        if "rank" in row and row.get("pp_rank") is not None:
            where.append(f"stage {row['pp_rank']}")
        share = f" ({', '.join(where)})" if where else ""
        lines.append(f"{who}{share}: compute {row['vs_median']:.2f}x its peers' median "
                     f"({row['compute_s'] * 1e3:.0f} ms against {row['peers_compute_s'] * 1e3:.0f} ms a step)")
    return lines


def straggler_line(summary: pl.DataFrame) -> str:
    """One line naming the stragglers, or saying there are none (the slowest, with its lead)."""
    lines = stragglers(summary)
    if lines:
        return "stragglers: " + "; ".join(lines)
    slowest = summary.row(0, named=True)
    who = f"rank {slowest['rank']}" if "rank" in slowest else f"stage {slowest['pp_rank']}"
    ratio = slowest["vs_median"]
    return (f"no straggler: the slowest, {who}, computes {ratio:.2f}x its peers' median (within "
            f"{STRAGGLER_RATIO:g}x)" if ratio is not None else "no compute timings")


def steps_phrase(label: str) -> str:
    """Which steps a rank summary's medians cover, in words."""
    return {"steady": "the steady steps (after warm-up; profiled steps left out)", "all": "every step"}.get(
        label, f"the steps within seconds {label.replace(':', ' to ')} after the first")


def recent_line(records: list[dict], steps: int = 10) -> str | None:
    """The stragglers of a run's last `steps` steady steps, from iteration-log records as a follower
    sees them (Live); None before any step has timers."""
    rows = rank_rows(records)
    if rows.height == 0:
        return None
    steady = rows.filter(~pl.col("warmup").fill_null(False) & ~pl.col("profiled").fill_null(False))
    rows = steady if steady.height else rows
    last = rows["iteration"].unique().sort().tail(steps)
    table = rank_table(rows.filter(pl.col("iteration").is_in(last.implode())))
    return f"last {plural(last.len(), 'step')}: {straggler_line(table)}"
