"""The step-time model against Megatron-LM's measured runs: the step times of the memory dev set
(tests/data/memory_dev/: every public H100 training case of Megatron-LM's CI but the project's
held-out 12, with the median steady `iteration-time` of each, rebuilt by tools/build_memory_dev.py).

Each case is imported from its exact command line and environment and estimated
(`engine.model.speed.estimate`); the relative error of the step time is printed per case and per
class. The issue's targets are for the cases of at least 1B parameters (mean absolute error at most
10%, each within 25%); the small ones, whose steps are mostly fixed host costs, are held to what the
model achieves today, so a regression fails. Run with `-s` to see the table.
"""

from __future__ import annotations

import statistics

import pytest
from test_memory_validation import _cases, line

from charllm.engine.model.megatron import import_megatron_args
from charllm.engine.model.memory import count_parameters
from charllm.engine.model.speed import estimate

LARGE = 1e9                     # parameters: the line between the target and the small cases
LARGE_MEAN, LARGE_MAX = 0.10, 0.25
# Achieved on the 83 small cases (mean and median absolute relative error, and the worst: the bound on
# each, so that no one case can grow unnoticed while the mean holds), just above
SMALL_MEAN, SMALL_MEDIAN, SMALL_MAX = 0.19, 0.12, 0.90
INFERRED = "world size inferred"   # the world size was read from the step time itself: no accuracy target


def classes(exp) -> list[str]:
    """The classes a case counts in (the issue's: dense, MoE, PP/VP, CP, large DP; and more)."""
    p, t = exp.parallel, exp.training
    tags = ["moe" if exp.model.is_moe else "dense"]
    tags += [tag for tag, on in (
        ("PP/VP", p.pipeline_model_parallel_size > 1), ("VP", exp.virtual_stages > 1),
        ("CP", p.context_parallel_size > 1), ("TP", p.tensor_model_parallel_size > 1),
        ("EP", p.expert_model_parallel_size > 1), ("large DP (16+)", exp.data_parallel_size >= 16),
        ("world > 8", exp.world_size > 8), ("recompute", t.recompute_granularity), ("fp8", t.fp8),
        ("offloading", t.fine_grained_activation_offloading or t.cpu_offloading_num_layers)) if on]
    return tags


@pytest.fixture(scope="module")
def errors():
    rows = []
    for case in _cases():
        exp = import_megatron_args(line(case), world_size=case["world_size"], hardware=case["hardware"]).experiment
        predicted = estimate(exp)
        measured = case["measured_iteration_time_s"]
        tags = classes(exp) + (["world size inferred"] if case["world_size_inferred"] and case["world_size"] > 8
                               else [])
        rows.append((case["name"], count_parameters(exp.model), measured, predicted.step_s,
                     predicted.step_s / measured - 1, tags))
    print(f"\n{'case':66s} {'params':>7s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  classes")
    for name, params, measured, predicted, error, tags in sorted(rows, key=lambda r: -r[1]):
        print(f"{name[:66]:66s} {params / 1e9:6.2f}B {measured:8.3f}s {predicted:8.3f}s {error * 100:+6.1f}%  "
              f"{', '.join(tags)}")
    for size, members in (("at least 1B parameters", [r for r in rows if r[1] >= LARGE]),
                          ("under 1B parameters", [r for r in rows if r[1] < LARGE])):
        print(f"\n{size}: {len(members)} cases")
        by_class: dict[str, list] = {}
        for row in members:
            for tag in row[5]:
                by_class.setdefault(tag, []).append(abs(row[4]))
        print(f"{'class':22s} {'cases':>5s} {'mean |err|':>10s} {'max |err|':>10s}")
        for tag, errs in sorted(by_class.items()):
            print(f"{tag:22s} {len(errs):5d} {statistics.mean(errs):10.1%} {max(errs):10.1%}")
    return rows


def test_every_case_has_a_measured_step_time():
    cases = _cases()
    assert len(cases) >= 88
    assert all(case["measured_iteration_time_s"] and case["measured_iteration_time_s"] > 0 for case in cases)


def test_large_cases_meet_the_target(errors):
    """The target holds on the cases whose world size the case states; those whose world size was
    inferred from the very step time predicted are reported apart and held to the per-case bound only."""
    large = [abs(r[4]) for r in errors if r[1] >= LARGE and INFERRED not in r[5]]
    inferred = [abs(r[4]) for r in errors if r[1] >= LARGE and INFERRED in r[5]]
    print(f"at least 1B parameters: {len(large)} cases, mean |error| {statistics.mean(large):.1%}, "
          f"max {max(large):.1%}; apart, {len(inferred)} with the world size inferred: max {max(inferred):.1%}")
    assert len(large) >= 2 and len(large) + len(inferred) >= 5
    assert statistics.mean(large) <= LARGE_MEAN and max(large + inferred) <= LARGE_MAX


def test_small_cases_do_not_regress(errors):
    small = [abs(r[4]) for r in errors if r[1] < LARGE]
    print(f"under 1B parameters: {len(small)} cases, mean |error| {statistics.mean(small):.1%}, "
          f"median {statistics.median(small):.1%}, max {max(small):.1%}")
    assert statistics.mean(small) < SMALL_MEAN and statistics.median(small) < SMALL_MEDIAN
    assert max(small) < SMALL_MAX
