"""The workbench at first contact (issue 36, items 9 to 13): Live shows a host run's log and progress
from the first second, Runs refresh themselves and ask before cancelling the run meant, Compare reads
at 80×24, the Campaign and Sweep tables keep up, and the messages say what they should where they
should. Each test drives the real app (Pilot) on recorded or synthetic runs.
"""

from __future__ import annotations

import os

import pytest

from charllm.probes.core import procid
from charllm.probes.store.rundir import RunDir
from charllm.tui.app import CharllmApp
from charllm.tui.demo import make_demo_run
from infra_pilot import pilot_test, wait_for

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
