"""The keyboard reaches everything (issue 36, item 8): every dropdown on every screen opens, moves and
chooses with keys; the command palette finds model, hardware and experiment presets; Sweep opens on
its table, where Space marks a layout.

Compose's dropdowns used to open with Space and then ignore Down and Enter (only Escape worked): the
form's in-order key handler took the keys bubbling up from the open list as the Select's own.
"""

from __future__ import annotations

import pytest
from textual.widgets import Select

from charllm.engine.model import catalog
from charllm.tui.app import CharllmApp
from charllm.tui.demo import make_demo_run
from infra_pilot import compose_settled, pilot_test, wait_for

pytestmark = pytest.mark.timeout(300)


async def choose_by_keys(pilot, select: Select, opener: str = "space", steps: int = 1):
    """Focus `select`, open it with `opener`, move `steps` down and choose with Enter, asserting that each
    key did its part; the value chosen."""
    values = [value for _, value in select._options]
    start = values.index(select.value)
    select.focus()
    await pilot.pause()
    await pilot.press(opener)
    assert select.expanded, f"{opener} did not open #{select.id}"
    await pilot.press(*["down"] * steps)
    await pilot.press("enter")
    assert not select.expanded, f"Enter did not close #{select.id}"
    assert select.has_focus
    want = values[(start + steps) % len(values)]          # the list wraps round
    assert select.value == want, f"#{select.id}: {select.value!r}, not {want!r} ({steps} down from {values[start]!r})"
    return want


@pilot_test
async def test_every_compose_dropdown_is_worked_by_keys():
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_settled(pilot)
        for wid in ("recompute_granularity", "recompute_method", "precision"):
            select = screen.query_one(f"#f-{wid}", Select)
            chosen = await choose_by_keys(pilot, select, opener="enter")
            screen = await compose_settled(pilot)
            assert str(chosen) in str(screen.query_one(f"#f-{wid}", Select).value)
        assert app.experiment.training.recompute_granularity is not None     # the choices reached the experiment
        hardware = await choose_by_keys(pilot, screen.query_one("#hardware", Select), steps=2)
        await compose_settled(pilot)
        assert app.experiment.hardware.name == hardware
        model = await choose_by_keys(pilot, screen.query_one("#model", Select))
        await compose_settled(pilot)
        assert app.experiment.model.name == model
        preset = screen.query_one("#preset", Select)
        await choose_by_keys(pilot, preset, steps=3)         # past the blank prompt: the third preset
        await compose_settled(pilot)
        assert app.experiment.name == list(catalog.entries("experiments"))[2]


@pilot_test
async def test_sweep_opens_on_its_table_and_its_dropdowns_are_worked_by_keys():
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        await wait_for(pilot, lambda: screen.frame is not None, timeout=120, what="the sweep")
        table = screen.query_one("#sweep-table")
        assert app.focused is table                      # Space marks a row, not opens a dropdown
        await pilot.press("down", "space")
        assert len(screen.marked) == 1
        for wid, column in (("mbs", "micro_batch_size"), ("recompute", "recompute")):
            select = screen.query_one(f"#{wid}", Select)
            chosen = await choose_by_keys(pilot, select, steps=1)
            listed = set(screen.shown[column].to_list())
            assert listed == set(screen.frame[column].to_list()) if chosen is Select.NULL else listed == {chosen}


@pilot_test
async def test_launch_target_is_chosen_by_keys(charllm_dirs):
    config = charllm_dirs["config"]
    config.mkdir(parents=True)
    (config / "targets.toml").write_text('[lab]\nkind = "ssh"\nhosts = ["node1"]\n')
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f4")
        screen = app.screen
        select = screen.query_one("#target", Select)
        await wait_for(pilot, lambda: len(select._options) == 2, what="the targets")
        assert await choose_by_keys(pilot, select, opener="down") == "lab"
        assert screen.target.name == "lab"


@pilot_test
async def test_compare_baseline_is_chosen_by_keys(charllm_dirs):
    a = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-a", seconds=6)
    b = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-b", seconds=6, seed=3)
    app = CharllmApp()
    app.compare_refs = [str(a), str(b)]
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f7")
        screen = app.screen
        await wait_for(pilot, lambda: screen.result is not None, what="the comparison")
        await pilot.press("b")                            # b puts the focus on the baseline picker
        select = screen.query_one("#baseline", Select)
        assert select.has_focus and select.value == str(a)
        await choose_by_keys(pilot, select)
        await wait_for(pilot, lambda: screen.result is not None and screen.result.baseline_ref == str(b),
                       what="the comparison against the second run")


@pytest.mark.parametrize("query, found, check", [
    ("hardware h100-sxm", "Use hardware h100-sxm-80gb", lambda exp: exp.hardware.name == "h100-sxm-80gb"),
    ("model llama3-8b", "Use model llama3-8b", lambda exp: exp.model.name == "llama3-8b"),
    ("experiment tiny-local", "Load experiment tiny-local", lambda exp: exp.name == "tiny-local"),
])
@pilot_test
async def test_the_palette_finds_model_hardware_and_experiment_presets(query, found, check):
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await compose_settled(pilot)
        await pilot.press("tab")                          # an edit first: the experiment preset must replace it
        app.experiment.name = "something-else"
        await pilot.press("ctrl+p")
        await pilot.press(*query)
        palette = app.screen
        await wait_for(pilot, lambda: _palette_shows(palette, found), what=f"{found!r} first in the palette")
        await pilot.press("enter")
        await wait_for(pilot, lambda: check(app.experiment), what=f"{found!r} done")
        assert app.current_mode == "compose"


@pilot_test
async def test_a_preset_chosen_in_the_palette_over_help_reaches_compose_when_help_closes():
    """The palette opened over Help (F1) on Compose: Compose is the mode's screen but not the one shown.
    Was: AttributeError ('HelpScreen' object has no attribute 'sync_from_app'), the workbench gone."""
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        compose = await compose_settled(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "HelpScreen", what="the help screen")
        await pilot.press("ctrl+p")
        await pilot.press(*"model llama3-8b")
        palette = app.screen
        await wait_for(pilot, lambda: _palette_shows(palette, "Use model llama3-8b"), what="the model first")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.experiment.model.name == "llama3-8b", what="the model composed")
        assert app.is_running and type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is compose
                       and compose.query_one("#model", Select).value == "llama3-8b", what="Compose showing the model")


def _palette_shows(palette, text: str) -> bool:
    from textual.command import CommandList

    options = palette.query_one(CommandList)
    return options.option_count > 0 and text in str(options.get_option_at_index(0).prompt)
