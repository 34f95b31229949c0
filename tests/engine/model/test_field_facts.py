"""Each experiment field's facts live once, in its dataclass metadata (engine.model.experiment.setting);
the Megatron flag tables, the validation choices and sizes and the TransformerConfig arguments are derived
from them. These tests read the metadata independently and check each derived table against it."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from charllm.engine.model import megatron, validate
from charllm.engine.model.experiment import (
    AUTO,
    SECTIONS,
    Experiment,
    ModelSpec,
    Parallel,
    Training,
    choices,
    expected,
    facts,
    field_types,
    help_text,
)
from charllm.engine.model.megatron import FLAGS, Many, Switch, Value
from charllm.probes.backends import BACKEND_NAMES, open_backend
from charllm.probes.backends.base import MAX_HZ
from charllm.probes.core.errors import UserError

FLAG_SECTIONS = {"model": ModelSpec, "parallel": Parallel, "training": Training}


def _declared_flags():
    """flag -> (section, field, the value a switch sets or None) as the metadata says it."""
    out = {}
    for section, kind in FLAG_SECTIONS.items():
        for f in dataclasses.fields(kind):
            flag = f.metadata.get("flag")
            if flag is None:
                continue
            own = f"--{f.name.replace('_', '-')}" if flag == AUTO else flag
            out[own] = (section, f.name, f.metadata["switch"] if field_types(kind)[f.name] is bool else None)
            out.update({other: out[own] for other in f.metadata["renamed"]})
            out.update({alias: (section, f.name, value) for alias, value in f.metadata["aliases"].items()})
    return out


def test_the_flag_table_is_what_the_fields_declare():
    declared = _declared_flags()
    assert set(FLAGS) == set(declared)
    for flag, (section, name, switch) in declared.items():
        got_section, got_name, kind = FLAGS[flag]
        assert (got_section, got_name) == (section, name), flag
        if switch is not None or isinstance(kind, Switch):
            assert kind == Switch(switch), flag
    # A few facts as Megatron-LM's arguments.py spells them (core_v0.16.1): names that differ from ours,
    # inverted switches, aliases, lists.
    assert FLAGS["--fp8-format"][:2] == ("training", "fp8")
    assert FLAGS["--num-experts"][:2] == ("model", "num_moe_experts")
    assert FLAGS["--disable-bias-linear"] == ("model", "add_bias_linear", Switch(False))
    assert FLAGS["--use-rotary-position-embeddings"] == ("model", "position_embedding_type", Switch("rope"))
    assert FLAGS["--recompute-modules"] == ("training", "recompute_modules", Many(str))
    assert FLAGS["--data-path"] == ("training", "data_path", Many(str, join=True))
    assert FLAGS["--mock-data"] == ("training", "data_path", Switch(None))
    assert FLAGS["--moe-layer-freq"][2] == Value(megatron.parse_layer_pattern)
    # Fields set by flags that combine (SPECIAL_FLAGS) declare none of their own.
    assert "--num-query-groups" not in FLAGS and "--virtual-pipeline-model-parallel-size" not in FLAGS


def _sample(section: str, name: str, kind) -> tuple[list[str], object]:
    """Command-line values for a flag of the table and the value its field should get."""
    if isinstance(kind, Switch):
        return [], kind.value
    if isinstance(kind, Many) and kind.parse is megatron._int:
        return ["16", "8", "100"], [16, 8, 100]
    if isinstance(kind, Many):
        return ["a", "b"], "a b" if kind.join else ["a", "b"]
    options = [c for c in choices(SECTIONS[section], name) or () if c is not None]
    if options:
        return [options[-1]], options[-1]
    if kind.parse is megatron.parse_layer_pattern:
        return ["([0]*1+[1]*2)"], [0, 1, 1]
    hint = field_types(SECTIONS[section])[name]
    types = typing.get_args(hint) or (hint,)
    if float in types:
        return ["0.25"], 0.25
    if int in types:
        return ["7"], 7
    return ["x"], "x"


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_every_flag_of_the_table_sets_its_field(flag):
    section, name, kind = FLAGS[flag]
    values, expected = _sample(section, name, kind)
    exp = Experiment()
    result = megatron.MegatronImport(experiment=exp)
    assert megatron._read_flags([(flag, values)], exp, result) == {} and not result.ignored
    assert getattr(getattr(exp, section), name) == expected


def test_choices_come_from_the_fields():
    declared = {f.name: (section, f.metadata["choices"]) for section, kind in SECTIONS.items()
                for f in dataclasses.fields(kind) if f.metadata.get("choices") is not None}
    lists = {name for name, (section, _) in declared.items()
             if "list" in str(field_types(SECTIONS[section])[name])}
    assert lists == {"recompute_modules", "offload_modules", "cuda_graph_scope"}
    assert validate.CHOICES == {n: c for n, c in declared.items() if n not in lists and n != "backend"}
    assert validate.ITEM_CHOICES == {n: declared[n] for n in lists}
    assert validate.BACKENDS == declared["backend"][1]
    for name, (section, options) in declared.items():
        default = getattr(getattr(Experiment(), section), name)
        assert default in options or (default is None and name in lists), (name, default, options)
    # Megatron-LM's --position-embedding-type choices (arguments.py, core_v0.16.1)
    assert declared["position_embedding_type"][1] == ("learned_absolute", "rope", "mrope", "relative", "none")
    # megatron-core TransformerConfig.recompute_modules' documented choices (core_v0.16.1)
    assert declared["recompute_modules"][1] == ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                                "shared_experts")


def test_the_telemetry_backends_are_the_registrys():
    """telemetry.backend accepts what probes.backends opens, and nothing else."""
    assert choices(SECTIONS["telemetry"], "backend") == BACKEND_NAMES
    for name in [*BACKEND_NAMES[:-1], "replay:runs/some-run"]:
        exp = Experiment()
        exp.telemetry.backend = name
        assert validate.value_problems(exp) == [], name
    exp = Experiment()
    exp.telemetry.backend = "dcgm"
    with pytest.raises(UserError, match="must be one of"):
        open_backend("dcgm")
    assert [str(p) for p in validate.value_problems(exp)] == [
        "backend = 'dcgm': must be one of auto, nvml, amdsmi, host, sim or replay:RUN"]


def test_every_field_has_a_one_line_help():
    for section, kind in SECTIONS.items():
        for f in dataclasses.fields(kind):
            text = help_text(kind, f.name)
            assert text and "\n" not in text and len(text) <= 110, (section, f.name, text)
            assert not text.endswith("."), (section, f.name)     # a hint line, not a sentence


def _typed(section: str, name: str, value: float) -> float:
    """`value` as the field holds it (an integer field's bounds are integers, a number field's floats)."""
    return float(value) if expected(SECTIONS[section], name) == "a number" else value


@pytest.mark.parametrize("section, name, minimum, above, maximum", validate.RANGES)
def test_each_range_is_checked_against_its_bounds(section, name, minimum, above, maximum):
    meta = facts(SECTIONS[section], name)
    assert (minimum, above) == (meta["minimum"], meta["above"])
    assert maximum == (meta["maximum"] if meta["maximum"] is not None else
                       validate.MAX_SIZE if minimum == 1 else None)
    def shown(bound):   # as a problem shows a bound: 10,000 and 100 (not 100.0)
        return f"{bound:,g}" if isinstance(bound, float) else f"{bound:,}"

    outside = [(minimum - 1, "must be 0 or more" if minimum == 0 else f"must be at least {shown(minimum)}")] \
        if minimum is not None else []
    outside += [(above, f"must be greater than {shown(above)}")] if above is not None else []
    outside += [(maximum + 1, f"must be at most {shown(maximum)}")] if maximum is not None else []
    for value, rule in outside:
        exp = Experiment()
        setattr(getattr(exp, section), name, value := _typed(section, name, value))
        assert [str(p) for p in validate.value_problems(exp)][:1] == [f"{name} = {value!r}: {rule}"]
    for value in {b for b in (minimum, maximum, None if above is None else above + 1) if b is not None}:
        exp = Experiment()
        setattr(getattr(exp, section), name, _typed(section, name, value))
        assert not [p for p in validate.value_problems(exp) if p.field == name], value


def test_the_ranges_are_the_declared_ones():
    bounded = {(section, f.name) for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)
               if any(f.metadata[bound] is not None for bound in ("minimum", "above", "maximum"))}
    assert {(s, n) for s, n, *_ in validate.RANGES} == bounded
    assert ("model", "num_layers", 1, None, 10_000) in validate.RANGES
    assert ("cluster", "gpus_per_node", 1, None, 1024) in validate.RANGES
    assert ("training", "micro_batch_size", 1, None, validate.MAX_SIZE) in validate.RANGES
    assert ("model", "hidden_dropout", 0, None, 1) in validate.RANGES          # a probability
    assert ("hardware", "memory_bytes", 0, None, None) in validate.RANGES       # 0: unknown, no size cap
    # what the sampler accepts (probes.backends.base.check_hz)
    assert ("telemetry", "hz", None, 0, MAX_HZ) in validate.RANGES


def test_transformer_config_takes_the_fields_marked_for_it():
    exp = Experiment.load("tiny-local")
    passed = exp.transformer_config_fields()
    marked = [(section, f) for section in FLAG_SECTIONS for f in dataclasses.fields(SECTIONS[section])
              if f.metadata.get("config")]
    assert len(passed) == len(marked)
    for section, f in marked:
        key = f.name if f.metadata["config"] is True else f.metadata["config"]
        assert passed[key] == getattr(getattr(exp, section), f.name)
    assert passed["num_layers_in_first_pipeline_stage"] is exp.parallel.decoder_first_pipeline_num_layers
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    known = {f.name for f in dataclasses.fields(config.TransformerConfig)}
    assert set(passed) <= known, set(passed) - known
