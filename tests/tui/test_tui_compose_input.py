"""No keystroke ends the workbench (issue 36, item 7): whatever is typed into Compose, the app stays
up and says what is wrong in one line beside the field it was typed into.

Typing 0 in TP, PP, CP or micro batch used to close the app (ZeroDivisionError in
Experiment.data_parallel_size) and lose the edits. Every numeric field is tested here with zero, a
negative, an empty, a huge and a non-numeric value, typed key by key; then a property test sends
random edit sequences (any field, any value, Selects chosen with the keyboard) and asserts that
the app never exits and every edit gets its estimate. CI runs CHARLLM_TUI_EDIT_SEQUENCES sequences
(default 10, derandomized); a longer run: CHARLLM_TUI_EDIT_SEQUENCES=1000.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from charllm.engine.model.experiment import Experiment
from charllm.tui.app import DEFAULT_EXPERIMENT, CharllmApp
from charllm.tui.screens.compose import FIELDS, get_value
from infra_pilot import compose_settled, pilot_test, send_at_once

pytestmark = pytest.mark.timeout(900)

NUMERIC = [f for f in FIELDS.values() if f.kind in ("int", "int?")]
HUGE = "99999999999999999999"


async def type_into(pilot, wid: str, text: str, timeout: float = 30.0):
    """Focus the field, clear it and type `text` key by key (sent at once, as a fast typist or a paste
    does); the screen once the edit's estimate is shown."""
    pilot.app.screen.query_one(f"#{wid}").focus()
    await pilot.pause()
    send_at_once(pilot.app, "ctrl+a", "ctrl+k", *text)
    await pilot.pause()
    return await compose_settled(pilot, timeout)


def shown_errors(screen) -> dict[str, str]:
    return {err.id.removeprefix("err-"): str(err.render()) for err in screen.query(".field-error")
            if err.has_class("shown")}


def expected(field, text: str) -> str | None:
    """The start of the line the field must show for `text` (None: nothing is wrong)."""
    if text == "" and field.kind == "int?":
        return None                                   # blank is unset: Megatron's default
    if text in ("", "abc"):
        return f"{field.name} = {text!r}: expected an integer"
    if text == HUGE:
        return f"{field.name} = {HUGE}: must be at most"
    return f"{field.name} = {text}: must be at least 1"


@pytest.mark.parametrize("field", NUMERIC, ids=lambda f: f.key)
@pilot_test
async def test_every_numeric_field_takes_any_value_and_says_what_is_wrong_beside_it(field):
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_settled(pilot)
        before = screen.query_one(f"#{field.wid}").value
        for text in ("0", "-3", "", HUGE, "abc"):
            screen = await type_into(pilot, field.wid, text)
            assert app.is_running and app.return_code is None, f"{field.key} = {text!r} ended the app"
            errors = shown_errors(screen)
            want = expected(field, text)
            if want is None:
                assert field.wid not in errors, errors
                assert get_value(app.experiment, field) is None
            else:
                assert errors.get(field.wid, "").startswith(want), (text, errors)
                assert "\n" not in errors[field.wid], "one line"
                others = {wid: line for wid, line in errors.items() if wid != field.wid and want in line}
                assert not others, f"the message of {field.key} is beside another field: {others}"
        screen = await type_into(pilot, field.wid, before)        # back to what it was: all is well again
        assert shown_errors(screen) == {} and "FITS" in str(screen.query_one("#verdict").render())


@pilot_test
async def test_an_optional_field_left_blank_says_what_it_means():
    """The sequence length left blank is the model's (Compose said "seq length unset" beside
    --seq-length 32); expert TP left blank is TP."""
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await compose_settled(pilot)
        seq = screen.query_one("#f-training-seq_length")
        assert seq.value == "" and seq.placeholder == f"unset: {app.experiment.model.seq_length}"
        assert f"--seq-length {app.experiment.model.seq_length}" in str(screen.query_one("#flags").render())
        assert screen.query_one("#f-expert_tensor_parallel_size").placeholder == "unset: 1"
        screen = await type_into(pilot, "f-tensor_model_parallel_size", "2")
        assert screen.query_one("#f-expert_tensor_parallel_size").placeholder == "unset: 2"
        assert screen.query_one("#f-virtual_pipeline_model_parallel_size").placeholder == "unset"


@pilot_test
async def test_a_problem_stays_beside_the_field_it_concerns_when_another_is_edited():
    """TP 3 on 2 devices: the world-size rule is shown beside TP, and stays there while the micro batch
    is edited (it used to move under whichever field was edited last)."""
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await compose_settled(pilot)
        screen = await type_into(pilot, "f-tensor_model_parallel_size", "3")
        assert shown_errors(screen)["f-tensor_model_parallel_size"].startswith("world_size = 2:")
        screen = await type_into(pilot, "f-micro_batch_size", "1")
        errors = shown_errors(screen)
        assert errors["f-tensor_model_parallel_size"].startswith("world_size = 2:")
        assert "f-micro_batch_size" not in errors


@pilot_test
async def test_export_of_an_invalid_layout_says_why_and_writes_nothing(charllm_dirs):
    app = CharllmApp()
    async with app.run_test(size=(120, 40)) as pilot:
        await compose_settled(pilot)
        screen = await type_into(pilot, "f-tensor_model_parallel_size", "3")
        await pilot.press("ctrl+g")
        await pilot.pause()
        said = [n.message for n in app._notifications]
        assert said and said[-1].startswith("no flags exported: the layout is invalid: world_size = 2:"), said
        assert not (charllm_dirs["data"] / "exports").exists()
        assert "^g exports them once the layout is valid" in str(screen.query_one("#flags").render())


# -- random edit sequences ---------------------------------------------------------------------------
SEQUENCES = int(os.environ.get("CHARLLM_TUI_EDIT_SEQUENCES", "10"))
SETTLE_S = 300.0     # an edit's estimate, at most: a hang, not slowness (at load 25 on 2 cores a sequence took 40 s)
CONTROLS = ["preset", "model", "hardware", *FIELDS]
numbers = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["", "0", "-0", HUGE, "2147483648", "1e3",
                                                                    " 4 ", "+2", "٣", "0x10", "1_000", "9" * 5000]),
                    st.text(max_size=12))
edits = st.lists(st.tuples(st.sampled_from(CONTROLS), numbers, st.integers(0, 40)), min_size=1, max_size=8)


class AppInThread:
    """One workbench, run headless on an event loop in a thread of its own, so that hypothesis (which
    calls the test once per example) sends every sequence to the same app: one start-up, not a thousand.
    Each sequence runs in the task that runs the app (Textual keeps the running app in a context variable)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app = CharllmApp()
        self.jobs: asyncio.Queue = asyncio.Queue()
        self.running = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        self.call(asyncio.sleep(0))            # started

    async def _run(self) -> None:
        async with self.app.run_test(size=(120, 40)) as pilot:
            self.pilot = pilot
            while (job := await self.jobs.get()) is not None:
                coroutine, done = job
                try:
                    done.set_result(await coroutine)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    done.set_exception(exc)

    def call(self, coroutine, timeout: float = 120.0):
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self.jobs.put_nowait, (coroutine, done))
        return done.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.jobs.put_nowait, None)
        try:
            self.running.result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


async def apply_edit(pilot, control: str, text: str, steps: int) -> None:
    """One edit as a user makes it: a Select opened with Space, moved `steps` down and chosen with Enter; a
    checkbox toggled with Space; anything else typed (a character no key makes is pasted)."""
    screen = pilot.app.screen
    widget = screen.query_one(f"#{control}")
    widget.focus()
    if control in ("preset", "model", "hardware") or FIELDS[control].kind == "choice":
        await pilot.press("space", *["down"] * (steps % 8), "enter")
    elif FIELDS[control].kind == "bool":
        await pilot.press("space")
    elif text.isascii() and text.isprintable() and len(text) <= 20:
        await type_into(pilot, control, text, SETTLE_S)
    else:
        widget.value = text
    await pilot.pause()
    await compose_settled(pilot, SETTLE_S)


@pytest.fixture(scope="module")
def workbench():
    running = AppInThread()
    yield running
    running.close()


@pytest.mark.timeout(300 + 60 * SEQUENCES)
@settings(max_examples=SEQUENCES, deadline=None, derandomize=SEQUENCES <= 100, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sequence=edits)
def test_no_edit_sequence_ends_the_workbench(workbench, sequence):
    app, pilot = workbench.app, workbench.pilot

    async def run() -> None:
        app.use_experiment(Experiment.load(DEFAULT_EXPERIMENT))     # each sequence starts from tiny-local
        await compose_settled(pilot, SETTLE_S)
        for control, text, steps in sequence:
            await apply_edit(pilot, control, text, steps)
            assert app.is_running and app.return_code is None, f"{control} <- {text!r} ended the app"
            assert len(app.screen_stack) == 1, "an edit opened a dialog"

    workbench.call(run(), timeout=10 * SETTLE_S)     # each edit is waited for itself; this only ends a hang
