"""The plans against runs this project measured on a real GPU (tests/data/gpu_runs/, written by
tools/import_gpu_runs.py from the acceptance kit's runs): the memory plan, the implementation the
plan says will run, the step-time model and MFU's denominator, for the stack each node really had.

Megatron-LM's goldens (test_memory_validation) are all Transformer Engine runs; these are the local
path (no TE, no Apex) that a machine without NVIDIA's container takes. Run with `-s` for the table.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from charllm.engine.model import runtime, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import peak_tflops
from charllm.engine.model.memory import estimate

DATA = Path(__file__).parents[2] / "data" / "gpu_runs"
TOOL = Path(__file__).parents[3] / "tools" / "import_gpu_runs.py"
PEAK_EACH = 0.03          # measured: at most 2.6% (the fp32 run)
STEP_EACH = 0.20          # measured: at most 14% (the fp32 run: attention at the flash kernels' share)
STEP_MEAN_HALF = 0.08     # bf16/fp16 runs, mean |error|: measured 4.6%


def _runs():
    return [(f"{path.stem}/{r['run']}", r) for path in sorted(DATA.glob("*.json"))
            for r in json.loads(path.read_text())]


RUNS = _runs()


def planned(record):
    exp = Experiment.from_dict(record["experiment"], source=record["run"])
    stack = runtime.Stack.from_dict(record["stack"], f"found on the node of {record['run']}")
    return exp, stack


def test_the_set_has_both_megatron_core_lines():
    assert len(RUNS) >= 16
    assert {r["versions"]["megatron_core"][:4] for _, r in RUNS} >= {"0.16", "0.19"}


@pytest.mark.parametrize("name,record", RUNS, ids=[n for n, _ in RUNS])
def test_the_plan_for_the_node_is_what_ran(name, record):
    exp, stack = planned(record)
    assert runtime.problems(exp, stack) == []
    assert runtime.resolve(exp, stack).to_dict() == record["implementation"]


@pytest.mark.parametrize("name,record", RUNS, ids=[n for n, _ in RUNS])
def test_memory_plan_within_3_percent_of_the_measured_peak(name, record):
    exp, stack = planned(record)
    plan = max(s.total_bytes for s in estimate(exp, stack=stack).stages)
    measured = record["measured"]["peak_allocated_bytes"]
    assert abs(plan / measured - 1) <= PEAK_EACH, f"plan {plan} bytes, measured {measured}"


@pytest.mark.parametrize("name,record", RUNS, ids=[n for n, _ in RUNS])
def test_mfu_is_taken_against_the_peak_of_the_precision_that_ran(name, record):
    exp, _ = planned(record)
    precision, peak = peak_tflops(exp, record["tf32"])
    m = record["measured"]
    assert precision == ("bf16" if exp.training.bf16 else "fp32")
    assert m["mfu_pct"] == pytest.approx(100 * m["tflops_per_gpu"] / peak, rel=1e-6)


def test_step_time_model():
    rows = []
    for name, record in RUNS:
        exp, stack = planned(record)
        layouts = speed.layouts_of(exp)
        step = float(speed.step_times(exp, layouts, impl=runtime.resolve(exp, stack)).step_s[0])
        measured = record["measured"]["iter_time_p50_s"]
        rows.append((name, exp.training.bf16 or exp.training.fp16, measured, step, step / measured - 1))
    print(f"\n{'run':58s} {'measured':>9s} {'planned':>8s} {'error':>7s}")
    for name, _, measured, step, error in rows:
        print(f"{name:58s} {measured:8.3f}s {step:7.3f}s {100 * error:+6.1f}%")
    half = [abs(e) for _, is_half, _, _, e in rows if is_half]
    print(f"bf16/fp16: mean |error| {100 * statistics.mean(half):.1f}% over {len(half)} runs")
    assert all(abs(e) <= STEP_EACH for *_, e in rows)
    assert statistics.mean(half) <= STEP_MEAN_HALF


REAL_RUN = DATA / "runs" / "20261126-045153-m1-llama1b-mbs1"    # one whole run of the set, as the H200 wrote it


def test_the_import_tool_reads_a_run_directory_back(tmp_path):
    out = tmp_path / "one.json"
    done = subprocess.run([sys.executable, str(TOOL), str(REAL_RUN), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [record] = json.loads(out.read_text())
    assert record == dict(RUNS)[f"h200-2026-11-26/{REAL_RUN.name}"]
    assert not (REAL_RUN.parent / "one.json").exists() and out.with_suffix(".tmp").exists() is False
