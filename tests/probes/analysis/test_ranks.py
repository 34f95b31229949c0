"""Every rank's step timers from the iteration log, and the stragglers named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from charllm.probes.analysis.ranks import rank_summary, straggler_line, stragglers
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import one_per_step
from charllm.probes.store.schema import RANK_TIMERS
from charllm.probes.store.synthetic import gpu_frame, make_run
from infra_traces import rank_log as log


def test_rank_steps_read_every_ranks_timers_and_place(tmp_path):
    run = make_run(tmp_path, [], iterations=log([0.3, 0.3, 0.3, 0.3]))
    steps = run.rank_steps()
    assert steps.height == 6 * 4 and sorted(set(steps["rank"])) == [0, 1, 2, 3]
    row = steps.filter((steps["iteration"] == 2) & (steps["rank"] == 3)).row(0, named=True)
    assert (row["node"], row["local_rank"], row["pp_rank"], row["dp_rank"]) == ("n1", 1, 1, 1)
    assert all(row[t] is not None for t in RANK_TIMERS) and row["warmup"] is False


def test_a_slow_rank_is_named_against_its_stage_peers(tmp_path):
    """Four ranks, two per stage; stage 1 computes more than stage 0 by design, rank 2 is slow. Peers
    are a stage's own ranks: rank 2 is the straggler, stage 1's heavier share is not."""
    run = make_run(tmp_path, [], iterations=log([0.2, 0.2, 0.6, 0.4]))
    df = rank_summary(run)
    assert df["rank"][0] == 2 and df.filter(df["straggler"])["rank"].to_list() == [2]
    top = df.row(0, named=True)
    assert top["vs_median"] == pytest.approx(0.6 / 0.5) and top["peers_compute_s"] == pytest.approx(0.5)
    assert top["node"] == "n1" and top["steps"] == 5                     # the warm-up step left out
    [line] = stragglers(df)
    assert line == "rank 2 (node n1, stage 1): compute 1.20x its peers' median (600 ms against 500 ms a step)"
    assert straggler_line(df).startswith("stragglers: rank 2")


def test_no_straggler_is_said_so(tmp_path):
    run = make_run(tmp_path, [], iterations=log([0.30, 0.31, 0.30, 0.30]))
    df = rank_summary(run)
    assert not df["straggler"].any()
    assert straggler_line(df).startswith("no straggler: the slowest, rank 1, computes 1.02x")


def test_one_rank_per_stage_compares_against_every_rank(tmp_path):
    run = make_run(tmp_path, [], iterations=log([0.1, 0.5], pp=2, nodes=("n0",)))
    df = rank_summary(run)
    assert df.filter(df["straggler"])["rank"].to_list() == [1]
    assert df.row(0, named=True)["vs_median"] == pytest.approx(0.5 / 0.3)
    stage = rank_summary(run, by="stage")
    assert stage["pp_rank"].to_list() == [1, 0] and stage["ranks"].to_list() == [1, 1]


def test_profiled_steps_are_left_out_of_the_steady_window(tmp_path):
    rows = log([0.3, 0.3], pp=1, nodes=("n0",), profiled=(3,))
    for row in rows:   # the profiled step: rank 1 took far longer
        if row.get("iteration") == 3 and row.get("timers"):
            row["timers"] = {**row["timers"], "compute_s": [0.3, 3.0]}
    df = rank_summary(make_run(tmp_path, [], iterations=rows))
    assert not df["straggler"].any() and df["notes"][0] == "1 profiled step left out (the profiler slows them)"
    every = rank_summary(make_run(tmp_path, [], iterations=rows, run_id="b"), window="all")
    assert every["steps"].to_list() == [6, 6]


def test_each_ranks_gpu_figures_beside_its_timers(tmp_path):
    t = np.round(np.arange(0, 61) * 0.1, 10)
    frames = [gpu_frame(t, node=f"n{n}", device=f"gpu{g}", power_w=100.0 + 10 * (2 * n + g), temp_gpu_c=50.0,
                        sm_clock_mhz=1500.0) for n in (0, 1) for g in (0, 1)]
    rows = log([0.2, 0.2, 0.6, 0.4], step_s=1.0)
    run = make_run(tmp_path, frames, iterations=rows)
    df = rank_summary(run, window="all").sort("rank")
    assert df["device"].to_list() == ["gpu0", "gpu1", "gpu0", "gpu1"]
    assert df["power_mean_w"].to_list() == pytest.approx([100.0, 110.0, 120.0, 130.0])


def test_runs_without_timers_or_with_damaged_ones(tmp_path):
    with pytest.raises(UserError, match="no per-rank step timers"):
        rank_summary(make_run(tmp_path, [], iterations=[{"event": "iteration", "iteration": 1, "rank": 0}]))
    rows = log([0.3, 0.3], pp=1, nodes=("n0",))
    rows[1]["timers"] = {"compute_s": "fast", "step_s": [1e400, None]}      # damaged: costs only itself
    run = make_run(tmp_path, [], iterations=rows, run_id="b")
    steps = run.rank_steps()
    first = steps.filter(steps["iteration"] == 1)
    assert first.height == 2 and first["compute_s"].null_count() == 2 and first["step_s"].null_count() == 2
    assert steps.filter(steps["iteration"] == 2)["compute_s"].null_count() == 0
    with pytest.raises(UserError, match="--by 'gpu'"):
        rank_summary(run, by="gpu")


def test_one_line_per_step_prefers_the_loss_and_the_timers(tmp_path):
    first = {"event": "iteration", "iteration": 1, "rank": 1, "loss": 2.5, "timers": None}
    second = {"event": "iteration", "iteration": 1, "rank": 0, "loss": None, "timers": {"compute_s": [1.0]}}
    [merged] = one_per_step([first, second])
    assert merged["loss"] == 2.5 and merged["timers"] == {"compute_s": [1.0]}
    json.dumps(merged)


@pytest.mark.parametrize("iteration", ["x", None, 10**30, 1.5, True, [1]])
@pytest.mark.parametrize("by", ["rank", "stage"])
def test_a_line_whose_iteration_is_not_a_step_is_skipped_and_counted(tmp_path, capsys, iteration, by):
    """Issue 35: rank 0's line with `"iteration": "x"`, null or 10**30 raised IndexError in summarize.
    Such a line is skipped, and one line counts them; with none left, one error line says why."""
    from infra_cli import one_error_line, run

    rows = log([0.2, 0.2, 0.6, 0.4])
    timed = [row for row in rows if row.get("timers")]
    timed[2]["iteration"] = iteration
    some = make_run(tmp_path, [], iterations=rows, run_id="some")
    code, out, err = run(capsys, "summarize", str(some.path), "--by", by)
    assert code == 0 and not err
    assert "note: 1 iteration-log line with timers skipped: 'iteration' is not a whole number (e.g. " in out
    for row in timed:
        row["iteration"] = iteration
    every = make_run(tmp_path, [], iterations=rows, run_id="every")
    code, _, err = run(capsys, "summarize", str(every.path), "--by", by)
    assert code == 2 and "no per-rank step timers" in one_error_line(err) and "6 iteration-log lines" in err


def test_timers_of_many_ranks_read_in_one_pass_and_bounded(tmp_path, monkeypatch):
    """Issue 35: 100,000 ranks' timers took minutes, a Python row per (step, rank). They are read a
    batch at a time into frames (benchmarks/bench_kernels.py times it), each rank placed by the
    start record logged last before its line; past MAX_RANK_ROWS, one line."""
    from charllm.probes.store import rundir

    monkeypatch.setattr(rundir, "_RANK_BATCH", 7)      # batches cut through steps
    rows = log([0.25] * 16, steps=3, pp=4, nodes=("n0", "n1"))
    moved = {**rows[0], "ranks": [{**place, "node": "n9"} for place in rows[0]["ranks"]]}
    rows.insert(3, moved)                               # a restart's start record: steps 2 and 3 ran on n9
    rows.insert(4, {"event": "start", "ranks": [{"rank": 10**30}, {"rank": "x"}, "junk"]})   # nothing placed
    rows.insert(5, moved)
    steps = make_run(tmp_path, [], iterations=rows).rank_steps()
    assert steps.height == 3 * 16 and steps["rank"].to_list() == list(range(16)) * 3
    assert steps["node"].to_list() == ["n0"] * 8 + ["n1"] * 8 + ["n9"] * 32
    assert steps["pp_rank"].to_list()[:16] == [r * 4 // 16 for r in range(16)]
    monkeypatch.setattr(rundir, "MAX_RANK_ROWS", 40)
    with pytest.raises(UserError, match=r"timers for more than 40 \(step, rank\) pairs \(16 ranks on one line\)"):
        make_run(tmp_path, [], iterations=rows, run_id="b").rank_steps()


def test_steps_without_times_are_left_out_and_counted(tmp_path):
    rows = log([0.3, 0.3], pp=1, nodes=("n0",))
    for row in rows:
        if row.get("iteration") == 4:
            row["start_ns"] = row["end_ns"] = "soon"
    df = rank_summary(make_run(tmp_path, [], iterations=rows))
    assert df["steps"].to_list() == [4, 4] and df["notes"][0] == "1 step without a start and end time left out"
    for row in rows:
        row["start_ns"] = None
    with pytest.raises(UserError, match=r"no step to summarize \(6 steps without a start and end time left out\)"):
        rank_summary(make_run(tmp_path, [], iterations=rows, run_id="b"))
    every = log([0.3, 0.3], pp=1, nodes=("n0",), profiled=range(1, 7))
    with pytest.raises(UserError, match=r"no step to summarize \(6 profiled steps left out"):
        rank_summary(make_run(tmp_path, [], iterations=every, run_id="c"))
