"""The Compare screen (Pilot): figures with units in reading order, each naming its window as the
CLI does; charts that show what the runs recorded (CPU runs: iteration time and CPU use); and a
baseline selector that always names the baseline the figures are measured against."""

from __future__ import annotations

import re

import numpy as np
import pytest

from charllm.probes.analysis import baselines
from charllm.probes.analysis.compare import compare, render
from charllm.probes.store.synthetic import cpu_run, gpu_frame, iteration_rows, make_run, tiny_experiment
from charllm.tui.app import CharllmApp
from charllm.tui.screens import compare as compare_screen
from charllm.tui.widgets.charts import Chart
from infra_pilot import pilot_test, wait_for

pytestmark = pytest.mark.timeout(300)
T = np.round(np.arange(0, 121) * 0.1, 10)  # 12 s at 10 Hz, as cpu_run records


def gpu_run(root, run_id: str, power_w: float):
    rows = iteration_rows(np.arange(0, 11, 1.0), 0.9, warmup=2, tokens=256)
    frame = gpu_frame(T, power_w=power_w + 10 * np.sin(T), temp_gpu_c=60.0,
                      iteration=np.searchsorted(np.arange(0, 11, 1.0), T, side="right"))
    host = gpu_frame(T, device="host", cpu_util_pct=40.0)
    return make_run(root, [frame, host], run_id=run_id, experiment=tiny_experiment(run_id), iterations=rows)


async def until(pilot, condition, timeout: float = 60.0, what: str = "the comparison") -> None:
    await wait_for(pilot, condition, timeout, what)


async def compared(pilot, refs, *, previous=None):
    """Open Compare on `refs` and wait for a result other than `previous`."""
    screen = pilot.app.screen
    if pilot.app.current_mode != "compare":
        pilot.app.compare_refs = [str(r) for r in refs]
        await pilot.press("f7")
        screen = pilot.app.screen
    await until(pilot, lambda: screen.result is not None and screen.result is not previous)
    await pilot.pause(0.2)
    return screen


def table_rows(screen) -> list[list[str]]:
    table = screen.query_one("#compare-table")
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def status_text(screen) -> str:
    return str(screen.query_one("#compare-status").render())


def shown_baseline(screen) -> str:
    """The text the baseline selector shows."""
    return str(screen.query_one("#baseline SelectCurrent Static#label").render())


@pilot_test
async def test_figures_carry_units_throughput_first_and_match_the_cli(charllm_dirs):
    a = cpu_run(charllm_dirs["runs"], "20261121-100000-cpu-a", 1.0)
    b = cpu_run(charllm_dirs["runs"], "20261121-110000-cpu-b", 1.2, busy_pct=60.0)
    async with CharllmApp().run_test(size=(160, 48)) as pilot:
        screen = await compared(pilot, [a.path, b.path])
        rows = table_rows(screen)
    metrics = [r[0] for r in rows]
    # Read as a user reads: window, then throughput / efficiency, then host statistics.
    assert metrics[0] == "window" and rows[0][2:4] == ["steady", "steady"]
    # Metrics in words (the csv and json forms keep their names).
    assert metrics.index("iterations") < metrics.index("tokens per second") < metrics.index("energy per token") \
        < metrics.index("host duration") < metrics.index("CPU utilization, mean")
    figures = {r[0]: r[2] for r in rows}
    assert re.fullmatch(r"[\d,]+ tokens/s", figures["tokens per second"])
    assert (
        figures["iteration time, mean"] == "950.0 ms" and figures["iterations"] == "9"
    )  # 11 steps of 0.95 s, 2 warm-up
    assert figures["CPU utilization, mean"].endswith("%") and figures["host memory used, peak"] == "3.000 GiB"
    assert not any(re.search(r"\de[+-]\d", cell) for row in rows for cell in row)
    # The CLI prints the same cells (the same wide form, the same formatting).
    cli = render(compare([str(a.path), str(b.path)]), "table")
    cli_rows = [[c.strip() or "—" for c in re.split(r"[│┆]", line)[1:-1]] for line in cli.splitlines()
                if line.startswith("│")]
    assert rows == cli_rows[1:]                                             # after the headings


@pilot_test
async def test_cpu_runs_chart_iteration_time_and_cpu_use_not_empty_gpu_boxes(charllm_dirs):
    a = cpu_run(charllm_dirs["runs"], "20261121-100000-cpu-a", 1.0)
    b = cpu_run(charllm_dirs["runs"], "20261121-110000-cpu-b", 1.2, busy_pct=60.0)
    async with CharllmApp().run_test(size=(160, 48)) as pilot:
        screen = await compared(pilot, [a.path, b.path])
        charts = list(screen.query(Chart))
        assert screen.query_one("#compare-charts").display
        assert [c.title for c in charts] == [title for _, title in compare_screen.HOST_CHARTS]
        for chart in charts:
            assert sorted(chart._series) == ["cpu-a", "cpu-b"]
            assert all(len(xs) >= 8 and all(y is not None for y in ys) for xs, ys in chart._series.values())
        times = dict(charts[0]._series)["cpu-b"][1]
        assert times[-1] == pytest.approx(1.14)                             # 1.2 s steps, 95 % busy
        assert compare_screen.NO_CHARTS not in status_text(screen)


@pilot_test
async def test_gpu_runs_keep_power_and_temperature_charts(charllm_dirs):
    a = gpu_run(charllm_dirs["runs"], "20261121-100000-gpu-a", 300.0)
    b = gpu_run(charllm_dirs["runs"], "20261121-110000-gpu-b", 250.0)
    async with CharllmApp().run_test(size=(160, 48)) as pilot:
        screen = await compared(pilot, [a.path, b.path])
        charts = list(screen.query(Chart))
        assert [c.title for c in charts] == [title for _, title in compare_screen.GPU_CHARTS]
        power = charts[0]._series
        assert sorted(power) == ["gpu-a", "gpu-b"]
        assert np.mean(power["gpu-a"][1]) == pytest.approx(300.0, abs=5)   # host rows are not GPU power


@pilot_test
async def test_runs_without_per_iteration_telemetry_hide_the_charts_and_say_why(charllm_dirs):
    a = cpu_run(charllm_dirs["runs"], "20261121-100000-cpu-a", 1.0, with_iterations=False)
    b = cpu_run(charllm_dirs["runs"], "20261121-110000-cpu-b", 1.2, with_iterations=False)
    for run in (a, b):
        run.iterations_path.unlink()
    async with CharllmApp().run_test(size=(160, 48)) as pilot:
        screen = await compared(pilot, [a.path, b.path])
        assert not screen.query_one("#compare-charts").display
        assert compare_screen.NO_CHARTS in status_text(screen)
        assert table_rows(screen)[0][2] == "all"                            # no log: every sample


@pilot_test
async def test_the_selector_always_names_the_baseline_in_use(charllm_dirs):
    a = cpu_run(charllm_dirs["runs"], "20261121-100000-cpu-a", 1.0)
    b = cpu_run(charllm_dirs["runs"], "20261121-110000-cpu-b", 1.2, busy_pct=60.0)
    baselines.save(str(b.path), "busy-60", window="all")
    async with CharllmApp().run_test(size=(160, 48)) as pilot:
        # Nothing picked: the first run is the baseline, and both the selector and the line say so.
        screen = await compared(pilot, [a.path, b.path])
        assert screen.result.baseline == a.id
        assert shown_baseline(screen) == f"{a.id} (run)"
        assert status_text(screen).startswith(f"baseline {a.id} ")
        # Pick the second run.
        first = screen.result
        screen.query_one("#baseline").value = str(b.path)
        await compared(pilot, [], previous=first)
        assert screen.result.baseline == b.id and shown_baseline(screen) == f"{b.id} (run)"
        assert status_text(screen).startswith(f"baseline {b.id} ")
        # Pick a saved baseline.
        second = screen.result
        screen.query_one("#baseline").value = "baseline:busy-60"
        await compared(pilot, [], previous=second)
        assert screen.result.baseline == "baseline:busy-60"
        assert shown_baseline(screen) == "busy-60 (saved baseline)"
        assert status_text(screen).startswith("baseline baseline:busy-60 ")
        # Its figures cover all samples, the runs' the steady window: the window row says so.
        window = table_rows(screen)[0]
        assert window[0] == "window" and window[2:5] == ["all", "steady", "steady"]
        # Leaving and coming back does not recompute: the selector's value is what was loaded.
        third = screen.result
        await pilot.press("f6")
        await pilot.press("f7")
        await pilot.pause(0.5)
        assert pilot.app.screen.result is third and shown_baseline(pilot.app.screen) == "busy-60 (saved baseline)"


def test_per_iteration_curves_of_a_finished_run_are_kept_and_equal_a_fresh_pass(charllm_dirs, monkeypatch):
    """The charts' per-iteration means are kept beside the summaries: a reopened Compare reads
    no telemetry, gets exactly the fresh pass's numbers, and a changed run is read again."""
    from polars.testing import assert_frame_equal

    from charllm.probes.analysis import summary
    from charllm.probes.store.rundir import RunDir

    run = gpu_run(charllm_dirs["runs"], "20261121-100000-gpu-a", 300.0)
    fresh = summary.per_iteration(run)
    assert fresh.height == 11 and fresh["power_w"].mean() == pytest.approx(300.0, abs=5)
    assert (run.path / "summaries" / "per-iteration.parquet").is_file()
    scans = []
    real_scan = RunDir.scan_telemetry
    monkeypatch.setattr(RunDir, "scan_telemetry",
                        lambda self, *a, **k: scans.append(self) or real_scan(self, *a, **k))
    curves = compare_screen.per_iteration_curves([str(run.path)])
    assert scans == []                                                      # from the kept result
    assert curves["power_w"]["gpu-a"] == (fresh["iteration"].to_list(), fresh["power_w"].to_list())
    assert_frame_equal(summary.per_iteration(run), fresh, check_exact=True)
    gpu_frame(T + 20, power_w=100.0, iteration=99).write_ipc(run.node_telemetry_dir("n0") / "000009.arrow")
    again = summary.per_iteration(run)
    assert len(scans) == 1 and again["iteration"].to_list()[-1] == 99      # a changed run is read again
