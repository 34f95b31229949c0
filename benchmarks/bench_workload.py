"""Startup cost of the training workload: from process start to the first iteration.

Runs the tiny local preset under torchrun a few times and splits the time to the first iteration
into torch/megatron import time (measured inside the ranks, reported in the `start` event of the
iteration log) and the rest (torchrun and interpreter start, rendezvous, process groups, model
and optimizer construction).

    python benchmarks/bench_workload.py [--preset tiny-local] [--repeat 3] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from charllm.engine.model.experiment import Experiment


def one_run(preset: str, iters: int, root: Path) -> dict:
    exp = Experiment.load(preset).apply([f"train_iters={iters}"])
    run_dir = root / f"run-{time.monotonic_ns()}"
    exp.save(run_dir / "experiment.toml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={exp.world_size}", "-m", "charllm.engine.workload.train", "--run-dir", str(run_dir)]
    launched_ns = time.time_ns()
    done = subprocess.run(cmd, capture_output=True, text=True)
    finished_ns = time.time_ns()
    if done.returncode:
        sys.exit(f"workload failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "iterations.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start" and r["rank"] == 0)
    steps = [r for r in records if r["event"] == "iteration" and r["rank"] == 0]
    to_first = (steps[0]["start_ns"] - launched_ns) / 1e9
    imports, setup = start["startup_s"]["import"], start["startup_s"]["setup"]
    return {
        "to_first_iteration_s": to_first,
        "import_s": imports,
        "setup_s": setup,
        "launch_and_interpreter_s": to_first - imports - setup,
        "first_iteration_s": (steps[0]["end_ns"] - steps[0]["start_ns"]) / 1e9,
        "steady_iteration_s": statistics.median((r["end_ns"] - r["start_ns"]) / 1e9 for r in steps[1:]),
        "teardown_s": (finished_ns - steps[-1]["end_ns"]) / 1e9,
        "world_size": start["world_size"],
    }


def bare_import_s() -> float:
    """torch + megatron-core import in one fresh interpreter, no other load from us (calibration)."""
    code = ("import time, warnings; warnings.simplefilter('ignore'); t = time.perf_counter(); import torch; "
            "import megatron.core.models.gpt.gpt_layer_specs, megatron.core.optimizer; "
            "print(time.perf_counter() - t)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-local")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-workload-") as tmp:
        runs = [one_run(args.preset, args.iters, Path(tmp)) for _ in range(args.repeat)]
    print(f"{args.preset}: {runs[0]['world_size']} ranks, median of {args.repeat} runs")
    for key in runs[0]:
        if key.endswith("_s"):
            values = [r[key] for r in runs]
            print(f"  {key:<28} {statistics.median(values):7.3f} s   (min {min(values):.3f}, max {max(values):.3f})")
    print(f"  {'bare_import_one_process_s':<28} {bare_import_s():7.3f} s")


if __name__ == "__main__":
    main()
