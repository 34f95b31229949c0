"""Benchmark: the workbench's startup, the live view's CPU cost, and Compose's edit latency.

    python benchmarks/bench_tui.py [--runs 5] [--seconds 30]

1. Time from `charllm-tui` to the first frame, in a real terminal (tmux, 80x24 and 160x48): from
   the process start until the pane shows the tab bar (target: under 1 s), and until the Compose
   form, which mounts just after the first frame, is on screen too.
2. CPU used by the TUI process while the Live screen follows a run written by a real sampler
   process (`python -m charllm.probes --backend sim --sim-gpus 8 --hz 20`); the sampler's own
   CPU is not counted. Target: under 10 % of one core.
3. Latency of one Compose edit (a new TP value) until the memory bars show the new estimate,
   headless (App.run_test), including the 50 ms debounce.
4. The Sweep screen on Llama-3 70B x 64 H100 (ppt-h100-llama3-70b-1-01000), headless: from the
   key that opens it (F3) until the table is filled, once the workbench has been up long enough
   to have swept the composed experiment ahead (as for a user, who takes more than a second), and
   right after start-up (F3 then sweeps itself); and from the key that toggles "fitting only" (f)
   until the table is redrawn; each until the first frame drawn after it. Target: under 300 ms.
5. The Runs screen over 16 recorded runs, headless: from F6 until the top row shows its headline
   numbers and until every row does, with no summary kept yet and with each run's summary kept.
6. Screen switches at 80x24, headless, once start-up's idle work is done: from each screen's key
   (F3 to F8, then back to F2) until the first frame that shows that screen. Target: under 300 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from charllm.engine.model.experiment import Experiment

console = Console()


def env_for(tmp: Path) -> dict[str, str]:
    return {"CHARLLM_CONFIG_DIR": str(tmp / "config"), "CHARLLM_DATA_DIR": str(tmp / "data"),
            "CHARLLM_RUNS_DIR": str(tmp / "runs"), "TERM": "xterm-256color"}


def tmux(sock: Path, *args: str) -> str:
    return subprocess.run(["tmux", "-S", str(sock), *args], capture_output=True, text=True).stdout


def start_in_tmux(sock: Path, env: dict[str, str], command: str, size: tuple[int, int] = (160, 48)) -> psutil.Process:
    line = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + command
    tmux(sock, "new-session", "-d", "-s", "b", "-x", str(size[0]), "-y", str(size[1]), line)
    return psutil.Process(int(tmux(sock, "display-message", "-p", "-t", "b", "#{pane_pid}").strip()))


def stop_tmux(sock: Path) -> None:
    pid = tmux(sock, "display-message", "-p", "-t", "b", "#{pid}").strip()
    if pid:
        psutil.Process(int(pid)).kill()


def first_frame(runs: int, size: tuple[int, int]) -> tuple[list[float], list[float]]:
    """Seconds to the first frame (tab bar) and to the complete Compose form, per run."""
    frames, forms = [], []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            sock = Path(tmp) / "t.sock"
            began = time.perf_counter()
            start_in_tmux(sock, env_for(Path(tmp)), "charllm-tui", size)
            seen = None
            while True:
                screen = tmux(sock, "capture-pane", "-p", "-t", "b")
                if seen is None and "Compose F2" in screen:
                    seen = time.perf_counter() - began
                if seen is not None and "devices/node" in screen:
                    break
                if time.perf_counter() - began > 30:
                    raise SystemExit("no complete Compose screen within 30 s")
                time.sleep(0.005)
            frames.append(seen)
            forms.append(time.perf_counter() - began)
            stop_tmux(sock)
        console.print(f"  {size[0]}x{size[1]} run {i + 1}/{runs}: first frame {frames[-1] * 1000:.0f} ms, "
                      f"form {forms[-1] * 1000:.0f} ms")
    return frames, forms


def live_cpu(seconds: float) -> tuple[float, int]:
    """CPU % of one core used by the TUI following an 8-GPU 20 Hz simulated run; frames drawn."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = env_for(tmp)
        run = tmp / "runs" / "bench-live"
        run.parent.mkdir()
        sampler = subprocess.Popen([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--sim-gpus", "8",
                                    "--hz", "20", "--out", str(run), "--node", "node0"],
                                   env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sock = tmp / "t.sock"
        try:
            time.sleep(3)   # the first chunks exist
            app = start_in_tmux(sock, env, f"{shlex.quote(sys.executable)} -c "
                                + shlex.quote(f"from charllm.tui.app import CharllmApp; "
                                              f"CharllmApp(run={str(run)!r}).run()"))
            deadline = time.monotonic() + 60
            while "SIMULATED" not in tmux(sock, "capture-pane", "-p", "-t", "b"):
                if time.monotonic() > deadline:
                    raise SystemExit(
                        "the live view never showed the run:\n" + tmux(sock, "capture-pane", "-p", "-t", "b")
                    )
                time.sleep(0.1)
            time.sleep(3)   # past startup: measure the steady state
            cpu0, t0 = app.cpu_times(), time.monotonic()
            time.sleep(seconds)
            cpu1, wall = app.cpu_times(), time.monotonic() - t0
            screen = tmux(sock, "capture-pane", "-p", "-t", "b")
            assert "GPU power" in screen, screen
            return 100 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / wall, 0
        finally:
            stop_tmux(sock)
            sampler.terminate()
            sampler.wait(10)


def compose_latency(edits: int) -> list[float]:
    from charllm.tui.app import CharllmApp
    from charllm.tui.widgets.memory_bars import MemoryBars

    latencies: list[float] = []

    async def run() -> None:
        app = CharllmApp()
        async with app.run_test(size=(160, 48)) as pilot:
            screen = app.screen
            while screen.last is None:
                await pilot.pause(0.01)
            bars = screen.query_one(MemoryBars)
            tp = screen.query_one("#f-tensor_model_parallel_size")
            for i in range(edits):
                before = bars.report
                began = time.perf_counter()
                tp.value = "2" if i % 2 == 0 else "1"
                while bars.report is before:
                    await pilot.pause(0.001)
                latencies.append(time.perf_counter() - began)

    asyncio.run(run())
    return latencies


class FrameClock:
    """Times a key to the first frame drawn once a condition holds (Textual's App._display draws a
    frame); install() patches App._display for the time of a measurement."""

    def __init__(self):
        from textual.app import App

        self.display = App._display
        self.looking_for = None     # what the next frame must show to be timed (None: nothing)
        self.shown_at = None        # when a frame first showed it

    def __enter__(self):
        from textual.app import App

        clock = self

        def timed_display(app, screen, renderable):
            clock.display(app, screen, renderable)
            if renderable is not None and clock.shown_at is None and clock.looking_for is not None \
                    and clock.looking_for():
                clock.shown_at = time.perf_counter()

        App._display = timed_display
        return self

    def __exit__(self, *exc):
        from textual.app import App

        App._display = self.display

    async def key_to_frame(self, pilot, key: str, filled) -> float:
        """From pressing `key` to the first frame drawn once `filled()` holds."""
        self.looking_for, self.shown_at = filled, None
        began = time.perf_counter()
        await pilot.press(key)
        while self.shown_at is None:
            await pilot.pause(0.001)
        self.looking_for = None
        return self.shown_at - began


def sweep_latency(runs: int, ahead: bool = True) -> tuple[list[float], list[float]]:
    """Key to the first frame that shows the filled table."""
    from charllm.tui.app import CharllmApp
    from charllm.tui.screens.sweep import SweepScreen

    opened, toggled = [], []

    async def run(clock: FrameClock) -> None:
        for _ in range(runs):
            app = CharllmApp(Experiment.load("ppt-h100-llama3-70b-1-01000"))
            async with app.run_test(size=(160, 48)) as pilot:
                await pilot.pause(0.2)
                while ahead and app.swept_ahead is None:
                    await pilot.pause(0.05)
                if ahead:
                    await pilot.pause(0.5)                  # the idle work after start-up is done
                opened.append(await clock.key_to_frame(pilot, "f3", lambda: isinstance(app.screen, SweepScreen)
                                                       and app.screen.query_one("#sweep-table").row_count))
                screen = app.screen
                for _ in range(4):
                    before = screen.table_frame
                    toggled.append(await clock.key_to_frame(pilot, "f", lambda: screen.table_frame is not before))

    with FrameClock() as clock:
        asyncio.run(run(clock))
    return opened, toggled


def screen_switches(runs: int) -> dict[str, list[float]]:
    """Per screen key at 80x24: key to the first frame showing that screen, first visit included."""
    from charllm.tui.app import CharllmApp
    from charllm.tui.screens import SCREENS

    order = [*SCREENS[1:], SCREENS[0]]          # F3 ... F8, then back to Compose
    times: dict[str, list[float]] = {key: [] for _, _, key, _ in order}

    async def run(clock: FrameClock) -> None:
        app = CharllmApp()
        async with app.run_test(size=(80, 24)) as pilot:
            while app.swept_ahead is None:          # start-up's idle work is done
                await pilot.pause(0.05)
            await pilot.pause(0.5)
            for mode, _, key, _ in order:
                times[key].append(await clock.key_to_frame(pilot, key, lambda: app.current_mode == mode))
                await pilot.pause(0.3)

    with tempfile.TemporaryDirectory() as tmp, FrameClock() as clock:
        saved = os.environ.copy()
        os.environ.update(env_for(Path(tmp)))
        try:
            for _ in range(runs):
                asyncio.run(run(clock))
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return times


def runs_headlines(n_runs: int) -> list[tuple[str, float, float]]:
    """Seconds from F6 (once start-up's work is done) until the Runs table shows the top run's
    headline numbers and until it shows every run's, over `n_runs` recorded runs (8 simulated GPUs,
    60 s at 10 Hz each): first with no summary kept, then again (a finished run's summary is kept
    in its directory)."""
    from charllm.tui.app import CharllmApp
    from charllm.tui.demo import make_demo_run

    timings = []
    saved = os.environ.copy()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(env_for(Path(tmp)))     # the app reads its runs from there
        runs = [make_demo_run(Path(tmp) / "runs", f"20251121-{i:06d}-demo-{i}", seconds=60, seed=i)
                for i in range(n_runs)]

        async def run(label: str) -> None:
            from charllm.tui.screens.runs import Headline

            filled: dict[str, float] = {}    # run id -> when its numbers reached the screen

            def hook(message) -> None:
                if isinstance(message, Headline):
                    filled.setdefault(message.run_id, time.perf_counter())

            app = CharllmApp()
            async with app.run_test(size=(160, 48), message_hook=hook) as pilot:
                while app.swept_ahead is None:      # start-up's background sweep is done
                    await pilot.pause(0.05)
                began = time.perf_counter()
                await pilot.press("f6")
                while len(filled) < len(runs):
                    await pilot.pause(0.01)
                top = runs[-1].name                 # the newest run: the top row
                timings.append((label, filled[top] - began, max(filled.values()) - began))

        asyncio.run(run("no summary kept"))
        asyncio.run(run("summaries kept"))
    os.environ.clear()
    os.environ.update(saved)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="startups to time (default 5)")
    parser.add_argument("--seconds", type=float, default=30, help="live-view measurement window (default 30)")
    args = parser.parse_args()
    if shutil.which("tmux") is None or shutil.which("charllm-tui") is None:
        raise SystemExit("needs tmux and charllm-tui on PATH")
    console.print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with console.status("time to first frame…"):
        small, _ = first_frame(args.runs, (80, 24))
        frames, forms = first_frame(args.runs, (160, 48))
    with console.status(f"live view CPU over {args.seconds:g} s…"):
        cpu, _ = live_cpu(args.seconds)
    with console.status("Compose edit latency…"):
        edits = compose_latency(20)
    with console.status("Sweep screen latency…"):
        opened, toggled = sweep_latency(3)
        cold, _ = sweep_latency(3, ahead=False)
    with console.status("Runs screen headlines…"):
        headlines = runs_headlines(16)
    with console.status("screen switches…"):
        switches = screen_switches(3)
    table = Table(title="charllm-tui workbench")
    for column in ("measure", "result", "target"):
        table.add_column(column)
    for size, times in (("80x24", small), ("160x48", frames)):
        table.add_row(f"first frame at {size} (median of {len(times)})", f"{statistics.median(times) * 1000:.0f} ms "
                      f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f})", "< 1000 ms")
    table.add_row("Compose form complete (median)", f"{statistics.median(forms) * 1000:.0f} ms", "—")
    table.add_row("live view, 8 sim GPUs @ 20 Hz", f"{cpu:.1f} % of one core", "< 10 %")
    table.add_row("Compose edit -> memory bars (median of 20)",
                  f"{statistics.median(edits) * 1000:.0f} ms (p90 {sorted(edits)[17] * 1000:.0f} ms)", "—")
    table.add_row("F3 -> Sweep table, Llama-3 70B x 64 H100 (median)", f"{statistics.median(opened) * 1000:.0f} ms",
                  "< 300 ms")
    table.add_row("  ... F3 0.2 s after start-up (swept on the key)", f"{statistics.median(cold) * 1000:.0f} ms", "—")
    table.add_row("f (fitting only) -> table redrawn (median)", f"{statistics.median(toggled) * 1000:.0f} ms",
                  "< 300 ms")
    for label, top, every in headlines:
        table.add_row(f"F6 -> Runs headlines, 16 runs, {label}",
                      f"top row {top * 1000:.0f} ms, all {every * 1000:.0f} ms", "—")
    for key, times in switches.items():
        table.add_row(f"{key.upper()} -> its screen at 80x24 (first visit; median of {len(times)})",
                      f"{statistics.median(times) * 1000:.0f} ms (max {max(times) * 1000:.0f})", "< 300 ms")
    console.print(table)


if __name__ == "__main__":
    main()
