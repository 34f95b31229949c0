"""The profiler window of an experiment: which ranks record which steps, and what is said of its cost."""

from __future__ import annotations

import pytest

from charllm.engine.model import profiling
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.validate import validate


def test_one_rank_per_stage_or_every_rank():
    exp = Experiment.load("ppt-h100-llama3-70b-1-01000").apply(["profile_steps=[10]"])   # TP8 PP4 DP2, 64 GPUs
    plan = profiling.plan(exp)
    assert plan.ranks == (0, 16, 32, 48) and plan.steps == (10,) and plan.scope == "stage"
    assert plan.total_bytes == 4 * plan.trace_bytes
    line = plan.describe()
    assert line.startswith("profiler: 1 step (10) on the first rank of each pipeline stage (ranks 0, 16, 32, 48): "
                           "4 traces into traces/, about ") and "run slower on every rank" in line
    every = profiling.plan(exp.copy().apply(["profile_scope=all"]))
    assert every.ranks == tuple(range(64)) and "on every rank" in every.describe()
    assert profiling.plan(Experiment.load("tiny-local")) is None


def test_the_estimate_grows_with_the_stage_and_its_micro_batches():
    def tiny(*more):   # apply sets the fields of the experiment it is called on
        return Experiment.load("tiny-local").apply(["profile_steps=[2]", *more])

    base, more_layers, more_batches = tiny(), tiny("num_layers=8"), tiny("global_batch_size=32")
    assert profiling.plan(more_layers).trace_bytes > profiling.plan(base).trace_bytes
    assert profiling.plan(more_batches).trace_bytes > profiling.plan(base).trace_bytes
    assert profiling.plan(base, "cuda").trace_bytes > profiling.plan(base, "cpu").trace_bytes


@pytest.mark.parametrize("assignments, rule", [
    (["profile_steps=[0]"], "step 0 is not one of the run's steps (1 to train_iters = 20)"),
    (["profile_steps=[21]"], "step 21 is not one of the run's steps"),
    (["profile_steps=[3, 3]"], "a step is listed twice"),
    (["profile_scope=some"], "must be one of stage, all"),
])
def test_a_window_outside_the_run_is_one_problem(assignments, rule):
    problems = [str(p) for p in validate(Experiment.load("tiny-local").apply(assignments))]
    assert len(problems) == 1 and rule in problems[0], problems
