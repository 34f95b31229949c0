"""Iteration statistics (run-wide) from the iteration log, iterations that lie wholly inside the
window: TFLOP/s per GPU uses Megatron's FLOP count (`engine.model.flops`), MFU is against the
hardware's dense peak in the precision the run's matrix multiplies ran in (`flops.peak_tflops`), efficiency is
samples/s per MJ of energy per iteration (the paper's
samples/(s·MJ))."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import PEAK_FIELDS, flops_per_iteration, peak_tflops
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError

_NS = 1e9


@dataclass(frozen=True)
class ExperimentFile:
    """A run's experiment.toml as the typed Experiment, and the tables the file itself gives. The engine
    writes it fully resolved; a hand-written one may leave the cluster or the global batch out, which
    are then unknown (the telemetry's devices count, the iteration log's samples), not defaults."""

    experiment: Experiment
    data: dict

    def gives(self, section: str, name: str | None = None) -> bool:
        table = self.data.get(section)
        return isinstance(table, dict) and bool(table) and (name is None or table.get(name) is not None)


def read_experiment(path: Path) -> ExperimentFile | None:
    """The experiment at `path` (RUN_DIR/experiment.toml); None when the run has none."""
    path = Path(path)
    if not path.is_file():
        return None
    data = paths.read_toml(path, "experiment file")
    try:
        return ExperimentFile(Experiment.from_dict(data, source=str(path)), data)
    except UserError as exc:   # a preset it names is gone, say: name the run's file
        raise UserError(exc if str(path) in str(exc) else f"{path}: {exc}") from None


def iteration_stats(iterations, start_ns, end_ns, exp_file: ExperimentFile | None, n_gpus: int | None,
                    tf32: bool | None = None):
    """`tf32`: whether the run allowed TF32 for fp32 matmuls, as its workload recorded it."""
    its = iterations.filter((pl.col("start_ns") >= start_ns) & (pl.col("end_ns") <= end_ns))
    if its.height == 0:
        return {}, [] if iterations.height == 0 else ["no whole iteration inside the window"]
    notes = []
    exp = exp_file.experiment if exp_file else None
    seq = exp.seq_length if exp else None
    gbs = exp.training.global_batch_size if exp and exp_file and exp_file.gives("training", "global_batch_size") \
        else None
    its = its.with_columns(
        ((pl.col("end_ns") - pl.col("start_ns")) / _NS).alias("time_s"),
        pl.col("samples").fill_null(pl.lit(gbs, dtype=pl.Int64)),  # gbs is None without experiment.toml
    ).with_columns(pl.col("tokens").fill_null(pl.col("samples") * seq))
    total_s = its["time_s"].sum()
    samples, tokens = its["samples"].sum(), its["tokens"].sum()
    out = {
        "iterations": its.height,
        "iter_time_mean_s": its["time_s"].mean(),
        "iter_time_p50_s": its["time_s"].quantile(0.5, "linear"),
        "iter_time_p99_s": its["time_s"].quantile(0.99, "linear"),
        "samples_total": samples or None, "tokens_total": tokens or None,
        "samples_per_s": samples / total_s if samples and total_s > 0 else None,
        "tokens_per_s": tokens / total_s if tokens and total_s > 0 else None,
    }
    world = (exp.world_size if exp and exp_file and exp_file.gives("cluster") else None) or n_gpus
    tflops = None
    if exp and world and total_s > 0 and its["samples"].null_count() == 0:
        flops = sum(flops_per_iteration(exp, int(s)) for s in its["samples"])
        tflops = flops / total_s / world / 1e12
    elif its["tflops_per_gpu"].null_count() < its.height:
        tflops = its["tflops_per_gpu"].mean()
        notes.append("TFLOP/s from the iteration log (no experiment.toml)")
    out["tflops_per_gpu"] = tflops
    out["mfu_pct"] = None
    if exp and tflops is not None:
        precision, peak = peak_tflops(exp, tf32)
        if peak:
            out["mfu_pct"] = 100 * tflops / peak
        else:
            notes.append(f"MFU not applicable: hardware {exp.hardware.name!r} gives no {precision} peak "
                         f"({PEAK_FIELDS[precision]})")
    return out, notes


def span_stats(steps: pl.DataFrame, part: pl.DataFrame, exp_file: ExperimentFile | None) -> dict:
    """`iteration_stats` of the window from the first start to the last end of `part`, some of a run's
    `steps` (`rundir.merged_steps`). With its non-warm-up steps that is the steady window `summarize`
    resolves, so Live shows the figures Runs, Compare and `summarize` give; {} for no steps."""
    if part.height == 0:
        return {}
    return iteration_stats(steps, part["start_ns"].min(), part["end_ns"].max(), exp_file, None)[0]


def with_iteration_stats(table: pl.DataFrame, it: dict) -> pl.DataFrame:
    names = ["iterations", "iter_time_mean_s", "iter_time_p50_s", "iter_time_p99_s", "samples_total",
             "tokens_total", "samples_per_s", "tokens_per_s", "tflops_per_gpu", "mfu_pct"]
    table = table.with_columns(
        pl.lit(it.get(n), pl.Int64 if n in ("iterations", "samples_total", "tokens_total") else pl.Float64).alias(n)
        for n in names
    )
    energy = pl.col("energy_j") if "energy_j" in table.columns else pl.lit(None, pl.Float64)  # host-only runs
    per_iter = energy / pl.col("iterations")
    return table.with_columns(
        per_iter.alias("energy_per_iteration_j"),
        (energy / pl.col("tokens_total")).alias("energy_per_token_j"),
        (pl.col("samples_per_s") / (per_iter / 1e6)).alias("efficiency_samples_per_s_mj"),
    ).drop("samples_total")
