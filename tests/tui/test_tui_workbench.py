"""The workbench as a careful user finds it (issue 28): keys sent faster than a person types are all
kept, controls read without colour, charts tell runs apart, keys and words say what they are.

Pilot drives the real app headless; `send_at_once` hands keys to the app the way a terminal does for
a paste or `tmux send-keys` (Pilot's own `press` waits for each key to be handled).
"""

from __future__ import annotations

import pytest

from charllm.tui.app import CharllmApp
from infra_pilot import pilot_test, send_at_once, wait_for

pytestmark = pytest.mark.timeout(300)


async def compose_ready(pilot):
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.last is not None, what="the first estimate")
    return screen


# -- 1. Compose keeps a fast-typed number ---------------------------------------------------------
@pilot_test
async def test_compose_keeps_a_number_typed_faster_than_a_person_types():
    """ctrl+a ctrl+k 1 6 Tab in one go: the field, the experiment and the flags all say 16."""
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_ready(pilot)
        field = screen.query_one("#f-global_batch_size")
        field.focus()
        await pilot.pause(0.1)
        send_at_once(app, "ctrl+a", "ctrl+k", "1", "6", "tab")
        await wait_for(pilot, lambda: screen.last.serial == screen.edit_serial
                       and "--global-batch-size 16" in str(screen.query_one("#flags").render()), what="16 planned")
        await pilot.pause(0.2)
        assert field.value == "16"
        assert app.experiment.training.global_batch_size == 16
        assert not screen.query_one("#err-f-global_batch_size").has_class("shown")
        assert app.focused is screen.query_one("#f-training-seq_length")


@pilot_test
async def test_compose_space_right_after_tab_ticks_the_checkbox_tab_lands_on():
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_ready(pilot)
        screen.query_one("#f-expert_tensor_parallel_size").focus()
        await pilot.pause(0.1)
        assert app.experiment.parallel.sequence_parallel is False
        send_at_once(app, "tab", "space")
        checkbox = screen.query_one("#f-sequence_parallel")
        await wait_for(pilot, lambda: checkbox.value, what="the checkbox ticked")
        await wait_for(pilot, lambda: app.experiment.parallel.sequence_parallel is True)
        assert screen.query_one("#f-expert_tensor_parallel_size").value == ""


# -- 7. checkboxes read without colour --------------------------------------------------------------
@pilot_test
async def test_checkboxes_show_their_state_in_the_glyph():
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_ready(pilot)
        checkbox = screen.query_one("#f-sequence_parallel")
        assert checkbox.value is False
        off = checkbox.render().plain
        checkbox.focus()
        await pilot.press("space")
        assert checkbox.value is True
        on = checkbox.render().plain
        assert on != off and "✓" in on and "✓" not in off


# -- 2, 3, 10. Compare: runs told apart, columns whole, metrics in words -----------------------------
def two_tiny_local_runs(root):
    from charllm.probes.store.synthetic import cpu_run

    return [cpu_run(root, "20261121-100000-tiny-local", 1.0).path,
            cpu_run(root, "20261121-110000-tiny-local", 1.2, busy_pct=60.0).path]


@pilot_test
async def test_compare_tells_two_runs_of_one_experiment_apart(charllm_dirs):
    runs = two_tiny_local_runs(charllm_dirs["runs"])
    app = CharllmApp()
    app.compare_refs = [str(r) for r in runs]
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("f7")
        screen = app.screen
        await wait_for(pilot, lambda: screen.result is not None, timeout=60, what="the comparison")
        await pilot.pause(0.2)
        series = screen.query_one("#cmp-chart-1")._series
        assert sorted(series) == ["100000-tiny-local", "110000-tiny-local"]
        headings = [c.label.plain for c in screen.query_one("#compare-table").columns.values()]
        assert "100000-tiny-local" in headings and "110000-tiny-local" in headings


@pilot_test
async def test_compare_columns_fit_their_cells_as_soon_as_they_are_filled(charllm_dirs):
    """The metric column is as wide as its longest metric the moment the rows are in, not only
    after the table next measures itself (the first comparison showed "iter_t", "tokens")."""
    from charllm.probes.analysis.compare import compare
    from charllm.tui.screens.compare import Compared

    runs = two_tiny_local_runs(charllm_dirs["runs"])
    result = compare([str(r) for r in runs])
    app = CharllmApp(start_mode="compare")
    async with app.run_test(size=(160, 48)) as pilot:
        screen = app.screen
        await pilot.pause(0.1)
        screen.on_compared(Compared(result, {}))
        table = screen.query_one("#compare-table")
        metrics = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        width = table.columns[next(iter(table.columns))].get_render_width(table)
        assert width >= max(map(len, metrics)) + 2, (width, metrics)
        assert "tokens per second" in metrics and "iteration time, mean" in metrics
        assert not [m for m in metrics if "_" in m]                        # no snake_case names


def test_metric_labels_read_as_words():
    from charllm.probes.analysis.render import metric_label

    assert metric_label("temp_gpu_peak_c") == "GPU temperature, peak"
    assert metric_label("util_gpu_mean_pct") == "GPU utilization, mean"
    assert metric_label("iter_time_p50_s") == "iteration time, median"
    assert metric_label("time_over_limit_s") == "time over limit"
    assert metric_label("throttle_sw_power_cap_frac") == "throttled: SW power cap"
    assert metric_label("energy_per_token_j") == "energy per token"


# -- 4. Launch forgets a refusal once the experiment changes ------------------------------------------
@pilot_test
async def test_launch_drops_a_refusal_when_another_experiment_comes(charllm_dirs):
    from charllm.engine.model.experiment import Experiment
    from charllm.tui.screens.launch import LaunchDone

    messages: list = []
    app = CharllmApp(Experiment.load("ppt-h100-llama3-70b-1-01000"))      # 64 GPUs: local refuses it
    async with app.run_test(size=(120, 40), message_hook=messages.append) as pilot:
        await pilot.press("f4")
        screen = app.screen
        await wait_for(pilot, lambda: "local target is one node" in str(screen.query_one("#dry-run-text").render()),
                       what="the dry run's answer")
        await pilot.press("l")
        await wait_for(pilot, lambda: any(isinstance(m, LaunchDone) for m in messages), timeout=60)
        log = screen.query_one("#launch-log")
        assert log.display and any("refused" in line for line in log.lines)
        await pilot.press("d")                       # the same experiment again: the refusal stays
        await pilot.pause(0.2)
        assert log.display and any("refused" in line for line in log.lines)
        app.use_experiment(Experiment.load("tiny-local"))
        await pilot.press("f4")
        await wait_for(pilot, lambda: "Commands" in str(screen.query_one("#dry-run-text").render()), what="dry run")
        assert not log.display and not any("refused" in line for line in log.lines)


# -- 5, 10. Keys say what they are ---------------------------------------------------------------------
@pilot_test
async def test_the_tab_bar_shows_a_remapped_screen_key():
    app = CharllmApp(settings={"theme": None, "keymap": {"screen.live": "f12"}})
    async with app.run_test(size=(120, 40)) as pilot:
        tabs = [str(tab.label) for tab in app.screen.query("ScreenTabs Tab")]
        assert "Live F12" in tabs and "Live F5" not in tabs and "Runs F6" in tabs
        await pilot.press("f12")
        await wait_for(pilot, lambda: app.current_mode == "live")
        assert "Live F12" in [str(tab.label) for tab in app.screen.query("ScreenTabs Tab")]


@pilot_test
async def test_help_writes_keys_as_the_footer_does():
    app = CharllmApp(settings={"theme": None, "keymap": {"live.pause": "p"}})
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen")
        text = app.screen.query_one("Markdown").source
        assert "question_mark" not in text and "equals_sign" not in text and "plus," not in text
        assert "| `?` | Help |" in text and "| `+`, `=` | Zoom in |" in text
        assert "| `p` | Pause | `live.pause` |" in text                    # the key tui.toml gives


@pilot_test
async def test_runs_footer_and_keys_line_name_the_same_delete_key(charllm_dirs):
    from charllm.tui.demo import make_demo_run

    make_demo_run(charllm_dirs["runs"], "20251121-080000-demo", seconds=3)
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.screen.query_one("#runs-table").row_count == 1)
        await pilot.pause(0.2)
        footer = {str(k.description): k.key_display for k in app.screen.query("FooterKey")}
        assert footer["Delete"] == "d"
        assert "d delete" in str(app.screen.query_one("#runs-keys").render())


@pilot_test
async def test_the_delete_question_is_shown_whole(charllm_dirs):
    from charllm.tui.demo import make_demo_run

    run = make_demo_run(charllm_dirs["runs"], "20251121-080000-a-long-experiment-name", seconds=3)
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.screen.query_one("#runs-table").row_count == 1)
        app.screen.query_one("#runs-table").focus()
        await pilot.press("d")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "Confirm")
        await pilot.pause(0.1)
        label = app.screen.query_one(".dialog Label")
        question = f"Delete run {run.name} and all its files?"
        assert str(label.render()) == question
        assert label.size.height * label.size.width >= len(question)        # wrapped, not cut
        assert label.region.right <= app.screen.query_one(".dialog").content_region.right


# -- 6. Save dialogs offer a name that can be saved, and say why one cannot ----------------------------
@pilot_test
async def test_baseline_dialog_suggests_a_name_and_says_when_it_is_empty(charllm_dirs):
    from charllm.probes.analysis import baselines
    from charllm.tui.demo import make_demo_run

    make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-base", seconds=6)
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.screen.query_one("#runs-table")
        await wait_for(pilot, lambda: table.row_count == 1)
        table.focus()
        await pilot.press("b")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName")
        dialog = app.screen
        assert dialog.query_one("#name").value == "demo-base"               # the run's experiment
        dialog.query_one("#name").value = ""
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.screen is dialog and "a name is needed" in str(dialog.query_one("#name-error").render())
        dialog.query_one("#name").value = "demo-base"
        await pilot.press("enter")
        await wait_for(pilot, lambda: baselines.exists("demo-base"), timeout=60)
        await pilot.press("b")                                             # taken now: the next free name
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName")
        assert app.screen.query_one("#name").value == "demo-base-2"


@pilot_test
async def test_save_preset_offers_a_free_name_and_keeps_the_dialog_on_a_refusal(charllm_dirs):
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_ready(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "AskName")
        dialog = app.screen
        assert dialog.query_one("#name").value == "tiny-local-2"           # tiny-local ships: not offered
        dialog.query_one("#name").value = "tiny-local"
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert app.screen is dialog
        assert "a shipped preset has that name" in str(dialog.query_one("#name-error").render())
        dialog.query_one("#name").value = "tiny-local-2"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen)
    assert (charllm_dirs["config"] / "experiments" / "tiny-local-2.toml").is_file()


# -- 9. A new model makes a new experiment --------------------------------------------------------------
@pilot_test
async def test_a_new_model_drops_what_belonged_to_the_old_one():
    """tiny-local trains its tiny model in FP32 on the CPU: Llama-3 70B gets the default precision,
    and a name of its own, not 'tiny-local-edited'."""
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_ready(pilot)
        assert screen.query_one("#f-precision").value == "fp32"
        screen.query_one("#model").value = "llama3-70b"
        await wait_for(pilot, lambda: app.experiment.model.name == "llama3-70b")
        await wait_for(pilot, lambda: screen.last.serial == screen.edit_serial)
        assert app.experiment.name == "llama3-70b-cpu"
        assert app.experiment.training.bf16 is True and screen.query_one("#f-precision").value == "bf16"
        assert "llama3-70b-cpu" in str(screen.query_one("#summary").render())
        assert app.experiment.cluster.gpus_per_node == 2                  # the cluster stays the user's


# -- 8. Live ----------------------------------------------------------------------------------------------
BRAILLE = range(0x2801, 0x2900)


@pilot_test
async def test_a_chart_keeps_its_legend_rows_clear_of_the_data():
    """A CPU at 100% ran under the legend: the plot's top rows are left to it."""
    from textual.app import App

    from charllm.tui.widgets.charts import Chart

    class One(App):
        def compose(self):
            yield Chart("host CPU utilization (%)", xlabel="time (s)")

    app = One()
    async with app.run_test(size=(60, 14)) as pilot:
        chart = app.query_one(Chart)
        xs = [i * 0.5 for i in range(40)]
        chart.show({"node0": (xs, [100.0 - i for i in range(40)]), "node1": (xs, [90.0 - i for i in range(40)])})
        await pilot.pause(0.3)
        lines = chart.render().plain.splitlines()
        for label in ("node0", "node1"):
            row = next(line for line in lines if label in line).replace("⢕⢕", "")
            assert not [c for c in row if ord(c) in BRAILLE], row                 # no data on a legend row
        assert sum(ord(c) in BRAILLE for c in "".join(lines)) > 20                  # the data is drawn


async def live_drawn(pilot, kind: str, timeout: float = 30.0):
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == kind,
                   timeout=timeout, what=f"a {kind} frame")
    return screen


@pilot_test
async def test_live_zooms_while_paused_on_the_data_it_paused_on():
    app = CharllmApp(start_mode="live")                                    # this machine's host telemetry
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await live_drawn(pilot, "host")
        await wait_for(pilot, lambda: max(max(xs) for xs, _ in screen.last_frame.charts["cpu_util_pct"].values()) > 1,
                       what="two seconds of samples")
        await pilot.press("space")
        paused_at = max(max(xs) for xs, _ in screen.last_frame.charts["cpu_util_pct"].values())
        drawn = screen.frames
        await pilot.press("plus")                                          # 60 s -> 30 s
        await wait_for(pilot, lambda: screen.frames > drawn, what="the zoomed charts")
        assert screen.paused and "last 30 s" in str(screen.query_one("#live-title").render())
        shown = max(max(xs) for xs, _ in screen.last_frame.charts["cpu_util_pct"].values())
        assert shown <= paused_at + 1e-9                                   # still the paused data
        await pilot.pause(2.5)
        assert max(max(xs) for xs, _ in screen.last_frame.charts["cpu_util_pct"].values()) == shown


@pilot_test
async def test_live_h_while_paused_shows_the_host_charts_live(charllm_dirs):
    from charllm.tui.demo import make_demo_run

    run = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo", seconds=6)
    app = CharllmApp(run=run)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await live_drawn(pilot, "gpu")
        await pilot.press("space")
        await pilot.press("h")
        await live_drawn(pilot, "host")
        assert not screen.paused and "PAUSED" not in str(screen.query_one("#live-title").render())
        # CPU utilization is a rate: it is reported from the second sample on, and then leads the panes
        await wait_for(pilot, lambda: [c.title.split(" · ")[0] for c in screen.query("Chart")][0]
                       == "host CPU utilization (%)", what="the host CPU chart first")


@pilot_test
async def test_live_a_cpu_run_charts_the_host_before_its_telemetry_comes(charllm_dirs):
    from charllm.engine.model.experiment import Experiment
    from charllm.probes.store.synthetic import make_run
    from charllm.tui.screens.live import GPU_CHARTS, HOST_CHARTS

    run = make_run(charllm_dirs["runs"], [], run_id="20251121-080000-tiny-local",
                   experiment=Experiment.load("tiny-local").to_toml())
    app = CharllmApp(run=run.path)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last_frame is not None, what="the first frame")
        assert screen.last_frame.kind == "none"
        titles = [c.title for c in screen.query("Chart")]
        assert titles == [title for _, title in HOST_CHARTS[:4]]
        assert not set(titles) & {title for _, title in GPU_CHARTS}
        assert all(c.xlabel == "time (s)" for c in screen.query("Chart"))


def test_live_names_the_window_of_each_speed():
    """The last 10 steps and the whole steady window, each named: the steady figure is the one
    Runs, Compare and summarize give."""
    from charllm.tui.screens.live import iterations_text

    events = []
    for i in range(1, 21):
        secs = 0.2 if i <= 5 else 0.1                # warm-up steps are slow
        events.append({"event": "iteration", "iteration": i, "warmup": i <= 5, "tokens": 1000,
                       "start_ns": int(i * 1e9), "end_ns": int(i * 1e9 + secs * 1e9), "loss": 2.0})
    events[-1]["end_ns"] += int(0.9e9)               # the last step took 1 s
    lines = iterations_text(events).splitlines()
    assert lines[1] == "last 10 steps: 190.0 ms/it · 5,263 tokens/s"
    assert lines[2] == "steady window: 160.0 ms/it · 6,250 tokens/s"


# -- 14. GPU processes in Live ------------------------------------------------------------------------------
@pilot_test
async def test_live_lists_this_machines_gpu_processes(monkeypatch):
    from fakes_nvml import FakeGpu, FakeNvml, FakeProcess

    FakeNvml([FakeGpu(0, processes=[FakeProcess(4242, "pretrain_gpt.py", 60 * 2**30, 97)]),
              FakeGpu(1, processes=[FakeProcess(4243, "pretrain_gpt.py", 58 * 2**30, 95)])]).install(monkeypatch)
    app = CharllmApp(start_mode="live")
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await live_drawn(pilot, "host")
        panel = screen.query_one("#gpu-processes")
        await wait_for(pilot, lambda: "4243" in str(panel.render()), what="the process list")
        text = str(panel.render())
        assert panel.display and "GPU processes on" in text and "(nvml)" in text
        assert "gpu0" in text and "4242" in text and "60.00 GiB" in text and "97%" in text and "pretrain_gpt.py" in text
        assert text.index("4242") < text.index("4243")


@pilot_test
async def test_live_gpu_processes_say_why_there_are_none():
    app = CharllmApp(start_mode="live")                # no GPU library answers in the test machine
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await live_drawn(pilot, "host")
        panel = screen.query_one("#gpu-processes")
        await pilot.pause(0.5)
        assert not panel.display and not screen.query_one("#live-bottom").display    # the charts keep the room
        await pilot.press("p")
        assert panel.display and "no GPU library answers" in str(panel.render()) and "nvml" in str(panel.render())


@pilot_test
async def test_live_p_shows_the_processes_in_place_of_a_local_runs_log(charllm_dirs, monkeypatch):
    from charllm.probes.store.rundir import RunDir
    from charllm.tui.demo import make_demo_run
    from fakes_nvml import FakeGpu, FakeNvml, FakeProcess

    FakeNvml([FakeGpu(0, processes=[FakeProcess(4242)])]).install(monkeypatch)
    recorded = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo", seconds=6)
    app = CharllmApp(run=recorded)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await live_drawn(pilot, "gpu")
        await pilot.press("p")                         # a recorded run: not this machine's GPUs now
        assert not screen.query_one("#gpu-processes").display and screen.query_one("#log-tail").display
        rd = RunDir(recorded)                          # the same run, going on here
        rd.write_manifest({**rd.read_manifest(), "status": "running", "target": {"name": "local", "kind": "local"}})
        screen.follow(recorded)
        await live_drawn(pilot, "gpu")
        await wait_for(pilot, lambda: screen.processes, what="the process list")
        assert screen.query_one("#log-tail").display
        await pilot.press("p")
        assert screen.query_one("#gpu-processes").display and not screen.query_one("#log-tail").display
        assert "4242" in str(screen.query_one("#gpu-processes").render())
        await pilot.press("p")
        assert screen.query_one("#log-tail").display


# -- 14. Runs: search, filter, sort ---------------------------------------------------------------------
@pilot_test
async def test_runs_search_filter_and_sort(charllm_dirs):
    from charllm.probes.store.rundir import RunDir
    from charllm.tui.demo import make_demo_run

    fast = make_demo_run(charllm_dirs["runs"], "20251121-080000-llama-fast", seconds=6)
    capped = make_demo_run(charllm_dirs["runs"], "20251121-090000-llama-capped", seconds=6, power_limit_w=450.0, seed=3)
    tiny = make_demo_run(charllm_dirs["runs"], "20251121-100000-tiny", seconds=6, seed=5)
    rd = RunDir(tiny)
    rd.write_manifest({**rd.read_manifest(), "status": "failed"})
    app = CharllmApp(start_mode="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = app.screen
        table = screen.query_one("#runs-table")

        def rows():
            return [row.key.value for row in table.ordered_rows]

        await wait_for(pilot, lambda: table.row_count == 3 and all(
            table.get_cell(r.name, "peak W") != "…" for r in (fast, capped, tiny)), timeout=60, what="headlines")
        assert rows() == [tiny.name, capped.name, fast.name]                     # newest first
        view = screen.query_one("#runs-view")
        assert not view.display
        # / searches id, experiment, target and status as one types
        table.focus()
        await pilot.press("slash", *"llama")
        assert sorted(rows()) == sorted([fast.name, capped.name])
        assert "2 of 3 runs · search 'llama'" in str(view.render())
        await pilot.press("escape")                                              # clears it
        assert len(rows()) == 3 and table.has_focus
        # f: one status at a time
        await pilot.press("f", "f")                                              # running, then completed
        assert sorted(rows()) == sorted([fast.name, capped.name]) and "status completed" in str(view.render())
        await pilot.press("f")                                                   # failed
        assert rows() == [tiny.name]
        await pilot.press("f", "f")                                              # cancelled, then all
        assert len(rows()) == 3
        # s: by tokens/s, then J/token (least first), ...; a click on a heading sorts by it
        await pilot.press("s")
        assert "sorted by tokens/s, fastest first" in str(view.render())
        speeds = [float(table.get_cell(r, "tokens/s").replace(",", "")) for r in rows()]
        assert speeds == sorted(speeds, reverse=True)
        await pilot.press("s", "s")
        peaks = [float(table.get_cell(r, "peak W")) for r in rows()]
        assert peaks == sorted(peaks, reverse=True) and rows()[-1] == capped.name     # capped at 450 W
        await pilot.click("#runs-table", offset=(3, 0))                          # the "run" heading
        await pilot.pause(0.1)
        assert rows() == sorted(rows()) and "sorted by run, a-z" in str(view.render())


# -- 13. A paper preset that does not fit says how the paper ran it -------------------------------------
@pilot_test
async def test_compose_says_how_the_paper_ran_a_preset_that_does_not_fit():
    from charllm.engine.model.experiment import Experiment

    app = CharllmApp(Experiment.load("ppt-h100-gpt3-175b-1-00000"))
    async with app.run_test(size=(160, 48)) as pilot:
        screen = app.screen
        await wait_for(pilot, lambda: screen.last is not None and screen.last.report is not None, timeout=60)
        verdict = " ".join(str(screen.query_one("#verdict").render()).split())
        assert "DOES NOT FIT" in verdict
        assert "the paper ran all four variants of this layout" in verdict and "ppt-h100-gpt3-175b-1-01000" in verdict
