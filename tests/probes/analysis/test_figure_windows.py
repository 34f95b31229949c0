"""One definition of each figure: Live, Runs, Compare and the CLI give the same tokens/s, TFLOP/s,
MFU, energy per token and power for the same window, and each names its window."""

from __future__ import annotations

import json
import re

import numpy as np

from charllm.probes.analysis.compare import compare, render
from charllm.probes.analysis.summary import summarize
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run, tiny_experiment
from charllm.tui.cli import main
from charllm.tui.screens import runs as runs_screen
from charllm.tui.screens.live import iterations_text

T = np.round(np.arange(0, 121) * 0.1, 10)  # 12 s at 10 Hz
FIGURES = ("tokens_per_s", "tflops_per_gpu", "mfu_pct", "energy_per_token_j", "power_mean_w")


def _run(root, run_id, step_s):
    # 2 warm-up steps then 10 steady ones: Live's "last 10 steps" is then the steady window too.
    rows = iteration_rows(np.arange(0, 12 * step_s, step_s), step_s, warmup=2, tokens=256)
    for row in rows:
        if row.get("warmup"):  # slower warm-up steps: a figure over the wrong window differs
            row["end_ns"] += 10**9
    return make_run(root, [gpu_frame(T, power_w=200.0 + 10 * np.sin(T), energy_j=np.cumsum(np.full(len(T), 20.0)))],
                    run_id=run_id, experiment=tiny_experiment(run_id), iterations=rows)


def test_live_runs_compare_and_the_cli_agree_for_the_steady_window(charllm_dirs, capsys):
    run = _run(charllm_dirs["runs"], "20261121-000000-a", 0.9)
    _run(charllm_dirs["runs"], "20261121-000001-b", 1.0)

    assert main(["summarize", run.id, "--by", "run", "--format", "json"]) == 0
    cli = json.loads(capsys.readouterr().out)[0]
    assert cli["window"] == "steady"
    runs_list = summarize(run.path, window=runs_screen.WINDOW, by="run").row(0, named=True)
    result = compare([run.id, "20261121-000001-b"])
    compared = {r["metric"]: r["value"] for r in result.table.iter_rows(named=True) if r["ref"] == run.id}
    for figure in FIGURES:
        assert cli[figure] is not None and cli[figure] == runs_list[figure] == compared[figure], figure

    events = [json.loads(line) for line in run.iterations_path.read_text().splitlines()]
    live = iterations_text([e for e in events if e.get("event") == "iteration"])
    assert re.search(r"last 10 steps: \d+ ms/it · ([\d,]+) tokens/s", live).group(1) == f"{cli['tokens_per_s']:,.0f}"
    assert re.search(r"steady window: \d+ ms/it · ([\d,]+) tokens/s", live).group(1) == f"{cli['tokens_per_s']:,.0f}"


def test_each_surface_names_the_window_of_its_figures(charllm_dirs, capsys):
    run = _run(charllm_dirs["runs"], "20261121-000000-a", 0.9)
    _run(charllm_dirs["runs"], "20261121-000001-b", 1.0)
    steady = compare([run.id, "20261121-000001-b"])
    assert "Metrics, figures over the steady window (non-warm-up iterations) (baseline" in render(steady)
    assert json.loads(render(steady, "json"))["windows"] == {run.id: "steady", "20261121-000001-b": "steady"}
    assert "figures over seconds 0 to 5 after the first sample" in render(compare([run.id, "20261121-000001-b"],
                                                                                  window=(0, 5)))
    assert "steady window" in runs_screen.WINDOW_TEXT
    assert main(["summarize", run.id, "--by", "gpu", "--window", "all"]) == 0
    assert re.search(r"│ window\s+┆ all", capsys.readouterr().out)


def test_the_launch_follow_lines_name_their_windows():
    from charllm.tui.commands.launch import _iteration_line, _telemetry_line

    rows = gpu_frame(np.arange(0, 5.05, 0.05), power_w=300.0)
    assert _telemetry_line(rows).startswith("telemetry 101 rows, means over the last 5 s:  GPU power 300 W")
    step = {"event": "iteration", "iteration": 3, "rank": 0, "start_ns": 0, "end_ns": 10**9, "tflops_per_gpu": 1.5}
    assert "1.500 TFLOP/s/gpu (this step)" in _iteration_line(step)
