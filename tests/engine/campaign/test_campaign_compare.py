"""`campaign compare A B` (issue 39): two campaigns side by side, each model's best fitting member in
each, predicted from the plans and measured from the runs (the paper's scale-up against scale-out
table). A real tiny CPU campaign is compared in test_campaign_local.py, where it runs."""

from __future__ import annotations

import json
import shutil

import pytest

from charllm.engine.campaign import spec, state
from charllm.engine.campaign.compare import METRICS
from charllm.engine.campaign.summary import campaign_summary
from charllm.engine.model import speed
from charllm.probes.core import paths
from charllm.tui.demo import make_demo_campaign
from infra_cli import one_error_line, run


def compared(capsys, *argv: str) -> list[dict]:
    code, out, err = run(capsys, "campaign", "compare", *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def test_scale_up_against_scale_out_from_the_plans_is_each_model_s_best_fitting_member(charllm_dirs, capsys):
    found = compared(capsys, "ppt-parallelism", "ppt-h100")
    plans = {name: spec.Campaign.load(name).plan() for name in ("ppt-parallelism", "ppt-h100")}
    models = ["gpt3-175b", "llama3-70b", "mixtral-8x22b", "mixtral-8x7b"]
    assert [(r["model"], r["source"], r["campaign"]) for r in found] == \
        [(m, "predicted", c) for m in models for c in ("ppt-parallelism", "ppt-h100")], "predicted only: none ran"
    for row in found:
        fitting = [p for p in plans[row["campaign"]] if p.runnable and p.member.experiment.model.name == row["model"]]
        best = max(fitting, key=lambda p: speed.estimate(p.member.experiment).tokens_per_s)
        plan = speed.estimate(best.member.experiment)
        assert row["member"] == best.member.index + 1 and row["layout"] == best.member.experiment.layout_label
        assert row["gpus"] == best.member.experiment.world_size == (32 if row["campaign"] == "ppt-parallelism" else 64)
        assert row["tokens_per_s"] == pytest.approx(plan.tokens_per_s)
        assert row["tokens_per_s_per_gpu"] == pytest.approx(plan.tokens_per_s / row["gpus"])
        assert row["energy_per_token_j"] == pytest.approx(plan.energy_per_token_j)
        assert row["power_mean_w"] == pytest.approx(plan.power_w)
        assert row["power_total_w"] == pytest.approx(plan.power_w * row["gpus"])
    for h200, h100 in zip(found[::2], found[1::2]):
        assert h200["ratio"] == 1 and h100["ratio"] == pytest.approx(h100["tokens_per_s"] / h200["tokens_per_s"])
    # the most frugal member instead: no fitting member of its model spends less per token
    for row in compared(capsys, "ppt-parallelism", "ppt-h100", "--metric", "energy_per_token_j"):
        fitting = [p for p in plans[row["campaign"]] if p.runnable and p.member.experiment.model.name == row["model"]]
        assert row["energy_per_token_j"] == pytest.approx(
            min(speed.estimate(p.member.experiment).energy_per_token_j for p in fitting))
    code, out, err = run(capsys, "campaign", "compare", "ppt-parallelism", "ppt-h100")
    assert code == 0, err
    assert out.startswith("ppt-parallelism (h200-141gb) against ppt-h100 (h100-sxm-80gb): each model's best member")
    assert "source: predicted" in out
    for row in found:
        line = next(text for text in out.splitlines()
                    if text.startswith(row["model"]) and f" {row['campaign']} " in text)
        assert f" {row['layout']} " in line and f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s" in line
    assert state.recorded() == [], "a comparison runs and records nothing"


def test_a_variant_compares_like_with_like(charllm_dirs, capsys):
    """ppt-parallelism holds recomputing members only; ppt-h100 all four variants."""
    found = compared(capsys, "ppt-parallelism", "ppt-h100", "--variant", "recompute")
    members = {name: {m.index + 1: m for m in spec.Campaign.load(name).members()}
               for name in ("ppt-parallelism", "ppt-h100")}
    assert len(found) == 8 and all(r["variant"] == "recompute" for r in found)
    assert all(members[r["campaign"]][r["member"]].experiment.training.recompute_granularity == "full" for r in found)
    found = compared(capsys, "ppt-parallelism", "ppt-h100", "--variant", "base")
    assert [r["why"] for r in found if r["campaign"] == "ppt-parallelism"] == ["no base member"] * 4
    assert all(r["why"] is None and r["ratio"] is None for r in found if r["campaign"] == "ppt-h100")


def test_measured_rows_are_the_best_completed_member_of_each_campaign_that_ran(charllm_dirs, capsys):
    make_demo_campaign(charllm_dirs["runs"], "demo-a")
    folder = paths.config_dir() / spec.KIND
    shutil.copy(folder / "demo-a.toml", folder / "demo-b.toml")          # the same plans, never run
    found = compared(capsys, "demo-a", "demo-b")
    assert [(r["source"], r["campaign"]) for r in found] == \
        [("predicted", "demo-a"), ("predicted", "demo-b"), ("measured", "demo-a"), ("measured", "demo-b")]
    predicted_a, predicted_b, measured, not_run = found
    assert {**predicted_a, "campaign": ""} == {**predicted_b, "campaign": ""}, "the same plans predict the same"
    summary = campaign_summary(state.Record.load("demo-a"))
    done = summary.filter(summary["status"] == "completed").sort("tokens_per_s", descending=True).row(0, named=True)
    assert measured["member"] == done["member"] and measured["tokens_per_s"] == pytest.approx(done["tokens_per_s"])
    assert measured["gpus"] == done["gpus"] == 8
    assert measured["tokens_per_s_per_gpu"] == pytest.approx(done["tokens_per_s"] / 8)
    assert measured["energy_per_token_j"] == pytest.approx(done["energy_per_token_j"])
    assert measured["power_mean_w"] == pytest.approx(done["power_mean_w"])
    assert measured["ratio"] == 1 and measured["why"] is None
    assert not_run["why"] == "not run" and not_run["tokens_per_s"] is None
    code, out, err = run(capsys, "campaign", "compare", "demo-a", "demo-b", "--format", "csv")
    assert code == 0 and len(out.strip().splitlines()) == 5, err
    code, out, err = run(capsys, "campaign", "compare", "demo-a", "demo-b")
    assert code == 0 and "model: llama3-8b" in out and "measured" in out and "not run" in out, err
    # a damaged record costs only its own measured row
    damaged = state.directory("demo-b") / "campaign.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_text("{not json")
    assert compared(capsys, "demo-a", "demo-b") == [*found[:3], {**not_run, "why": "its record is damaged "
                                                                  "(charllm-tui campaign status demo-b says how)"}]


@pytest.mark.parametrize("argv, says", [
    (("ppt-parallelism", "ppt-parallelism"), "'ppt-parallelism' and 'ppt-parallelism' are the same campaign"),
    (("ppt-parallelism", "ppt-h10"), "campaign 'ppt-h10': no such campaign"),
    (("tiny-local", "ppt-h100"), "campaigns 'tiny-local' (tiny-dense) and 'ppt-h100' (gpt3-175b, llama3-70b, "
                                 "mixtral-8x22b, mixtral-8x7b) have no model in common"),
    (("ppt-parallelism", "ppt-h100", "--metric", "power_mean_w"), "--metric 'power_mean_w': expected one of"),
])
def test_bad_input_is_one_line_and_exit_2(charllm_dirs, capsys, argv, says):
    code, out, err = run(capsys, "campaign", "compare", *argv)
    assert code == 2 and out == "" and says in one_error_line(err)


def test_an_unknown_variant_is_refused_by_its_choices(capsys):
    with pytest.raises(SystemExit) as exit:
        run(capsys, "campaign", "compare", "ppt-parallelism", "ppt-h100", "--variant", "fast")
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "argument --variant: invalid choice: 'fast'" in err and "Traceback" not in err


def test_the_help_names_every_metric(capsys):
    with pytest.raises(SystemExit):
        run(capsys, "campaign", "compare", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert all(metric in text for metric in METRICS) and "predicted" in text and "measured" in text
