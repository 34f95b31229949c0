"""The workbench as a careful user finds it (issue 28): keys sent faster than a person types are all
kept, controls read without colour, charts tell runs apart, keys and words say what they are.

Pilot drives the real app headless; `send_at_once` hands keys to the app the way a terminal does for
a paste or `tmux send-keys` (Pilot's own `press` waits for each key to be handled).
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from textual import events

from charllm.tui.app import CharllmApp

pytestmark = pytest.mark.timeout(300)


def pilot_test(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.05)


def send_at_once(app, *keys: str) -> None:
    """Queue every key before the app handles the first, as one terminal read delivers them."""
    for key in keys:
        char = " " if key == "space" else key if len(key) == 1 else None
        event = events.Key(key, char)
        event.set_sender(app)
        app._driver.send_message(event)


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
