"""The memory model's caches are keyed by field metadata: a field whose `setting()` says
`activations=True` keys the activation terms, `pipeline_split=True` the pipeline split
(engine.model.memory.ACTIVATION_FIELDS, SPLIT_FIELDS). These tests change every field one at a time
on a few experiments and check that the declarations are exactly the fields that change those terms:
an undeclared one would let a cache (the sweep's) hand back stale terms."""

from __future__ import annotations

import dataclasses

import pytest

from charllm.engine.model import memory
from charllm.engine.model.experiment import Experiment, declared
from charllm.engine.model.sweep import base_experiment
from charllm.probes.core.errors import UserError
from infra_fields import changed, needed, variants


def _bases() -> list[Experiment]:
    moe = base_experiment("tiny-moe", "h100-sxm-80gb", 1, 8, 16)
    moe.model.position_embedding_type, moe.model.mtp_num_layers = "rope", 1
    moe.model.moe_layer_freq = [0, 1, 1, 1]
    moe.apply(["tensor_model_parallel_size=2", "sequence_parallel=true", "expert_model_parallel_size=2",
               "pipeline_model_parallel_size=2", "moe_token_dispatcher_type=alltoall"])
    mla = moe.copy()
    mla.model.multi_latent_attention, mla.model.q_lora_rank = True, 32
    dense = base_experiment("tiny-dense", "cpu", 1, 2, 8)
    dense.apply(["tensor_model_parallel_size=2", "attention_backend=unfused", "attention_softmax_in_fp32=true",
                 "num_query_groups=2"])
    dense_gpu = base_experiment("tiny-dense", "h100-sxm-80gb", 1, 6, 12)      # 4 layers over 3 stages
    dense_gpu.apply(["context_parallel_size=2", "pipeline_model_parallel_size=3", "micro_batch_size=2"])
    return [moe, mla, dense, dense_gpu]


def _activations(exp: Experiment):
    terms = memory.activation_terms(exp, {})
    return dataclasses.astuple(terms)


@pytest.fixture(scope="module")
def effects() -> dict[str, dict[str, set]]:
    """{"activations" | "pipeline_split": {field: which values changed the terms}} over all bases."""
    out = {"activations": {}, "pipeline_split": {}}
    for base in _bases():
        for section, name, value in variants(base):
            before, after = needed(base, name), changed(base, section, name, value)
            try:
                # the hardware reaches the terms through the implementation, which keys them with the
                # fields (one cache plans for one hardware: it keeps that hardware's stack)
                if section != "hardware" and _activations(after) != _activations(before):
                    out["activations"].setdefault(name, set()).add(repr(value))
            except (UserError, ZeroDivisionError, KeyError):
                pass
            try:
                if memory.split_layers(after) != memory.split_layers(before):
                    out["pipeline_split"].setdefault(name, set()).add(repr(value))
            except UserError:
                pass
    return out


@pytest.mark.parametrize("fact", ["activations", "pipeline_split"])
def test_the_fields_that_change_the_terms_are_the_declared_ones(effects, fact):
    declared_names = {name for _, name, _ in declared(fact)}
    undeclared = {name: values for name, values in effects[fact].items() if name not in declared_names}
    assert not undeclared, f"these fields change the {fact} terms but do not say so in setting(): {undeclared}"
    idle = declared_names - set(effects[fact])
    assert not idle, f"these fields say they change the {fact} terms, and none of their values did: {idle}"


def test_the_caches_are_keyed_by_the_declared_fields():
    exp = _bases()[0]
    fields = {name for _, name, _ in declared("activations")}
    assert {name for _, name in memory.ACTIVATION_FIELDS} == fields
    assert {name for _, name in memory.SPLIT_FIELDS} == {name for _, name, _ in declared("pipeline_split")}
    cache = {}
    first = memory.activation_terms(exp, cache)
    assert memory.activation_terms(exp.copy(), cache) is first          # one entry per setting
    other = exp.copy()
    other.training.micro_batch_size = 2
    assert memory.activation_terms(other, cache) is not first
