"""Launch overhead: from `launch()` to the first iteration of the tiny local preset.

Splits the time into our part (checks, run directory, detached supervisor, starting the sampler
and torchrun) and the rest (torchrun, torch/megatron imports, process-group and model set-up),
and measures the torch + megatron import time in a fresh interpreter for reference.

    python benchmarks/bench_launch.py [--repeat 3] [--preset tiny-local]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

IMPORTS = "import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); " \
          "import megatron.core.models.gpt, megatron.core.pipeline_parallel; t2 = time.perf_counter(); " \
          "print(t1 - t, t2 - t1)"


def import_times() -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True).stdout
    torch_s, megatron_s = map(float, out.split())
    return torch_s, megatron_s


def one_launch(preset: str) -> dict:
    from charllm.engine.launch.launcher import cancel, launch
    from charllm.engine.launch.targets import LOCAL
    from charllm.engine.model.experiment import Experiment
    from charllm.probes.store.rundir import RunDir

    exp = Experiment.load(preset)
    exp.training.train_iters = 3
    t0 = time.time_ns()
    result = launch(exp, LOCAL)
    returned = time.time_ns()
    rd = RunDir(result.run_dir)
    start_event = first_iter = None
    deadline = time.monotonic() + 600
    while first_iter is None and time.monotonic() < deadline:
        frame = rd.read_iterations()
        starts = frame.filter(frame["event"] == "start")
        iters = frame.filter(frame["event"] == "iteration")
        if start_event is None and starts.height:
            start_event = starts["start_ns"].min()
        if iters.height:
            first_iter = iters["end_ns"].min()
        time.sleep(0.02)
    manifest = rd.read_manifest()
    while rd.status not in ("completed", "failed", "cancelled"):
        time.sleep(0.2)
    if first_iter is None:
        cancel(rd)
        raise SystemExit("no iteration within 600 s")
    started = manifest["started_ns"]
    return {
        "launch() returned": (returned - t0) / 1e9,
        "supervisor started sampler + torchrun": (started - t0) / 1e9,
        "workload ready (imports, init, model)": (start_event - started) / 1e9,
        "first iteration done": (first_iter - t0) / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--preset", default="tiny-local")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CHARLLM_RUNS_DIR"] = tmp
        runs = [one_launch(args.preset) for _ in range(args.repeat)]
    imports = [import_times() for _ in range(args.repeat)]
    print(f"launch overhead, {args.preset}, median of {args.repeat} (seconds from launch()):")
    for key in runs[0]:
        print(f"  {key:<42} {statistics.median(r[key] for r in runs):7.2f}")
    ours = statistics.median(r["supervisor started sampler + torchrun"] for r in runs)
    torch_s = statistics.median(i[0] for i in imports)
    megatron_s = statistics.median(i[1] for i in imports)
    print(f"  {'ours (checks, run dir, supervisor, spawn)':<42} {ours:7.2f}")
    print(f"  {'import torch (fresh interpreter)':<42} {torch_s:7.2f}")
    print(f"  {'import megatron.core (after torch)':<42} {megatron_s:7.2f}")
    print(f"  cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
