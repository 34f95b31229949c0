"""Regenerate the README's SVG screenshots of every workbench screen.

    python screenshots/make_screenshots.py [--out screenshots] [--only NAME ...]

The data is deterministic, as in tests/tui/test_tui_snapshots.py: private config/data/runs directories
in a temp dir, recorded runs from `charllm.tui.demo` (simulated backend, fixed seed and clock), the
shipped tiny-local preset, a dry run with this host's name and the free port pinned, a fixed
saved calibration of a CPU node (`charllm.tui.demo.save_demo_calibration`) for the Doctor screen, and
a finished campaign of recorded runs (`charllm.tui.demo.make_demo_campaign`) for the Campaign screen,
made after the Runs screen's shot (its runs would be listed there).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
from pathlib import Path
from charllm.engine.model.experiment import Experiment, Hardware, ModelSpec

SIZE = (160, 48)


async def until(pilot, condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("a screen never got its data")
        await pilot.pause(0.1)
    await pilot.pause(0.5)


async def shoot(name: str, app, prepare, out: Path, size=SIZE) -> Path:
    async with app.run_test(size=size) as pilot:
        await prepare(pilot)
        path = out / f"{name}.svg"
        app.save_screenshot(filename=path.name, path=str(out))
    print(f"wrote {path}")
    return path


async def main(out: Path, only: set[str]) -> None:
    from charllm.tui.app import CharllmApp
    from charllm.tui.demo import make_demo_campaign, make_demo_run, save_demo_calibration

    runs_dir = Path(os.environ["CHARLLM_RUNS_DIR"])
    capped = make_demo_run(runs_dir, "20251121-090000-demo-capped", seconds=30, power_limit_w=450.0, seed=3)
    demo = make_demo_run(runs_dir, "20251121-080000-demo-8gpu", seconds=30)

    async def compose(pilot):
        screen = pilot.app.screen
        await until(pilot, lambda: screen.last is not None and screen.last.serial == screen.edit_serial)

    def llama70b():
        exp = Experiment.load("tiny-local")
        exp.name = "llama3-70b-h100-64"
        exp.model, exp.hardware = ModelSpec.load("llama3-70b"), Hardware.load("h100-sxm-80gb")
        exp.cluster.nodes, exp.cluster.gpus_per_node = 8, 8
        exp.parallel.tensor_model_parallel_size, exp.parallel.pipeline_model_parallel_size = 8, 4
        exp.parallel.sequence_parallel = exp.parallel.use_distributed_optimizer = True
        exp.training.global_batch_size, exp.training.micro_batch_size = 128, 1
        exp.training.bf16 = True
        exp.training.recompute_granularity = "selective"
        return exp

    async def compose_big(pilot):
        pilot.app.use_experiment(llama70b())
        await compose(pilot)

    async def sweep(pilot):
        await pilot.press("f3")
        await until(pilot, lambda: getattr(pilot.app.screen, "frame", None) is not None)

    async def launch(pilot):
        await pilot.press("f4")
        text = pilot.app.screen.query_one("#dry-run-text")
        await until(pilot, lambda: "Commands" in str(text.render()))

    async def live(pilot):
        screen = pilot.app.screen
        await until(pilot, lambda: screen.last_frame is not None and screen.last_frame.kind == "gpu")

    async def runs(pilot):
        await pilot.press("f6")
        table = pilot.app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 2 and all(
            table.get_cell(r.name, "peak W") != "…" for r in (demo, capped)))

    async def compare(pilot):
        pilot.app.compare_refs = [str(demo), str(capped)]
        await pilot.press("f7")
        status = pilot.app.screen.query_one("#compare-status")
        await until(pilot, lambda: str(status.render()) and "comparing" not in str(status.render()))

    async def help_screen(pilot):
        await pilot.press("f1")
        await pilot.pause(0.5)

    async def doctor(pilot):
        await pilot.press("f8")
        status = pilot.app.screen.query_one("#doctor-status")
        await until(pilot, lambda: "Saved calibrations" in str(status.render()))

    async def campaign(pilot):
        if not (runs_dir / ".campaigns").is_dir():
            make_demo_campaign(runs_dir)
        await pilot.press("f9")
        screen = pilot.app.screen
        listing = screen.query_one("#campaign-list")
        await until(pilot, lambda: screen.shown is not None and screen.query_one("#campaign-members").row_count
                    and listing.row_count and "…" not in [str(listing.get_cell(k, "members")) for k in listing.rows])

    async def campaign_figures(pilot):
        await campaign(pilot)
        await pilot.press("g")                  # the parallelism figure: the paper's six panels
        screen = pilot.app.screen
        await until(pilot, lambda: screen.drawn is not None and screen.drawn.wanted == screen.wanted)

    save_demo_calibration()
    shots = [
        ("compose", CharllmApp(), compose, SIZE), ("compose-llama3-70b", CharllmApp(), compose_big, SIZE),
        ("compose-80x24", CharllmApp(), compose, (80, 24)), ("sweep", CharllmApp(llama70b()), sweep, SIZE),
        ("launch", CharllmApp(), launch, SIZE), ("live", CharllmApp(run=demo), live, SIZE),
        ("live-80x24", CharllmApp(run=demo), live, (80, 24)), ("runs", CharllmApp(), runs, SIZE),
        ("compare", CharllmApp(), compare, SIZE), ("help", CharllmApp(), help_screen, SIZE),
        ("doctor", CharllmApp(), doctor, SIZE), ("campaign", CharllmApp(), campaign, SIZE),
        ("campaign-figures", CharllmApp(), campaign_figures, SIZE),
    ]
    unknown = only - {name for name, *_ in shots}
    if unknown:
        raise SystemExit(f"--only: no screenshot named {', '.join(sorted(unknown))}")
    for name, app, prepare, size in shots:
        if not only or name in only:
            await shoot(name, app, prepare, out, size=size)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="only these screenshots (e.g. doctor)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("CONFIG", "DATA", "RUNS"):
            os.environ[f"CHARLLM_{name}_DIR"] = str(Path(tmp) / name.lower())
        socket.gethostname = lambda: "node0"       # the dry run names the host
        os.environ["TZ"] = "UTC"                  # the Runs screen shows local time: the same on every machine
        time.tzset()
        asyncio.run(main(args.out, set(args.only)))


if __name__ == "__main__":
    run()
