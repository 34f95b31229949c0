"""What finishes a run keeps its summaries (import here; the supervisor, whose end-to-end check
is in tests/engine/launch/test_launch_local.py), so that the usual compare is warm; what they
keep is exactly what a fresh pass computes."""

from __future__ import annotations

import shutil

import numpy as np
from polars.testing import assert_frame_equal

from charllm.engine.launch.supervise import keep_summaries
from charllm.engine.model.experiment import Experiment
from charllm.probes.analysis.summary import BY, cached_summary, per_iteration, summarize
from charllm.probes.store.rundir import resolve_run
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run
from charllm.tui.cli import main
from infra_charllm_ppt import make_results


def _kept_equals_a_fresh_pass(run) -> None:
    kept = {by: cached_summary(run, "steady", by=by) for by in BY}
    kept_curves = per_iteration(run)
    assert all(df is not None for df in kept.values()), "a level was not kept"
    shutil.rmtree(run.path / "summaries")
    for by, df in kept.items():
        assert_frame_equal(df, summarize(run, "steady", by=by))
    assert_frame_equal(kept_curves, per_iteration(run))


def test_import_keeps_the_summaries_of_each_run(tmp_path, capsys):
    assert main(["import", "charllm-ppt", str(make_results(tmp_path / "res")), "--gpus-per-node", "1"]) == 0
    run = resolve_run(capsys.readouterr().out.strip())
    assert (run.path / "summaries" / "per-iteration.parquet").is_file()
    _kept_equals_a_fresh_pass(run)


def test_import_of_a_tree_keeps_the_summaries_of_every_run(tmp_path, capsys):
    for where in ("sweep/model/run0", "sweep/model/run1"):
        make_results(tmp_path / "results" / where)
    assert main(["import", "charllm-ppt", str(tmp_path / "results"), "--gpus-per-node", "1"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 2
    for run_id in ids:
        _kept_equals_a_fresh_pass(resolve_run(run_id))


def test_the_supervisor_keeps_the_summaries_of_the_run_it_finished(charllm_dirs, tmp_path):
    experiment = tmp_path / "experiment.toml"
    Experiment.load("tiny-local").save(experiment)
    t = np.arange(0, 10, 0.05)
    run = make_run(charllm_dirs["runs"], [gpu_frame(t, power_w=150.0 + 50 * np.sin(t), temp_gpu_c=60.0)],
                   experiment=experiment.read_text(), iterations=iteration_rows(np.arange(0, 9, 1.0), 0.9, warmup=2),
                   run_id="supervised")
    keep_summaries(run)
    assert cached_summary(run, "steady", by="run")["window"][0] == "steady"
    _kept_equals_a_fresh_pass(run)


def test_a_run_with_nothing_to_summarize_keeps_nothing(charllm_dirs):
    run = make_run(charllm_dirs["runs"], run_id="empty")      # finished, but no telemetry
    keep_summaries(run)
    assert not (run.path / "summaries").exists()


def test_a_summary_that_fails_is_said_and_costs_the_run_nothing(charllm_dirs, capsys, monkeypatch):
    from charllm.probes.analysis import summary

    run = make_run(charllm_dirs["runs"], [gpu_frame(np.arange(0, 10, 0.05), power_w=150.0)], run_id="buggy")

    def broken(run):
        raise RuntimeError("a bug in the analysis")

    monkeypatch.setattr(summary, "keep_summaries", broken)
    keep_summaries(run)   # the supervisor goes on to exit normally
    assert "summaries not kept: RuntimeError('a bug in the analysis')" in capsys.readouterr().out
    assert run.status == "completed"
