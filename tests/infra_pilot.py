"""Driving the real workbench headless (Textual's Pilot) from tests: async tests on a fresh event
loop, waiting for the app's workers, and keys sent as a terminal delivers them."""

from __future__ import annotations

import asyncio
import functools
import time

from textual import events


def pilot_test(fn):
    """Run an async Pilot test on a fresh event loop (no pytest async plugin needed)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Let the app run until `condition()` holds (workers run in threads on a busy 2-core box)."""
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


async def compose_settled(pilot, timeout: float = 30.0):
    """The Compose screen once the estimate of its newest edit is shown."""
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.last is not None and screen.last.serial == screen.edit_serial,
                   timeout=timeout, what="the estimate of the newest edit")
    return screen


async def list_every_layout(pilot, sweep_screen) -> None:
    """Set the Sweep screen's micro batch and recompute dropdowns to "any" (a sweep sets them to its
    best layout's)."""
    from textual.widgets import Select

    for wid in ("mbs", "recompute"):
        sweep_screen.query_one(f"#{wid}", Select).value = Select.NULL
    await pilot.pause()
