"""Figures drawn from a campaign's plans before any run (issue 39): `campaign report NAME --figure KIND
--predicted`, in the terminal and as JSON, one entry per member with the speed model's values."""

from __future__ import annotations

import json

import pytest

from charllm.engine.campaign import spec, state
from charllm.engine.model import speed
from infra_cli import one_error_line, run


def test_the_parallelism_figure_of_the_plans_has_every_member_with_its_predicted_values(charllm_dirs, capsys):
    code, out, err = run(capsys, "campaign", "report", "ppt-parallelism", "--figure", "parallelism", "--predicted",
                         "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    assert len(found) == 15 and len({e["name"] for e in found}) == 15
    assert len({(e["model"], e["x"]) for e in found}) == 15, "no two members of a model share a tick"
    metrics = ["power_mean_w", "tokens_per_s", "iter_time_mean_s", "efficiency_samples_per_s_mj"]
    assert all(list(e["values"]) == metrics and None not in e["values"].values() for e in found)
    experiments = {m.experiment.name: m.experiment for m in spec.Campaign.load("ppt-parallelism").members()}
    for e in found:
        plan = speed.estimate(experiments[e["name"]])
        assert e["values"]["power_mean_w"] == pytest.approx(plan.power_w)
        assert e["values"]["iter_time_mean_s"] == pytest.approx(plan.step_s)
        assert e["values"]["tokens_per_s"] == pytest.approx(plan.tokens_per_s)
    code, out, err = run(capsys, "campaign", "report", "ppt-parallelism", "--figure", "parallelism", "--predicted")
    assert code == 0 and "ppt-parallelism: per layout (predicted)" in out and "power, mean (W)" in out, err
    assert state.recorded() == [], "a prediction runs and records nothing"


def test_a_cpu_campaign_is_predicted_in_what_its_plans_hold(charllm_dirs, capsys):
    """A CPU has no board limit, so no predicted power: the figure plots tokens/s instead of empty panels."""
    code, out, err = run(capsys, "campaign", "report", "tiny-local", "--figure", "microbatch", "--predicted",
                         "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    assert [e["x"] for e in found] == ["1", "2", "4"] * 2
    assert all(list(e["values"]) == ["tokens_per_s"] and e["values"]["tokens_per_s"] > 0 for e in found)


def test_a_per_gpu_figure_cannot_be_predicted(charllm_dirs, capsys):
    code, _, err = run(capsys, "campaign", "report", "ppt-parallelism", "--figure", "heatmap", "--predicted")
    assert code == 2 and "a plan predicts per layout, not per GPU or kernel" in one_error_line(err)
    code, _, err = run(capsys, "campaign", "report", "ppt-parallelism", "--figure", "optimization", "--predicted",
                       "--metric", "temp_gpu_mean_c")
    assert code == 2 and "--metric 'temp_gpu_mean_c': not a campaign figure" in one_error_line(err)
