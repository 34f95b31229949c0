"""`campaign report NAME --findings` (issue 39): what a campaign shows, each finding between members alike
but for one thing, with numbers that `campaign summary` reproduces and the members they rest on."""

from __future__ import annotations

import json

import polars as pl
import pytest

from charllm.engine.campaign.findings import findings
from charllm.engine.campaign.summary import campaign_summary
from charllm.probes.analysis.render import metric_label
from infra_campaign import plant_record, record
from infra_cli import one_error_line, run

CAMPAIGN = """experiments = ["tiny-local"]
[axes]
micro_batch_size = [1, 4]
overlap_grad_reduce = [false, true]
train_iters = [8]
[target]
name = "local"
max_parallel = 2
"""


@pytest.mark.integration
@pytest.mark.train
@pytest.mark.timeout(400)
def test_a_tiny_campaign_of_micro_batch_and_overlap_states_its_findings_with_the_summarys_numbers(
        capsys, charllm_dirs):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "tinyf.toml").write_text(CAMPAIGN)
    code, out, err = run(capsys, "campaign", "run", "tinyf")
    assert code == 0, out + err
    code, out, err = run(capsys, "campaign", "report", "tinyf", "--findings", "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    assert [f["kind"] for f in found] == ["micro_batch", "overlap", "plan"], found
    rows = {r["member"]: r for r in campaign_summary(record("tinyf")).to_dicts()}
    members = {r["member"]: r for r in rows.values()}
    for f in found:
        assert f["evidence"] and f["members"] == sorted({n for e in f["evidence"] for n in e["members"]})
        for e in f["evidence"]:   # every number is the summary's, of the members named
            assert e["values"] == [rows[n][e["metric"]] for n in e["members"]], e
    by_kind = {f["kind"]: f for f in found}
    mbs = by_kind["micro_batch"]["evidence"]
    assert {tuple(members[n]["micro_batch_size"] for n in e["members"]) for e in mbs} == {("1", "4")}
    overlap = by_kind["overlap"]["evidence"]
    assert {tuple(members[n]["overlap_grad_reduce"] for n in e["members"]) for e in overlap} == {("False", "True")}
    for e in mbs + overlap:   # a pair shares everything else
        a, b = (members[n] for n in e["members"])
        other = "overlap_grad_reduce" if e in mbs else "micro_batch_size"
        assert a[other] == b[other] and a["layout"] == b["layout"]
        assert e["change_pct"] == pytest.approx(100 * (e["values"][1] / e["values"][0] - 1))
    assert len(by_kind["plan"]["evidence"]) == 4   # every member had a plan and a run
    code, text, _ = run(capsys, "campaign", "report", "tinyf", "--findings")
    assert code == 0 and text.startswith("campaign tinyf: 3 findings from 4 of 4 members completed"), text
    e = mbs[0]
    said = f"members {e['members'][0]} -> {e['members'][1]}: {rows[e['members'][0]]['tokens_per_s']:,.0f} tokens/s"
    assert said in text and "1. micro batch 4 against 1 (members 1, 2, 3, 4)" in text, text


def _member(index: int, mbs: int, variant: str, layout: str = "TP1 PP8 DP8") -> dict:
    return {"name": f"m{index}", "model": "llama3-70b", "hardware": "h200-141gb", "layout": layout,
            "variant": variant, "micro_batch_size": mbs, "varied": {"micro_batch_size": mbs},
            "status": "completed", "run": f"20261129-000000-m{index}"}


def test_bursts_with_the_micro_batch_and_the_cost_of_recomputation_are_said_where_the_runs_have_them(charllm_dirs):
    """GPU figures (a planted record with its summary given): the micro batch finding says the power bursts,
    recomputation its cost in speed and energy, the layouts the fastest against the slowest; a figure the
    runs lack is left out, never guessed."""
    members = [_member(0, 1, "base"), _member(1, 8, "base"), _member(2, 1, "recompute"),
               _member(3, 1, "base", "TP8 PP1 DP8")]
    plant_record(charllm_dirs["runs"], "h200", members, status="completed")
    summary = pl.DataFrame({
        "member": [1, 2, 3, 4], "status": ["completed"] * 4,
        "tokens_per_s": [1000.0, 1300.0, 800.0, 1500.0], "energy_per_token_j": [2.0, 1.8, 2.6, None],
        "power_p99_w": [706.0, 741.0, 690.0, 700.0], "time_over_limit_s": [0.5, 3.0, 0.2, 0.1],
        "power_max_rise_w_per_s": [None] * 4, "spikes_over_limit_count": [1, 9, 0, 0],
        "throttle_sw_power_cap_frac": [0.59, 0.92, 0.3, 0.2],
        "step_error_pct": [5.0, -10.0, None, 2.0], "planned_step_s": [1.0, 2.0, None, 0.5],
        "power_error_pct": [None] * 4, "planned_power_w": [None] * 4,
    })
    found = {f.kind: f for f in findings(record("h200"), summary)}
    assert list(found) == ["micro_batch", "recompute", "layout", "plan"]
    mbs = found["micro_batch"]
    assert mbs.title == "micro batch 8 against 1" and mbs.members == [1, 2]
    said = ["tokens_per_s", "power_p99_w", "spikes_over_limit_count", "time_over_limit_s", "throttle_sw_power_cap_frac"]
    assert len(mbs.lines) == len(said) and all(line.startswith(metric_label(metric) + ": ")
                                               for line, metric in zip(mbs.lines, said)), mbs.lines   # no power rise
    assert f"{metric_label('time_over_limit_s')}: +500.0% on TP1 PP8 DP8, base (members 1 -> 2: 500.0 ms -> 3.000 s)" \
        in mbs.lines, mbs.lines
    recompute = found["recompute"]
    assert recompute.members == [1, 3] and recompute.lines == [
        "tokens per second: -20.0% on TP1 PP8 DP8, micro batch 1 (members 1 -> 3: 1,000 tokens/s -> 800 tokens/s)",
        "energy per token: +30.0% on TP1 PP8 DP8, micro batch 1 (members 1 -> 3: 2.000 J -> 2.600 J)"]
    assert found["layout"].lines == ["TP8 PP1 DP8 against TP1 PP8 DP8: +50.0% tokens per second (members 1 -> 4: "
                                     "1,000 tokens/s -> 1,500 tokens/s)"]
    assert found["plan"].lines == ["step time: the plans were off by 5.7% on average over 3 members, at most -10.0% "
                                   "(member 2)"]


def test_findings_say_so_when_there_are_none_and_refuse_figure_options_in_one_line(capsys, charllm_dirs):
    plant_record(charllm_dirs["runs"], "empty", [_member(0, 1, "base")], status="completed")
    code, out, _ = run(capsys, "campaign", "report", "empty", "--findings")
    assert code == 0 and "0 findings from 0 of 1 member completed" in out and "none yet" in out, out
    code, _, err = run(capsys, "campaign", "report", "empty", "--findings", "--metric", "power_mean_w")
    assert code == 2 and "--findings: reads the runs" in one_error_line(err)
    with pytest.raises(SystemExit) as exited:
        run(capsys, "campaign", "report", "empty")
    assert exited.value.code == 2 and "one of the arguments --figure --findings is required" in capsys.readouterr().err


def test_a_command_axis_of_words_is_no_micro_batch_to_compare(charllm_dirs):
    """A command campaign's micro_batch_size axis may hold words: no finding compares them, none fails."""
    members = [_member(0, 1, "base"), {**_member(1, 1, "base"), "micro_batch_size": "auto"}]
    plant_record(charllm_dirs["runs"], "words", members, status="completed")
    summary = pl.DataFrame({"member": [1, 2], "status": ["completed"] * 2, "tokens_per_s": [1.0, 2.0]})
    assert [f.kind for f in findings(record("words"), summary)] == []


def test_a_change_that_rounds_to_nothing_is_said_as_no_change(charllm_dirs):
    plant_record(charllm_dirs["runs"], "flat", [_member(0, 1, "base"), _member(1, 2, "base")], status="completed")
    summary = pl.DataFrame({"member": [1, 2], "status": ["completed"] * 2, "power_p99_w": [557.1, 557.09]})
    line, = findings(record("flat"), summary)[0].lines
    assert "+0.0% on TP1 PP8 DP8, base" in line and "-0.0%" not in line, line
