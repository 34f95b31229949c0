"""A campaign's summary holds the paper's burst figures (issue 39, Findings): p99 power, the steepest
rise, spikes over the run's mean and over the board limit, and time throttled, each as `summarize`
gives it for the member's run."""

from __future__ import annotations

import json

import pytest

from charllm.engine.campaign import state
from charllm.engine.campaign.report import figure, values_of
from charllm.engine.campaign.summary import campaign_summary
from charllm.probes.analysis.summary import summarize
from charllm.tui.demo import DEMO_CAMPAIGN, make_demo_campaign
from infra_cli import run

BURSTS = ("power_p99_w", "power_max_rise_w_per_s", "spikes_over_mean_count", "spikes_over_limit_count",
          "spikes_over_limit_max_excess_w", "time_over_limit_s", "throttle_perf_frac")


def test_spike_excursion_and_throttle_figures_are_each_member_run_s(charllm_dirs, capsys):
    make_demo_campaign(charllm_dirs["runs"])
    record = state.Record.load(DEMO_CAMPAIGN)
    summary = campaign_summary(record)
    assert all(c in summary.columns for c in BURSTS)
    ran = 0
    for m, row in zip(record.members, summary.iter_rows(named=True)):
        if m["status"] != "completed":
            assert all(row[c] is None for c in BURSTS), "a member without a run has no figures"
            continue
        ran += 1
        per_run = summarize(record.run_dir(m), "steady", by="run").row(0, named=True)
        for c in BURSTS:
            assert per_run[c] is not None and row[c] == pytest.approx(per_run[c]), c
        assert row["spikes_over_limit_count"] > 0 and row["throttle_perf_frac"] > 0   # the demo runs at its limit
    assert ran == 6
    code, out, err = run(capsys, "campaign", "summary", DEMO_CAMPAIGN, "--format", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert all(type(r["spikes_over_limit_count"]) is int for r in rows if r["status"] == "completed"), "counts"
    code, out, err = run(capsys, "campaign", "summary", DEMO_CAMPAIGN)
    assert code == 0 and "spikes over limit, count" in " ".join(out.split()), err
    # a figure of them: spikes over the limit against the micro batch size
    plotted = values_of(figure(record, "microbatch", "spikes_over_limit_count"))
    assert sorted(v for v in plotted.values() if v is not None) == \
        sorted(summary.filter(summary["status"] == "completed")["spikes_over_limit_count"].to_list())
