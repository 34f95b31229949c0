"""The memory estimate against measured Megatron-LM runs (tests/data/memory_dev/, a copy of the
team's ../shared/validation/memory_dev.json with its README).

Every case is imported from its exact Megatron command line and estimated; the last pipeline stage
is compared with rank world_size-1's allocator figures: `steady_bytes` (weights + grads + optimizer +
resident workspaces) with `mem-allocated-bytes`, `total_bytes` with `mem-max-allocated-bytes`.
The thresholds sit just above what the estimator achieves today, so a regression fails.
Run with `-s` to see the per-case table.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from charllm.engine.model.megatron import import_megatron_args
from charllm.engine.model.memory import estimate

DATA = Path(os.environ.get("CHARLLM_MEMORY_DEV", Path(__file__).parents[2] / "data" / "memory_dev" / "memory_dev.json"))

# Achieved on the 39 cases (mean / max absolute relative error, share within ±5%).
STATIC_MEAN, STATIC_MAX = 0.03, 0.235
PEAK_MEAN, PEAK_MAX = 0.018, 0.10
PEAK_WITHIN_5PCT = 0.90


def _cases() -> list[dict]:
    if not DATA.is_file():
        pytest.skip(f"validation data not found at {DATA} (set CHARLLM_MEMORY_DEV)")
    return json.loads(DATA.read_text())


def _errors() -> list[tuple[str, float, float]]:
    rows = []
    for case in _cases():
        imported = import_megatron_args(case["megatron_args"], world_size=case["world_size"],
                                        hardware=case["hardware"])
        last = estimate(imported.experiment).stages[-1]
        rows.append((case["name"],
                     last.steady_bytes / case["measured_static_bytes"] - 1,
                     last.total_bytes / case["measured_peak_bytes"] - 1))
    return rows


@pytest.fixture(scope="module")
def errors():
    rows = _errors()
    print(f"\n{'case':78s} {'static':>8s} {'peak':>8s}")
    for name, static, peak in rows:
        print(f"{name[:78]:78s} {static * 100:+7.1f}% {peak * 100:+7.1f}%")
    return rows


def _summary(values: list[float]) -> tuple[float, float]:
    absolute = [abs(v) for v in values]
    return statistics.mean(absolute), max(absolute)


def test_every_case_is_estimated(errors):
    assert len(errors) == len(_cases()) >= 39


def test_static_error_does_not_regress(errors):
    mean, worst = _summary([e[1] for e in errors])
    print(f"static: mean |error| {mean:.2%}, max {worst:.2%}")
    assert mean < STATIC_MEAN and worst < STATIC_MAX


def test_peak_error_does_not_regress(errors):
    peaks = [e[2] for e in errors]
    mean, worst = _summary(peaks)
    within = sum(abs(p) <= 0.05 for p in peaks) / len(peaks)
    print(f"peak: mean |error| {mean:.2%}, max {worst:.2%}, within ±5%: {within:.0%}")
    assert mean < PEAK_MEAN and worst < PEAK_MAX
    assert within >= PEAK_WITHIN_5PCT
