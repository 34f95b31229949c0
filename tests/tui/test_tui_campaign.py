"""The Campaign screen (F9) and Sweep's marked layouts, driven with Pilot on the real app: campaigns
listed with their progress, members refreshed from their record while nobody presses a key, a
member's run opened on Live and Runs, the report's figures drawn with its own values, a campaign
written from Sweep, and (integration) a real tiny CPU campaign run and cancelled from the screen."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from test_tui_pilot import pilot_test, run_app, wait_for

from charllm.engine.campaign import spec, state
from charllm.engine.campaign.findings import describe, findings
from charllm.engine.campaign.report import figure, values_of
from charllm.engine.model import sweep
from charllm.engine.model.experiment import Experiment
from charllm.probes.core import paths, procid
from charllm.tui.app import CharllmApp
from charllm.tui.demo import DEMO_CAMPAIGN, make_demo_campaign
from charllm.tui.figures import heatmap_text
from infra_pilot import list_every_layout

pytestmark = pytest.mark.timeout(300)


def campaign_app(name: str | None = DEMO_CAMPAIGN) -> CharllmApp:
    app = CharllmApp(start_mode="campaign")
    app.campaign_name = name
    return app


def shown(app, name: str = DEMO_CAMPAIGN):
    """The condition: the screen shows campaign `name`'s members."""
    def ready():
        screen = app.screen
        return (
            type(screen).__name__ == "CampaignScreen"
            and screen.shown is not None
            and screen.shown.name == name
            and screen.query_one("#campaign-members").row_count == len(screen.shown.rows) > 0
        )
    return ready


def cell(app, member: int, column: str) -> str:
    return str(app.screen.query_one("#campaign-members").get_cell(str(member), column))


def polling(app) -> bool:
    from textual.worker import WorkerState

    return any(w.group == "campaign-poll" and w.state == WorkerState.RUNNING for w in app.workers)


def notes_of(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


@pilot_test
async def test_lists_every_campaign_with_its_progress_and_shows_the_members_of_the_chosen_one(charllm_dirs):
    make_demo_campaign(charllm_dirs["runs"])
    gone = state.directory("old-sweep")              # a record whose campaign file was deleted since
    shutil.copytree(state.directory(DEMO_CAMPAIGN), gone)
    data = json.loads((gone / "campaign.json").read_text())
    (gone / "campaign.json").write_text(json.dumps({**data, "name": "old-sweep"}))
    app = campaign_app()
    async with run_app(app) as pilot:
        await wait_for(pilot, shown(app), what="the demo campaign's members")
        listing = app.screen.query_one("#campaign-list")
        await wait_for(pilot, lambda: "…" not in [str(listing.get_cell(k, "members")) for k in listing.rows],
                       what="every campaign's count")           # they come after the chosen one's members
        names = [key.value for key in listing.rows]
        assert names == sorted({*spec.campaigns(), "old-sweep"}) and "ppt-microbatch" in names
        record = state.Record.load(DEMO_CAMPAIGN)
        assert str(listing.get_cell(DEMO_CAMPAIGN, "progress")) == record.progress().split(": ", 1)[1]
        assert str(listing.get_cell("ppt-microbatch", "members")) == "60"
        assert str(listing.get_cell("ppt-microbatch", "progress")) == "not run"
        assert str(listing.get_cell("old-sweep", "members")) == "9"         # its record's
        for m in record.members:
            assert cell(app, m["index"] + 1, "status") == state.member_status(record, m)
        assert cell(app, 2, "note") == record.members[1]["reason"]          # skipped: does not fit
        assert "completed at 08:02:54" in str(app.screen.query_one("#campaign-status").render())
        members = app.screen.query_one("#campaign-members")
        members.focus()
        await pilot.pause(0.1)
        assert record.members[0]["run"] in str(app.screen.query_one("#campaign-detail").render())
        # Another campaign: one that has not run shows its plan, each member's verdict.
        listing.focus()
        await pilot.press("down")                       # demo-microbatch -> old-sweep
        await wait_for(pilot, shown(app, "old-sweep"))
        assert record.data["description"] in str(app.screen.query_one("#campaign-status").render())
        await pilot.press("r")                          # no file: nothing to run
        await pilot.pause(0.1)
        assert any("no campaign file to run" in n for n in notes_of(app))
        await pilot.press("down")                       # -> ppt-h100
        await wait_for(pilot, shown(app, "ppt-h100"), what="the plan of ppt-h100")
        plans = spec.Campaign.load("ppt-h100").plan()
        assert [cell(app, p.member.index + 1, "status") for p in plans] == [p.verdict for p in plans]
        assert app.campaign_name == "ppt-h100"
        assert f"plan: {spec.describe(plans)}" in str(app.screen.query_one("#campaign-status").render())


@pilot_test
async def test_members_follow_their_record_while_nobody_presses_a_key(charllm_dirs):
    """A running campaign (its supervisor is this process here, so nothing settles it): a member the
    record moves on is shown moved on within a poll."""
    path = make_demo_campaign(charllm_dirs["runs"])
    data = json.loads(path.read_text())
    last = data["members"][-1]
    done = dict(last)
    last.update(status=state.QUEUED, run=None, runs=[], started_ns=None, ended_ns=None)
    data.update(status="running", ended_ns=None, supervisor=procid.identify(os.getpid()))
    path.write_text(json.dumps(data))
    app = campaign_app()
    async with run_app(app) as pilot:
        await wait_for(pilot, shown(app))
        assert cell(app, 9, "status") == "queued"
        assert "1 queued" in str(app.screen.query_one("#campaign-status").render())
        await pilot.press("c")                       # asks first; no cancels nothing
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm", what="the cancel question")
        await pilot.press("n")
        data["members"][-1] = done
        path.write_text(json.dumps(data))
        await wait_for(pilot, lambda: cell(app, 9, "status") == "completed", timeout=10, what="the new status")
        assert "1 queued" not in str(app.screen.query_one("#campaign-status").render())
        await pilot.press("r")                       # a running campaign is not started twice
        await pilot.pause(0.2)
        assert app.screen.__class__.__name__ == "CampaignScreen"
        assert any("is running; c cancels it" in n for n in notes_of(app))
    assert state.Record.load(DEMO_CAMPAIGN).data["status"] == "running"


@pilot_test
async def test_a_member_opens_on_live_and_on_runs(charllm_dirs):
    make_demo_campaign(charllm_dirs["runs"])
    record = state.Record.load(DEMO_CAMPAIGN)
    app = campaign_app()
    async with run_app(app) as pilot:
        await wait_for(pilot, shown(app))
        members = app.screen.query_one("#campaign-members")
        members.focus()
        await pilot.press("down", "down", "down")       # member 4: completed
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "live")
        assert app.run_path == paths.runs_dir() / record.members[3]["run"]
        await wait_for(pilot, lambda: not polling(app), what="the poller to stop")   # it reads only while shown
        await pilot.press("f9")
        await wait_for(pilot, lambda: app.current_mode == "campaign" and polling(app))
        await pilot.press("o")
        await wait_for(pilot, lambda: app.current_mode == "runs")
        runs = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: runs.row_count == 6)
        assert app.screen.current_run() == record.members[3]["run"]
        await pilot.press("f9")
        await wait_for(pilot, lambda: app.current_mode == "campaign")
        await pilot.press("up")                          # member 3: invalid, no run
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert app.current_mode == "campaign"
        assert any("has no run: invalid" in n for n in notes_of(app))


@pilot_test
async def test_figures_draw_the_values_of_the_report(charllm_dirs):
    from charllm.tui.widgets.charts import FigurePanel

    make_demo_campaign(charllm_dirs["runs"])
    record = state.Record.load(DEMO_CAMPAIGN)
    app = campaign_app()
    async with run_app(app, size=(160, 48)) as pilot:
        await wait_for(pilot, shown(app))
        screen = app.screen

        def drawn(kind, metric):
            return lambda: screen.drawn is not None and screen.drawn.wanted == screen.wanted and \
                screen.wanted.kind == kind and screen.wanted.metric == metric

        await pilot.press("g")
        await wait_for(pilot, drawn("parallelism", None), what="the parallelism figure")
        panels = list(screen.query(FigurePanel))
        expected = figure(record, "parallelism")
        assert [p.panel.metric for p in panels] == [p.metric for p in expected.panels]     # the paper's six
        assert values_of(screen.drawn.figure) == values_of(expected)
        assert all(p.panel is q for p, q in zip(panels, screen.drawn.figure.panels))      # drawn: the report's
        assert "OOM" in str(screen.query_one("#figure-text").render())                  # a member that did not fit
        await pilot.press("m")                                                            # one metric
        await wait_for(pilot, drawn("parallelism", "iter_time_mean_s"))
        assert values_of(screen.drawn.figure) == values_of(figure(record, "parallelism", "iter_time_mean_s"))
        await pilot.press("g")
        await wait_for(pilot, drawn("optimization", "efficiency_samples_per_s_mj"))
        await pilot.press("n")
        await wait_for(pilot, lambda: screen.drawn is not None and screen.drawn.wanted == screen.wanted
                       and screen.wanted.normalize)
        normalised = values_of(figure(record, "optimization", "efficiency_samples_per_s_mj", normalize=True))
        assert values_of(screen.drawn.figure) == normalised and max(v for v in normalised.values() if v) == 1.0
        await pilot.press("g")
        await wait_for(pilot, drawn("microbatch", "power_peak_w"))
        assert values_of(screen.drawn.figure) == values_of(figure(record, "microbatch", "power_peak_w"))
        chart = str(screen.query_one(FigurePanel).render())
        assert "power, peak (W)" in chart and "micro batch size" in chart
        await pilot.press("g")
        await wait_for(pilot, drawn("heatmap", "temp_gpu_mean_c"), what="the heatmap")
        heat = figure(record, "heatmap")
        assert values_of(screen.drawn.figure) == values_of(heat)
        assert heatmap_text(heat) in str(screen.query_one("#figure-text").render())
        await pilot.press("g")
        await wait_for(pilot, drawn("kernels", None), what="the kernels figure")
        assert values_of(screen.drawn.figure) == values_of(figure(record, "kernels")) == {}     # no traces here
        assert "no member's run holds profiler traces" in str(screen.query_one("#figure-text").render())
        await pilot.press("g")                                                            # then the findings
        await wait_for(pilot, drawn("findings", None), what="the findings")
        said = str(screen.query_one("#figure-text").render())
        assert said == "\n".join(describe(record, findings(record))) and "1. micro batch" in said, said
        await pilot.press("g")                                                            # back to the members
        await pilot.pause(0.1)
        assert screen.query_one("#campaign-members").display and not screen.query_one("#campaign-figure").display


@pilot_test
async def test_a_campaign_files_own_words_are_shown_as_written_never_read_as_markup(charllm_dirs):
    """Issue 35: a `[/]` in a campaign's value or error was a rich MarkupError that ended the app."""
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "odd.toml").write_text('experiments = ["tiny-local"]\ndescription = "[/] x"\n[axes]\n'
                                     '"model.description" = ["a\\nb [/]", "[bold]c"]\n')
    (folder / "broken.toml").write_text('experiments = ["tiny-local"]\n[axes]\n"[/]" = [1]\n')
    app = campaign_app("odd")
    async with run_app(app) as pilot:
        await wait_for(pilot, shown(app, "odd"), what="the odd campaign's plan")
        assert "description = 'a\\nb [/]'" in cell(app, 1, "note")
        listing = app.screen.query_one("#campaign-list")
        await wait_for(pilot, lambda: "invalid" in str(listing.get_cell("broken", "progress")),
                       what="the broken file's row")
        assert "axes.[/]" in str(listing.get_cell("broken", "progress"))


@pilot_test
async def test_a_campaign_that_has_not_run_asks_before_it_runs_and_has_no_figure_yet(charllm_dirs):
    app = campaign_app("tiny-local")
    async with run_app(app) as pilot:
        await wait_for(pilot, shown(app, "tiny-local"))
        assert [cell(app, i, "status") for i in range(1, 7)] == ["fits"] * 6
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm", what="the run question")
        assert "Run campaign tiny-local on local: 6 of 6 members, at most 2 at once?" in \
            str(app.screen.query_one("Label").render())
        await pilot.press("n")
        await pilot.press("g")
        await wait_for(pilot, lambda: app.screen.drawn is not None)
        assert "has not run" in str(app.screen.query_one("#figure-text").render())
    assert state.recorded() == []                     # nothing started


# -- Sweep: marked layouts become a campaign -------------------------------------------------------
async def swept(pilot):
    """The Sweep screen once swept, listing every micro batch and recompute choice (it opens on the best
    layout's)."""
    from charllm.tui.screens.sweep import SweepScreen

    await pilot.press("f3")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, SweepScreen) and pilot.app.screen.frame is not None,
                   timeout=60, what="the sweep")
    screen = pilot.app.screen
    await list_every_layout(pilot, screen)
    screen.query_one("#sweep-table").focus()
    return screen


def mark_rows(screen, rows: list[int]) -> list[str]:
    """The keys that mark table rows `rows` (from the top), in that order."""
    keys, at = [], 0
    for row in rows:
        keys += ["down"] * (row - at) + ["space"]
        at = row
    return keys


@pilot_test
async def test_marked_sweep_layouts_become_a_campaign_of_the_preset(charllm_dirs):
    app = CharllmApp()
    async with run_app(app) as pilot:
        screen = await swept(pilot)
        frame = screen.table_frame
        # three layouts of one micro batch and recompute choice (a campaign's layouts share them), the first
        # such group from the top
        key = [(frame.row(i, named=True)["micro_batch_size"], frame.row(i, named=True)["recompute"])
               for i in range(frame.height)]
        same = next(members[:3] for members in ([j for j, k in enumerate(key) if k == key[i]]
                                                 for i in range(frame.height)) if len(members) >= 3)
        await pilot.press(*mark_rows(screen, same))
        assert str(screen.query_one("#sweep-table").get_cell(str(same[1]), "rank")).startswith("●")
        assert "3 marked" in str(screen.query_one("#sweep-status").render())
        await pilot.press("c")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName", what="the name dialog")
        assert app.screen.query_one("#name").value == "tiny-local-layouts"
        await pilot.press("enter")
        await wait_for(pilot, shown(app, "tiny-local-layouts"), what="the new campaign on its screen")
    path = charllm_dirs["config"] / "campaigns" / "tiny-local-layouts.toml"
    assert path.is_file() and not (charllm_dirs["config"] / "experiments").exists()   # the preset, by name
    campaign = spec.Campaign.load("tiny-local-layouts")
    assert campaign.experiments == ("tiny-local",) and len(campaign.layouts) == 3
    base = Experiment.load("tiny-local")
    for member, i in zip(campaign.members(), same):
        want = sweep.layout_to_experiment(base, frame.row(i, named=True)).to_dict()
        assert {**member.experiment.to_dict(), "name": want["name"]} == want


@pilot_test
async def test_an_edited_experiment_is_saved_with_its_campaign_and_mixed_layouts_are_refused(charllm_dirs):
    exp = Experiment.load("tiny-local")
    exp.name, exp.training.seq_length = "tiny-local-edited", 16
    app = CharllmApp(exp)
    async with run_app(app) as pilot:
        screen = await swept(pilot)
        frame = screen.table_frame
        mbs = [frame.row(i, named=True)["micro_batch_size"] for i in range(frame.height)]
        other = next(i for i, m in enumerate(mbs) if m != mbs[0])
        await pilot.press(*mark_rows(screen, [0, other]), "c")
        await pilot.pause(0.2)
        assert app.screen is screen                                                   # no dialog
        assert any("the layouts differ in micro_batch_size" in n for n in notes_of(app))
        await pilot.press("space")                                                    # unmark the other one
        await pilot.press("c")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName")
        assert "saved as an experiment preset too" in str(app.screen.query_one("Label").render())
        app.screen.query_one("#name").value = "tiny-local"                          # a shipped name: refused
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert "already exists" in str(app.screen.query_one("#name-error").render())
        app.screen.query_one("#name").value = "short-seq"
        await pilot.press("enter")
        await wait_for(pilot, shown(app, "short-seq"))
    campaign = spec.Campaign.load("short-seq")
    assert campaign.experiments == ("short-seq",)
    (member,) = campaign.members()
    assert member.experiment.seq_length == 16
    assert Experiment.load("short-seq").seq_length == 16


# -- a real campaign, run and cancelled from the screen ---------------------------------------------
@pytest.mark.integration
@pytest.mark.train
@pytest.mark.slow
@pytest.mark.timeout(600)
@pilot_test
async def test_run_a_tiny_campaign_from_the_screen_follow_it_and_cancel_it(charllm_dirs):
    from infra_campaign import runs_of, tiny_campaign
    from infra_runs import left_after

    # member 1 trains 6 iterations, member 2 until it is cancelled; one at a time
    name = tiny_campaign(charllm_dirs, "ui", max_parallel=1)
    path = charllm_dirs["config"] / "campaigns" / "ui.toml"
    path.write_text(path.read_text().replace("micro_batch_size = [1, 2, 4]\ntrain_iters = [6]",
                                             "micro_batch_size = [1]\ntrain_iters = [6, 100000]"))
    assert len(spec.Campaign.load(name).members()) == 4
    app = campaign_app(name)
    try:
        async with run_app(app) as pilot:
            await wait_for(pilot, shown(app, name), what="the plan")
            await pilot.press("r")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
            await pilot.press("y")
            await wait_for(pilot, lambda: cell(app, 1, "status") == "completed" and cell(app, 2, "status") == "running",
                           timeout=300, what="member 1 completed and member 2 running, on screen")
            assert "1 completed" in str(app.screen.query_one("#campaign-status").render())
            app.screen.query_one("#campaign-members").focus()
            await pilot.press("enter")                     # member 1 on Live
            await wait_for(pilot, lambda: app.current_mode == "live")
            assert app.run_path == state.Record.load(name).run_dir(state.Record.load(name).members[0]).path
            await pilot.press("f9")
            await wait_for(pilot, lambda: app.current_mode == "campaign")
            await pilot.press("c")
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
            await pilot.press("y")
            await wait_for(pilot, lambda: state.Record.load(name).data["status"] == "cancelled", timeout=180,
                           what="the campaign cancelled")
            await wait_for(pilot, lambda: cell(app, 2, "status") == "cancelled" and cell(app, 3, "status") ==
                           "cancelled", timeout=10, what="the cancel on screen")
        record = state.Record.load(name)
        assert [m["status"] for m in record.members] == ["completed", "cancelled", "cancelled", "cancelled"]
        assert all(left_after(str(rd.path), timeout=30) == 0 for rd in runs_of(record))
    finally:
        record = state.Record.load(name) if state.recorded() else None
        if record is not None and record.data.get("status") not in ("completed", "cancelled", "failed"):
            from charllm.engine.campaign import queue

            queue.cancel(name)


@pilot_test
async def test_help_and_palette_list_the_campaign_screen(charllm_dirs):
    app = CharllmApp()
    async with run_app(app) as pilot:
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
        text = app.screen.query_one("Markdown").source
        for binding_id in ("screen.campaign", "campaign.run", "campaign.cancel", "campaign.figure", "sweep.mark",
                           "sweep.campaign"):
            assert binding_id in text
        await pilot.press("escape")
        await pilot.press("ctrl+p")
        await pilot.press(*"go to campaign")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "campaign")
