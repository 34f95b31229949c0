"""The workbench at first contact (issue 36, items 9 to 13): Live shows a host run's log and progress
from the first second, Runs refresh themselves and ask before cancelling the run meant, Compare reads
at 80×24, the Campaign and Sweep tables keep up, and the messages say what they should where they
should. Each test drives the real app (Pilot) on recorded or synthetic runs.
"""

from __future__ import annotations

import html
import os
import re

import pytest

from charllm.probes.core import procid
from charllm.probes.store.rundir import RunDir
from charllm.tui.app import CharllmApp
from charllm.tui.demo import make_demo_run
from infra_pilot import list_every_layout, pilot_test, wait_for

pytestmark = pytest.mark.timeout(300)


def notes_of(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


def supervised_here(path) -> RunDir:
    """A run that is running, its supervisor this process (so that nothing finishes it but the test)."""
    rd = RunDir(path)
    rd.update_manifest(status="running", ended_ns=None, supervisor=procid.identify(os.getpid()))
    return rd


# -- Runs -------------------------------------------------------------------------------------------------
@pilot_test
async def test_runs_show_a_run_that_finishes_or_appears_without_a_key(charllm_dirs):
    rd = supervised_here(make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-a", seconds=4, gpus=2))
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 1 and str(table.get_cell(rd.id, "status")) == "running")
        rd.update_manifest(status="completed")
        await wait_for(pilot, lambda: str(table.get_cell(rd.id, "status")) == "completed", timeout=10,
                       what="the finished run's status, with no key pressed")
        newer = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-b", seconds=4, gpus=2)
        await wait_for(pilot, lambda: table.row_count == 2, timeout=10, what="the new run, with no key pressed")
        await wait_for(pilot, lambda: str(table.get_cell(newer.name, "peak W")) != "…", timeout=30,
                       what="the new run's figures")


@pilot_test
async def test_runs_cancel_asks_first_naming_the_running_run_not_the_one_under_an_old_cursor(charllm_dirs):
    old = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-old", seconds=4, gpus=2)
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 1)
        await pilot.press("c")                          # nothing runs: said, nothing asked
        assert app.screen.__class__.__name__ == "RunsScreen"
        assert notes_of(app)[-1] == f"no run is running ({old.name} is completed)"
        running = supervised_here(make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-new", seconds=4, gpus=2))
        await wait_for(pilot, lambda: table.row_count == 2, timeout=10, what="the new run")
        assert app.screen.current_run() == old.name     # the cursor stayed where it was
        await pilot.press("c")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm", what="the question")
        question = str(app.screen.query_one("Label").render())
        assert question.startswith(f"Cancel run {running.id} (running, on local)")
        await pilot.press("n")                          # no: nothing is signalled
        await pilot.pause(0.2)
        assert running.manifest().status == "running"
    assert RunDir(old).manifest().status == "completed"


@pilot_test
async def test_runs_put_the_cursor_on_a_run_launched_since_they_were_last_shown(charllm_dirs):
    make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-old", seconds=4, gpus=2)
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(120, 30)) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.current_run() == "20251121-080000-demo-old")
        await pilot.press("f2")
        make_demo_run(charllm_dirs["runs"], "20251121-070000-demo-new", seconds=4, gpus=2)   # an older stamp
        await pilot.press("f6")
        await wait_for(pilot, lambda: screen.current_run() == "20251121-070000-demo-new", what="the cursor on it")


# -- Live -------------------------------------------------------------------------------------------------
@pilot_test
async def test_live_shows_a_cpu_runs_log_and_progress_before_its_first_iteration(charllm_dirs):
    """A host (CPU) run that has not finished its first step: its log and iterations pane are there from
    the first frame (they were hidden until the first iteration: 15 s without a word, or an error)."""
    import numpy as np

    from charllm.engine.model.experiment import Experiment
    from charllm.probes.store.synthetic import gpu_frame, make_run

    t = np.arange(0, 30) * 0.5                    # 15 s of host telemetry, no step finished yet
    host = gpu_frame(t, node="node0", device="host", cpu_util_pct=90.0, host_mem_used_bytes=2.0**31)
    run = make_run(charllm_dirs["runs"], [host], run_id="20251121-080000-tiny-local",
                   manifest={"id": "20251121-080000-tiny-local", "status": "running", "kind": "train",
                             "supervisor": procid.identify(os.getpid())},
                   experiment=Experiment.load("tiny-local").to_toml(),
                   logs={"rank0.log": "building the model\nAssertionError: no data path\n"})
    for size in ((80, 24), (160, 48)):
        app = CharllmApp(run=run.path)
        async with app.run_test(size=size) as pilot:
            screen = app.screen
            log = screen.query_one("#log-tail")
            await wait_for(pilot, lambda: log.line_count >= 2 and screen.last_frame.kind == "host",
                           what="the log's lines and the host telemetry")
            assert screen.query_one("#live-bottom").display and log.display
            assert "AssertionError: no data path" in "\n".join(log.lines)
            assert "iterations  none yet" in str(screen.query_one("#iterations").render())
            assert screen.query_one("#iterations").region.height > 0


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
@pilot_test
async def test_live_status_pane_ends_where_a_phrase_ends(charllm_dirs, size):
    """The iterations pane names the straggler: whole where there is room, else cut where a phrase ends,
    with an ellipsis (it was cut at "stragglers: rank 1 (node vm," at 80×24)."""
    import numpy as np

    from charllm.probes.store.synthetic import gpu_frame, make_run
    from charllm.tui.screens.live import rows
    from infra_traces import rank_log

    t = np.arange(0, 61) * 0.1
    frames = [gpu_frame(t, device=f"gpu{i}", power_w=300.0, temp_gpu_c=50.0, sm_clock_mhz=1800.0) for i in (0, 1)]
    run = make_run(charllm_dirs["runs"], frames, run_id="20251121-080000-ranks",
                   iterations=rank_log([0.1, 0.3], pp=1, nodes=("n0",)))   # rank 1 computes 3x its peer
    app = CharllmApp(run=run.path)
    async with app.run_test(size=size) as pilot:
        screen = app.screen
        pane, bottom = screen.query_one("#iterations"), screen.query_one("#live-bottom")
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.stragglers
                       and "stragglers" in str(pane.render()), what="the stragglers in the pane")
        await wait_for(pilot, lambda: rows(str(pane.render()), pane.content_size.width)
                       <= bottom.content_size.height, timeout=5, what="the pane's lines within it")
        text = str(pane.render())
        last = text.splitlines()[-1]
        whole = screen.last_frame.stragglers
        assert whole.startswith("last 5 steps: stragglers: rank 1 (node n0, stage 0)")
        assert last == whole or (last.endswith(" …") and whole.startswith(last[:-2])
                                 and whole[len(last) - 2:][:2] in (", ", "; ", ": ", " (")
                                 and last.count("(") == last.count(")")), last
        assert rows(text, pane.content_size.width) <= bottom.content_size.height
        assert (last == whole) == (size == (160, 48))


# -- Compare ----------------------------------------------------------------------------------------------
async def compare_shown(pilot, refs):
    app = pilot.app
    app.compare_refs = [str(r) for r in refs]
    await pilot.press("f7")
    screen = app.screen
    await wait_for(pilot, lambda: screen.result is not None, timeout=60, what="the comparison")
    await pilot.pause(0.5)
    return screen


def y_labels(chart) -> list[float]:
    """The numbers on a drawn chart's y axis (left of its tick marks)."""
    return [float(line.split("┤")[0].strip().replace(",", "")) for line in chart.render().plain.splitlines()
            if "┤" in line and line.split("┤")[0].strip()]


@pilot_test
async def test_compare_at_80x24_gives_the_table_the_room_and_c_the_charts_without_overlap(charllm_dirs):
    """Two runs with long names on different hardware (many experiment differences): 8 metrics at least
    (there was one row), and the charts, on c, each in the table's place."""
    a = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-llama3-8b-tp4-mbs4", seconds=12, gpus=2)
    b = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-llama3-8b-tp4-mbs2", seconds=12, gpus=2,
                      power_limit_w=450.0, seed=3, hardware="a100-80gb")
    app = CharllmApp()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await compare_shown(pilot, [a, b])
        table, charts = screen.query_one("#compare-table"), screen.query_one("#compare-charts")
        assert screen.result.experiment_diff.height > 2
        assert not charts.display and table.region.height >= 9      # 8 metrics or more, not one row
        first, second = (screen.query_one(f"#cmp-chart-{i}") for i in (1, 2))
        for shown in (first, second):                                 # c: each chart in the table's place
            await pilot.press("c")
            await pilot.pause(0.5)
            assert charts.display and not table.display and shown.display
            assert shown.region.height >= 10 and shown.region.width >= 76
            assert not (first if shown is second else second).display
        await pilot.press("c")
        assert not charts.display and table.display


@pilot_test
async def test_compare_charts_tell_series_apart_by_glyph_and_mark_the_baseline(charllm_dirs):
    from charllm.probes.analysis import baselines

    a = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-a", seconds=12, gpus=2)
    b = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-b", seconds=12, gpus=2, power_limit_w=450.0,
                      seed=3)
    baselines.save(str(a), "demo-level")
    app = CharllmApp()
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await compare_shown(pilot, [a, b])
        first, second = (screen.query_one(f"#cmp-chart-{i}") for i in (1, 2))
        assert first.region.right < second.region.x                 # the axes do not touch
        legend = [line for line in first.render().plain.splitlines() if "demo-" in line]
        assert "demo-a (baseline)" in legend[0] and "demo-b" in legend[1]
        glyphs = [line.strip(" │").split(" ")[0] for line in legend]
        assert glyphs[0] != glyphs[1] and "xx" in glyphs[1]          # not colour alone
        # A saved baseline has no curve: it is drawn as the level of its figure.
        select = screen.query_one("#baseline")
        select.value = "baseline:demo-level"
        await wait_for(pilot, lambda: screen.result is not None and screen.result.baseline == "baseline:demo-level")
        await pilot.pause(0.5)
        level = screen.result.table.filter((screen.result.table["ref"] == "baseline:demo-level")
                                           & (screen.result.table["metric"] == "power_mean_w"))["value"][0]
        xs, ys = first._series["demo-level"]
        assert len(xs) > 2 and set(ys) == {level} and first._baseline == "demo-level"
        assert "demo-level (baseline)" in first.render().plain


@pilot_test
async def test_a_cpu_chart_axis_never_runs_past_100_percent():
    from textual.app import App

    from charllm.tui.widgets.charts import Chart

    class One(App):
        def compose(self):
            yield Chart("host CPU utilization (%)", xlabel="time (s)")

    for size in ((60, 14), (80, 24), (160, 48)):
        app = One()
        async with app.run_test(size=size) as pilot:
            chart = app.query_one(Chart)
            xs = [i * 0.5 for i in range(40)]
            chart.show({"node0": (xs, [min(100.0, 60 + 3 * i) for i in range(40)]),
                        "node1": (xs, [min(100.0, 40 + 2 * i) for i in range(40)])})
            await wait_for(pilot, lambda: len(y_labels(chart)) >= 2, what="the chart drawn")
            labels = y_labels(chart)
            assert max(labels) <= 100, labels                        # it ran to 102.22
            assert all(label == round(label) for label in labels)    # round figures


# -- Sweep and Campaign ---------------------------------------------------------------------------------
@pilot_test
async def test_sweep_keeps_the_chosen_order_and_its_first_two_rows_make_a_campaign(charllm_dirs):
    """The dropdowns start at the best layout's micro batch and recompute choice, so the two top rows
    marked make a campaign (a campaign's layouts share them; the first c used to fail); s sorts, and f or
    a dropdown keeps that order (f dropped it)."""
    from charllm.tui.screens.sweep import SORTS, sort_text

    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await wait_for(pilot, lambda: screen.frame is not None, timeout=120, what="the sweep")
        best = screen.frame.row(0, named=True)
        assert screen.query_one("#mbs").value == best["micro_batch_size"]
        assert screen.query_one("#recompute").value == best["recompute"]
        await pilot.press("s", "s", "s", "s")                    # ... to peak memory, least first
        column, descending = SORTS[3]
        assert column == "peak_bytes"
        order = screen.table_frame[column].to_list()
        assert order == sorted(order, reverse=descending)
        await pilot.press("f")                                   # all layouts, in the same order
        listed = screen.table_frame[column].to_list()
        assert len(listed) >= len(order) and listed == sorted(listed, reverse=descending)
        assert f"sorted by {sort_text(SORTS[3])}" in str(screen.query_one("#sweep-status").render())
        await pilot.press("f")
        await list_every_layout(pilot, screen)                    # a dropdown too
        listed = screen.table_frame[column].to_list()
        assert len(listed) > len(order) and listed == sorted(listed, reverse=descending)
        screen.query_one("#mbs").value = best["micro_batch_size"]
        screen.query_one("#recompute").value = best["recompute"]
        screen.sort = None                                       # ranked again: the first two rows
        screen.fill_table(screen.shown)
        await pilot.press("home", "space", "down", "space", "c")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName", what="the campaign's name")


@pilot_test
async def test_campaign_columns_widen_as_the_record_moves_on(charllm_dirs):
    """Every member queued, then the record moves on: 'completed' shows whole (the column kept the
    width of 'queued' and showed 'comple' until a restart)."""
    import json

    from charllm.engine.campaign import state
    from charllm.tui.demo import DEMO_CAMPAIGN, make_demo_campaign

    path = make_demo_campaign(charllm_dirs["runs"])
    finished = json.loads(path.read_text())
    queued = json.loads(path.read_text())
    for member in queued["members"]:
        member.update(status=state.QUEUED, run=None, runs=[], failure=None, started_ns=None, ended_ns=None)
    queued.update(status="running", ended_ns=None, supervisor=procid.identify(os.getpid()))
    path.write_text(json.dumps(queued))
    app = CharllmApp(start_mode="campaign")
    app.campaign_name = DEMO_CAMPAIGN
    async with app.run_test(size=(120, 40)) as pilot:
        screen = app.screen
        members = screen.query_one("#campaign-members")

        def on_screen() -> str:
            """What the terminal shows (the screenshot's text; a table's own render_lines, called from
            here, at times gave its header alone while the screen showed every row)."""
            return html.unescape(re.sub(r"<[^>]+>", "", pilot.app.export_screenshot())).replace("\xa0", " ")

        await wait_for(pilot, lambda: members.row_count == 9 and str(members.get_cell("1", "status")) == "queued")
        assert "completed" not in on_screen()
        path.write_text(json.dumps({**finished, "status": "running", "ended_ns": None,
                                    "supervisor": procid.identify(os.getpid())}))
        await wait_for(pilot, lambda: str(members.get_cell("1", "status")) == "completed", timeout=10)
        await wait_for(pilot, lambda: "completed" in on_screen(), what="'completed' whole")
        listing = screen.query_one("#campaign-list")
        await wait_for(pilot, lambda: str(listing.get_cell(DEMO_CAMPAIGN, "progress")) in on_screen(),
                       what="the campaign's progress whole")


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
@pilot_test
async def test_sweep_status_says_the_device_budget_whole(size):
    """The note on the budget every verdict assumes and the rates every speed assumes, to its last word
    (it was cut mid-parenthesis)."""
    app = CharllmApp()
    async with app.run_test(size=size) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await wait_for(pilot, lambda: screen.frame is not None, timeout=120, what="the sweep")
        await pilot.pause(0.5)
        status = screen.query_one("#sweep-status")
        shown = " ".join(strip.text.strip() for strip in status.render_lines(status.region.reset_offset))
        for line in screen.basis.splitlines():
            assert " ".join(line.split()) in " ".join(shown.split()), (line, shown)
        assert screen.query_one("#sweep-table").region.height >= 8


# -- messages ---------------------------------------------------------------------------------------------
@pilot_test
async def test_launch_refusal_names_the_key_that_launches_anyway(charllm_dirs):
    from charllm.engine.model.experiment import Experiment

    exp = Experiment.load("tiny-local")
    exp.parallel.tensor_model_parallel_size = 3                    # 2 devices: an invalid layout
    app = CharllmApp(exp)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f4")
        screen = app.screen
        text = screen.query_one("#dry-run-text")
        await wait_for(pilot, lambda: "This layout has problems" in str(text.render()), what="the dry run")
        assert "f launches anyway" in str(text.render())
        await pilot.press("l")
        log = screen.query_one("#launch-log")
        await wait_for(pilot, lambda: any("refused" in line for line in log.lines), what="the refusal")
        refusal = next(line for line in log.lines if "refused" in line)
        assert refusal.startswith("refused: world_size = 2:") and refusal.endswith("(f launches anyway)")
        assert "--force" not in refusal and notes_of(app)[-1] == refusal.removeprefix("refused: ")


@pilot_test
async def test_quitting_with_work_in_flight_says_what_goes_on_and_how_to_stop_it(charllm_dirs):
    import json

    from charllm.tui.demo import DEMO_CAMPAIGN, make_demo_campaign

    make_demo_run(charllm_dirs["runs"], "20251121-070000-demo-done", seconds=4, gpus=2)       # finished: not said
    run = supervised_here(make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-a", seconds=4, gpus=2))
    path = make_demo_campaign(charllm_dirs["runs"])
    record = json.loads(path.read_text())
    record.update(status="running", ended_ns=None, supervisor=procid.identify(os.getpid()))
    path.write_text(json.dumps(record))
    member_run = RunDir(charllm_dirs["runs"] / record["members"][0]["run"])
    supervised_here(member_run.path)                  # a campaign's member: its campaign's cancel stops it
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm", what="the question")
        question = str(app.screen.query_one("Label").render())
        assert f"run {run.id} (running, on local) · stop it: charllm-tui runs cancel {run.id}" in question
        assert f"· stop it: charllm-tui campaign cancel {DEMO_CAMPAIGN}" in question
        assert "demo-done" not in question and member_run.id not in question
        await pilot.press("n")
        assert app.is_running and app.screen.__class__.__name__ == "ComposeScreen"
        await pilot.press("ctrl+q", "y")
        await wait_for(pilot, lambda: not app.is_running, what="the quit")
    left = app.return_value.splitlines()            # charllm-tui prints it in the terminal after the workbench
    assert f"run {run.id} (running, on local) · stop it: charllm-tui runs cancel {run.id}" in left
    assert run.manifest().status == "running"


@pilot_test
async def test_quitting_with_nothing_in_flight_asks_nothing(charllm_dirs):
    make_demo_run(charllm_dirs["runs"], "20251121-070000-demo-done", seconds=4, gpus=2)
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running, what="the quit")
