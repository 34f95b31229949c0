"""Fuzzing: random --set values, random TOML experiments and random Megatron command lines go through
validation, export, import and the CLI; the only exception that may come out is UserError."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from charllm.engine.model import catalog
from charllm.engine.model.experiment import SECTIONS, Experiment, all_keys, field_names
from charllm.engine.model.megatron import FLAGS, SPECIAL_FLAGS, export_megatron_args, import_megatron_args
from charllm.engine.model.validate import check, validate
from charllm.probes.core.errors import UserError
from charllm.tui.cli import main

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])

# Values of every shape a user could type: sizes around the interesting edges, junk, lists, strings.
scalars = st.one_of(
    st.integers(-2, 9), st.integers(10, 10**6), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, 128, 2**31]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=6), st.sampled_from(["none", "full", "selective", "block", "uniform", "rope", "RMSNorm",
                                          "alltoall", "hybrid", "e4m3", "local", "flash", "true", "Et|tL"]),
)
values = st.one_of(scalars, st.lists(st.one_of(st.integers(-1, 2), st.sampled_from(["mlp", "core_attn"])),
                                     max_size=6))
keys = st.sampled_from(sorted(all_keys()) + [f"{s}.{n}" for s, k in SECTIONS.items() for n in field_names(k)]
                       + ["tensor_parallel_size", "model.nope", "nope.x", ""])
presets = st.sampled_from(sorted(catalog.entries("experiments")))


def _toml_literal(value) -> str:
    """How a user would write the value after `--set key=` (TOML syntax, or a bare word)."""
    import tomli_w

    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    return tomli_w.dumps({"v": value}).partition("=")[2].strip() if not isinstance(value, float) or \
        value == value and abs(value) != float("inf") else repr(value)


def exercise(exp: Experiment) -> None:
    """Everything downstream of an experiment: validation, export, and the import of that export."""
    problems = validate(exp)
    assert all(str(p).count("\n") == 0 for p in problems)
    if problems:
        with pytest.raises(UserError):
            check(exp)
    tokens = export_megatron_args(exp)
    assert all(isinstance(t, str) for t in tokens)
    import_megatron_args(tokens, world_size=exp.world_size, gpus_per_node=exp.cluster.gpus_per_node,
                         hardware=exp.hardware)


@given(presets, st.lists(st.tuples(keys, values), min_size=1, max_size=4))
@FUZZ
def test_random_set_values_raise_only_user_errors(preset, assignments):
    exp = Experiment.load(preset)
    try:
        exp.apply([f"{k}={_toml_literal(v)}" for k, v in assignments])
        exercise(exp)
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)


def _section(kind) -> st.SearchStrategy[dict]:
    names = [n for n in field_names(kind)] + ["unknown_field"]
    return st.dictionaries(st.sampled_from(names), values, max_size=6)


toml_experiments = st.fixed_dictionaries(
    {"name": st.text(max_size=5)},
    optional={
        "model": st.one_of(st.sampled_from(sorted(catalog.entries("models")) + ["nope"]),
                           _section(SECTIONS["model"]).map(lambda d: {"preset": "tiny-dense", **d}), values),
        "hardware": st.one_of(st.sampled_from(sorted(catalog.entries("hardware"))), _section(SECTIONS["hardware"])),
        "cluster": _section(SECTIONS["cluster"]),
        "parallel": _section(SECTIONS["parallel"]),
        "training": _section(SECTIONS["training"]),
        "telemetry": st.one_of(_section(SECTIONS["telemetry"]), values),
        "extra": values,
    },
)


@given(toml_experiments)
@FUZZ
def test_random_toml_experiments_raise_only_user_errors(data):
    try:
        exercise(Experiment.from_dict(data, source="fuzz"))
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)


flag_names = st.sampled_from(sorted(FLAGS) + sorted(SPECIAL_FLAGS) + ["--no-swiglu", "--log-interval", "--foo-bar"])
flag_values = st.lists(st.one_of(st.integers(-2, 64).map(str), st.sampled_from(
    ["([0]*2+[1]*2)", "[1]*3", "1e-4", "nan", "full", "rope", "Et|tL", "x", "", "--", "0.5"])), max_size=2)
# The sizes everything else is derived from, at their edges (0, 1, small primes), so the fuzzer reaches them.
SIZE_FLAGS = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
              "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--micro-batch-size",
              "--global-batch-size", "--num-layers", "--num-experts", "--num-virtual-stages-per-pipeline-rank",
              "--num-layers-per-virtual-pipeline-stage", "--world-size", "--decoder-first-pipeline-num-layers",
              "--recompute-num-layers"]
size_flags = st.tuples(st.sampled_from(SIZE_FLAGS), st.integers(-1, 5).map(lambda v: [str(v)]))
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1"]


@given(st.lists(st.one_of(size_flags, size_flags, st.tuples(flag_names, flag_values)), max_size=6),
       st.none() | st.sampled_from([1, 2, 4, 8, 16]) | st.integers(-1, 16),
       st.none() | st.sampled_from([1, 2, 8]) | st.integers(0, 8), st.sampled_from([True, True, True, False]))
@FUZZ
def test_random_megatron_command_lines_raise_only_user_errors(flags, world, per_node, with_base):
    tokens = (BASE if with_base else []) + [t for flag, vals in flags for t in (flag, *vals)]
    try:
        result = import_megatron_args(tokens, world_size=world, gpus_per_node=per_node, hardware="cpu")
        exercise(result.experiment)
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)


@given(presets, st.lists(st.tuples(keys, values), max_size=3), st.sampled_from(["megatron", "toml"]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
def test_cli_never_shows_a_traceback(capsys, preset, assignments, fmt):
    argv = ["export", fmt, preset]
    for key, value in assignments:
        argv += ["--set", f"{key}={_toml_literal(value)}"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code in (0, 2)
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("charllm-tui: error: ")
    else:
        assert out


size_sets = st.tuples(st.sampled_from(["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                       "context_parallel_size", "expert_model_parallel_size",
                                       "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
                                       "micro_batch_size", "global_batch_size", "nodes", "gpus_per_node",
                                       "num_layers", "num_moe_experts"]), st.integers(-1, 5))


@given(st.lists(size_sets, min_size=1, max_size=4))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
def test_user_experiment_files_never_break_presets_commands(capsys, charllm_dirs, sets):
    """A user's experiment file with odd sizes is listed and shown (marked invalid), never a traceback."""
    import tomli_w

    exp = Experiment.load("tiny-moe-ep2")
    for key, value in sets:
        exp.set(key, value)
    user = charllm_dirs["config"] / "experiments"
    user.mkdir(parents=True, exist_ok=True)
    (user / "odd.toml").write_text(tomli_w.dumps(exp.to_dict()))
    for argv in (["presets", "show", "odd"], ["presets", "show", "odd", "--json"]):
        assert main(argv) == 0
        capsys.readouterr()
    for argv in (["export", "megatron", "odd"], ["export", "megatron", "odd", "--no-validate"]):
        assert main(argv) in (0, 2)
        capsys.readouterr()


def test_fuzz_helpers_cover_every_section():
    """The strategies above draw from every field of every section (a new field is fuzzed too)."""
    every = {n for kind in SECTIONS.values() for n in field_names(kind)}
    assert every - {"name", "description"} <= set(all_keys()) | {"name", "description"}
    assert dataclasses.is_dataclass(Experiment)
