"""`charllm-tui fields`: every experiment field with its --set key, default, values, Megatron flag and help,
as the fields' metadata states them."""

from __future__ import annotations

import dataclasses
import json

from charllm.engine.model import experiment
from charllm.engine.model.experiment import SECTIONS, Experiment
from charllm.engine.model.megatron import FLAGS
from infra_cli import one_error_line, run


def test_every_field_is_listed_once_with_a_key_that_sets_it(capsys):
    code, out, _ = run(capsys, "fields", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["section"], r["name"]) for r in rows] == [
        (section, f.name) for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)]
    for r in rows:
        kind = SECTIONS[r["section"]]
        assert r["help"] == experiment.help_text(kind, r["name"])
        exp = Experiment()
        exp.set(r["key"], r["default"])       # the key is one --set takes, and names this very field
        assert exp == Experiment(), r["key"]
        if r["flag"] is not None:
            assert FLAGS[r["flag"]][:2] == (r["section"], r["name"])
    keys = {r["key"]: r for r in rows}
    assert keys["seq_length"]["section"] == "training" and keys["model.seq_length"]["section"] == "model"
    assert keys["num_moe_experts"]["flag"] == "--num-experts"
    assert (keys["num_layers"]["minimum"], keys["num_layers"]["maximum"]) == (1, 10_000)
    assert keys["backend"]["choices"][-1] == "replay:RUN"


def test_a_pattern_lists_the_matching_fields_as_text(capsys):
    code, out, _ = run(capsys, "fields", "recompute_")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "[training]"
    assert lines[1:3] == [
        "recompute_granularity = none  (one of none, full, selective)  --recompute-granularity",
        "    activation recompute: whole layers (full), some modules (selective), or none"]
    assert "recompute_num_layers = none  (an integer or none, at least 1)  --recompute-num-layers" in lines
    assert ("recompute_modules = none  (a list of core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
            "shared_experts)  --recompute-modules") in lines
    assert len(lines) == 1 + 2 * 4

    code, out, _ = run(capsys, "fields", "cluster.")
    assert out.splitlines()[1] == "nodes = 1  (an integer, 1 to 1,000,000)"


def test_a_pattern_that_matches_nothing_is_one_line(capsys):
    code, _, err = run(capsys, "fields", "recompute_modulez")
    assert code == 2
    assert one_error_line(err) == ("charllm-tui: error: fields: no field matches 'recompute_modulez'; "
                                   "did you mean 'recompute_modules'?")
