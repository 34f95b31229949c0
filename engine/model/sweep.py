"""Layout sweep: every valid parallel layout of an experiment on its cluster, with its peak memory.

`sweep(base)` enumerates TP (within a node), CP, PP, VP, EP and the micro batch of the experiment
`base`, keeps the layouts `engine.model.validate` accepts, and estimates each with the memory model
(`engine.model.memory`): one row per layout, ranked. Everything else (model, hardware, precision,
attention, recompute settings, optimizer options) is `base`'s, so a row loaded back with
`layout_to_experiment(base, row)` plans to the same bytes. Recompute and the distributed optimizer
stay as `base` has them unless the caller asks to vary them too (`recompute=`, `distributed_optimizer=`);
a varied recompute choice other than `base`'s own uses the plain settings in RECOMPUTE.

Each row also carries what the step-time model (`engine.model.speed`) gives for the layout: the step
time, tokens/s, MFU, the shares of the step in compute, exposed communication, pipeline bubble, host-bound
time and the rest, the estimated power per device and energy per token, Megatron's FLOPs per iteration, and the
parameters (all, and the most on one device); `speed.step_times` evaluates every row at once.

Ranking (the `rank` column, 1 = most promising):
  1. layouts that fit first, then tight ones, then those that do not fit;
  2. more tokens per second (the step-time model: recompute, bubble and communication all cost time);
  3. more memory headroom.

How (`_Grid`): `engine.model.validate`'s rules see each layout shape (TP, CP, PP, VP, EP) once
(every micro batch shares the check: the micro batch only enters the batch rule, which the
enumeration applies itself) and every recompute and optimizer choice once per pipeline shape (see
`layouts`). Python then runs once per shape for what it holds (`memory.layout_terms`: the stage plan
and the parameters per stage, cached per pipeline split and TP/EP) and once per distinct activation
setting (`memory.activation_terms`, keyed by the fields whose metadata says they change
activations); every layout is a row of index arrays into those. The per-stage terms of all rows
sharing a stage plan and recompute setting are evaluated together as numpy arrays
(`memory.stage_arrays`, the arithmetic `estimate` runs), then the bytes of both optimizer settings
(`memory.combine`) and the verdicts (`memory.severity`, the one `estimate` uses) of every row at once.
`stage_table` shows the per-stage figures behind each row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from charllm.engine.model import calibration, memory, runtime, speed
from charllm.engine.model.experiment import (
    Cluster,
    Experiment,
    Hardware,
    ModelSpec,
    Training,
    microbatches,
    resolve_key,
)
from charllm.engine.model.validate import interleaving_problem, rule_problems, value_problems
from charllm.probes.core.errors import UserError

RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None},
    "selective": {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Fields each layout sets itself: a `training` option naming one would be silently overwritten.
SWEPT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
         "context_parallel_size", "expert_model_parallel_size", "sequence_parallel", "use_distributed_optimizer",
         "micro_batch_size", *RECOMPUTE["none"])

# The agreed columns (common.md); the sweep adds num_microbatches, bubble, peak_stage and static_bytes.
REQUIRED_COLUMNS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                    "data_parallel_size", "micro_batch_size", "recompute", "use_distributed_optimizer",
                    "sequence_parallel", "peak_bytes", "fits", "headroom_bytes", "rank")
COLUMNS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
           "context_parallel_size", "expert_model_parallel_size", "data_parallel_size", "micro_batch_size",
           "recompute", "use_distributed_optimizer", "sequence_parallel")

# What the step-time model (engine.model.speed) adds per layout
SPEED = ("step_s", "tokens_per_s", "mfu", *(f"{part}_share" for part in speed.SHARES),
         "power_w", "energy_per_token_j", "flops_per_iteration", "params", "params_per_device")
ORDER = ("rank", *COLUMNS, "num_microbatches", "bubble", *SPEED, "peak_bytes", "peak_stage", "static_bytes",
         "headroom_bytes", "verdict", "fits")


def base_experiment(model: ModelSpec | str, hardware: Hardware | str, nodes: int, gpus_per_node: int,
                    global_batch_size: int, seq_length: int | None = None,
                    training: dict[str, Any] | None = None, name: str = "sweep") -> Experiment:
    """The experiment every layout of a sweep starts from, when there is no composed one (`plan
    --model` plans it as it is: no parallelism until set)."""

    for size, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node),
                        ("global_batch_size", global_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{size} = {value!r}: must be a positive integer")
    exp = Experiment(name=name)
    exp.model = ModelSpec.load(model) if isinstance(model, str) else model
    exp.hardware = Hardware.load(hardware) if isinstance(hardware, str) else hardware
    exp.cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node)
    exp.training = Training(global_batch_size=global_batch_size, seq_length=seq_length)
    for key, value in (training or {}).items():
        section, field = resolve_key(key)
        if field in SWEPT:
            raise UserError(f"{key} = {value!r}: the sweep varies {field} itself; it cannot be fixed")
        if section not in ("training", "parallel"):
            raise UserError(f"{key} = {value!r}: only training and parallel options apply to a sweep "
                            f"(this is a {section} field)")
        exp.set(key, value)
    return exp


def recompute_name(exp: Experiment) -> str:
    """The experiment's recompute choice as a sweep names it: none, selective or full."""
    return exp.training.recompute_granularity or "none"


def layout_to_experiment(base: Experiment, row: dict[str, Any]) -> Experiment:
    """`base` with the layout of one sweep row applied."""
    exp = base.copy()
    _apply(exp, row, _recompute_settings(base))
    return exp


def _recompute_settings(base: Experiment) -> dict[str, dict[str, Any]]:
    """Each recompute choice's settings: `base`'s own for its choice, RECOMPUTE's for the others."""
    t = base.training
    own = {"recompute_granularity": t.recompute_granularity, "recompute_method": t.recompute_method,
           "recompute_num_layers": t.recompute_num_layers, "recompute_modules": t.recompute_modules}
    plain = {name: {**settings, "recompute_modules": None} for name, settings in RECOMPUTE.items()}
    return {**plain, recompute_name(base): own}


def _apply(exp: Experiment, row: dict[str, Any], recompute: dict[str, dict[str, Any]]) -> None:
    p, t = exp.parallel, exp.training
    p.tensor_model_parallel_size = int(row["tensor_model_parallel_size"])
    p.pipeline_model_parallel_size = int(row["pipeline_model_parallel_size"])
    vp = row.get("virtual_pipeline_model_parallel_size")
    p.virtual_pipeline_model_parallel_size = int(vp) if vp and vp > 1 else None
    p.context_parallel_size = int(row.get("context_parallel_size", 1))
    p.expert_model_parallel_size = int(row.get("expert_model_parallel_size", 1))
    p.sequence_parallel = bool(row.get("sequence_parallel", p.tensor_model_parallel_size > 1))
    p.use_distributed_optimizer = bool(row.get("use_distributed_optimizer", False))
    t.micro_batch_size = int(row["micro_batch_size"])
    _set_recompute(exp, row.get("recompute", "none"), recompute)


def _set_recompute(exp: Experiment, name: str, recompute: dict[str, dict[str, Any]]) -> None:
    for key, value in recompute[name].items():
        setattr(exp.training, key, value)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def layouts(base: Experiment, micro_batch_sizes=MICRO_BATCH_SIZES, recompute=tuple(RECOMPUTE),
            distributed_optimizer=(True, False)):
    """Every layout `engine.model.validate` accepts, as (shape, micro batches, choices) per (TP, CP, PP,
    VP, EP): the shape a dict of its sizes (with its data-parallel size and sequence parallelism), the
    micro batches that divide the global batch, and choices {recompute: [distributed-optimizer settings]}.
    `base`'s own values must have passed `validate.value_problems` (the layouts' values are good by
    construction, so only the rules are asked).

    The rules see each shape once, with its first micro batch (the micro batch only enters the batch
    rules, applied here: it divides the global batch and, interleaved, its micro-batch count suits the
    schedule's groups) and one recompute/optimizer choice. Which choices are valid is asked for
    every combination once per pipeline shape (PP, VP), the layout sizes the recompute rules read;
    tests/engine/model/test_sweep.py checks the result against `validate` on every combination."""
    m, world, gpn = base.model, base.world_size, base.cluster.gpus_per_node
    gbs, seq = base.training.global_batch_size, base.seq_length
    group = base.parallel.microbatch_group_size_per_vp_stage
    probe = base.copy()
    settings = _recompute_settings(base)
    sp_runs, cp_runs = _node_runs(base)
    # SP with TP > 1 unless the experiment runs TP without it
    sp_runs &= base.parallel.sequence_parallel or base.parallel.tensor_model_parallel_size == 1
    by_pipeline: dict[tuple[int, int], dict[str, list[bool]]] = {}
    for tp in _powers_of_two(gpn):                                  # TP stays inside a node
        if m.num_attention_heads % tp or m.query_groups % tp:
            continue
        for cp in _powers_of_two(world // tp) if cp_runs else [1]:
            if world % (tp * cp) or seq % (2 * cp if cp > 1 else 1):
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > m.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                vps = [1] + ([v for v in _divisors(m.num_layers // pp) if v > 1]
                             if pp > 1 and m.num_layers % pp == 0 else [])
                eps = [e for e in _divisors(m.num_moe_experts or 1) if (tp * cp * dp) % (e * tp) == 0] \
                    if m.is_moe else [1]
                divide = [b for b in micro_batch_sizes if gbs % (b * dp) == 0]
                for vp in vps if divide else ():
                    # the batch rules, applied here: the micro batch divides the global batch and, interleaved,
                    # gives micro-batch groups the schedule takes (validate.interleaving_problem)
                    batches = [b for b in divide if interleaving_problem(pp, vp, group, gbs, b, dp) is None]
                    if not batches:
                        continue
                    for ep in eps:
                        shape = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                 "virtual_pipeline_model_parallel_size": vp, "context_parallel_size": cp,
                                 "expert_model_parallel_size": ep, "data_parallel_size": dp,
                                 "sequence_parallel": tp > 1 and sp_runs}
                        _apply(probe, {**shape, "micro_batch_size": batches[0]}, settings)
                        choices = by_pipeline.get((pp, vp))
                        if choices is None:
                            choices = _valid_choices(probe, recompute, distributed_optimizer, settings)
                            if choices:              # else the layout may be at fault: ask again next time
                                by_pipeline[pp, vp] = choices
                        else:
                            name, dists = next(iter(choices.items()))
                            _set_recompute(probe, name, settings)
                            probe.parallel.use_distributed_optimizer = dists[0]
                            if rule_problems(probe):
                                continue
                        if choices:
                            yield shape, batches, choices


def _node_runs(base: Experiment) -> tuple[bool, bool]:
    """(sequence parallelism, context parallelism): whether the node planned for can run them
    (engine.model.runtime's rules, on the calibrated or assumed stack of the hardware). Without
    Transformer Engine neither runs, so the sweep proposes TP without SP and no CP there."""
    probe = base.copy()
    probe.parallel.tensor_model_parallel_size, probe.parallel.sequence_parallel = 2, True
    probe.parallel.context_parallel_size = 2
    refused = {p.field for p in runtime.problems(probe, calibration.for_planning(base.hardware))}
    return "sequence_parallel" not in refused, "context_parallel_size" not in refused


def _valid_choices(exp: Experiment, recompute, distributed_optimizer, settings) -> dict[str, list[bool]]:
    """{recompute: [distributed-optimizer settings]} whose rules `engine.model.validate` accepts for `exp`'s layout."""
    choices: dict[str, list[bool]] = {}
    for name in recompute:
        _set_recompute(exp, name, settings)
        for dist in distributed_optimizer:
            exp.parallel.use_distributed_optimizer = dist
            if not rule_problems(exp):
                choices.setdefault(name, []).append(dist)
    return choices


def sweep(base: Experiment, *, micro_batch_sizes=MICRO_BATCH_SIZES, recompute: tuple[str, ...] | None = None,
          distributed_optimizer: tuple[bool, ...] | None = None, fits_only: bool = False):
    """One row per valid layout of `base` with peak memory, verdict and headroom, most promising
    first. `recompute` and `distributed_optimizer`: the choices to vary (default: `base`'s own)."""
    import numpy as np  # deferred: start-up time (the CLI imports this module for every command)
    import polars as pl  # deferred: likewise

    grid = _Grid(base, micro_batch_sizes, recompute, distributed_optimizer)
    if not grid.rows:
        flags = ("use_distributed_optimizer", "sequence_parallel", "fits")
        floats = ("bubble", *SPEED)
        return pl.DataFrame(
            schema={
                name: pl.String
                if name in ("recompute", "verdict")
                else pl.Float64
                if name in floats
                else pl.Boolean
                if name in flags
                else pl.Int64
                for name in ORDER
            }
        )
    starts = np.flatnonzero(np.r_[True, grid.stage_row[1:] != grid.stage_row[:-1]])
    sizes = np.diff(np.r_[starts, len(grid.stage_row)])
    frames = []
    for d, dist in enumerate(grid.distributed_optimizer):
        st = grid.stage_bytes(dist)
        fast = grid.speed(dist)
        peak = np.maximum.reduceat(st["total"], starts)
        at_peak = st["total"] == np.repeat(peak, sizes)
        peak_stage = np.minimum.reduceat(np.where(at_peak, grid.stage_rank, 1 << 30), starts)
        # the static bytes of that stage (stages may tie on the peak with different static bytes)
        on_peak = grid.stage_rank == np.repeat(peak_stage, sizes)
        static = np.maximum.reduceat(np.where(on_peak, st["static"], 0), starts)
        headroom = np.minimum.reduceat(st["headroom"], starts)
        worst = np.maximum.reduceat(st["severity"], starts)
        frames.append(grid.layout_frame().with_columns(
            pl.lit(dist).alias("use_distributed_optimizer"),
            pl.Series("peak_bytes", peak.astype(np.int64)),
            pl.Series("peak_stage", peak_stage.astype(np.int64)),
            pl.Series("static_bytes", static.astype(np.int64)),
            pl.Series("headroom_bytes", headroom.astype(np.int64)),
            pl.Series("verdict", np.asarray(memory.VERDICTS)[worst]),
            pl.Series("fits", worst == memory.SEVERITY[memory.FITS]),
            pl.Series("_severity", worst),
            *(pl.Series(name, values) for name, values in fast.items()),
        ).filter(pl.Series(grid.allowed[:, d])))
    df = pl.concat(frames).with_columns(
        ((pl.col("pipeline_model_parallel_size") - 1)
         / (pl.col("num_microbatches") * pl.col("virtual_pipeline_model_parallel_size"))).alias("bubble"),
        *(pl.col(name).fill_nan(None) for name in SPEED))    # unknown (the hardware lacks a figure): null
    df = df.sort(["_severity", "tokens_per_s", "headroom_bytes"], descending=[False, True, True], nulls_last=True)
    df = df.drop("_severity").with_row_index("rank", offset=1)
    df = df.with_columns(pl.col("rank").cast(pl.Int64))
    if fits_only:
        df = df.filter(pl.col("fits"))
    return df.select(ORDER)


def stage_table(base: Experiment, *, micro_batch_sizes=MICRO_BATCH_SIZES, recompute: tuple[str, ...] | None = None,
                distributed_optimizer: tuple[bool, ...] | None = None):
    """What the sweep computes for each pipeline stage it evaluates, one row per (layout, stage): the
    layout's columns, `pp_rank`, and that stage's `total_bytes` (its allocated peak), `static_bytes`,
    `reserve_bytes`, `headroom_bytes` and `verdict`, as `estimate` has them for that stage. Middle
    stages that cannot hold a layout's peak are not evaluated (`memory.layout_terms`' peak candidates)."""
    import numpy as np  # deferred: start-up time
    import polars as pl  # deferred: likewise

    grid = _Grid(base, micro_batch_sizes, recompute, distributed_optimizer)
    if not grid.rows:
        return pl.DataFrame()
    layouts = grid.layout_frame()
    frames = []
    for d, dist in enumerate(grid.distributed_optimizer):
        st = grid.stage_bytes(dist)
        frames.append(layouts[grid.stage_row].with_columns(
            pl.lit(dist).alias("use_distributed_optimizer"),
            pl.Series("pp_rank", grid.stage_rank.astype(np.int64)),
            pl.Series("total_bytes", st["total"].astype(np.int64)),
            pl.Series("static_bytes", st["static"].astype(np.int64)),
            pl.Series("reserve_bytes", st["reserve"].astype(np.int64)),
            pl.Series("headroom_bytes", st["headroom"].astype(np.int64)),
            pl.Series("verdict", np.asarray(memory.VERDICTS)[st["severity"]]),
        ).filter(pl.Series(grid.allowed[grid.stage_row, d])))
    return pl.concat(frames)


class _Grid:
    """Every valid layout of `base` (one row per layout shape, micro batch and recompute choice, before
    the optimizer choice) and the memory terms of each stage the sweep evaluates, as numpy arrays.

    Python runs once per layout shape (TP, CP, PP, VP, EP: the rules, the precision's sharding degrees,
    the stage plan and parameters) and once per distinct activation setting; the rows are index arrays
    into those. The activation setting of a shape is the values of its swept sizes whose metadata says
    they change activations (`memory.ACTIVATION_FIELDS`): with the micro batch and recompute choice,
    it picks the row's `memory.activation_terms`, which `memory` keys by every such field."""

    def __init__(self, base: Experiment, micro_batch_sizes, recompute, distributed_optimizer):
        import numpy as np  # deferred: start-up time

        self.base = base
        self.recompute = (recompute_name(base),) if recompute is None else tuple(recompute)
        self.distributed_optimizer = (base.parallel.use_distributed_optimizer,) if distributed_optimizer is None \
            else tuple(distributed_optimizer)
        for name in self.recompute:
            if name not in RECOMPUTE:
                raise UserError(f"recompute = {name!r}: expected one of {', '.join(RECOMPUTE)}")
        problems = value_problems(base)          # a bad option would otherwise just leave no valid layout
        if problems:
            raise UserError(str(problems[0]))
        settings = _recompute_settings(base)
        self.micro_batch_sizes = np.asarray(micro_batch_sizes, dtype=np.int64)
        names, dists, batch_sizes = self.recompute, self.distributed_optimizer, self.micro_batch_sizes
        activation_sizes = [name for name in _SHAPE if (_section(name), name) in memory.ACTIVATION_FIELDS]
        work = base.copy()
        cache: dict = {}
        shapes: list[dict] = []
        batch_ok, choice_ok = [], []              # per shape: micro batch allowed (B), choice allowed (R x D)
        entries: dict[int, int] = {}              # id(layout entry) -> index in self.entries
        self.entries: list[tuple] = []            # memory.layout_terms' (chunks, plan, weights)
        entry_of: list[list[int]] = []            # per shape: its entry index per recompute choice (-1: none)
        parts: dict[tuple, int] = {}              # activation setting of a shape -> index
        part_of: list[int] = []                   # per shape: its setting
        part_shape: list[int] = []                # per setting: a shape that has it
        sharding, workspace = [], []              # per shape: (dp shard, expert dp shard, dispatcher), per batch
        expert_sizes = []                         # per shape: (expert TP, expert DP)
        features: dict[int, int] = {}             # id(speed.stage_features entry) -> index in self.features
        self.features: list[tuple] = []           # speed.stage_features' (stages, counts, first ranks, _)
        feature_of: list[list[int]] = []          # per shape: its features' index per recompute choice (-1: none)
        for shape, batches, choices in layouts(base, tuple(batch_sizes.tolist()), names, dists):
            _apply(work, {**shape, "micro_batch_size": batches[0]}, settings)
            pr = memory.precision(work)           # the same for every micro batch and recompute choice
            sharding.append((pr.dp_shard, pr.edp_shard, memory.dispatcher_buffer_bytes(work)))
            expert_sizes.append((work.expert_tensor_parallel_size, work.expert_data_parallel_size))
            workspace.append(memory.workspace_bytes(work, cache, micro_batch_size=batch_sizes)
                             + np.zeros(len(batch_sizes)))
            batch_ok.append([size in batches for size in micro_batch_sizes])
            choice_ok.append([[dist in choices.get(name, ()) for dist in dists] for name in names])
            row, feature_row = [], []
            for name in names:
                if name not in choices:
                    row.append(-1)
                    feature_row.append(-1)
                    continue
                _set_recompute(work, name, settings)
                entry = memory.layout_terms(work, cache, peak_candidates=True)
                row.append(entries.setdefault(id(entry), len(entries)))
                if row[-1] == len(self.entries):
                    self.entries.append(entry)
                found = speed.stage_features(work, cache)
                feature_row.append(features.setdefault(id(found), len(features)))
                if feature_row[-1] == len(self.features):
                    self.features.append(found)
            entry_of.append(row)
            feature_of.append(feature_row)
            part = tuple(shape[name] for name in activation_sizes)
            part_of.append(parts.setdefault(part, len(parts)))
            if part_of[-1] == len(part_shape):
                part_shape.append(len(shapes))
            shapes.append(shape)
        self.rows = 0
        if not shapes:
            return
        batch_okay, choice_okay = np.array(batch_ok), np.array(choice_ok, dtype=bool)
        part_at, entry_at_shape = np.array(part_of), np.array(entry_of)
        # rows: (shape, recompute choice, micro batch) in that order
        s, r, b = np.nonzero(np.asarray(choice_okay.any(axis=2))[:, :, None] & batch_okay[:, None, :])
        self.rows = len(s)
        self.columns = {name: np.array([shape[name] for shape in shapes])[s]
                        for name in (*_SHAPE, "data_parallel_size")}
        self.columns["micro_batch_size"] = batch_sizes[b]
        self.columns["recompute"] = np.asarray(names)[r]
        self.columns["num_microbatches"] = microbatches(base.training.global_batch_size, batch_sizes[b],
                                                        self.columns["data_parallel_size"])
        self.allowed = choice_okay[s, r]                                      # rows x optimizer choices
        # the activation terms of every (setting, recompute, micro batch) some row has
        acts: list[memory.ActTerms] = []
        act_index: dict[int, int] = {}
        table = np.full((len(part_shape), len(names), len(batch_sizes)), -1)
        used = np.zeros(table.shape, dtype=bool)
        used[part_at[s], r, b] = True
        for p_, r_, b_ in zip(*np.nonzero(used)):
            _apply(work, {**shapes[part_shape[p_]], "micro_batch_size": int(batch_sizes[b_])}, settings)
            _set_recompute(work, names[r_], settings)
            terms = memory.activation_terms(work, cache)
            table[p_, r_, b_] = act_index.setdefault(id(terms), len(act_index))
            if table[p_, r_, b_] == len(acts):
                acts.append(terms)
        act = table[part_at[s], r, b]
        entry = entry_at_shape[s, r]
        self.speed_layouts = self._speed_layouts(base, s, r, b, shapes, expert_sizes, np.array(feature_of),
                                                 part_at, part_shape, settings, cache)
        # rows sharing a stage plan and a recompute setting are evaluated together
        plans: dict[int, int] = {}
        plan_of_entry = np.array([plans.setdefault(id(e[1]), len(plans)) for e in self.entries])
        settings_of: dict[tuple, int] = {}
        setting_of_act = np.array([settings_of.setdefault(a.recompute, len(settings_of)) for a in acts])
        group = plan_of_entry[entry] * len(settings_of) + setting_of_act[act]
        order = np.argsort(group, kind="stable")
        bounds = np.flatnonzero(np.r_[True, group[order][1:] != group[order][:-1], True])
        stages = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            members = order[lo:hi]
            used_entries, entry_at = np.unique(entry[members], return_inverse=True)
            used_acts, act_at = np.unique(act[members], return_inverse=True)
            chunks, plan, _ = self.entries[used_entries[0]]
            weights = []                  # per stage: (dense, expert, per chunk, FSDP layer, embedding), per member
            for st in range(len(plan)):
                dense, expert, fsdp, embedding = np.array([[self.entries[e][2][st][i] for i in (0, 1, 3, 4)]
                                                           for e in used_entries], dtype=np.int64)[entry_at].T
                weights.append((dense, expert, self.entries[used_entries[0]][2][st][2], fsdp, embedding))
            terms = memory.take(memory.stack([acts[a] for a in used_acts]), act_at)
            for arrays in memory.stage_arrays(len(chunks), plan, weights, terms,
                                              self.columns["num_microbatches"][members],
                                              base.parallel.microbatch_group_size_per_vp_stage):
                zero = np.zeros(len(members))
                # CUDA graphs: their static buffers, and the held terms while they are captured
                capture = arrays.capture if arrays.capture is not None else (zero,) * 4
                stages.append((members, np.full(len(members), arrays.pp_rank), arrays.dense_params,
                               arrays.expert_params, arrays.embedding_params, arrays.held_loss, arrays.held_max,
                               arrays.backward, arrays.loss_extra, arrays.fsdp_layer_params,
                               zero + arrays.graph_static, *(zero + c for c in capture)))
        columns = [np.concatenate(c) for c in zip(*stages)]
        by_row = np.argsort(columns[0], kind="stable")
        (self.stage_row, self.stage_rank, self.dense, self.expert, self.embedding, self.held_loss, self.held_max,
         self.backward, self.loss_extra, self.fsdp, self.graph_static, *capture_columns) = (c[by_row] for c in columns)
        # every row has CUDA graphs or none (the base's setting)
        self.capture = tuple(capture_columns) if acts[0].capture is not None else None
        dp_shard, edp_shard, dispatcher = (np.asarray(c)[s][self.stage_row] for c in zip(*sharding))
        self.dp_shard, self.edp_shard = dp_shard, edp_shard
        self.workspace = np.array(workspace)[s, b][self.stage_row]
        room = memory.budget(base)
        # each layout's own dispatcher buffers (its EP group) come out of what the allocator may hold
        self.room = dataclasses.replace(room, dispatcher_bytes=dispatcher)

    def _speed_layouts(self, base, s, r, b, shapes, expert_sizes, feature_of, part_of, part_shape, settings,
                       cache) -> speed.Layouts:
        """The rows as the step-time model reads them (speed.Layouts, with the base's optimizer setting)."""
        import numpy as np  # deferred: start-up time

        c = self.columns
        which = feature_of[s, r]
        width = max(len(f[1]) for f in self.features)
        stages = np.zeros((len(self.features), width, speed.FEATURES))
        count, first = np.zeros((len(self.features), width)), np.zeros((len(self.features), width))
        for i, (rows, counts, ranks, _) in enumerate(self.features):
            stages[i, :len(rows)], count[i, :len(rows)], first[i, :len(rows)] = rows, counts, ranks
        etp, edp = (np.array(v)[s] for v in zip(*expert_sizes))
        t = base.training
        modules = [set(settings[name]["recompute_modules"] or ["core_attn"])
                   if settings[name]["recompute_granularity"] == "selective" else set() for name in self.recompute]
        host = np.zeros((self.rows, 2))
        if t.fine_grained_activation_offloading or t.cpu_offloading_num_layers:
            work = base.copy()
            for key in set(zip(part_of[s].tolist(), r.tolist(), b.tolist())):
                p_, r_, b_ = key
                _apply(work, {**shapes[part_shape[p_]], "micro_batch_size": int(self.micro_batch_sizes[b_])}, settings)
                _set_recompute(work, self.recompute[r_], settings)
                at = (part_of[s] == p_) & (r == r_) & (b == b_)
                host[at] = [memory.host_bytes(work, cache)[k] for k in (False, True)]
        return speed.Layouts(
            tp=c["tensor_model_parallel_size"], cp=c["context_parallel_size"], ep=c["expert_model_parallel_size"],
            etp=etp, pp=c["pipeline_model_parallel_size"], vp=c["virtual_pipeline_model_parallel_size"],
            dp=c["data_parallel_size"], edp=edp, sp=c["sequence_parallel"].astype(bool),
            micro_batch=c["micro_batch_size"], microbatches=c["num_microbatches"],
            distributed_optimizer=np.zeros(self.rows, dtype=bool), selective=r, modules=modules,
            stages=stages[which], stage_count=count[which], stage_rank=first[which], host_bytes=host)

    def speed(self, distributed_optimizer: bool) -> dict:
        """Per row, with the distributed optimizer on or off: what `speed.estimate` reports for the layout."""
        import numpy as np  # deferred: start-up time

        base = self.base
        layouts = dataclasses.replace(self.speed_layouts,
                                      distributed_optimizer=np.full(self.rows, distributed_optimizer))
        times = speed.step_times(base, layouts)
        return speed.figures(base, layouts, times)

    def layout_frame(self):
        """The rows' layout columns, as a polars frame."""
        import polars as pl  # deferred: start-up time

        return pl.DataFrame({name: self.columns[name] for name in (*COLUMNS[:7], "sequence_parallel", "recompute",
                                                                    "num_microbatches")})

    def stage_bytes(self, distributed_optimizer: bool) -> dict:
        """Per evaluated stage, with the distributed optimizer on or off: its bytes, as `estimate` has them
        (`memory.combine`, whole bytes), the allocator's reserve on its churn, the room left and the verdict."""
        import numpy as np  # deferred: start-up time

        # bytes per parameter and the sharding rules follow the base; the degrees follow each layout
        pr = dataclasses.replace(memory.precision(self.base, use_distributed_optimizer=distributed_optimizer),
                                 dp_shard=self.dp_shard, edp_shard=self.edp_shard)
        parts = [np.trunc(v) for v in memory.combine(self.dense, self.expert, self.embedding, self.held_loss,
                                                     self.held_max, self.backward, self.loss_extra, self.fsdp,
                                                     self.workspace, pr, self.graph_static, self.capture,
                                                     memory.captured_before_first_step(self.base))]
        total = sum(parts)
        static = parts[0] + parts[1] + parts[2]
        reserve = np.trunc(self.room.reserve(total - static - np.trunc(self.workspace + self.graph_static)))
        allocator = self.room.allocator_bytes
        return {"total": total, "static": static, "reserve": reserve, "headroom": allocator - total - reserve,
                "severity": memory.severity(allocator, total, reserve)}


# The sizes a layout shape sets (with its micro batch and recompute choice, a layout)
_SHAPE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "context_parallel_size", "expert_model_parallel_size", "sequence_parallel")


def _section(name: str) -> str:
    return resolve_key(name)[0]
