"""Runs and baselines side by side: each metric, its change from the baseline, better or worse.

`compare(refs, baseline=None)` summarizes each run (run level, steady window) or loads each
baseline, and measures every metric against the baseline (the first ref unless named).
Direction matters: lower energy, temperature, throttling and iteration time are better;
higher throughput, MFU, clocks and efficiency are better; a change beyond the threshold
(default 5 %) is flagged "better" or "worse" ("changed" for metrics with no direction).
Experiments may differ: the fields that differ are listed first (`experiment_diff`).

A ref is a run (id, prefix/suffix or directory) or a baseline name; `baseline:NAME` says
"the baseline" explicitly when a run has the same name.
"""

from __future__ import annotations

import json
import os
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import polars as pl

from charllm.probes.analysis import COMPARE_FORMATS, baselines
from charllm.probes.analysis.render import format_figure, metric_label, text_table
from charllm.probes.analysis.summary import summarize
from charllm.probes.analysis.windows import window_phrase
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import resolve_run

DEFAULT_THRESHOLD_PCT = 5.0

# Columns that identify or describe a summary rather than measure the run.
_NOT_METRICS = {"run", "level", "node", "device", "gpus", "simulated", "backend", "window", "window_start_s",
                "window_end_s", "notes", "energy_source", "hottest_gpu", "coolest_gpu", "highest_power_gpu",
                "lowest_power_gpu", "uuid", "temp_limit_c", "max_sm_clock_mhz", "power_limit_w"}

_HIGHER_BETTER = ("samples_per_s", "tokens_per_s", "tflops_per_gpu", "mfu_pct", "efficiency_", "sm_clock_mean",
                  "sm_clock_min", "util_gpu", "sm_active", "sm_occupancy", "tensor_active")
_LOWER_BETTER = (
    "energy_",
    "cpu_energy",
    "dram_energy",
    "power_mean",
    "power_peak",
    "power_p99",
    "power_max_rise",
    "power_spread",
    "temp_",
    "time_above",
    "time_over",
    "throttle_",
    "violation_",
    "below_max_clock",
    "spikes_",
    "iter_time_",
)


# The table reads as a user asks: how fast and how efficient, then the GPUs' power and heat, then
# the hosts; bookkeeping (duration, samples) last. Metrics keep the summary's order within a prefix.
_SECTIONS = (
    ("iterations", "iter_time_", "tokens_per_s", "samples_per_s", "tflops_per_gpu", "mfu_pct", "efficiency_",
     "energy_per_", "energy_j", "tokens_total"),
    ("power_", "spikes_", "time_over_", "temp_gpu", "temp_mem", "time_above", "sm_clock", "below_max_clock",
     "throttle_", "violation_", "util_", "sm_active", "sm_occupancy", "tensor_active", "dram_bw", "mem_used",
     "nvlink_", "pcie_", "gpus"),
    ("host_", "cpu_", "temp_cpu", "dram_", "ib_", "net_"),
)


def reading_order(metrics: list[str]) -> list[str]:
    """`metrics` in the order the table shows them (see _SECTIONS)."""
    def rank(item):
        position, metric = item
        for section, prefixes in enumerate(_SECTIONS):
            for k, prefix in enumerate(prefixes):
                if metric.startswith(prefix):
                    return section, k, position
        return len(_SECTIONS), 0, position
    return [m for _, m in sorted(enumerate(metrics), key=rank)]


# Figures measured against the run's own mean power (spikes over it, time over it): a burstier run
# can have fewer of them over a lower mean, so across runs they are changes, not better or worse.
_RELATIVE_TO_ITSELF = "_over_mean"


def direction(metric: str) -> str | None:
    """"higher" or "lower" when that way is better; None for metrics that are neither (bytes, counts)
    or that measure a run against itself."""
    if _RELATIVE_TO_ITSELF in metric:
        return None
    if any(metric.startswith(p) for p in _HIGHER_BETTER):
        return "higher"
    if any(metric.startswith(p) for p in _LOWER_BETTER):
        return "lower"
    return None


@dataclass
class CompareResult:
    labels: list[str]                      # one per ref, in the order compared
    baseline: str                          # the label figures are measured against
    table: pl.DataFrame                    # tidy: metric, ref, value, baseline_value, delta, delta_pct, better, flag
    experiment_diff: pl.DataFrame          # field + one column per ref, only the fields that differ
    threshold_pct: float
    notes: list[str] = field(default_factory=list)
    windows: dict[str, str] = field(default_factory=dict)  # ref -> its summary's window label
    refs: list[str] = field(default_factory=list)          # the ref each label came from, as given

    @property
    def window_text(self) -> str:
        """The window every figure covers, in words (or what each ref's is, when they differ)."""
        if len(set(self.windows.values())) == 1:
            return f"figures over {window_phrase(next(iter(self.windows.values())))}"
        return "figures over different windows: " + ", ".join(f"{k}: {v}" for k, v in self.windows.items())

    @property
    def baseline_ref(self) -> str:
        """The ref (as given) of the baseline."""
        return self.refs[self.labels.index(self.baseline)]

    def wide(self) -> pl.DataFrame:
        """Display form: the window row, then one row per metric: each ref's figure with its unit,
        and for the others the % change and flag."""
        rows = [{"metric": "window", "better": "", **{label: self.windows.get(label, "") for label in self.labels},
                 **{f"{label} vs base": "" for label in self.labels if label != self.baseline}}]
        for metric, part in self.table.group_by("metric", maintain_order=True):
            row = {"metric": metric[0], "better": part["better"][0] or ""}
            for r in part.iter_rows(named=True):
                row[r["ref"]] = format_figure(metric[0], r["value"])
                if r["ref"] != self.baseline:
                    pct = r["delta_pct"]
                    mark = f"{pct:+.1f}%" if pct is not None else ""
                    row[f"{r['ref']} vs base"] = f"{mark} {r['flag'] or ''}".strip()
            rows.append(row)
        return pl.DataFrame(rows, infer_schema_length=None)


def compare(refs: list[str], baseline: str | None = None, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
            window="steady") -> CompareResult:
    refs = [*refs]
    if baseline is not None and baseline not in refs:
        refs.insert(0, baseline)
    if len(refs) < 2:
        raise UserError("compare: give at least two runs or baselines (or one and --baseline NAME)")
    if not 0 <= threshold_pct < 1e6:  # nan, inf and 1e400 (inf) compare false
        raise UserError(f"--threshold {threshold_pct}: must be a percentage from 0 to 1,000,000")
    # Runs are summarized side by side (polars frees the GIL while it works); each ref once. On 2 idle
    # cores this is the faster way (4 cold 1-h runs: 1.5-1.8 s against 1.7-2.1 s one after another), on
    # busy ones a wash; it costs peak memory (0.75-0.9 GB against 0.5; benchmarks/bench_summary.py).
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = {ref: pool.submit(_load, ref, window) for ref in dict.fromkeys(refs)}
        loaded = [futures[ref].result() for ref in refs]
    labels = _unique([label for label, _, _ in loaded])
    base_label = labels[refs.index(baseline)] if baseline is not None else labels[0]

    summaries = [s.with_columns(pl.lit(label).alias("ref")) for label, (_, s, _) in zip(labels, loaded)]
    wide = pl.concat(summaries, how="diagonal_relaxed")
    metrics = [c for c, t in wide.schema.items() if c not in _NOT_METRICS and c != "ref" and t.is_numeric()]
    if not metrics:
        raise UserError("compare: the summaries share no metrics (are these runs' summaries from this version?)")
    long = (
        wide.select("ref", *(pl.col(m).cast(pl.Float64) for m in metrics))
        .unpivot(index="ref", variable_name="metric", value_name="value")
    )
    base = long.filter(pl.col("ref") == base_label).select("metric", pl.col("value").alias("baseline_value"))
    better = pl.col("metric").map_elements(direction, return_dtype=pl.String)
    delta = pl.col("value") - pl.col("baseline_value")
    pct = pl.when(pl.col("baseline_value") != 0).then(100 * delta / pl.col("baseline_value").abs())
    improved = pl.when(pl.col("better") == "higher").then(pl.col("delta") > 0).otherwise(pl.col("delta") < 0)
    table = (
        long.join(base, on="metric", how="left", maintain_order="left")
        .with_columns(delta.alias("delta"), pct.alias("delta_pct"), better.alias("better"))
        .with_columns(
            pl.when((pl.col("ref") == base_label) | (pl.col("delta_pct").abs() <= threshold_pct)
                    | pl.col("delta_pct").is_null()).then(None)
            .when(pl.col("better").is_null()).then(pl.lit("changed"))
            .when(improved).then(pl.lit("better")).otherwise(pl.lit("worse")).alias("flag")
        )
        .select("metric", "ref", "value", "baseline_value", "delta", "delta_pct", "better", "flag")
    )
    order = {m: i for i, m in enumerate(reading_order(metrics))}
    table = table.sort(pl.col("metric").replace_strict(order, return_dtype=pl.Int64), maintain_order=True)

    notes = []
    windows = {label: s["window"][0] for label, (_, s, _) in zip(labels, loaded) if "window" in s.columns}
    if len(set(windows.values())) > 1:
        notes.append("windows differ: " + ", ".join(f"{k}: {v}" for k, v in windows.items()))
    simulated = {label: bool(s["simulated"][0]) for label, (_, s, _) in zip(labels, loaded) if "simulated" in s.columns}
    if len(set(simulated.values())) > 1:
        notes.append("simulated and measured runs are mixed: " +
                     ", ".join(k for k, v in simulated.items() if v) + " simulated")
    by_note: dict[str, list[str]] = {}  # a note several summaries share is said once
    for label, (_, s, _) in zip(labels, loaded):
        for note in (s["notes"][0] or "").split("; ") if "notes" in s.columns else ():
            if note:
                by_note.setdefault(note, []).append(label)
    notes += [f"{', '.join(refs_with)}: {note}" for note, refs_with in by_note.items()]
    return CompareResult(labels, base_label, table, _experiment_diff(labels, [e for _, _, e in loaded]),
                         threshold_pct, notes, windows, refs)


def _load(ref: str, window) -> tuple[str, pl.DataFrame, dict]:
    """(label, run-level summary, experiment as a dict) for a run or a baseline."""
    explicit = ref.startswith("baseline:")
    name = ref.removeprefix("baseline:")
    if not explicit:
        try:
            run = resolve_run(ref)
        except UserError:
            if not baselines.exists(name):
                raise UserError(f"{ref!r}: neither a run nor a baseline (see `charllm-tui runs` and "
                                "`charllm-tui baseline list`)") from None
        else:
            exp = paths.read_toml(run.experiment_path, "experiment file") if run.experiment_path.is_file() else {}
            return run.id, summarize(run, window, by="run"), exp
    b = baselines.show(name)
    return f"baseline:{name}", b.summary, tomllib.loads(b.experiment_toml) if b.experiment_toml else {}


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _experiment_diff(labels: list[str], experiments: list[dict]) -> pl.DataFrame:
    """The fields whose values differ. A field one experiment lacks (an older run's) and another holds
    empty reads the same in both, and is no difference: `hardware.device_names` absent and []."""
    flat = [_flatten(e) for e in experiments]
    fields = sorted({k for f in flat for k in f} - {"name", "description"})

    def value(f: dict, k: str) -> str:
        v = f.get(k)
        return json.dumps(None if v in ([], {}, "") else v, sort_keys=True)

    differing = [k for k in fields if len({value(f, k) for f in flat}) > 1]
    data = {"field": differing}
    for label, f in zip(labels, flat):
        data[label] = ["" if f.get(k) is None else str(f.get(k)) for k in differing]
    return pl.DataFrame(data, schema={c: pl.String for c in data})


def render(result: CompareResult, fmt: str = "table") -> str:
    if fmt == "csv":
        return result.table.write_csv()
    if fmt == "json":
        return json.dumps({
            "baseline": result.baseline, "refs": result.labels, "threshold_pct": result.threshold_pct,
            "experiment_diff": result.experiment_diff.to_dicts(), "metrics": result.table.to_dicts(),
            "windows": result.windows, "notes": result.notes,
        }, indent=2) + "\n"
    if fmt not in ("table", "markdown"):
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(COMPARE_FORMATS)}")
    md = fmt == "markdown"
    parts = []
    if result.experiment_diff.height:
        parts.append(("## Experiment differences\n\n" if md else "Experiment differences\n")
                     + text_table(result.experiment_diff, md))
    heading = (f"Metrics, {result.window_text} (baseline {result.baseline}; "
               f"flagged beyond ±{result.threshold_pct:g}%)")
    # in words for a reader; the csv and json forms keep the metrics' names
    wide = result.wide().with_columns(pl.col("metric").map_elements(metric_label, return_dtype=pl.String))
    parts.append((f"## {heading}\n\n" if md else f"{heading}\n") + text_table(wide, md))
    if result.notes:
        parts.append("\n".join(("- " if md else "note: ") + n for n in result.notes) + "\n")
    return "\n".join(parts)
