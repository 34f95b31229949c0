"""What the headless commands print reads as it says: a sort column is shown, lists come as JSON too,
tables fit 80 columns without cutting names, simulated figures are labelled, times and events are
said in their order, and a refusal says what would be accepted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from charllm.probes.store.synthetic import T0_NS, gpu_frame, iteration_rows, make_run, tiny_experiment
from charllm.tui.commands.launch import follow
from infra_cli import one_error_line, run

T = np.round(np.arange(0, 61) * 0.1, 10)  # 6 s at 10 Hz


def test_follow_says_training_ended_after_the_last_step(charllm_dirs, capsys):
    """Rank 0 logs its end before the last rank logs the last step (the last rank's line is the one
    printed): the end comes after that step, and the final status last."""
    rows = iteration_rows(np.arange(0, 5, 1.0), 0.9, tokens=256)
    last_rank_step = rows.pop()                  # rank 1's step 5, written after rank 0's end
    rows += [{"event": "end", "rank": 0, "iteration": 5, "status": "completed", "end_ns": T0_NS + 5 * 10**9},
             last_rank_step,
             {"event": "end", "rank": 1, "iteration": 5, "status": "completed", "end_ns": T0_NS + 5 * 10**9}]
    rd = make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=300.0)], run_id="20261121-000000-x",
                  manifest={"id": "20261121-000000-x", "status": "completed", "kind": "train", "world_size": 2},
                  experiment=tiny_experiment(), iterations=rows)
    assert follow(rd.path) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("telemetry")]
    assert lines[-3:] == [lines[-3], "training ended: completed at iteration 5", "status: completed"]
    assert lines[-3].startswith("iter     5  rank 1")
    assert sum(line.startswith("training ended") for line in lines) == 1


# -- sweep --------------------------------------------------------------------------------------
def test_sweep_sorted_by_a_column_the_table_does_not_show_shows_it(capsys):
    code, out, _ = run(capsys, "sweep", "tiny-local", "--sort", "energy_per_token_j", "--top", "3")
    assert code == 0
    header = next(line for line in out.splitlines() if line.strip().startswith("rank"))
    assert header.split()[:2] == ["rank", "energy_per_token_j"]
    code, out, _ = run(capsys, "sweep", "tiny-local", "--sort", "host_share", "--top", "3", "--json")
    shares = [row["host_share"] for row in json.loads(out)]
    code, out, _ = run(capsys, "sweep", "tiny-local", "--sort", "host_share", "--top", "3")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()][:3]
    assert [row[1] for row in rows] == [f"{v:,.4g}" for v in shares[:3]]      # the sorted column, in order
    code, out, _ = run(capsys, "sweep", "tiny-local", "--sort", "tokens_per_s", "--top", "3")
    header = next(line for line in out.splitlines() if line.strip().startswith("rank"))
    assert header.split()[1] == "TP"                                           # shown already: not twice


# -- runs list / show / cancel -------------------------------------------------------------------
def _probe_run(root, run_id, *, simulated: bool, seconds: float = 6.0):
    """A probe-only run (no iterations) of one GPU: created, never 'started' (a probe run's manifest)."""
    t = np.round(np.arange(0, seconds * 10 + 1) * 0.1, 10)
    return make_run(root, [gpu_frame(t, power_w=600.0 + 5 * np.sin(t), simulated=simulated)], run_id=run_id,
                    manifest={"id": run_id, "status": "completed", "kind": "probe", "created_ns": T0_NS})


def test_runs_list_labels_simulated_figures_and_the_window_they_are_over(charllm_dirs, capsys):
    _probe_run(charllm_dirs["runs"], "sim-run", simulated=True)
    _probe_run(charllm_dirs["runs"], "real-run", simulated=False)
    make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=300.0, simulated=False)], run_id="trained",
             experiment=tiny_experiment(), iterations=iteration_rows(np.arange(0, 5, 1.0), 0.9, warmup=1, tokens=256))
    code, out, _ = run(capsys, "runs", "list")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["sim-run"], ["real-run"],
                                                                                       ["trained"])}
    assert "SIMULATED" in rows["sim-run"] and "SIMULATED" not in rows["real-run"] + rows["trained"]
    # a probe run has no iterations: its figures are over all samples, and say so
    assert "605*" in rows["sim-run"] and "*" not in rows["trained"]
    assert "* over all samples (no steady iterations)" in " ".join(out.split())

    code, out, _ = run(capsys, "runs", "list", "--json")
    listed = {r["run"]: r for r in json.loads(out)}
    assert listed["sim-run"]["simulated"] is True and listed["real-run"]["simulated"] is False
    assert listed["sim-run"]["window"] == "all" and listed["trained"]["window"] == "steady"
    assert listed["sim-run"]["power_peak_w"] == pytest.approx(605.0, abs=0.1)
    assert listed["trained"]["tokens_per_s"] > 0 and listed["trained"]["iterations"] == 4
    assert listed["sim-run"]["kind"] == "probe" and listed["sim-run"]["started_ns"] == T0_NS
    assert set(listed["trained"]) >= {"status", "status_line", "target", "nodes", "ended_ns", "duration_s", "path"}
    assert [r["run"] for r in json.loads(out)] == ["trained", "sim-run", "real-run"]    # newest first: by id


def test_runs_list_json_without_runs_is_an_empty_list(charllm_dirs, capsys):
    assert run(capsys, "runs", "list", "--json")[:2] == (0, "[]\n")


def test_runs_show_gives_the_start_runs_list_gives(charllm_dirs, capsys):
    from charllm.probes.core.formatting import local_time

    _probe_run(charllm_dirs["runs"], "sim-run", simulated=True)
    code, out, _ = run(capsys, "runs", "show", "sim-run")
    assert code == 0
    started = next(line for line in out.splitlines() if line.startswith("started"))
    assert started.startswith(f"started   {local_time(T0_NS)}   duration")
    assert "target    probe" in out
    code, out, _ = run(capsys, "runs", "list")
    assert local_time(T0_NS, "%Y-%m-%d %H:%M") in out


def test_cancelling_a_finished_run_says_so_and_nothing_else(charllm_dirs, capsys):
    _probe_run(charllm_dirs["runs"], "sim-run", simulated=True)
    code, out, err = run(capsys, "runs", "cancel", "sim-run")
    assert code == 2 and out == ""
    assert one_error_line(err) == "charllm-tui: error: run 'sim-run' is already completed: nothing to cancel"


# -- presets list -------------------------------------------------------------------------------
def test_presets_list_at_80_columns_is_about_two_lines_a_preset(capsys, monkeypatch):
    from charllm.engine.model import catalog

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "presets", "list")
    assert code == 0
    presets = sum(len(catalog.entries(kind)) for kind in catalog.KINDS)
    assert len(out.splitlines()) <= 2.5 * presets and max(map(len, out.splitlines())) <= 80
    assert out.rstrip().endswith("descriptions: presets show NAME, --json, or 120+ columns")
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = run(capsys, "presets", "list", "hardware")
    assert "description" in out.splitlines()[1] and "NVLink 4" in out


# -- campaigns ----------------------------------------------------------------------------------
@pytest.fixture
def imported_campaign(tmp_path, charllm_dirs, capsys):
    """The artifact's results of three mixtral-8x7b runs, imported: campaign 'results' with runs."""
    from infra_charllm_ppt import make_results

    root = tmp_path / "results"
    for folder in ("optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_00000",
                   "optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_01000",
                   "microbatch-sweep-h200/mixtral-8x7b/mixtral-8x7b_2_mbs2"):
        make_results(root / folder, ranks=32, gpus_per_node=8)
    assert run(capsys, "import", "charllm-ppt", str(root))[0] == 0
    return "results"


@pytest.mark.parametrize("columns", ["40", "60", "80", "110", "200"])
def test_campaign_summary_never_cuts_a_member_name(imported_campaign, capsys, monkeypatch, columns):
    from charllm.engine.campaign.state import Record

    monkeypatch.setenv("COLUMNS", columns)
    code, out, _ = run(capsys, "campaign", "summary", imported_campaign)
    assert code == 0
    words = set(out.split())
    for member in Record.load(imported_campaign).members:
        assert member["name"] in words, (columns, member["name"])
    assert "…" not in out
    if int(columns) >= 110:
        assert max(map(len, out.splitlines())) <= int(columns)


def test_campaign_list_json_says_how_far_each_has_run(imported_campaign, capsys):
    code, out, _ = run(capsys, "campaign", "list", "--json")
    assert code == 0
    listed = {c["campaign"]: c for c in json.loads(out)}
    assert listed["results"]["status"] == "completed" and listed["results"]["by_status"] == {"completed": 3}
    assert listed["tiny-local"] == {"campaign": "tiny-local", "members": 6, "status": "not run", "by_status": {},
                                    "progress": "not run", "description": listed["tiny-local"]["description"]}
    assert listed["results"]["progress"].startswith("3 members (3 completed)")


def test_an_unknown_metric_lists_the_metrics(imported_campaign, capsys):
    code, _, err = run(capsys, "campaign", "report", imported_campaign, "--figure", "microbatch", "--metric", "xyz")
    line = one_error_line(err)
    assert code == 2 and "--metric 'xyz': not a campaign figure (the figures: iter_time_mean_s, " in line
    for metric in ("tokens_per_s", "mfu_pct", "power_mean_w", "energy_per_token_j"):
        assert metric in line
    code, _, err = run(capsys, "campaign", "report", imported_campaign, "--figure", "microbatch", "--metric",
                       "tokens_per_sec")
    assert "not a campaign figure; did you mean 'tokens_per_s'? (the figures: " in one_error_line(err)
    code, _, err = run(capsys, "campaign", "report", imported_campaign, "--figure", "heatmap", "--metric", "xyz")
    assert code == 2 and "not a per-GPU figure (the figures: " in one_error_line(err) and "temp_gpu_peak_c" in err


def test_a_campaign_and_summarize_give_one_step_error(imported_campaign, capsys):
    """The campaign's planned step and power are compared with the figures `summarize` compares them
    with (probes.analysis.predicted: the window's mean step, its mean power)."""
    from charllm.engine.campaign.summary import PLANNED
    from charllm.probes.analysis.predicted import METRICS, predicted_vs_measured

    compared = {name: column for _, column, name, _ in METRICS}
    assert {name: column for name, column, _, _ in PLANNED} == {"step_s": compared["step_s"],
                                                               "power_w": compared["power_w"]}
    assert compared["step_s"] == "iter_time_mean_s"
    code, out, _ = run(capsys, "campaign", "summary", imported_campaign, "--format", "json")
    for row in json.loads(out):
        errors = {r["metric"]: r["error_pct"] for r in predicted_vs_measured(row["run"]).iter_rows(named=True)}
        assert row["step_error_pct"] == pytest.approx(errors["step time"])
        assert row["power_error_pct"] == pytest.approx(errors["power per GPU"])
