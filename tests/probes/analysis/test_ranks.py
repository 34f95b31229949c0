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
