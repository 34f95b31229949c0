"""The layout sweep: every row valid, its memory equal to `estimate` and its step time to `speed.estimate`,
ranked as documented."""

from __future__ import annotations

import itertools
import random

import polars as pl
import pytest

from charllm.engine.model import calibration, runtime, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.memory import estimate
from charllm.engine.model.sweep import (
    MICRO_BATCH_SIZES,
    RECOMPUTE,
    REQUIRED_COLUMNS,
    base_experiment,
    layout_to_experiment,
    stage_table,
    sweep,
)
from charllm.engine.model.validate import validate
from charllm.probes.core.errors import UserError
from infra_fields import changed, variants

KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "micro_batch_size", "recompute",
        "use_distributed_optimizer")


ALL = {"recompute": tuple(RECOMPUTE), "distributed_optimizer": (True, False)}   # vary these too


def sweep_model(*args, training=None, **kwargs):
    """The sweep of a model with no composed experiment (`charllm-tui sweep --model ...`)."""
    return sweep(base_experiment(*args, training=training), **{**ALL, **kwargs})


@pytest.fixture(scope="module")
def llama():
    args = ("llama3-70b", "h100-sxm-80gb", 8, 8, 128)
    return args, sweep_model(*args)


def test_columns_and_one_row_per_layout(llama):
    _, df = llama
    assert set(REQUIRED_COLUMNS) <= set(df.columns)
    assert df.select(KEYS).is_unique().all()
    assert df["rank"].to_list() == list(range(1, df.height + 1))
    assert set(df["recompute"]) == {"none", "selective", "full"}
    assert set(df["use_distributed_optimizer"]) == {True, False}
    # TP stays within a node; SP exactly when TP > 1
    assert df["tensor_model_parallel_size"].max() <= 8
    assert (df["sequence_parallel"] == (df["tensor_model_parallel_size"] > 1)).all()


def test_every_row_is_valid_and_its_peak_is_what_plan_says(llama):
    args, df = llama
    base = base_experiment(*args)
    rows = df.to_dicts()
    for row in random.Random(0).sample(rows, 60) + rows[:5] + rows[-5:]:
        exp = layout_to_experiment(base, row)
        assert validate(exp) == []
        report = estimate(exp)
        assert row["peak_bytes"] == report.peak_bytes
        assert row["peak_stage"] == report.peak_stage
        assert (row["fits"], row["verdict"]) == (report.fits, report.verdict)
        assert row["headroom_bytes"] == pytest.approx(report.headroom_bytes, abs=1)


@pytest.mark.parametrize(
    "args, training",
    [
        (("llama3-8b", "h100-sxm-80gb", 1, 8, 64), None),  # dense, interleaved schedules
        (("deepseek-v3", "h200-141gb", 2, 8, 32), None),  # MLA, MTP, dense/MoE layer pattern
        (
            ("mixtral-8x7b", "h100-sxm-80gb", 4, 8, 64),  # DeepEP buffers per EP group
            {"moe_token_dispatcher_type": "flex"},
        ),
        (
            ("tiny-moe", "h100-sxm-80gb", 1, 8, 16),  # TE CUDA graphs captured before the optimizer's first step
            {"cuda_graph_impl": "transformer_engine", "cuda_graph_warmup_steps": 0,
             "cuda_graph_scope": ["attn", "moe_router"]},
        ),
        # (FSDP2 needs untied embeddings, which tiny-moe does not have: Megatron-FSDP shards the same way)
        (
            ("tiny-moe", "cpu", 1, 4, 8),
            {
                "attention_backend": "unfused",
                "moe_expert_capacity_factor": 1.25,
                "use_megatron_fsdp": True,
                "data_parallel_sharding_strategy": "optim_grads_params",
            },
        ),
    ],
)
@pytest.mark.timeout(120)
def test_every_row_equals_estimate_exactly(args, training):
    df = sweep_model(*args, training=training)
    assert df.height > 0
    base = base_experiment(*args, training=training)
    for row in df.iter_rows(named=True):
        report = estimate(layout_to_experiment(base, row))
        assert (row["peak_bytes"], row["peak_stage"], row["verdict"], row["headroom_bytes"]) == \
            (report.peak_bytes, report.peak_stage, report.verdict, report.headroom_bytes), row
        assert row["static_bytes"] == report.stages[report.peak_stage].static_bytes


@pytest.mark.parametrize("hardware, training", [
    ("cpu", None),
    ("h100-sxm-80gb", None),
    ("cpu", {"optimizer": "muon"}),                                              # no distributed optimizer
    ("cpu", {"overlap_grad_reduce": True, "overlap_param_gather": True}),        # only with the distributed optimizer
    ("cpu", {"cuda_graph_impl": "local"}),                                       # no full recompute
    ("h100-sxm-80gb", {"use_torch_fsdp2": True}),                                # PP = EP = 1, no distributed optimizer
    ("cpu", {"microbatch_group_size_per_vp_stage": 4}),     # interleaved: 4 micro-batches or more, not 2
])
@pytest.mark.timeout(120)
def test_rows_are_exactly_what_validate_accepts(hardware, training):
    """Brute force: every combination of a grid wider than the sweep's, through `validate`, with
    sequence and context parallelism only where the node planned for runs them (engine.model.runtime:
    a CPU node has no Transformer Engine, an H100 is assumed to have it)."""
    args = ("tiny-moe", hardware, 1, 4, 8)
    base = base_experiment(*args, training=training)
    stack = calibration.for_planning(base.hardware)
    expected = set()
    for tp, cp, pp, vp, ep, mbs, name, dist in itertools.product(
            (1, 2, 4), (1, 2, 4), range(1, 5), range(1, 5), range(1, 5), MICRO_BATCH_SIZES, RECOMPUTE,
            (True, False)):
        row = dict(zip(KEYS, (tp, pp, vp, cp, ep, mbs, name, dist)), sequence_parallel=tp > 1)
        exp = layout_to_experiment(base, row)
        if tp > 1 and any(p.field == "sequence_parallel" for p in runtime.problems(exp, stack)):
            exp.parallel.sequence_parallel = False           # TP without SP where SP cannot run
        refused = {p.field for p in runtime.problems(exp, stack)}
        if not validate(exp) and not refused & {"sequence_parallel", "context_parallel_size"}:
            expected.add(tuple(row[k] for k in KEYS))
    got = sweep_model(*args, training=training).select(KEYS).rows()
    assert len(got) == len(set(got))
    assert set(got) == expected


def test_ranking_puts_fitting_layouts_first_then_the_fastest(llama):
    _, df = llama
    fits = df["fits"].to_list()
    assert fits == sorted(fits, reverse=True)            # every fitting layout before any that does not
    fitting = df.filter(pl.col("fits"))
    speeds = fitting["tokens_per_s"].to_list()
    assert speeds == sorted(speeds, reverse=True)
    # the model's costs show in the order: of two layouts alike but for recompute, the one without runs faster
    alike = [c for c in KEYS if c != "recompute"]
    pairs = fitting.filter(pl.col("recompute") == "none").join(
        fitting.filter(pl.col("recompute") == "full"), on=alike, suffix="_full")
    assert pairs.height > 0 and (pairs["tokens_per_s"] > pairs["tokens_per_s_full"]).all()


def test_speed_columns_follow_from_the_step_time(llama):
    (model, hardware, nodes, gpus, batch), df = llama
    base = base_experiment(model, hardware, nodes, gpus, batch)
    tokens = batch * base.seq_length
    assert (df["tokens_per_s"] - tokens / df["step_s"]).abs().max() < 1e-6 * df["tokens_per_s"].max()
    shares = sum(df[f"{part}_share"] for part in ("compute", "communication", "bubble", "host", "other"))
    assert (shares - 1).abs().max() < 1e-9
    assert df["mfu"].is_between(0, 1).all() and df["power_w"].is_between(0, base.hardware.tdp_w).all()
    assert (df["params"] == df["params"][0]).all() and (df["params_per_device"] <= df["params"]).all()
    assert (df["params_per_device"] < df["params"]).any()           # sharded wherever TP, PP or EP split it


def test_fits_only_and_a_model_that_fits_nowhere():
    df = sweep_model("llama3-70b", "h100-sxm-80gb", 1, 8, 8, fits_only=True)
    assert df.height == 0 or df["fits"].all()
    one_gpu = sweep_model("llama3-70b", "h100-sxm-80gb", 1, 1, 8)
    assert one_gpu.height > 0 and set(one_gpu["verdict"]) == {"does not fit"}


def test_moe_sweep_includes_expert_parallel_layouts():
    df = sweep_model("tiny-moe", "cpu", 1, 4, 8)
    assert set(df["expert_model_parallel_size"]) == {1, 2, 4}
    exp = layout_to_experiment(base_experiment("tiny-moe", "cpu", 1, 4, 8), df.row(0, named=True))
    assert exp.parallel.expert_model_parallel_size == df["expert_model_parallel_size"][0]


def test_layout_to_experiment_sets_the_layout():
    base = base_experiment("llama3-8b", "h100-sxm-80gb", 1, 8, 64)
    row = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
           "virtual_pipeline_model_parallel_size": 4, "context_parallel_size": 2, "expert_model_parallel_size": 1,
           "micro_batch_size": 2, "recompute": "full", "use_distributed_optimizer": True, "sequence_parallel": True}
    exp = layout_to_experiment(base, row)
    p, t = exp.parallel, exp.training
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
            p.context_parallel_size) == (2, 2, 4, 2)
    assert p.sequence_parallel and p.use_distributed_optimizer
    assert (t.micro_batch_size, t.recompute_granularity, t.recompute_method) == (2, "full", "uniform")
    assert base.parallel.tensor_model_parallel_size == 1          # the base is untouched


@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": 0}, "nodes = 0"),
    ({"global_batch_size": -4}, "global_batch_size = -4"),
    ({"recompute": ("sometimes",)}, "recompute = 'sometimes'"),
    ({"gpus_per_node": 0}, "gpus_per_node = 0"),
    ({"training": {"micro_batch_size": 2}}, "the sweep varies micro_batch_size"),
    ({"training": {"hidden_size": 128}}, "only training and parallel options"),
    ({"training": {"seq_length": 0}}, "seq_length = 0: must be at least 1"),
])
def test_bad_input_is_a_user_error(kwargs, message):
    args = {"model": "tiny-dense", "hardware": "cpu", "nodes": 1, "gpus_per_node": 2, "global_batch_size": 8}
    args.update(kwargs)
    recompute = args.pop("recompute", None)
    with pytest.raises(UserError, match=message):
        sweep(base_experiment(**args), recompute=recompute)


def test_a_node_without_transformer_engine_is_offered_what_it_can_run():
    """A calibrated H100 node without TE: TP without sequence parallelism, no context parallelism,
    and every row launchable there."""
    from charllm.engine.model import calibration

    calibration.save({"hardware": "h100-sxm-80gb", "node": "plain-pip", "date": "2026-11-20",
                      "stack": {"cuda": True, "capability": [9, 0], "extensions": []},
                      "memory": {"usable_bytes": 80 * 2**30, "outside_allocator_bytes": 2**30, "devices": 8}})
    args = ("llama3-8b", "h100-sxm-80gb", 2, 8, 64)
    df = sweep_model(*args)
    assert df["tensor_model_parallel_size"].max() > 1 and not df["sequence_parallel"].any()
    assert set(df["context_parallel_size"]) == {1}
    base = base_experiment(*args)
    stack = calibration.for_planning(base.hardware)
    assert stack.source == "calibrated on plain-pip, 2026-11-20"
    for row in df.head(50).iter_rows(named=True):
        assert runtime.problems(layout_to_experiment(base, row), stack) == []


def test_a_composed_experiment_is_swept_with_everything_but_its_layout_kept():
    """One estimator, one input: the sweep of a composed experiment keeps its precision, attention,
    recompute and optimizer settings, and every fitting row, loaded back, plans to the same bytes."""

    composed = Experiment.load("ppt-h100-llama3-70b-1-01000").apply([
        "attention_backend=unfused", "attention_softmax_in_fp32=true", "grad_reduce_in_bf16=true",
        "cross_entropy_loss_fusion=true", "recompute_granularity=selective",
        "recompute_method=none", "recompute_num_layers=none", "recompute_modules=['core_attn','mlp']",
        "expandable_segments=false"])
    df = sweep(composed)
    assert df.height > 0 and set(df["recompute"]) == {"selective"}
    assert set(df["use_distributed_optimizer"]) == {composed.parallel.use_distributed_optimizer}
    fitting = df.filter(pl.col("fits"))
    assert fitting.height > 0
    for row in fitting.iter_rows(named=True):
        exp = layout_to_experiment(composed, row)
        t = exp.training
        assert (t.attention_backend, t.recompute_modules, t.grad_reduce_in_bf16, t.expandable_segments) == \
            ("unfused", ["core_attn", "mlp"], True, False)
        report = estimate(exp)
        assert (report.peak_bytes, report.verdict, report.headroom_bytes) == \
            (row["peak_bytes"], row["verdict"], row["headroom_bytes"]), row
    # the same layouts planned without the composed settings come out different: they are not ignored
    plain = sweep(base_experiment("llama3-70b", "h100-sxm-80gb", 8, 8, composed.training.global_batch_size),
                  recompute=("selective",), distributed_optimizer=(composed.parallel.use_distributed_optimizer,))
    keys = list(KEYS)
    joined = df.join(plain, on=keys, suffix="_plain")
    assert joined.height > 0 and (joined["peak_bytes"] != joined["peak_bytes_plain"]).any()


def _moe_base() -> Experiment:
    """A small MoE model with an MTP layer, planned for H100s (Transformer Engine: SP, CP and FP8 run)."""
    base = base_experiment("tiny-moe", "h100-sxm-80gb", 1, 4, 8)
    base.model.position_embedding_type, base.model.mtp_num_layers = "rope", 1
    return base


def _stages_equal_estimate(base: Experiment) -> int:
    """Check every stage the sweep evaluates against `estimate` of the same layout, and that a stage it
    leaves out is no worse, and each layout's step time and power against `speed.estimate`'s; return the
    number of layouts."""
    table = stage_table(base, **ALL)
    if table.height == 0:
        return 0
    keys = [*KEYS, "sequence_parallel"]
    layouts = 0
    rows = {tuple(r[k] for k in keys): r for r in sweep(base, **ALL).iter_rows(named=True)}
    for key, stages in table.group_by(keys, maintain_order=True):
        row = dict(zip(keys, key))
        exp = layout_to_experiment(base, row)
        report = estimate(exp)
        fast, swept = speed.estimate(exp), rows[tuple(key)]
        if fast is None:                                 # the hardware lacks a figure: no speed anywhere
            assert swept["step_s"] is None and swept["tokens_per_s"] is None, row
        else:
            assert (swept["step_s"], swept["power_w"], swept["flops_per_iteration"]) == pytest.approx(
                (fast.step_s, fast.power_w, fast.flops_per_iteration), rel=1e-12), row
            assert swept["params_per_device"] == max(fast.params_per_device), row
        for st in stages.iter_rows(named=True):
            planned = report.stages[st["pp_rank"]]
            assert (st["total_bytes"], st["static_bytes"], st["reserve_bytes"], st["headroom_bytes"], st["verdict"]) \
                == (planned.total_bytes, planned.static_bytes, planned.reserve_bytes, planned.headroom_bytes,
                    planned.verdict), (row, st["pp_rank"])
        evaluated = set(stages["pp_rank"])
        for planned in report.stages:
            if planned.pp_rank not in evaluated:
                assert planned.total_bytes <= stages["total_bytes"].max(), (row, planned.pp_rank)
                assert planned.headroom_bytes >= stages["headroom_bytes"].min(), (row, planned.pp_rank)
        layouts += 1
    assert layouts == sweep(base, **ALL).height
    return layouts


@pytest.mark.timeout(900)
def test_every_field_changed_alone_keeps_every_stage_of_the_sweep_equal_to_estimate():
    """One estimator: whatever field of the experiment changes (with what it needs, see
    tests/infra_fields.py), the sweep's per-stage bytes, reserve, headroom and verdict are `estimate`'s
    for every layout: no term of the estimate is missed by the sweep's vectorised path or its caches."""
    base = _moe_base()
    assert _stages_equal_estimate(base) > 50
    swept, without = set(), {}
    for section, name, value in variants(base):
        exp = changed(base, section, name, value)
        try:
            layouts = _stages_equal_estimate(exp)
        except UserError as exc:       # a value the base's other fields refuse
            without.setdefault(name, str(exc))
            continue
        if layouts:
            swept.add(name)
        else:
            without.setdefault(name, "no valid layout")
    never = {name: why for name, why in without.items() if name not in swept}
    assert not never                      # every field was swept with one of its values at least
