"""Memory- and step-time-model speed, run by hand: `python benchmarks/bench_memory.py`.

Targets (issues 2, 11, 26 and 30): one plan (`memory.estimate`) well under 1 ms, and its step time
(`speed.estimate`) a few ms; the full sweep of Llama-3 70B on 64 H100s (every recompute and optimizer
choice: 6,834 layouts, each with its memory and its step time) under 100 ms beyond start-up, and on
1,024 H100s under 1 s. Prints best and median wall and process CPU time; on a shared, loaded
machine the best-of-N CPU figures are the meaningful ones. Nothing is cached between sweeps but the
catalog and the pipeline split (`memory._split`). "first in a process" is the first sweep of a fresh
Python process, once its modules are imported (start-up): what `charllm-tui sweep` pays.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from charllm.engine.model import speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.memory import estimate
from charllm.engine.model.sweep import base_experiment, sweep

EVERY_CHOICE = {"recompute": ("none", "selective", "full"), "distributed_optimizer": (True, False)}

PLANS = ("ppt-h100-llama3-70b-1-00000", "ppt-h100-gpt3-175b-2-01000", "ppt-h200-mixtral-8x22b-1-00000",
         "tiny-local")


def timed(fn, repeat: int) -> tuple[float, float, float, float]:
    """(best wall, median wall, best CPU, median CPU) in seconds."""
    fn()                                         # warm imports and caches of the catalog
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), statistics.median(walls), min(cpus), statistics.median(cpus)


FIRST_SWEEP = """
import time
from charllm.engine.model.sweep import base_experiment, sweep
import numpy, polars
base = base_experiment({model!r}, {hardware!r}, {nodes}, 8, {batch})
wall, cpu = time.perf_counter(), time.process_time()
sweep(base, recompute=("none", "selective", "full"), distributed_optimizer=(True, False))
print(time.perf_counter() - wall, time.process_time() - cpu)
"""


def first_sweep(repeat: int, **case) -> tuple[float, float, float, float]:
    """(best wall, median wall, best CPU, median CPU) of the first sweep in fresh processes."""
    walls, cpus = [], []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", FIRST_SWEEP.format(**case)], capture_output=True, text=True,
                             check=True).stdout.split()
        walls.append(float(out[0]))
        cpus.append(float(out[1]))
    return min(walls), statistics.median(walls), min(cpus), statistics.median(cpus)


def main() -> None:
    print("one plan (engine.model.memory.estimate):")
    for name in PLANS:
        exp = Experiment.load(name)
        best, median, cpu, cpu_median = timed(lambda: estimate(exp), 300)
        print(f"  {name:34s} PP{exp.parallel.pipeline_model_parallel_size:<3d} wall best {best * 1e6:5.0f} us"
              f" median {median * 1e6:5.0f} us   cpu best {cpu * 1e6:5.0f} us median {cpu_median * 1e6:5.0f} us")
    print("one step time (engine.model.speed.estimate):")
    for name in PLANS:
        exp = Experiment.load(name)
        best, median, cpu, cpu_median = timed(lambda: speed.estimate(exp), 300)
        print(f"  {name:34s} PP{exp.parallel.pipeline_model_parallel_size:<3d} wall best {best * 1e6:5.0f} us"
              f" median {median * 1e6:5.0f} us   cpu best {cpu * 1e6:5.0f} us median {cpu_median * 1e6:5.0f} us")
    exp = Experiment.load(PLANS[0])
    exp.parallel.pipeline_model_parallel_size, exp.parallel.virtual_pipeline_model_parallel_size = 8, 5
    best, median, cpu, cpu_median = timed(lambda: estimate(exp), 300)
    print(f"  {'llama3-70b TP8 PP8 VP5 (40 chunks)':34s}       wall best {best * 1e6:5.0f} us"
          f" median {median * 1e6:5.0f} us   cpu best {cpu * 1e6:5.0f} us median {cpu_median * 1e6:5.0f} us")

    print("full sweep (engine.model.sweep.sweep, every recompute and optimizer choice):")
    for model, hardware, nodes, batch in (("llama3-70b", "h100-sxm-80gb", 8, 128),
                                          ("mixtral-8x7b", "h100-sxm-80gb", 8, 128),
                                          ("llama3-70b", "h100-sxm-80gb", 128, 1024)):
        base = base_experiment(model, hardware, nodes, 8, batch)
        rows = sweep(base, **EVERY_CHOICE).height
        print(f"  {model} on {nodes * 8} x {hardware}: {rows} layouts")
        for what, (best, median, cpu, cpu_median) in (
                ("repeated", timed(lambda: sweep(base, **EVERY_CHOICE), 15)),
                ("first in a process", first_sweep(5, model=model, hardware=hardware, nodes=nodes, batch=batch))):
            print(f"    {what:20s} wall best {best * 1e3:5.1f} ms median {median * 1e3:5.1f} ms"
                  f"   cpu best {cpu * 1e3:5.1f} ms median {cpu_median * 1e3:5.1f} ms")


if __name__ == "__main__":
    main()
