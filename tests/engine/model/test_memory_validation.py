"""The memory estimate against measured Megatron-LM runs (tests/data/memory_dev/: every public H100
training case of Megatron-LM's CI with memory goldens but the project's held-out 12, rebuilt by
tools/build_memory_dev.py; see its README).

Every case is imported from its exact Megatron command line and environment and estimated; the last
pipeline stage is compared with rank world_size-1's allocator figures: `steady_bytes` (weights +
grads + optimizer + resident workspaces) with `mem-allocated-bytes`, `total_bytes` with
`mem-max-allocated-bytes`. The thresholds sit just above what the estimator achieves today, so a
regression fails. Run with `-s` to see each case's errors and each class's means.

A case marked `superseded_by` (tools/build_memory_dev.py, `mark_superseded`: the same command line
measured again at a newer commit, with other values) measured an older Megatron-LM: it is estimated
and printed, and left out of the means and maxima.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
from pathlib import Path

import pytest

from charllm.engine.model.megatron import SUPPORTED_VERSIONS, import_megatron_args
from charllm.engine.model.memory import estimate

DATA = Path(os.environ.get("CHARLLM_MEMORY_DEV", Path(__file__).parents[2] / "data" / "memory_dev" / "memory_dev.json"))

# Achieved on the 87 counted cases (mean absolute relative error, share within ±5%), just above; and
# the target for every counted case (issue 26: each within 10%).
STATIC_MEAN, PEAK_MEAN = 0.016, 0.014
PEAK_WITHIN_5PCT = 0.97
STATIC_MAX = PEAK_MAX = 0.10


def _cases() -> list[dict]:
    if not DATA.is_file():
        pytest.skip(f"validation data not found at {DATA} (set CHARLLM_MEMORY_DEV)")
    return json.loads(DATA.read_text())


# The cases ran Megatron-LM's main branch, not releases. Where the estimate depends on the megatron-core
# release, a case runs as the release that first shipped the change once its golden commit has it, else as
# the oldest supported one: (date of the change on main, release), oldest first.
MAIN_CHANGES = (
    ("2026-05-30", "0.18.0"),       # 378d81fbd3: memory.FSDP_RESIDENT_NON_UNITS_SINCE (Megatron-FSDP)
)


def release(case: dict) -> str:
    """The megatron-core release whose memory behaviour the case's golden commit had."""
    date = case["provenance"]["golden_date"]
    return ([version for since, version in MAIN_CHANGES if date >= since] or [SUPPORTED_VERSIONS[0]])[-1]


def line(case: dict) -> str:
    """The case's launch as a command line: its environment, then pretrain_gpt.py and its flags."""
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in case.get("env", {}).items())
    return f"{env} pretrain_gpt.py {case['megatron_args']}"


def classes(exp) -> list[str]:
    """The classes a case counts in (a case may be in several)."""
    m, p, t = exp.model, exp.parallel, exp.training
    tags = ["moe" if m.is_moe else "dense"]
    tags += [tag for tag, on in (
        ("mtp", m.mtp_num_layers), ("mla", m.multi_latent_attention), ("fp8", t.fp8),
        ("offloading", t.fine_grained_activation_offloading or t.cpu_offloading_num_layers),
        ("recompute", t.recompute_granularity), ("cuda graphs", t.cuda_graph_impl != "none"),
        ("fsdp", p.use_megatron_fsdp or p.use_torch_fsdp2), ("muon", t.optimizer == "muon"),
        ("flex dispatcher", m.is_moe and t.moe_token_dispatcher_type == "flex"),
        ("world > 8", exp.world_size > 8)) if on]
    return tags


def _errors() -> list[tuple[str, float, float, list[str], str | None]]:
    rows = []
    for case in _cases():
        imported = import_megatron_args(line(case), world_size=case["world_size"], hardware=case["hardware"])
        last = estimate(imported.experiment, megatron_version=release(case)).stages[-1]
        rows.append((case["name"],
                     last.steady_bytes / case["measured_static_bytes"] - 1,
                     last.total_bytes / case["measured_peak_bytes"] - 1,
                     classes(imported.experiment), case.get("superseded_by")))
    return rows


@pytest.fixture(scope="module")
def all_errors():
    rows = _errors()
    print(f"\n{'case':78s} {'static':>8s} {'peak':>8s}  classes")
    for name, static, peak, tags, superseded in rows:
        print(f"{name[:78]:78s} {static * 100:+7.1f}% {peak * 100:+7.1f}%  {', '.join(tags)}"
              + (f"  (superseded by {superseded}: not counted)" if superseded else ""))
    return rows


@pytest.fixture(scope="module")
def errors(all_errors):
    """The counted cases: all but the superseded."""
    rows = [row for row in all_errors if not row[4]]
    by_class: dict[str, list] = {}
    for row in rows:
        for tag in row[3]:
            by_class.setdefault(tag, []).append(row)
    print(f"\n{'class':20s} {'cases':>5s} {'static |err|':>12s} {'peak |err|':>11s}")
    for tag, members in sorted(by_class.items()):
        print(f"{tag:20s} {len(members):5d} {statistics.mean(abs(r[1]) for r in members):12.2%} "
              f"{statistics.mean(abs(r[2]) for r in members):11.2%}")
    return rows


def _summary(values: list[float]) -> tuple[float, float]:
    absolute = [abs(v) for v in values]
    return statistics.mean(absolute), max(absolute)


def test_every_case_is_estimated(all_errors, errors):
    assert len(all_errors) == len(_cases()) >= 88
    assert len(errors) >= len(all_errors) - 1


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


def test_the_tight_margin_is_the_dev_sets_measured_error(errors):
    """memory.PEAK_MARGIN (a plan within it of the limit is tight) is the 90th percentile of the counted
    cases' |peak error|: about nine cases in ten are planned within it, and it stays so as the model moves."""
    from charllm.engine.model.memory import PEAK_MARGIN

    within = sum(abs(e[2]) <= PEAK_MARGIN for e in errors) / len(errors)
    print(f"peak errors within the tight margin {PEAK_MARGIN:.1%}: {within:.1%} of {len(errors)} cases")
    assert 0.85 <= within <= 0.95
