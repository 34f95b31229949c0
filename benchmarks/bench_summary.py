"""Benchmark: a CharLLM-PPT campaign at cluster scale, from the artifact's CSVs to summaries.

    python benchmarks/bench_summary.py [--cache /tmp/charllm-bench-summary] [--seconds 3600]
                                       [--gpus 64] [--runs 4] [--repeat 1] [--skip-artifact]
                                       [--scale-to-gpus N]

24 h x 512 GPUs (885 M samples) does not fit this machine's time budget; it is measured on a
subset and scaled: `--seconds 86400 --gpus 8 --runs 1 --scale-to-gpus 512` measures one node
of the full length and prints the 512-GPU figures by arithmetic (bytes and times x 64: nodes are
independent files and independent batches; peak RSS stays that of one batch, BATCH_ROWS samples).

For each of --runs runs (1 h x 64 GPUs x 20 Hz by default, 4.6 M samples of power, temperature
and SM clock), the artifact's `{metric}_{rank}.csv` files are generated once (cached) and then
measured, each step in a fresh process so its peak RSS is its own:
- `import charllm-ppt` of one run: time, peak RSS, bytes per sample on disk;
- cold `summarize --by gpu` and `--by run` (cached summaries removed first);
- the artifact's own way, a numpy loop over the same CSVs (vistools' averages and energy);
- cold compare of the --runs runs (no cached summaries), then again with them cached.

--repeat N measures each summary and compare N times and reports the minimum and the median (the
machine is shared: one measurement says little). The CSVs are kept in --cache for the next
invocation; the imported runs go to a directory of this invocation's own, removed at the end, so
invocations running at once do not disturb each other's data.

Targets (this 2-core machine, 1 h x 64 GPUs x 20 Hz, 3 metrics): <= 40 bytes per sample; cold
summarize --by gpu >= 8x faster than the numpy loop and under 1 s, in <= 800 MB RSS; compare of
4 runs under 2 s cold.

Values are generated at the resolution NVML reports them (power in mW, temperature in whole
degrees, clocks in whole MHz), as the artifact's files hold them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

HZ, GPUS_PER_NODE = 20, 8
T0 = 1_763_700_000.0
METRICS = ("gpu_power", "gpu_thermal", "sm_clock")


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
def gpu_signals(seconds: int, gpu: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Bursty training power (an iteration every 12 s: compute burst then communication), at
    NVML's resolution, on the sampler's slightly jittered 20 Hz ticks."""
    n = seconds * HZ
    t = np.arange(n) / HZ + rng.uniform(0, 0.002, n)
    phase = (t % 12.0) / 12.0
    power = np.round(np.where(phase < 0.7, 620.0, 380.0) + rng.normal(0, 25, n) + gpu % 8, 3)
    temp = np.round(55 + 25 * (1 - np.exp(-t / 600)) + rng.normal(0, 0.5, n) + gpu % 8)
    clock = np.where(power > 680, 1755.0, 1980.0)
    return {"t": T0 + t, "gpu_power": power, "gpu_thermal": temp, "sm_clock": clock}


def make_csvs(root: Path, seconds: int, gpus: int, seed: int) -> Path:
    """The artifact's result folder: `{metric}_{rank}.csv`, rows `unix_time_s,value` (made once,
    in a folder of its own renamed into place, so an invocation running alongside never sees half)."""
    out = root / f"csv-{seed}"
    if (out / "done").exists():
        return out
    staging = Path(tempfile.mkdtemp(prefix=f".csv-{seed}-", dir=root))
    rng = np.random.default_rng(seed)
    for rank in range(gpus):
        s = gpu_signals(seconds, rank, rng)
        for metric in METRICS:
            pl.DataFrame({"t": s["t"], "v": s[metric]}).write_csv(
                staging / f"{metric}_{rank}.csv", include_header=False, float_precision=6)
    (staging / "done").touch()
    try:
        staging.rename(out)
    except OSError:  # made by another invocation meanwhile (or left half-made by an older version)
        if not (out / "done").exists():
            shutil.rmtree(out)
            staging.rename(out)
        else:
            shutil.rmtree(staging)
    return out


# --------------------------------------------------------------------------------------------
# Measurements (each in its own process)
# --------------------------------------------------------------------------------------------
def _measure(kind: str, args: list[str]) -> dict:
    code = (f"import sys; sys.argv = {['x', kind, *args]!r}; import runpy; "
            f"runpy.run_path({__file__!r}, run_name='__child__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _repeated(n: int, kind: str, args: list[str], runs: list[str] | None) -> dict:
    """`n` measurements (cold: kept summaries of `runs` removed before each, unless None): the
    first's details, with the minimum and median wall and CPU seconds of all."""
    results = []
    for _ in range(n):
        if runs is not None:
            _uncache(runs)
        results.append(_measure(kind, args))
    out = dict(results[0])
    for k in ("seconds", "cpu_s"):
        values = [r[k] for r in results]
        out[k], out[f"{k}_median"], out[f"{k}_all"] = min(values), statistics.median(values), values
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    return out


def _times(r: dict) -> str:
    if len(r["seconds_all"]) == 1:
        return f"{r['seconds']:.2f} s wall, {r['cpu_s']:.2f} s CPU"
    return (f"{r['seconds']:.2f} s wall (median {r['seconds_median']:.2f}), {r['cpu_s']:.2f} s CPU "
            f"(median {r['cpu_s_median']:.2f}), min of {len(r['seconds_all'])}")


def _uncache(runs: list[str]) -> None:
    """Cold means no cached summaries (one pass keeps every level of a finished run)."""
    for run in runs:
        shutil.rmtree(Path(run) / "summaries", ignore_errors=True)


def child(kind: str, args: list[str]) -> None:
    import charllm.probes.analysis.summary  # noqa: F401 - imports are not what we measure

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    if kind == "import":
        from charllm.probes.store.importers import import_charllm_ppt

        run = import_charllm_ppt(args[0], name=args[1], gpus_per_node=GPUS_PER_NODE, simulated=True)
        files = run.telemetry_files()
        rows = run.scan_telemetry().select(pl.len()).collect().item()
        extra = {"run": str(run.path), "rows": rows, "bytes": sum(f.stat().st_size for f in files),
                 "files": len(files)}
    elif kind == "summary":
        from charllm.probes.analysis.summary import summarize

        df = summarize(args[0], "all", by=args[1])
        extra = {"rows": df.height}
    elif kind == "compare":
        from charllm.probes.analysis.compare import compare

        result = compare(args, window="all")
        extra = {"metrics": result.table.height}
    elif kind == "scan":
        from charllm.probes.store.rundir import RunDir

        frame = RunDir(Path(args[0])).scan_telemetry().select("ts_ns", "device", "power_w").collect()
        extra = {"rows": frame.height}
    else:
        extra = {"gpus": artifact_way(Path(args[0]))}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": time.perf_counter() - start, "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra}))


def artifact_way(csv_dir: Path) -> int:
    """The artifact's per-GPU loop (vistools.calculate_average_metric and calculate_total_energy)."""

    def weighted(a):
        return np.sum(a[:-1, 1] * np.diff(a[:, 0])) / np.sum(np.diff(a[:, 0]))

    results = []
    ranks = sorted(int(f.stem.rsplit("_", 1)[1]) for f in csv_dir.glob("gpu_power_*.csv"))
    for rank in ranks:
        load = lambda m: np.loadtxt(csv_dir / f"{m}_{rank}.csv", delimiter=",")  # noqa: E731
        r = {}
        for metric in ("gpu_power", "gpu_thermal"):
            a = load(metric)
            r[metric] = (weighted(a), a[:, 1].max())
        r["sm_clock"] = weighted(load("sm_clock")) / 1000
        power = load("gpu_power")
        r["energy"] = np.trapezoid(power[:, 1], power[:, 0])
        results.append(r)
    return len(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/charllm-bench-summary"))
    ap.add_argument("--seconds", type=int, default=3600)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="measure each summary and compare N times (min, median)")
    ap.add_argument("--skip-artifact", action="store_true")
    ap.add_argument("--scale-to-gpus", type=int, metavar="N", help="also print the figures scaled to N GPUs")
    a = ap.parse_args()
    from rich.console import Console

    console = Console()
    root = a.cache / f"{a.seconds}s-{a.gpus}gpus"
    root.mkdir(parents=True, exist_ok=True)
    with console.status("generating the artifact's CSVs (cached after the first time)..."):
        csvs = [make_csvs(root, a.seconds, a.gpus, seed) for seed in range(a.runs)]
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=root))  # this invocation's own
    os.environ["CHARLLM_RUNS_DIR"] = str(runs_dir)
    try:
        measure(a, console, csvs)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)


def measure(a: argparse.Namespace, console, csvs: list[Path]) -> None:
    report = {"load_average_1min": os.getloadavg()[0], "gpus": a.gpus, "seconds": a.seconds, "hz": HZ}
    runs = []
    for i, csv in enumerate(csvs):
        r = _measure("import", [str(csv), f"bench-{i}"])
        runs.append(r["run"])
        if i == 0:
            report["import"] = r
            r["bytes_per_sample"] = r["bytes"] / r["rows"]
            csv_bytes = sum(f.stat().st_size for f in csv.glob("*.csv"))
            console.print(f"import of {a.gpus} GPUs x {a.seconds} s x {HZ} Hz ({r['rows']:,} samples, "
                          f"{len(METRICS)} metrics): {r['seconds']:.1f} s wall, peak RSS {r['peak_rss_mb']:.0f} MB; "
                          f"{r['bytes'] / 1e6:.1f} MB in {r['files']} files = {r['bytes_per_sample']:.1f} bytes/sample "
                          f"(CSVs: {csv_bytes / r['rows']:.1f} bytes/sample; target <= 40)")
    for by in ("gpu", "run"):
        report[f"summary_by_{by}"] = r = _repeated(a.repeat, "summary", [runs[0], by], runs)
        console.print(f"summarize --by {by} (cold): {_times(r)}, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB (target < 1 s, <= 800 MB)")
    if len(runs) > 1:
        report["compare_cold"] = r = _repeated(a.repeat, "compare", runs, runs)
        console.print(f"compare of {len(runs)} runs, cold: {_times(r)}, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB (target < 2 s)")
        report["compare_cached"] = r = _repeated(a.repeat, "compare", runs, None)
        console.print(f"compare of {len(runs)} runs, summaries kept: {_times(r)}")
    if a.scale_to_gpus:
        k = a.scale_to_gpus / a.gpus
        imp, summ = report["import"], report["summary_by_gpu"]
        report["scaled"] = scaled = {"gpus": a.scale_to_gpus, "factor": k, "samples": imp["rows"] * k,
                                     "bytes": imp["bytes"] * k, "import_s": imp["seconds"] * k,
                                     "summary_by_gpu_s": summ["seconds"] * k, "summary_cpu_s": summ["cpu_s"] * k,
                                     "summary_peak_rss_mb": summ["peak_rss_mb"]}
        console.print(
            f"scaled to {a.scale_to_gpus} GPUs (x{k:g}, arithmetic): {scaled['samples'] / 1e6:,.0f} M samples, "
            f"{scaled['bytes'] / 1e9:.1f} GB, import {scaled['import_s'] / 60:.0f} min, summarize --by gpu "
            f"{scaled['summary_by_gpu_s']:.0f} s ({scaled['summary_cpu_s']:.0f} s CPU) in the same peak RSS "
            f"{scaled['summary_peak_rss_mb']:.0f} MB (batches of at most BATCH_ROWS samples)"
        )
    if not a.skip_artifact:
        report["artifact_way"] = r = _measure("artifact", [str(csvs[0])])
        ratio = r["seconds"] / report["summary_by_gpu"]["seconds"]
        report["artifact_ratio"] = ratio
        console.print(f"artifact way (numpy loop over {len(METRICS) * a.gpus} CSVs): {r['seconds']:.1f} s wall, "
                      f"{r['cpu_s']:.1f} s CPU, peak RSS {r['peak_rss_mb']:.0f} MB -> summarize --by gpu is "
                      f"{ratio:.1f}x faster (target >= 8x)")
    console.print(f"load average during the run: {os.getloadavg()[0]:.1f} (2 cores)")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
elif __name__ == "__child__":
    child(sys.argv[1], sys.argv[2:])
