"""Layout sweep: every valid parallel layout of an experiment on its cluster, with its peak memory.

`sweep(base)` enumerates TP (within a node), CP, PP, VP, EP and the micro batch of the experiment
`base`, keeps the layouts `engine.model.validate` accepts, and estimates each with the memory model
(`engine.model.memory`): one row per layout, ranked. Everything else (model, hardware, precision,
attention, recompute settings, optimizer options) is `base`'s, so a row loaded back with
`layout_to_experiment(base, row)` plans to the same bytes. Recompute and the distributed optimizer
stay as `base` has them unless the caller asks to vary them too (`recompute=`, `distributed_optimizer=`);
a varied recompute choice other than `base`'s own uses the plain settings in RECOMPUTE.

Ranking (the `rank` column, 1 = most promising):
  1. layouts that fit first, then tight ones, then those that do not fit;
  2. less recompute (none, then selective, then full: full recompute re-runs the forward);
  3. a smaller pipeline bubble, (PP - 1) / (micro-batches x VP), in whole percent;
  4. fewer ranks in the communication-heavy dimensions, TP x CP (their collectives sit on the
     critical path of every layer), then fewer expert-parallel ranks, then fewer pipeline
     stages and virtual stages (point-to-point traffic);
  5. more memory headroom.

How: `engine.model.validate` checks each layout once (every micro batch shares the check: the micro
batch only enters the batch rule, which the enumeration applies itself) and every recompute and
optimizer choice once per pipeline shape (see `layouts`). The memory model's pieces are computed once per distinct input and cached:
what each stage holds per pipeline split and TP/EP (`memory.layout_terms`), the activation sizes
per TP/CP/EP, micro batch and recompute (`memory.activation_terms`). The per-stage terms of all
layouts sharing a pipeline split and recompute choice are then evaluated together as numpy arrays
(`memory.stage_arrays`, the arithmetic `estimate` runs), and the bytes and verdicts for both
optimizer settings of every layout at once (`memory.combine`).
"""

from __future__ import annotations

import math

from typing import Any

from charllm.engine.model import calibration, memory, runtime
from charllm.engine.model.experiment import Cluster, Experiment, Hardware, ModelSpec, Training, resolve_key
from charllm.engine.model.validate import validate, value_problems
from charllm.probes.core.errors import UserError

RECOMPUTE = {
    "none": {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None},
    "selective": {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
RECOMPUTE_ORDER = {name: i for i, name in enumerate(RECOMPUTE)}
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

ORDER = ("rank", *COLUMNS, "num_microbatches", "bubble", "peak_bytes", "peak_stage", "static_bytes",
         "headroom_bytes", "verdict", "fits")
VERDICTS = (memory.FITS, memory.TIGHT, memory.DOES_NOT_FIT)     # by severity


def base_experiment(model: ModelSpec | str, hardware: Hardware | str, nodes: int, gpus_per_node: int,
                    global_batch_size: int, seq_length: int | None = None,
                    training: dict[str, Any] | None = None) -> Experiment:
    """The experiment every layout of a sweep starts from, when there is no composed one."""

    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node),
                        ("global_batch_size", global_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name} = {value!r}: must be a positive integer")
    exp = Experiment(name="sweep")
    exp.model = ModelSpec.load(model) if isinstance(model, str) else model
    exp.hardware = Hardware.load(hardware) if isinstance(hardware, str) else hardware
    exp.cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node)
    exp.training = Training(global_batch_size=global_batch_size, seq_length=seq_length)
    for key, value in (training or {}).items():
        section, name = resolve_key(key)
        if name in SWEPT:
            raise UserError(f"{key} = {value!r}: the sweep varies {name} itself; it cannot be fixed")
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
    """Every layout `engine.model.validate` accepts: (rows, choices) per (TP, CP, PP, VP, EP), with one row
    (a dict) per micro batch and choices {recompute: [distributed-optimizer settings]}.

    `validate` sees each layout once, with its first micro batch (the micro batch only enters the
    batch rule, applied here) and one recompute/optimizer choice. Which choices are valid is asked
    for every combination once per pipeline shape (PP, VP), the layout sizes the recompute rules
    read; tests/engine/model/test_sweep.py checks the result against `validate` on every combination."""
    m, world, gpn = base.model, base.world_size, base.cluster.gpus_per_node
    gbs, seq = base.training.global_batch_size, base.seq_length
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
                eps = [e for e in _divisors(m.num_moe_experts) if (tp * cp * dp) % (e * tp) == 0] \
                    if m.is_moe else [1]
                batches = [b for b in micro_batch_sizes if gbs % (b * dp) == 0]
                for vp in vps if batches else ():
                    for ep in eps:
                        rows = [{"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                 "virtual_pipeline_model_parallel_size": vp, "context_parallel_size": cp,
                                 "expert_model_parallel_size": ep, "data_parallel_size": dp,
                                 "micro_batch_size": b, "sequence_parallel": tp > 1 and sp_runs}
                                for b in batches]
                        _apply(probe, rows[0], settings)
                        choices = by_pipeline.get((pp, vp))
                        if choices is None:
                            choices = _valid_choices(probe, recompute, distributed_optimizer, settings)
                            if choices:              # else the layout may be at fault: ask again next time
                                by_pipeline[pp, vp] = choices
                        else:
                            name, dists = next(iter(choices.items()))
                            _set_recompute(probe, name, settings)
                            probe.parallel.use_distributed_optimizer = dists[0]
                            if validate(probe):
                                continue
                        if choices:
                            yield rows, choices


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
    """{recompute: [distributed-optimizer settings]} that `engine.model.validate` accepts for `exp`'s layout."""
    choices: dict[str, list[bool]] = {}
    for name in recompute:
        _set_recompute(exp, name, settings)
        for dist in distributed_optimizer:
            exp.parallel.use_distributed_optimizer = dist
            if not validate(exp):
                choices.setdefault(name, []).append(dist)
    return choices


def sweep(base: Experiment, *, micro_batch_sizes=MICRO_BATCH_SIZES, recompute: tuple[str, ...] | None = None,
          distributed_optimizer: tuple[bool, ...] | None = None, fits_only: bool = False):
    """One row per valid layout of `base` with peak memory, verdict and headroom, most promising
    first. `recompute` and `distributed_optimizer`: the choices to vary (default: `base`'s own)."""
    import dataclasses

    import numpy as np
    import polars as pl

    recompute = (recompute_name(base),) if recompute is None else tuple(recompute)
    distributed_optimizer = (base.parallel.use_distributed_optimizer,) if distributed_optimizer is None \
        else tuple(distributed_optimizer)
    for name in recompute:
        if name not in RECOMPUTE:
            raise UserError(f"recompute = {name!r}: expected one of {', '.join(RECOMPUTE)}")
    problems = value_problems(base)          # a bad option would otherwise just leave no valid layout
    if problems:
        raise UserError(str(problems[0]))
    settings = _recompute_settings(base)
    work, cache = base.copy(), {}
    table: list[tuple] = []                  # one row per (layout, recompute), before the optimizer choice
    allowed: list[list[bool]] = []           # its valid distributed-optimizer settings
    shards: list[tuple[int, int, float, int]] = []  # its (DP x CP, expert DP) sharding degrees, workspace
    #                                                 and dispatcher buffers (outside the allocator)
    batches: dict[tuple, tuple] = {}         # rows sharing a stage plan and recompute setting: evaluated together
    for rows, choices in layouts(base, micro_batch_sizes, recompute, distributed_optimizer):
        _apply(work, rows[0], settings)
        pr = memory.precision(work)          # its sharding degrees: the same for every micro batch and recompute
        dispatcher = memory.dispatcher_buffer_bytes(work)
        per_batch = []
        for row in rows:
            work.training.micro_batch_size = row["micro_batch_size"]
            per_batch.append((row, work.num_microbatches, memory.workspace_bytes(work, cache)))
        for name, dists in choices.items():
            _set_recompute(work, name, settings)
            chunks, plan, weights = memory.layout_terms(work, cache, peak_candidates=True)
            for row, num_mb, workspace in per_batch:
                work.training.micro_batch_size = row["micro_batch_size"]
                acts = memory.activation_terms(work, cache)
                # plans are cached, so one plan is one object
                batches.setdefault((id(plan), acts.full_recompute, acts.group), (len(chunks), plan, []))[2].append(
                    (len(table), weights, acts, num_mb))
                table.append((*row.values(), name, num_mb))
                allowed.append(dists)
                shards.append((pr.dp_shard, pr.edp_shard, workspace, dispatcher))
    if not table:
        flags = ("use_distributed_optimizer", "sequence_parallel", "fits")
        return pl.DataFrame(schema={name: pl.String if name in ("recompute", "verdict") else pl.Float64 if name == "bubble"
                                    else pl.Boolean if name in flags else pl.Int64 for name in ORDER})
    # per stage of every row: (row, pp rank, params, activation terms), grouped by row
    stages = []
    for pp, plan, members in batches.values():
        index, weights, acts, num_mb = (list(column) for column in zip(*members))
        index = np.asarray(index)
        for st in memory.stage_arrays(pp, plan, weights, acts, num_mb):
            stages.append((index, np.full(len(index), st.pp_rank), st.dense_params, st.expert_params,
                           st.held_loss, st.held_max, st.backward, st.loss_extra, st.fsdp_layer_params))
    columns = [np.concatenate(c) for c in zip(*stages)]
    order = np.argsort(columns[0], kind="stable")
    stage_row, stage_rank, dense, expert, held_loss, held_max, backward, loss_extra, fsdp = \
        (c[order] for c in columns)
    starts = np.flatnonzero(np.r_[True, stage_row[1:] != stage_row[:-1]])
    sizes = np.diff(np.r_[starts, len(stage_row)])
    dp_shard, edp_shard, workspace, dispatcher = (np.asarray(c)[stage_row] for c in zip(*shards))
    room = memory.budget(base)
    allocator = room.allocator_bytes + room.dispatcher_bytes - dispatcher      # each layout's own EP group
    layout_frame = pl.DataFrame(table, schema=[*rows[0], "recompute", "num_microbatches"], orient="row")
    frames = []
    for dist in distributed_optimizer:
        # bytes per parameter and the sharding rules follow the base; the degrees follow each layout
        pr = dataclasses.replace(memory.precision(base, use_distributed_optimizer=dist),
                                 dp_shard=dp_shard, edp_shard=edp_shard)
        parts = [np.trunc(v) for v in memory.combine(dense, expert, held_loss, held_max, backward, loss_extra,
                                                     fsdp, workspace, pr)]   # whole bytes, as estimate() has them
        total = sum(parts)
        static_parts = parts[0] + parts[1] + parts[2]
        # per stage, as estimate() has it: the allocator's reserve on its churn, the room left, the verdict
        reserve = np.trunc(room.reserve(total - static_parts - np.trunc(workspace)))
        room_left = allocator - total - reserve
        severity = np.where(total > allocator, 2, np.where(room_left < 0, 1, 0))
        peak = np.maximum.reduceat(total, starts)
        at_peak = total == np.repeat(peak, sizes)
        peak_stage = np.minimum.reduceat(np.where(at_peak, stage_rank, 1 << 30), starts)
        # the static bytes of that stage (stages may tie on the peak with different static bytes)
        static = np.maximum.reduceat(np.where(stage_rank == np.repeat(peak_stage, sizes), static_parts, 0), starts)
        headroom = np.minimum.reduceat(room_left, starts)
        worst = np.maximum.reduceat(severity, starts)
        frames.append(layout_frame.with_columns(
            pl.lit(dist).alias("use_distributed_optimizer"),
            pl.Series("peak_bytes", peak.astype(np.int64)),
            pl.Series("peak_stage", peak_stage.astype(np.int64)),
            pl.Series("static_bytes", static.astype(np.int64)),
            pl.Series("headroom_bytes", headroom.astype(np.int64)),
            pl.Series("verdict", np.array(VERDICTS)[worst]),
            pl.Series("fits", worst == 0),
            pl.Series("_severity", worst),
        ).filter(pl.Series([dist in dists for dists in allowed])))
    df = pl.concat(frames).with_columns(
        ((pl.col("pipeline_model_parallel_size") - 1)
         / (pl.col("num_microbatches") * pl.col("virtual_pipeline_model_parallel_size"))).alias("bubble"),
        pl.col("recompute").replace_strict(RECOMPUTE_ORDER, return_dtype=pl.Int64).alias("_recompute_cost"),
        (pl.col("tensor_model_parallel_size") * pl.col("context_parallel_size")).alias("_comm"),
    )
    df = df.with_columns((pl.col("bubble") * 100).round(0).alias("_bubble_pct")).sort(
        ["_severity", "_recompute_cost", "_bubble_pct", "_comm", "expert_model_parallel_size",
         "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "headroom_bytes"],
        descending=[False, False, False, False, False, False, False, True])
    df = df.drop("_recompute_cost", "_comm", "_bubble_pct", "_severity").with_row_index("rank", offset=1)
    df = df.with_columns(pl.col("rank").cast(pl.Int64))
    if fits_only:
        df = df.filter(pl.col("fits"))
    return df.select(ORDER)

