"""The artifact's own results as a campaign: `import charllm-ppt` attaches to each run the shipped
ppt-* experiment its folder names (results/<sweep>/<model>/<model>_<layout>_<variant or mbsN>), records
its start and duration, and makes the tree a campaign that `campaign summary` and `report` read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from charllm.engine.campaign.artifact import MIXTRAL_LABELS, experiment_for
from charllm.engine.campaign.report import figure, values_of
from charllm.engine.campaign.state import Record
from charllm.probes.analysis.summary import summarize
from charllm.probes.store.rundir import resolve_run
from infra_charllm_ppt import make_results
from infra_cli import run


@pytest.mark.parametrize("path, preset, mbs", [
    ("optimization-sweep-h200/llama3-70b/llama3-70b_2_11000", "ppt-h200-llama3-70b-2-11000", 1),
    ("optimization-sweep-h200-fsdp/gpt3-175b/gpt3-175b_5_00000", "ppt-h200-gpt3-175b-5-00000", 1),
    ("optimization-sweep-h100/mixtral-8x22b/mixtral-8x22b_4_10000", "ppt-h100-mixtral-8x22b-4-10000", 1),
    ("microbatch-sweep-h200/mixtral-8x7b/mixtral-8x7b_2_mbs4", "ppt-h200-mixtral-8x7b-2-01000", 4),
    ("optimization-sweep-h100/llama3-70b/llama3-70b_4_00000", "ppt-h100-llama3-70b-4-00000", 1),   # our split
])
def test_a_run_folder_names_the_experiment_it_ran(path, preset, mbs):
    exp, name = experiment_for(Path("results") / path)
    assert name == preset and exp.training.micro_batch_size == mbs


@pytest.mark.parametrize("path", ["optimization-sweep-h200/llama3-70b/gpt3-175b_1_00000",   # model mismatch
                                  "optimization-sweep-h300/llama3-70b/llama3-70b_1_00000",  # no such sweep
                                  "optimization-sweep-h100/llama3-70b/llama3-70b_6_00000",  # no layout 6
                                  "other/x/y", "x"])
def test_a_folder_that_names_no_run_of_the_artifact_gets_none(path):
    assert experiment_for(Path(path)) is None


def test_an_imported_results_tree_is_a_campaign_with_experiments_and_times(tmp_path, charllm_dirs, capsys):
    root = tmp_path / "results"
    folders = {"optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_00000": ("base", None),
               "optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_01000": ("recompute", None),
               "microbatch-sweep-h200/mixtral-8x7b/mixtral-8x7b_2_mbs2": (None, 2)}
    for folder in folders:
        make_results(root / folder, ranks=32, gpus_per_node=8)
    code, out, err = run(capsys, "import", "charllm-ppt", str(root))
    assert code == 0, err
    assert "campaign 'results'" in err
    record = Record.load("results")
    assert [m["status"] for m in record.members] == ["completed"] * 3
    for m in record.members:
        rd = resolve_run(m["run"])
        manifest = rd.read_manifest()
        assert manifest["experiment"].startswith("ppt-h200-mixtral-8x7b-") and rd.experiment_path.is_file()
        assert MIXTRAL_LABELS in manifest["notes"], "the layout numbering the import follows is said"
        assert manifest["ended_ns"] - manifest["started_ns"] == pytest.approx(2e9, rel=0.01)   # the recording
        assert m["layout"] in ("TP1 PP1 EP8 DP32", "TP2 PP1 EP4 DP16")
    code, out, err = run(capsys, "campaign", "summary", "results", "--format", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 3 and all(r["efficiency_samples_per_s_mj"] and r["mfu_pct"] for r in rows)
    assert all(r["tokens_per_s"] == pytest.approx(128 * 4096 / 2.0, rel=0.01) for r in rows)
    fig = figure(record, "optimization", "power_mean_w")
    plotted = values_of(fig)
    first = record.members[0]
    expected = summarize(resolve_run(first["run"]), "steady", by="run")["power_mean_w"][0]
    assert plotted[("power_mean_w", "base", "TP1 PP1 EP8 DP32")] == pytest.approx(expected)
    for kind in ("parallelism", "optimization", "microbatch", "heatmap"):
        assert run(capsys, "campaign", "report", "results", "--figure", kind)[0] == 0


def test_the_kernels_figure_shows_each_layouts_profiled_step_by_category(tmp_path, charllm_dirs, capsys):
    """The artifact's traces come with the import: the report's kernels figure puts each layout's
    share of the step per category side by side (the paper's Figure 10), marking a layout without."""
    import shutil

    from infra_traces import ARTIFACT_TRACES

    root = tmp_path / "results"
    traced, plain = ("optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_00000",
                     "optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_2_00000")
    for folder in (traced, plain):
        make_results(root / folder, ranks=32, gpus_per_node=8)
    shutil.copytree(ARTIFACT_TRACES, root / traced / "4242_kineto")
    assert run(capsys, "import", "charllm-ppt", str(root))[0] == 0
    record = Record.load("results")
    fig = figure(record, "kernels")
    assert [p.metric for p in fig.panels] == [
        "matmul_pct",
        "attention_pct",
        "norm_pct",
        "elementwise_pct",
        "optimizer_pct",
        "other_pct",
        "memcpy_pct",
        "SendRecv_pct",
        "AllGather_pct",
        "ReduceScatter_pct",
        "AllReduce_pct",
    ]
    matmul = fig.panels[0].series[0]
    assert matmul.x == ["TP1 PP1 EP8 DP32 variant=base", "TP2 PP1 EP4 DP16 variant=base"]
    assert matmul.y[0] == pytest.approx(40.0) and matmul.y[1] is None     # (20 % + 60 %) / 2 stages
    assert matmul.marks == {"TP2 PP1 EP4 DP16 variant=base": "no traces"}
    code, out, err = run(capsys, "campaign", "report", "results", "--figure", "kernels")
    assert code == 0, err
    assert (
        "matmul, share of the step" in out and "no value: mixtral-8x7b TP2 PP1 EP4 DP16 variant=base: no traces" in out
    )


def test_an_import_never_takes_over_a_campaign_record_it_did_not_make(tmp_path, charllm_dirs, capsys):
    """Issue 35: importing a tree named like a campaign that has a record replaced that record."""
    from infra_campaign import plant_record
    from infra_fuzz import tree

    root = tmp_path / "results"
    make_results(root / "optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_00000", ranks=8, gpus_per_node=8)
    theirs = plant_record(charllm_dirs["runs"], "results", [{"status": "completed"}], status="completed")
    before = tree(theirs)
    runs_before = sorted(charllm_dirs["runs"].iterdir())
    code, _, err = run(capsys, "import", "charllm-ppt", str(root), "--name", "results")
    assert code == 2 and "--name results: campaign 'results' exists already" in err.strip().splitlines()[-1]
    assert sorted(charllm_dirs["runs"].iterdir()) == runs_before, "nothing imported"
    code, _, err = run(capsys, "import", "charllm-ppt", str(root))
    assert code == 0 and "campaign 'results-2' (campaign 'results' exists already)" in err, err
    assert Record.load("results-2").members[0]["status"] == "completed"
    assert tree(theirs) == before, "the record it did not make is untouched"
    code, _, err = run(capsys, "import", "charllm-ppt", str(root))
    assert code == 0 and "campaign 'results-3'" in err, "its own earlier import is not replaced either"


def crash(folder: Path, samples: int = 3) -> None:
    """Cut every file of an artifact folder to its first `samples` rows: a run that died before its
    sampled step (the artifact's analysis drops such runs as OOM)."""
    for f in folder.iterdir():
        f.write_text("".join(f.read_text().splitlines(keepends=True)[:samples]))


def test_an_imported_crash_is_a_failed_member_left_out_of_the_figures_and_marked(tmp_path, charllm_dirs, capsys):
    """Issue 39: a crashed folder with 3 power samples imported as "completed", at 1,048,576 tokens/s."""
    root = tmp_path / "results"
    ran, crashed = (root / "optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_1_00000",
                    root / "optimization-sweep-h200/mixtral-8x7b/mixtral-8x7b_2_00000")
    for folder in (ran, crashed):
        make_results(folder, ranks=8, gpus_per_node=8)
    crash(crashed)
    code, out, err = run(capsys, "import", "charllm-ppt", str(root))
    assert code == 0, err
    record = Record.load("results")
    assert [m["status"] for m in record.members] == ["completed", "failed"]
    assert record.data["status"] == "failed" and record.data["failure"] == "1 of 2 members did not complete (1 failed)"
    why = ("crashed or OOM: 3 power samples on its best rank, under the 10 a sampled step holds (the artifact's "
           "own scripts drop such runs as OOM)")
    assert record.members[1]["failure"] == why and f"warning: {record.members[1]['run']}: {why}" in err
    code, out, err = run(capsys, "campaign", "summary", "results", "--format", "json")
    rows = json.loads(out)
    assert rows[0]["tokens_per_s"] and rows[1]["tokens_per_s"] is None and rows[1]["step_error_pct"] is None
    plotted = values_of(figure(record, "optimization", "power_mean_w"))
    assert plotted[("power_mean_w", "base", "TP1 PP1 EP8 DP32")] is not None, plotted
    assert plotted[("power_mean_w", "base", "TP2 PP1 EP4 DP16")] is None, "left out of the figure's values"
    code, out, _ = run(capsys, "campaign", "report", "results", "--figure", "optimization")
    assert code == 0 and "TP2 PP1 EP4 DP16: crashed or OOM" in out, out


@pytest.mark.parametrize("samples, status", [(9, "failed"), (10, "completed")])
def test_a_folder_below_the_artifacts_sample_threshold_is_a_crash(samples, status, tmp_path, charllm_dirs, capsys):
    folder = tmp_path / "run"
    make_results(folder, ranks=2)
    crash(folder, samples)
    code, out, err = run(capsys, "import", "charllm-ppt", str(folder))
    assert code == 0, err
    manifest = resolve_run(out.strip()).read_manifest()
    assert manifest["status"] == status and (status == "completed") == (manifest.get("failure") is None)
