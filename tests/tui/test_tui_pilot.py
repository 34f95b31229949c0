"""Pilot tests of the workbench flows: compose → plan → save; sweep → pick; launch → live → runs → compare.

They drive the real app headless (App.run_test) against the real engine and probes APIs, and
assert on app state, on what the screens show, and on the messages the workers post.
"""

from __future__ import annotations

import polars as pl
import pytest

from charllm.engine.model.experiment import Experiment, Hardware, ModelSpec
from charllm.probes.core.errors import UserError
from charllm.tui.app import CharllmApp, load_settings
from charllm.tui.demo import make_demo_run
from infra_pilot import list_every_layout, pilot_test, wait_for

pytestmark = pytest.mark.timeout(300)


def run_app(app: CharllmApp, messages: list | None = None, size=(120, 40)):
    hook = messages.append if messages is not None else None
    return app.run_test(size=size, message_hook=hook)


# -- Compose -------------------------------------------------------------------------------------
@pilot_test
async def test_opens_on_compose_with_tiny_local_and_estimates_it():
    messages: list = []
    app = CharllmApp()
    async with run_app(app, messages) as pilot:
        screen = app.screen
        assert app.current_mode == "compose"
        assert app.experiment.name == "tiny-local"
        await wait_for(pilot, lambda: screen.last is not None, what="the first estimate")
        estimated = [m for m in messages if isinstance(m, screen.Estimated)]
        assert estimated and estimated[-1].problems == []
        report = screen.last.report
        assert report["fits"] is True and report["stages"][0]["pp_rank"] == 0
        assert "FITS" in str(screen.query_one("#verdict").render())
        assert screen.query_one("#f-cluster-gpus_per_node").value == "2"


@pilot_test
async def test_compose_shows_the_focused_fields_help():
    app = CharllmApp()
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last is not None)
        hint = screen.query_one("#field-help")
        assert "experiment preset" in str(hint.render())          # the form starts on the preset picker
        await pilot.press("tab")
        assert str(hint.render()) == "the model preset: architecture and sizes"
        screen.query_one("#f-tensor_model_parallel_size").focus()
        await pilot.pause()
        assert str(hint.render()) == "tensor parallel: each layer's matrices split over this many devices"
        screen.query_one("#save").focus()
        await pilot.pause()
        assert str(hint.render()) == ""


@pilot_test
async def test_compose_edit_revalidates_and_shows_the_rule_beside_the_field():
    messages: list = []
    app = CharllmApp()
    async with run_app(app, messages) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last is not None)
        tp = screen.query_one("#f-tensor_model_parallel_size")
        tp.focus()
        tp.value = ""
        await pilot.press("3")
        await wait_for(pilot, lambda: screen.last.serial == screen.edit_serial and screen.last.problems,
                       what="a validation problem for TP=3")
        assert app.experiment.parallel.tensor_model_parallel_size == 3
        error = screen.query_one("#err-f-tensor_model_parallel_size")
        assert error.has_class("shown")
        assert "tensor_model_parallel_size" in str(error.render())
        assert "INVALID" in str(screen.query_one("#verdict").render())
        # Back to a valid value: the message goes away and the estimate returns.
        tp.value = "1"
        await wait_for(pilot, lambda: screen.last.serial == screen.edit_serial and screen.last.report is not None)
        assert not error.has_class("shown")


@pilot_test
async def test_compose_model_and_hardware_change_reestimates_against_new_capacity():
    app = CharllmApp()
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last is not None)
        exp = Experiment.load("tiny-local")
        exp.model = ModelSpec.load("llama3-8b")
        exp.hardware = Hardware.load("h100-sxm-80gb")
        exp.cluster.gpus_per_node = 8
        exp.training.global_batch_size = 64
        exp.training.micro_batch_size = 1
        app.use_experiment(exp)
        await wait_for(pilot, lambda: screen.last.serial == screen.edit_serial and screen.last.report is not None)
        assert screen.query_one("#model").value == "llama3-8b"
        assert screen.last.report["usable_bytes"] == Hardware.load("h100-sxm-80gb").usable_bytes


@pilot_test
async def test_compose_save_preset_round_trips(charllm_dirs):
    app = CharllmApp()
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last is not None)
        screen.query_one("#f-training-seq_length").value = "64"
        await wait_for(pilot, lambda: app.experiment.seq_length == 64)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is not screen, what="the name dialog")
        name_input = app.screen.query_one("#name")
        name_input.value = "my-tiny"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen)
    path = charllm_dirs["config"] / "experiments" / "my-tiny.toml"
    assert path.is_file()
    saved = Experiment.load("my-tiny")
    assert saved.seq_length == 64 and saved.model.name == "tiny-dense"
    assert saved.cluster.gpus_per_node == 2


@pilot_test
async def test_compose_edit_renames_the_experiment_and_save_refuses_a_shipped_or_unsafe_name(charllm_dirs):
    """An edited preset is no longer that preset: its title, exported flags file and suggested name say
    so; saving under a shipped preset's name (which would hide it) or a path is refused, nothing written."""
    app = CharllmApp()
    copied: list[str] = []
    app.copy_to_clipboard = copied.append
    notes: list[str] = []
    app.notify = lambda message, **kw: notes.append(str(message))
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last is not None)
        screen.query_one("#f-training-seq_length").value = "16"
        await wait_for(pilot, lambda: app.experiment.seq_length == 16)
        assert app.experiment.name == "tiny-local-edited"
        await wait_for(pilot, lambda: "tiny-local-edited" in str(screen.query_one("#summary").render()),
                       what="the title")
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: (charllm_dirs["data"] / "exports" / "tiny-local-edited.megatron-args").is_file())
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is not screen, what="the name dialog")
        dialog = app.screen
        assert dialog.query_one("#name").value == "tiny-local-edited"
        refusals = []
        for name in ("tiny-local", "../outside"):      # refused in the dialog, which stays open
            dialog.query_one("#name").value = name
            await pilot.press("enter")
            await pilot.pause(0.1)
            assert app.screen is dialog and dialog.query_one("#name-error").has_class("shown")
            refusals.append(str(dialog.query_one("#name-error").render()))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen)
    assert "a shipped preset has that name" in refusals[0] and "'../outside'" in refusals[1]
    assert (
        not (charllm_dirs["config"] / "experiments").exists() and not (charllm_dirs["config"] / "outside.toml").exists()
    )


@pilot_test
async def test_compose_export_writes_megatron_flags_and_copies_them(charllm_dirs):
    app = CharllmApp()
    copied: list[str] = []
    app.copy_to_clipboard = copied.append
    async with run_app(app) as pilot:
        await pilot.press("ctrl+g")
        await pilot.pause(0.2)
    written = (charllm_dirs["data"] / "exports" / "tiny-local.megatron-args").read_text()
    assert "--micro-batch-size" in copied[0] and "--global-batch-size" in copied[0]
    assert "--num-layers" in written


# -- Sweep -----------------------------------------------------------------------------------------
def llama3_8b_on_8_h100():
    exp = Experiment.load("tiny-local")
    exp.model = ModelSpec.load("llama3-8b")
    exp.hardware = Hardware.load("h100-sxm-80gb")
    exp.cluster.gpus_per_node = 8
    exp.training.global_batch_size = 64
    exp.training.bf16 = True
    return exp


async def swept(pilot):
    """The Sweep screen once it shows a sweep (one made on its key, or the app's sweep ahead, which
    a loaded machine may finish before the key), listing every micro batch and recompute choice."""
    from charllm.tui.screens.sweep import SweepScreen

    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, SweepScreen) and app.screen.frame is not None,
                   timeout=120, what="the sweep")
    await list_every_layout(pilot, app.screen)
    return app.screen


@pilot_test
async def test_sweep_runs_and_a_pick_loads_into_compose():
    from charllm.tui.screens.sweep import TABLE_PAGE

    exp = llama3_8b_on_8_h100()
    exp.training.attention_backend = "unfused"             # composed: the sweep must keep it
    app = CharllmApp(exp)
    async with run_app(app) as pilot:
        await pilot.press("f3")
        screen = await swept(pilot)
        assert screen.frame.height > 0
        table = screen.query_one("#sweep-table")
        fitting = int(screen.frame["fits"].sum())
        assert table.row_count == min(fitting, TABLE_PAGE) and screen.table_frame.height == fitting
        first = screen.table_row(0)
        table.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "compose")
        p = app.experiment.parallel
        assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (
            first["tensor_model_parallel_size"], first["pipeline_model_parallel_size"])
        assert app.experiment.training.micro_batch_size == first["micro_batch_size"]
        assert app.experiment.training.attention_backend == "unfused"
        assert app.screen.query_one("#f-tensor_model_parallel_size").value == str(p.tensor_model_parallel_size)
        compose = app.screen                                  # Compose plans the row to the same bytes
        await wait_for(pilot, lambda: compose.last.serial == compose.edit_serial and compose.last.report is not None)
        report = compose.last.report
        assert (report["peak_bytes"], report["verdict"]) == (first["peak_bytes"], first["verdict"])


@pilot_test
async def test_sweep_table_adds_rows_a_page_at_a_time_as_the_cursor_nears_the_end():
    """All layouts of Llama-3 8B on 8 H100s (220 rows): the table starts with one page and the rest
    comes as the cursor moves down, in the frame's order; a row picked from a later page is that row."""
    from charllm.tui.screens.sweep import TABLE_PAGE

    app = CharllmApp(llama3_8b_on_8_h100())
    async with run_app(app) as pilot:
        await pilot.press("f3")
        screen = await swept(pilot)
        table = screen.query_one("#sweep-table")
        await pilot.press("f")                               # all layouts, not only the fitting ones
        await wait_for(pilot, lambda: screen.table_frame.height > 2 * TABLE_PAGE, what="all layouts listed")
        assert table.row_count == TABLE_PAGE
        assert "listing 220 (all" in str(screen.query_one("#sweep-status").render())
        table.focus()
        table.move_cursor(row=TABLE_PAGE - 5)
        await wait_for(pilot, lambda: table.row_count == 2 * TABLE_PAGE, what="the second page")
        table.move_cursor(row=2 * TABLE_PAGE - 1)
        await wait_for(pilot, lambda: table.row_count == screen.table_frame.height, what="the last page")
        last = screen.table_frame.height - 1
        table.move_cursor(row=last)
        await pilot.pause(0.05)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "compose")
        row = screen.table_frame.row(last, named=True)
        p = app.experiment.parallel
        assert (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            app.experiment.training.micro_batch_size,
        ) == (row["tensor_model_parallel_size"], row["pipeline_model_parallel_size"], row["micro_batch_size"])


@pilot_test
async def test_sweep_table_shows_what_tells_layouts_apart_and_the_map_gives_way_at_80_columns():
    """Columns with one value across the sweep are hidden and named once; the speed and verdict columns
    come before the options, and at 80 columns the map starts hidden (m shows it) so that the columns up
    to the verdict fit (the rest scroll)."""

    app = CharllmApp(Experiment.load("tiny-local"))
    async with run_app(app, size=(80, 24)) as pilot:
        await pilot.press("f3")
        screen = await swept(pilot)
        frame = screen.frame
        table = screen.query_one("#sweep-table")
        shown = [c.key.value for c in table.columns.values()]
        constant = [c for c in ("context_parallel_size", "expert_model_parallel_size", "sequence_parallel")
                    if frame[c].n_unique() == 1]
        assert constant and not set(constant) & set(shown)
        status = str(screen.query_one("#sweep-status").render())
        assert "in every layout: CP 1 · EP 1" in status and "SP no" in status
        options = [shown.index(c) for c in ("recompute", "use_distributed_optimizer", "sequence_parallel")
                   if c in shown]
        assert shown.index("tokens_per_s") < shown.index("verdict") < min(options, default=len(shown))
        assert "tensor_model_parallel_size" in shown and frame["tensor_model_parallel_size"].n_unique() > 1
        assert not screen.query_one("#map-pane").display
        columns = list(table.columns.values())[:shown.index("verdict") + 1]
        assert table.region.right <= 80 and sum(c.get_render_width(table) for c in columns) <= 80
        await pilot.press("m")
        assert screen.query_one("#map-pane").display
        await pilot.resize_terminal(160, 40)
        await pilot.pause(0.1)
        assert screen.query_one("#map-pane").display                              # the user's choice stays
        await pilot.press("m")
        assert not screen.query_one("#map-pane").display


@pilot_test
async def test_sweep_screen_opens_on_the_sweep_made_ahead_and_resweeps_after_an_edit():
    """Once idle after start-up the app sweeps the composed experiment in the background: F3 then
    shows that table without sweeping again; after an edit in Compose, F3 sweeps the new experiment."""
    from charllm.tui.screens.sweep import SweepDone

    messages: list = []
    app = CharllmApp(Experiment.load("ppt-h100-llama3-70b-1-01000"))
    async with run_app(app, messages) as pilot:
        await wait_for(pilot, lambda: app.swept_ahead is not None, timeout=60, what="the sweep ahead")
        key, ahead = app.swept_ahead
        assert key == app.experiment.to_toml() and ahead.error is None and ahead.frame.height > 0
        await pilot.press("f3")
        await pilot.pause(0.05)
        screen = app.screen
        assert screen.frame is ahead.frame and screen.query_one("#sweep-table").row_count > 0
        assert not any(isinstance(m, SweepDone) for m in messages)          # no sweep on the key
        app.experiment.training.global_batch_size *= 2                     # as a Compose edit does
        await pilot.press("f2")
        await pilot.press("f3")
        await wait_for(pilot, lambda: any(isinstance(m, SweepDone) for m in messages), timeout=60,
                       what="the sweep of the edited experiment")
        await wait_for(pilot, lambda: screen.frame is not ahead.frame, what="the new table")


@pilot_test
async def test_a_screen_first_opened_after_a_theme_change_has_that_theme():
    """A new screen skips Textual's whole-stylesheet refresh (app._screen_factory): it must still be
    styled by the theme chosen before it opened."""
    from textual.color import Color

    app = CharllmApp()
    async with run_app(app) as pilot:
        dark = app.screen.styles.background
        app.theme = "textual-light"
        await pilot.pause(0.1)
        await pilot.press("f6")                                            # Runs: opened for the first time
        await wait_for(pilot, lambda: app.current_mode == "runs")
        await pilot.pause(0.1)
        assert app.screen.styles.background == Color.parse(app.current_theme.background) != dark


# -- Live, Runs, Compare on recorded (simulated) runs --------------------------------------------
@pilot_test
async def test_live_replays_a_recorded_run_labelled_simulated(charllm_dirs):
    run = make_demo_run(charllm_dirs["runs"])
    app = CharllmApp(run=run)
    async with run_app(app) as pilot:
        screen = app.screen
        assert app.current_mode == "live"
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")
        frame = screen.last_frame
        assert frame.simulated and screen.query_one("#sim-badge").display
        assert sorted(frame.charts["power_w"]) == [f"gpu{i}" for i in range(8)]
        assert len(frame.iterations) == 33
        assert "iteration 33" in str(screen.query_one("#iterations").render())
        # The demo's 550 W cap shows up as power-cap throttling on the strip.
        assert any(bits & 0x4 for _, row in frame.throttle for bits in row)
        # The power chart names the span and the buckets its figures are averaged over.
        power = screen.query_one("#chart-0")
        assert power.title.startswith("GPU power (W) · ") and power.title.endswith(" s means · all recorded")
        # Pause freezes the drawing; zoom changes the window.
        await pilot.press("space")
        drawn = screen.frames
        await pilot.pause(1.0)
        assert screen.frames == drawn
        await pilot.press("space")
        await pilot.press("minus")
        assert screen.window == len(screen_windows()) - 1
        await pilot.press("plus")
        assert screen.window == len(screen_windows()) - 2
        await wait_for(pilot, lambda: power.title.endswith(f"· last {screen_windows()[-2]} s"),
                       what="the zoomed window in the title")


def screen_windows():
    from charllm.tui.screens.live import WINDOWS_S

    return WINDOWS_S


@pilot_test
async def test_live_groups_many_gpus_per_node(charllm_dirs):
    run = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-2x8", gpus=8, nodes=2, seconds=12)
    app = CharllmApp(run=run)
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")
        assert screen.last_frame.grouped and sorted(screen.last_frame.charts["power_w"]) == ["node0", "node1"]
        await pilot.press("g")
        await wait_for(pilot, lambda: not screen.last_frame.grouped)
        assert len(screen.last_frame.charts["power_w"]) == 16


@pilot_test
async def test_live_without_a_run_shows_host_telemetry():
    from charllm.tui.screens.live import HOST_CHARTS, PANES

    app = CharllmApp(start_mode="live")
    async with run_app(app) as pilot:
        screen = app.screen

        def reported(metric):
            frame = screen.last_frame
            return any(v is not None for _, ys in frame.charts.get(metric, {}).values() for v in ys)

        # network throughput is a rate: it needs two samples
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "host"
                       and reported("net_mb_s"), what="host telemetry rows")
        frame = screen.last_frame
        assert frame.source.startswith("host telemetry")
        assert not frame.simulated
        # The panes go to what this machine reports: a pane is "not reported here" only when fewer
        # than four host figures are (psutil always gives CPU, memory and network).
        with_data = sum(reported(m) for m, _ in HOST_CHARTS)
        assert with_data >= 3 and reported("cpu_util_pct")
        charts = list(screen.query("Chart"))
        assert [c.title.split(" · ")[0] for c in charts] == [title for _, title in frame.panes]
        assert [bool(c._note) for c in charts] == [i >= with_data for i in range(PANES)]


def test_live_host_panes_plot_reported_figures_and_counter_rates():
    import numpy as np

    from charllm.probes.store.synthetic import gpu_frame
    from charllm.tui.screens.live import build_frame

    t = np.arange(0, 10, 0.25)
    # No CPU temperature, no RAPL energy (as in a container): network takes a pane instead.
    rows = gpu_frame(t, device="host", cpu_util_pct=50.0, host_mem_used_bytes=2 * 1024**3, cpu_freq_mhz=2600.0,
                     net_tx_bytes=1e6 * t, net_rx_bytes=3e6 * t)
    frame = build_frame(rows, rows["ts_ns"].min(), 60, None, 60)
    assert [m for m, _ in frame.panes] == ["cpu_util_pct", "host_mem_used_gib", "net_mb_s", "cpu_freq_mhz"]
    net = [v for v in frame.charts["net_mb_s"]["host"][1] if v is not None]
    assert net and all(abs(v - 4.0) < 1e-6 for v in net)                # (1 + 3) MB per second
    assert frame.charts["host_mem_used_gib"]["host"][1][0] == 2.0
    # Where RAPL is readable, the package power (the energy counter's rate) comes before network.
    frame = build_frame(rows.with_columns(cpu_energy_j=pl.Series(80.0 * t)), rows["ts_ns"].min(), 60, None, 60)
    assert [m for m, _ in frame.panes] == ["cpu_util_pct", "host_mem_used_gib", "cpu_power_w", "net_mb_s"]
    assert all(abs(v - 80.0) < 1e-6 for v in frame.charts["cpu_power_w"]["host"][1] if v is not None)
    assert frame.window == "samples · last 60 s"       # 40 samples: fewer than the 120 points a chart shows
    coarse = build_frame(rows, rows["ts_ns"].min(), None, None, 60, chart_points=13)
    assert coarse.window == "0.75 s means · all recorded"


@pilot_test
async def test_live_pause_shows_paused_and_space_resumes_with_the_newest_data():
    app = CharllmApp(start_mode="live")          # host telemetry: new samples keep coming
    async with run_app(app) as pilot:
        screen = app.screen
        title = screen.query_one("#live-title")
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "host",
                       what="host telemetry rows")
        await pilot.press("space")
        assert "PAUSED" in str(title.render())
        drawn, shown = screen.frames, screen.last_frame
        latest = max(max(xs) for xs, _ in shown.charts["cpu_util_pct"].values())
        await pilot.pause(3.0)                   # longer than a chart redraw takes to come due
        assert screen.frames == drawn and screen.last_frame is shown and "PAUSED" in str(title.render())
        await pilot.press("space")
        assert "PAUSED" not in str(title.render())
        await wait_for(pilot, lambda: screen.frames > drawn, what="a new frame after resuming")
        assert max(max(xs) for xs, _ in screen.last_frame.charts["cpu_util_pct"].values()) > latest + 2


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
@pilot_test
async def test_live_next_chart_cycles_at_every_size(charllm_dirs, size):
    app = CharllmApp(run=make_demo_run(charllm_dirs["runs"], seconds=6))
    async with run_app(app, size=size) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")
        charts = list(screen.query("Chart"))

        def shown():
            return [i for i, c in enumerate(charts) if c.display]

        if size == (80, 24):     # one chart at a time: c shows the next, round
            steps = [[1], [2], [3], [0]]
            assert shown() == [0]
        else:                    # all four: c shows each alone, full width, then all four again
            steps = [[0], [1], [2], [3], [0, 1, 2, 3]]
            assert shown() == [0, 1, 2, 3]
        for step in steps:
            await pilot.press("c")
            await pilot.pause(0.1)
            assert shown() == step
            if len(step) == 1:
                assert charts[step[0]].size.width == size[0]


@pilot_test
async def test_runs_lists_headlines_and_compare_shows_both(charllm_dirs):
    a = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-a", seconds=15)
    b = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-b", seconds=15, power_limit_w=450.0, seed=3)
    app = CharllmApp()
    async with run_app(app) as pilot:
        await pilot.press("f6")
        screen = app.screen
        table = screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 2)
        await wait_for(pilot, lambda: all(table.get_cell(r.name, "peak W") != "…" for r in (a, b)),
                       what="headline numbers")      # each run's as it is summarized: b's first, then a's
        assert float(table.get_cell(b.name, "peak W")) <= 460     # capped at 450 W (+ sensor noise)
        assert float(table.get_cell(a.name, "peak W")) > float(table.get_cell(b.name, "peak W"))
        # one tokens/s per run: the Runs list shows the steady window, as summarize and compare do
        from charllm.probes.analysis.summary import summarize

        steady = summarize(b, "steady", by="run")["tokens_per_s"][0]
        assert table.get_cell(b.name, "tokens/s") == f"{steady:,.0f}"
        table.focus()
        await pilot.press("space", "down", "space", "m")
        await wait_for(pilot, lambda: app.current_mode == "compare")
        cmp = app.screen
        assert sorted(app.compare_refs) == sorted([str(a), str(b)])
        await wait_for(pilot, lambda: cmp.query_one("#compare-status").render() and
                       "comparing" not in str(cmp.query_one("#compare-status").render()), timeout=60)
        curves = cmp.query_one("#cmp-chart-1")._series
        assert sorted(curves) == ["demo-a", "demo-b"]
        assert cmp.result is not None and set(cmp.result.labels) == {a.name, b.name}
        power = cmp.result.table.filter(pl.col("metric") == "power_peak_w")
        other = next(label for label in cmp.result.labels if label != cmp.result.baseline)
        # b is capped at 450 W: its peak power is better (lower) than a's, a's worse than b's.
        assert power.filter(pl.col("ref") == other)["flag"][0] == ("better" if other == b.name else "worse")
        # Open a run from the list: Live follows it.
        await pilot.press("f6")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "live")
        assert app.run_path is not None


@pilot_test
async def test_runs_fills_kept_summaries_first_keeps_them_on_refresh_and_keeps_its_keys_line(charllm_dirs):
    from charllm.probes.analysis.summary import summarize
    from charllm.tui.screens.runs import Headline

    old = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-old", seconds=6)
    new = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-new", seconds=6, seed=3)
    summarize(old, "steady", by="run")          # kept in its directory, as after any earlier look
    messages: list = []
    app = CharllmApp(start_mode="runs")
    async with run_app(app, messages) as pilot:
        screen = app.screen
        table = screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 2 and "…" not in
                       (table.get_cell(old.name, "peak W"), table.get_cell(new.name, "peak W")), what="headlines")
        # The kept summary fills its row before the top row's is computed.
        assert [m.run_id for m in messages if isinstance(m, Headline)][0] == old.name
        # A refresh shows the numbers it has at once, then re-reads them.
        screen.action_refresh()
        assert "…" not in (table.get_cell(old.name, "peak W"), table.get_cell(new.name, "peak W"))
        # Highlighting a run shows its details; the keys line, b included, stays under them.
        table.focus()
        await pilot.press("down")
        await pilot.pause(0.1)
        assert old.name in str(screen.query_one("#runs-detail").render())
        keys = screen.query_one("#runs-keys")
        assert keys.display and "b save as baseline" in str(keys.render())


@pilot_test
async def test_runs_delete_asks_first(charllm_dirs):
    run = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-del", seconds=3)
    app = CharllmApp(start_mode="runs")
    async with run_app(app) as pilot:
        table = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 1)
        table.focus()
        await pilot.press("d")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
        await pilot.press("n")
        assert run.is_dir()
        await pilot.press("d")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
        await pilot.press("y")
        await wait_for(pilot, lambda: not run.exists())
        assert table.row_count == 0


@pilot_test
async def test_runs_save_as_baseline_then_bad_name_is_refused(charllm_dirs):
    from charllm.probes.analysis import baselines

    make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-base", seconds=6)
    app = CharllmApp(start_mode="runs")
    async with run_app(app) as pilot:
        table = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 1)
        table.focus()
        await pilot.press("b")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName")
        await pilot.press(*"h100-demo", "enter")
        await wait_for(pilot, lambda: baselines.exists("h100-demo"), timeout=60)
        assert baselines.show("h100-demo").summary.height == 1
        await pilot.press("b")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName")
        await pilot.press(*"no good", "enter")   # a name with a space: one error line, nothing saved
        await pilot.pause(0.1)
        assert app.screen.__class__.__name__ == "AskName"                # the dialog says why and stays
        assert "'no good'" in str(app.screen.query_one("#name-error").render())
        await pilot.press("escape")
        assert [b["name"] for b in baselines.list() if b["name"] == "no good"] == []


# -- Launch: a tiny local run, end to end ----------------------------------------------------------
@pytest.mark.train
@pytest.mark.integration
@pytest.mark.slow
@pilot_test
async def test_launch_tiny_local_then_live_runs_and_compare(charllm_dirs):
    from charllm.tui.screens.launch import LaunchDone, LaunchProgress

    messages: list = []
    app = CharllmApp()
    async with run_app(app, messages) as pilot:
        await pilot.press("f4")
        screen = app.screen
        await wait_for(pilot, lambda: "torch.distributed.run" in str(screen.query_one("#dry-run-text").render()),
                       what="the dry run")
        assert "<run-id>" in str(screen.query_one("#dry-run-text").render())
        await pilot.press("l")
        await wait_for(pilot, lambda: any(isinstance(m, LaunchDone) for m in messages), timeout=60)
        done = next(m for m in messages if isinstance(m, LaunchDone))
        assert done.error is None, done.error
        assert any(isinstance(m, LaunchProgress) for m in messages)
        await wait_for(pilot, lambda: app.current_mode == "live")
        live = app.screen
        await wait_for(pilot, lambda: live.last_frame is not None and live.last_frame.iterations
                       and live.last_frame.kind == "host" and live.last_frame.runtime, timeout=180,
                       what="iterations, host telemetry and what ran")
        assert "iteration" in str(live.query_one("#iterations").render())
        # What ran, as the workload recorded it: never a silent downgrade.
        ran = str(live.query_one("#live-runtime").render())
        assert ran.startswith("ran as local layers · attention sdpa · fusions none · optimizer kernels torch's"), ran
        assert " · on CPU · torch " in ran, ran
        run_dir = done.result.run_dir
        from charllm.probes.store.rundir import RunDir

        await wait_for(pilot, lambda: RunDir(run_dir).status in ("completed", "failed"), timeout=240)
        assert RunDir(run_dir).status == "completed"
        await pilot.press("f6")
        table = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 1)
        assert str(table.get_cell(run_dir.name, "status")) == "completed"
        assert RunDir(run_dir).read_manifest()["runtime"]["implementation"]["attention"] == "sdpa"


@pilot_test
async def test_runs_keys_line_follows_the_keymap(charllm_dirs):
    make_demo_run(charllm_dirs["runs"], "20251121-080000-demo", seconds=6)
    app = CharllmApp(settings={"theme": None, "keymap": {"runs.delete": "x", "runs.mark": "ctrl+k"}},
                     start_mode="runs")
    async with run_app(app) as pilot:
        await pilot.press("x")  # the remapped delete asks first
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm", what="the delete question")
        await pilot.press("escape")
        keys = str(app.screen.query_one("#runs-keys").render())
        assert "x delete" in keys and "^k mark" in keys and "d delete" not in keys, keys
        assert "b save as baseline" in keys


@pilot_test
async def test_launch_offers_the_good_targets_and_names_a_broken_one(charllm_dirs):
    config = charllm_dirs["config"]
    config.mkdir(parents=True)
    (config / "targets.toml").write_text('[lab]\nkind = "ssh"\nhosts = ["node1"]\n\n[old]\nkind = "ftp"\n')
    app = CharllmApp()
    async with run_app(app) as pilot:
        await pilot.press("f4")
        screen = app.screen
        await wait_for(pilot, lambda: "torch.distributed.run" in str(screen.query_one("#dry-run-text").render()),
                       what="the dry run on the built-in target")
        assert sorted(screen.targets) == ["lab", "local"] and screen.target.name == "local"
        summary = str(screen.query_one("#launch-summary").render())
        assert "not offered:" in summary and "[old].kind = 'ftp'" in summary, summary


# -- settings, palette -------------------------------------------------------------------------------
@pilot_test
async def test_keymap_and_theme_from_tui_toml(charllm_dirs):
    config = charllm_dirs["config"]
    config.mkdir(parents=True)
    (config / "tui.toml").write_text('theme = "gruvbox"\n[keymap]\n"screen.runs" = "f12"\n')
    app = CharllmApp(settings=load_settings())
    async with run_app(app) as pilot:
        assert app.theme == "gruvbox"
        await pilot.press("f12")
        await wait_for(pilot, lambda: app.current_mode == "runs")


def test_bad_tui_toml_is_one_clear_error(charllm_dirs):
    config = charllm_dirs["config"]
    config.mkdir(parents=True)
    (config / "tui.toml").write_text('colour = "red"\n')
    with pytest.raises(UserError, match="unknown key 'colour'"):
        load_settings()
    (config / "tui.toml").write_text('[keymap]\n"screen.runs" = 9\n')
    with pytest.raises(UserError, match="keymap"):
        load_settings()
    (config / "tui.toml").write_text('[keymap]\n"screen.lve" = "f9"\n')
    with pytest.raises(UserError, match="'screen.lve': no such binding id; did you mean 'screen.live'"):
        load_settings()


@pilot_test
async def test_palette_goes_to_a_screen_and_opens_a_run(charllm_dirs):
    run = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-pal", seconds=3)
    app = CharllmApp()
    async with run_app(app) as pilot:
        await pilot.press("ctrl+p")
        await pilot.press(*"go to sweep")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "sweep")
        await pilot.press("ctrl+p")
        await pilot.press(*"open run demo-pal")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "live")
        assert app.run_path == run


@pilot_test
async def test_help_lists_binding_ids():
    app = CharllmApp()
    async with run_app(app) as pilot:
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
        text = app.screen.query_one("Markdown").source
        for binding_id in ("screen.live", "compose.save", "live.pause", "runs.delete", "sweep.run"):
            assert binding_id in text
        await pilot.press("escape")
        assert app.current_mode == "compose"


@pilot_test
async def test_compare_a_run_against_a_saved_baseline(charllm_dirs):
    from charllm.probes.analysis import baselines

    a = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-a", seconds=12)
    b = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-b", seconds=12, power_limit_w=450.0, seed=3)
    baselines.save(str(b), "capped-450w", window="all")
    app = CharllmApp()
    app.compare_refs = [str(a)]
    async with run_app(app) as pilot:
        await pilot.press("f7")
        screen = app.screen
        select = screen.query_one("#baseline")
        await wait_for(pilot, lambda: "baseline:capped-450w" in [v for _, v in select._options])
        select.value = "baseline:capped-450w"
        await wait_for(pilot, lambda: screen.result is not None and screen.result.baseline == "baseline:capped-450w",
                       timeout=60)
        assert screen.query_one("#compare-table").row_count > 5


@pytest.mark.train
@pytest.mark.integration
@pytest.mark.slow
@pilot_test
async def test_runs_cancel_stops_a_running_run(charllm_dirs):
    from charllm.engine.launch import launcher, targets
    from charllm.probes.store.rundir import RunDir

    exp = Experiment.load("tiny-local")
    exp.training.train_iters = 100_000          # runs until cancelled
    result = launcher.launch(exp, targets.get_target("local"))
    rd = RunDir(result.run_dir)
    try:
        app = CharllmApp(start_mode="runs")
        async with run_app(app) as pilot:
            table = app.screen.query_one("#runs-table")
            await wait_for(pilot, lambda: table.row_count == 1)
            await wait_for(pilot, lambda: rd.status == "running", timeout=120, what="the run to start")
            table.focus()
            await pilot.press("c")                  # asks first, naming the run
            await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm", what="the question")
            assert rd.id in str(app.screen.query_one("Label").render())
            await pilot.press("y")
            await wait_for(pilot, lambda: rd.status == "cancelled", timeout=120, what="the cancel")
            await wait_for(pilot, lambda: str(table.get_cell(rd.id, "status")) == "cancelled", timeout=30)
    finally:
        if rd.status not in ("completed", "failed", "cancelled"):
            launcher.cancel(rd.path)


# -- utilization counters, heat strips, stragglers, kernels, GPU matrices ---------------------------
def _run_with_ranks_and_traces(root, run_id: str, *, gpm: bool, traces: bool):
    """Two GPUs on one node (gpu0 with GPM counters when `gpm`, gpu1 never), an iteration log with
    every rank's timers (rank 1 computes three times its peer), and the artifact fixture's traces."""
    import shutil

    import numpy as np

    from charllm.probes.store.synthetic import gpu_frame, make_run
    from infra_traces import ARTIFACT_TRACES, rank_log

    t = np.round(np.arange(0, 61) * 0.1, 10)
    gpm_columns = dict(sm_active_pct=70.0, tensor_active_pct=40.0, dram_bw_util_pct=30.0, nvlink_tx_bytes_s=2e9,
                       nvlink_rx_bytes_s=1e9) if gpm else {}
    frames = [gpu_frame(t, device="gpu0", power_w=300.0 + 10 * t, temp_gpu_c=50.0 + t, sm_clock_mhz=1800.0,
                        **gpm_columns),
              gpu_frame(t, device="gpu1", power_w=250.0, temp_gpu_c=45.0, sm_clock_mhz=1700.0)]
    run = make_run(root, frames, run_id=run_id, iterations=rank_log([0.1, 0.3], pp=1, nodes=("n0",)))
    if traces:
        shutil.copytree(ARTIFACT_TRACES, run.path / "traces")
    return run.path


@pilot_test
async def test_live_utilization_heat_strips_and_stragglers(charllm_dirs):
    """u: SM and tensor-core activity, DRAM and NVLink bandwidth (the GPU without GPM has none, never
    zeros); m: each GPU's temperature, power, clock and link bytes over time; the iterations pane
    names the slow rank."""
    from charllm.tui.screens.live import STRIPS, UTILIZATION_CHARTS

    app = CharllmApp(
        run=_run_with_ranks_and_traces(charllm_dirs["runs"], "20251121-080000-gpm", gpm=True, traces=False)
    )
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")
        assert "stragglers: rank 1 (node n0, stage 0): compute 1.50x" in str(screen.query_one("#iterations").render())
        await pilot.press("u")
        await wait_for(pilot, lambda: screen.last_frame.panes == list(UTILIZATION_CHARTS), what="the utilization panes")
        charts = screen.last_frame.charts
        assert {v for v in charts["sm_active_pct"]["gpu0"][1] if v is not None} == {70.0}
        assert all(v is None for v in charts["sm_active_pct"]["gpu1"][1])
        assert {round(v, 6) for v in charts["nvlink_gb_s"]["gpu0"][1] if v is not None} == {3.0}
        assert [c.title.split(" · ")[0] for c in screen.query("Chart")] == [t for _, t in UTILIZATION_CHARTS]
        for strip in STRIPS[1:]:
            await pilot.press("m")
            await wait_for(pilot, lambda: screen.last_frame.strip == strip, what=f"the {strip} strip")
        assert screen.strip == "link" and len(screen.last_frame.heat) == 2
        await pilot.press("m")
        await pilot.press("u")
        await wait_for(
            pilot, lambda: screen.last_frame.strip == "throttle" and screen.last_frame.panes[0][0] == "power_w"
        )

    app = CharllmApp(
        run=_run_with_ranks_and_traces(charllm_dirs["runs"], "20251121-090000-a100", gpm=False, traces=False)
    )
    async with run_app(app) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")
        await pilot.press("u")
        await wait_for(pilot, lambda: screen.last_frame.panes == list(UTILIZATION_CHARTS))
        await pilot.pause(0.2)
        notes = [c._note for c in screen.query("Chart")]
        assert notes[:3] == [" — not supported by these GPUs (NVML GPM: Hopper and newer)"] * 3
        await pilot.press("m")
        await wait_for(pilot, lambda: screen.last_frame.strip == "temperature")
        text = str(screen.query_one("#throttle").render())
        assert "GPU temperature (°C)  ▁ 45 … █ 56" in text and "gpu0" in text and "gpu1" in text


@pilot_test
async def test_compare_kernels_gpu_matrix_and_stragglers(charllm_dirs):
    a = _run_with_ranks_and_traces(charllm_dirs["runs"], "20251121-080000-traced", gpm=True, traces=True)
    b = _run_with_ranks_and_traces(charllm_dirs["runs"], "20251121-090000-plain", gpm=False, traces=False)
    app = CharllmApp()
    app.compare_refs = [str(a), str(b)]
    async with run_app(app) as pilot:
        await pilot.press("f7")
        screen = app.screen
        await wait_for(pilot, lambda: screen.result is not None, timeout=60)
        status = screen.query_one("#compare-status")
        assert "traced: stragglers: rank 1" in str(status.render()) and "plain: stragglers: rank 1" in str(
            status.render()
        )
        table = screen.query_one("#compare-table")
        await pilot.press("k")
        await wait_for(pilot, lambda: [c.label.plain for c in table.columns.values()] == ["mean per stage", "traced"])
        rows = {str(table.get_row_at(i)[0]): str(table.get_row_at(i)[1]) for i in range(table.row_count)}
        assert rows["matmul"].startswith("40.0% (400.0 µs)") and "SendRecv" in rows      # (200 + 600) / 2 stages
        assert "no profiler traces" in str(status.render())
        await pilot.press("g")
        await wait_for(pilot, lambda: [c.label.plain for c in table.columns.values()] == ["gpu", "traced", "plain"])
        assert [str(table.get_row_at(i)[0]) for i in range(table.row_count)] == [
            "n0/gpu0 (SIMULATED)",
            "n0/gpu1 (SIMULATED)",
        ]
        assert str(table.get_row_at(1)[2]) == "45.00 °C" and "GPU temperature per GPU" in str(status.render())
        for _ in range(4):                      # power, clock, throttle, link, then the metrics again
            await pilot.press("g")
        await wait_for(pilot, lambda: screen.view == "link" and table.row_count == 2)
        await pilot.press("g")
        await wait_for(pilot, lambda: screen.view == "metrics" and table.row_count > 5)
