"""How long commands take before and beyond start-up (issue 36: `--help` and `runs list` under
0.15 s, the Llama-3 70B x 64 H100 sweep's JSON under 0.15 s beyond `--help`'s time).

Each command runs as a fresh process (`python -m charllm.tui ...`, as the console script runs it)
`--repeat` times; it prints the median wall time and the median CPU time (user + system) of the
process. On a shared machine the wall time grows with the load while the CPU time does not: read
the CPU column there, and the wall column on a quiet machine. `runs list` lists a runs directory of
`--runs` finished demo runs (tui/demo.py), each with its kept summary, in a temporary directory.

    python benchmarks/bench_startup.py [--repeat 7] [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWEEP = ["sweep", "--model", "llama3-70b", "--hardware", "h100", "--nodes", "8", "--gpus-per-node", "8",
         "--global-batch-size", "128", "--json"]
COMMANDS = {"--help": ["--help"], "runs list": ["runs", "list"], "sweep --json (70B x 64)": SWEEP}


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one `charllm-tui ARGV` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "charllm.tui", *argv], env=env, stdout=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--runs", type=int, default=20, help="finished runs in the listed runs directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **{f"CHARLLM_{k}_DIR": str(Path(tmp) / k.lower()) for k in ("CONFIG", "DATA", "RUNS")}}
        os.environ.update(env)
        from charllm.probes.analysis.summary import keep_summaries  # deferred: the benchmark's own set-up
        from charllm.probes.store.rundir import RunDir
        from charllm.tui.demo import make_demo_run

        for n in range(args.runs):
            keep_summaries(RunDir(make_demo_run(Path(env["CHARLLM_RUNS_DIR"]), f"20251121-0800{n:02d}-demo",
                                                gpus=8, seconds=5.0)))
        print(f"{'command':<26}{'wall median':>14}{'CPU median':>14}   ({args.repeat} runs each, "
              f"{args.runs} finished runs listed; load {os.getloadavg()[0]:.1f})")
        results = {}
        for name, argv in COMMANDS.items():
            timed(argv, env)   # warm the file cache and the byte-code
            walls, cpus = zip(*(timed(argv, env) for _ in range(args.repeat)))
            results[name] = (statistics.median(walls), statistics.median(cpus))
            print(f"{name:<26}{results[name][0]:>12.3f} s{results[name][1]:>12.3f} s")
        sweep, helped = results["sweep --json (70B x 64)"], results["--help"]
        print(f"{'sweep beyond --help':<26}{sweep[0] - helped[0]:>12.3f} s{sweep[1] - helped[1]:>12.3f} s")


if __name__ == "__main__":
    main()
