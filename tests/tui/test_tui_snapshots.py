"""Snapshot tests (pytest-textual-snapshot): every screen at 80×24 and at 160×48.

The data is deterministic: recorded runs from `charllm.tui.demo` (the simulated backend with a
fixed seed and a fixed clock), the shipped tiny-local preset, and a dry run whose only
machine-dependent parts (host name, free port) are pinned. Update with `--snapshot-update`
after checking the new SVGs by eye.
"""

from __future__ import annotations

import socket
import time

import pytest

from charllm.tui.app import CharllmApp
from charllm.tui.demo import make_demo_campaign, make_demo_run

pytestmark = pytest.mark.timeout(300)

SIZES = {"small": (80, 24), "large": (160, 48)}


@pytest.fixture
def demo_runs(charllm_dirs):
    a = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-8gpu", seconds=30)
    b = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-capped", seconds=30, power_limit_w=450.0, seed=3)
    return a, b


@pytest.fixture
def pinned_host(monkeypatch):
    """The dry run names this host; pin it so the snapshot is the same everywhere."""
    monkeypatch.setattr(socket, "gethostname", lambda: "node0")


async def until(pilot, condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the screen never got its data"
        await pilot.pause(0.1)
    await pilot.pause(0.3)          # let the last update paint


@pytest.fixture
def pinned_megatron(monkeypatch):
    """Compose shows the Megatron-LM flags for the installed megatron-core (the newest supported one
    where none is installed, as with only [test]): pin the release the snapshots were taken with."""
    from charllm.engine.model import megatron

    monkeypatch.setattr(megatron, "installed_version", lambda: "0.16.1")


def settled_compose(pilot):
    screen = pilot.app.screen
    return until(pilot, lambda: screen.last is not None and screen.last.serial == screen.edit_serial)


@pytest.mark.parametrize("size", SIZES)
def test_compose(snap_compare, size, pinned_megatron):
    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=settled_compose)


@pytest.mark.parametrize("size", SIZES)
def test_compose_invalid_layout(snap_compare, size, pinned_megatron):
    async def edit(pilot):
        await settled_compose(pilot)
        pilot.app.screen.query_one("#f-tensor_model_parallel_size").value = "3"
        await until(pilot, lambda: pilot.app.screen.last.serial == pilot.app.screen.edit_serial
                    and pilot.app.screen.last.problems)

    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=edit)


@pytest.mark.parametrize("size", SIZES)
def test_sweep(snap_compare, size):
    async def swept(pilot):
        await pilot.press("f3")
        await until(pilot, lambda: getattr(pilot.app.screen, "frame", None) is not None, timeout=120)

    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=swept)


@pytest.mark.parametrize("size", SIZES)
def test_launch_dry_run(snap_compare, size, pinned_host):
    async def planned(pilot):
        await pilot.press("f4")
        text = pilot.app.screen.query_one("#dry-run-text")
        await until(pilot, lambda: "Commands" in str(text.render()))

    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=planned)


@pytest.mark.parametrize("size", SIZES)
def test_live_replay(snap_compare, size, demo_runs):
    async def drawn(pilot):
        screen = pilot.app.screen
        await until(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")

    assert snap_compare(CharllmApp(run=demo_runs[0]), terminal_size=SIZES[size], run_before=drawn)


@pytest.mark.parametrize("size", SIZES)
def test_runs(snap_compare, size, demo_runs):
    async def listed(pilot):
        await pilot.press("f6")
        table = pilot.app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 2 and all(
            table.get_cell(r.name, "peak W") != "…" for r in demo_runs))

    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=listed)


@pytest.mark.parametrize("size", SIZES)
def test_compare(snap_compare, size, demo_runs):
    app = CharllmApp()
    app.compare_refs = [str(r) for r in demo_runs]

    async def compared(pilot):
        await pilot.press("f7")
        status = pilot.app.screen.query_one("#compare-status")
        await until(pilot, lambda: "comparing" not in str(status.render()) and str(status.render()))

    assert snap_compare(app, terminal_size=SIZES[size], run_before=compared)


@pytest.mark.parametrize("size", SIZES)
def test_compare_cpu_runs(snap_compare, size, charllm_dirs):
    """Host-only runs: iteration time and CPU use are charted, not empty GPU boxes."""
    from charllm.probes.store.synthetic import cpu_run

    app = CharllmApp()
    app.compare_refs = [str(cpu_run(charllm_dirs["runs"], "20261121-100000-cpu-a", 1.0).path),
                        str(cpu_run(charllm_dirs["runs"], "20261121-110000-cpu-b", 1.2, busy_pct=60.0).path)]

    async def compared(pilot):
        await pilot.press("f7")
        await until(pilot, lambda: pilot.app.screen.result is not None)

    assert snap_compare(app, terminal_size=SIZES[size], run_before=compared)


@pytest.fixture
def demo_campaign(charllm_dirs):
    return make_demo_campaign(charllm_dirs["runs"])


async def campaign_shown(pilot):
    await pilot.press("f9")
    screen = pilot.app.screen
    listing = screen.query_one("#campaign-list")
    await until(pilot, lambda: screen.shown is not None and screen.query_one("#campaign-members").row_count == 9
                and listing.row_count and "…" not in [str(listing.get_cell(k, "members")) for k in listing.rows])


@pytest.mark.parametrize("size", SIZES)
def test_campaign(snap_compare, size, demo_campaign):
    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=campaign_shown)


@pytest.mark.parametrize("size, figures", [("large", 1), ("small", 3)])   # parallelism; micro batch
def test_campaign_figure(snap_compare, size, figures, demo_campaign):
    async def drawn(pilot):
        await campaign_shown(pilot)
        await pilot.press(*["g"] * figures)
        screen = pilot.app.screen
        await until(pilot, lambda: screen.drawn is not None and screen.drawn.wanted == screen.wanted)

    assert snap_compare(CharllmApp(), terminal_size=SIZES[size], run_before=drawn)


def test_help(snap_compare):
    assert snap_compare(CharllmApp(), terminal_size=SIZES["large"], press=["f1", "_"])
