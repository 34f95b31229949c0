"""The Doctor screen (F8): a Pilot test against the real checks and a real CPU training job, and
snapshots of a fixed saved calibration (`tui.demo.save_demo_calibration`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from charllm.tui.app import CharllmApp
from charllm.tui.demo import save_demo_calibration
from charllm.tui.screens.doctor import DoctorDone, DoctorProgress
from infra_pilot import wait_for as pilot_wait_for

pytestmark = pytest.mark.timeout(300)

SIZES = {"small": (80, 24), "large": (160, 48)}


async def wait_for(pilot, condition, timeout: float = 120.0, what: str = "condition") -> None:
    await pilot_wait_for(pilot, condition, timeout, what)


def text(widget) -> str:
    """What a Static shows, as plain text (the report is a rich Group, not markup)."""
    import io

    from rich.console import Console

    console = Console(width=160, file=io.StringIO(), record=True)
    console.print(widget.content)
    return console.export_text()


@pytest.mark.train
@pytest.mark.integration
def test_check_then_train_and_calibrate_from_the_doctor_screen(charllm_dirs):
    async def scenario():
        messages: list = []
        app = CharllmApp()
        async with app.run_test(size=(120, 40), message_hook=messages.append) as pilot:
            await pilot.press("f8")
            screen = app.screen
            assert app.current_mode == "doctor"
            assert "No calibration saved yet" in text(screen.query_one("#doctor-status"))

            await pilot.press("r")
            await wait_for(pilot, lambda: any(isinstance(m, DoctorDone) for m in messages), what="the check")
            done = next(m for m in messages if isinstance(m, DoctorDone))
            assert done.error is None and done.saved is None
            assert done.report["hardware"] == "cpu" and [s["hz"] for s in done.report["sampling"]] == [20.0, 100.0]
            assert any(isinstance(m, DoctorProgress) and "sampling at 100 Hz" in m.text for m in messages)
            shown = text(screen.query_one("#doctor-report-text"))
            assert "no GPU" in shown and "sampling" in shown
            assert not (charllm_dirs["data"] / "calibrations").exists()   # r only reports

            # (the check's DoctorDone reaches the hook twice, at the screen and as it bubbles to the app,
            # and on a busy machine the second may come after this point: pick the train check's own)
            messages.clear()
            await pilot.press("t")

            def train_done():
                return next((m for m in messages
                             if isinstance(m, DoctorDone) and (m.report is None or "train" in m.report)), None)

            await wait_for(pilot, lambda: train_done() is not None, what="the train check")
            done = train_done()
            assert done.error is None and done.report["errors"] == [], done.error or done.report["errors"]
            assert any(isinstance(m, DoctorProgress) and "iteration" in m.text for m in messages)
            assert done.saved == str(charllm_dirs["data"] / "calibrations" / "cpu.json")
            assert "Calibration saved" in text(screen.query_one("#doctor-status"))
            assert "train check" in text(screen.query_one("#doctor-report-text"))
        record = json.loads((charllm_dirs["data"] / "calibrations" / "cpu.json").read_text())
        assert record["train"]["world_size"] == 2 and record["stack"]["cuda"] is False

    asyncio.run(scenario())


def test_the_palette_reaches_the_doctor_screen():
    async def scenario():
        app = CharllmApp()
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("ctrl+p")
            await pilot.pause(0.3)
            await pilot.press(*"Go to Doctor")
            await pilot.pause(0.5)
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.current_mode == "doctor", timeout=20, what="the Doctor screen")

    asyncio.run(scenario())


@pytest.mark.parametrize("size", SIZES)
def test_doctor_snapshot(snap_compare, size, charllm_dirs):
    save_demo_calibration()

    async def shown(pilot):
        await pilot.press("f8")
        report = pilot.app.screen.query_one("#doctor-report-text")
        await wait_for(pilot, lambda: "calibration for cpu" in text(report), timeout=30, what="the saved calibration")
        await pilot.pause(0.3)

    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=shown)
