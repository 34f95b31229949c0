"""One definition of each figure: Live, Runs, Compare and the CLI give the same iteration time, tokens/s,
TFLOP/s, MFU, energy per token and power for the same window, and each names its window."""

from __future__ import annotations

import asyncio
import functools
import json
import re

import numpy as np

from charllm.probes.analysis.compare import compare, render
from charllm.probes.analysis.render import format_figure
from charllm.probes.analysis.summary import summarize
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run, tiny_experiment
from charllm.tui.app import CharllmApp
from charllm.tui.cli import main
from charllm.tui.screens import runs as runs_screen

T = np.round(np.arange(0, 121) * 0.1, 10)  # 12 s at 10 Hz
FIGURES = ("tokens_per_s", "tflops_per_gpu", "mfu_pct", "energy_per_token_j", "power_mean_w")


def pilot_test(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


def _run(root, run_id, step_s, *, tokens=256, lag_s=0.0):
    """A run of 2 warm-up steps, then 10 steady ones (Live's "last 10 steps" is then the steady window
    too), whose last rank starts each step up to `lag_s` after rank 0 and ends it later still, as the
    ranks of a real run do: a step is from its first start to its last end. `tokens=None`: the steps log
    none, and the experiment's batch says how many."""
    rows = iteration_rows(np.arange(0, 12 * step_s, step_s), step_s * 0.9, warmup=2, tokens=tokens)
    for row in rows:
        if row.get("event") != "iteration":
            continue
        if row.get("warmup"):  # slower warm-up steps: a figure over the wrong window differs
            row["end_ns"] += 10**9
        if row["rank"] == 1:
            wobble = (row["iteration"] % 3) / 2 * lag_s
            row["start_ns"] += int(wobble * 1e9)
            row["end_ns"] += int((lag_s + wobble) * 1e9)
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


def _printed(text: str, metric: str) -> str:
    """A figure of `summarize RUN --by run`'s table as printed."""
    return re.search(rf"^│ {metric}\s+┆ (.+?)\s+│$", text, re.M).group(1)


@pilot_test
async def test_the_four_surfaces_print_the_same_steady_figures(charllm_dirs, capsys):
    """Live's steady window, the Runs screen, the Compare screen and `summarize` print the same
    iteration time and tokens/s, digit for digit, on 3 runs whose ranks log each step at different
    times (and one whose steps log no tokens)."""
    runs = [_run(charllm_dirs["runs"], "20261121-000000-a", 0.9, lag_s=0.04),
            _run(charllm_dirs["runs"], "20261121-000001-b", 0.5, tokens=None, lag_s=0.02),
            _run(charllm_dirs["runs"], "20261121-000002-c", 1.3, lag_s=0.11)]
    cli = {}
    for run in runs:
        assert main(["summarize", run.id, "--by", "run"]) == 0
        out = capsys.readouterr().out
        cli[run.id] = (_printed(out, "iter_time_mean_s"), _printed(out, "tokens_per_s").removesuffix(" tokens/s"))
        # rank 0's own times give another step: the runs tell the two apart
        first = [e for e in map(json.loads, run.iterations_path.read_text().splitlines())
                 if e.get("event") == "iteration" and e["rank"] == 0 and not e["warmup"]]
        assert format_figure("iter_time_mean_s", np.mean([(e["end_ns"] - e["start_ns"]) / 1e9 for e in first])) \
            != cli[run.id][0]

    async with CharllmApp().run_test(size=(160, 48)) as pilot:
        async def until(condition, what):
            for _ in range(600):
                if condition():
                    return
                await pilot.pause(0.1)
            raise AssertionError(f"timed out waiting for {what}")

        await pilot.press("f6")
        table = pilot.app.screen.query_one("#runs-table")
        await until(lambda: table.row_count == 3 and all(table.get_cell(r.id, "tokens/s") != "…" for r in runs),
                    "the Runs screen's figures")
        for run in runs:
            assert table.get_cell(run.id, "tokens/s") == cli[run.id][1], run.id

        pilot.app.compare_refs = [str(r.path) for r in runs]
        await pilot.press("f7")
        screen = pilot.app.screen
        await until(lambda: screen.result is not None, "the comparison")
        await pilot.pause(0.2)
        cmp = screen.query_one("#compare-table")
        rows = {str(row[0]): [str(c) for c in row[2:5]] for row in map(cmp.get_row_at, range(cmp.row_count))}
        for i, run in enumerate(runs):
            assert rows["iteration time, mean"][i] == cli[run.id][0], run.id
            assert rows["tokens per second"][i] == f"{cli[run.id][1]} tokens/s", run.id

        for run in runs:
            pilot.app.open_run(run.path)
            await until(lambda: pilot.app.current_mode == "live", "Live")
            live = pilot.app.screen
            await until(lambda: getattr(live.last_frame, "source", None) == run.id
                        and "steady window" in live.last_frame.progress, f"Live on {run.id}")
            await pilot.pause(0.1)
            text = str(live.query_one("#iterations").render())
            steady = re.search(r"steady window: (.+?)/it · ([\d,]+) tokens/s", text)
            assert (steady.group(1), steady.group(2)) == cli[run.id], (run.id, text)


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
