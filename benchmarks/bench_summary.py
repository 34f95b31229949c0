"""Benchmark: summaries of a 1-hour, 64-GPU, 20 Hz recording (~4.6M rows), compare of 4 runs,
and the CharLLM-PPT artifact's way (a per-file numpy loop over its CSVs) for reference.

    python benchmarks/bench_summary.py [--cache /tmp/charllm-bench-summary] [--seconds 3600]
                                       [--chunk-s 1] [--skip-artifact]

Targets (2-core machine): summary per GPU and per run < 2 s and < 2 GB peak RSS each;
compare of 4 runs < 3 s. Each measurement runs in a fresh process so peak RSS is its own.
The recordings are generated once and cached (written by the recorder's ChunkWriter, a chunk
closed every --chunk-s seconds and compacted as the sampler does; CSVs in the artifact's
`{metric}_{rank}.csv` layout).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

NODES, GPUS_PER_NODE, HZ = 8, 8, 20
T0_NS = 1_763_700_000 * 10**9

EXPERIMENT = """\
name = "bench-llama3-70b-h100"
[model]
num_layers = 80
hidden_size = 8192
ffn_hidden_size = 28672
num_attention_heads = 64
num_query_groups = 8
seq_length = 8192
vocab_size = 128256
swiglu = true
[hardware]
name = "h100-sxm-80gb"
bf16_tflops = 989.0
temp_limit_c = 85.0
max_sm_clock_mhz = 1980.0
[cluster]
nodes = 8
gpus_per_node = 8
[parallel]
tensor_model_parallel_size = 8
pipeline_model_parallel_size = 4
[training]
global_batch_size = 128
"""


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
def gpu_signals(seconds: int, gpu: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Bursty training power (an iteration every 12 s: compute burst then communication)."""
    n = seconds * HZ
    t = np.arange(n) / HZ
    phase = (t % 12.0) / 12.0
    power = np.where(phase < 0.7, 620.0, 380.0) + rng.normal(0, 25, n) + gpu
    temp = 55 + 25 * (1 - np.exp(-t / 600)) + rng.normal(0, 0.5, n) + (gpu % 8)
    clock = np.where(power > 680, 1755.0, 1980.0)
    throttle = np.where(power > 680, 0x4, 0) | np.where(temp > 84, 0x20, 0)
    energy = 1e9 + np.concatenate([[0.0], np.cumsum((power[1:] + power[:-1]) / 2 / HZ)])
    link = (np.cumsum(rng.integers(0, 40_000_000, n)) + 2**32 - 10**9) % 2**32  # wraps, 32-bit
    return {
        "t": t, "power_w": power, "energy_j": energy, "temp_gpu_c": temp, "temp_mem_c": temp + 6,
        "sm_clock_mhz": clock, "mem_clock_mhz": np.full(n, 2619.0), "util_gpu_pct": np.where(phase < 0.7, 99.0, 40.0),
        "util_mem_pct": np.where(phase < 0.7, 60.0, 20.0), "mem_power_w": power * 0.12,
        "power_limit_w": np.full(n, 700.0), "throttle_reasons": throttle.astype(np.int64),
        "pcie_tx_bytes_s": np.full(n, 2.5e8), "pcie_rx_bytes_s": np.full(n, 1.5e8),
        "nvlink_tx_bytes": link.astype(np.int64), "nvlink_rx_bytes": link.astype(np.int64),
        "mem_used_bytes": np.full(n, 70 * 2**30, dtype=np.int64),
    }


def make_run(root: Path, name: str, seconds: int, chunk_s: int, seed: int) -> Path:
    from charllm.probes.recorder import ChunkWriter
    from charllm.probes.rundir import RunDir
    from charllm.probes.schema import conform

    run = RunDir(root / name)
    if run.manifest_path.exists():
        return run.path
    rng = np.random.default_rng(seed)
    rows_per_chunk = chunk_s * HZ
    for node in range(NODES):
        per_gpu = [gpu_signals(seconds, node * GPUS_PER_NODE + g, rng) for g in range(GPUS_PER_NODE)]
        n = seconds * HZ
        cols = {k: np.stack([s[k] for s in per_gpu], axis=1).reshape(-1) for k in per_gpu[0] if k != "t"}
        ts = (T0_NS + np.repeat(np.arange(n) * (10**9 // HZ), GPUS_PER_NODE)).astype(np.int64)
        frame = conform(pl.DataFrame({
            "ts_ns": ts, "mono_ns": ts - T0_NS, "node": f"node{node}",
            "device": np.tile([f"gpu{g}" for g in range(GPUS_PER_NODE)], n),
            "uuid": np.tile([f"GPU-{node}-{g}" for g in range(GPUS_PER_NODE)], n),
            "backend": "sim", "simulated": True, **cols,
        }))
        # The recorder's own layout: a chunk every --chunk-s seconds, compacted as it goes.
        writer = ChunkWriter(run.node_telemetry_dir(f"node{node}"))
        step = rows_per_chunk * GPUS_PER_NODE
        for start in range(0, frame.height, step):
            writer.write(frame.slice(start, step))
        writer.close()
    run.experiment_path.write_text(EXPERIMENT)
    with open(run.iterations_path, "w") as fh:
        for i in range(seconds // 12):
            for rank in (0, 63):
                fh.write(json.dumps({"event": "iteration", "iteration": i + 1, "rank": rank,
                                     "start_ns": T0_NS + i * 12 * 10**9, "end_ns": T0_NS + (i + 1) * 12 * 10**9,
                                     "samples": 128, "warmup": i < 2}) + "\n")
    run.write_manifest({"id": name, "status": "completed", "kind": "benchmark", "simulated": True})
    return run.path


ARTIFACT_METRICS = ("gpu_power", "mem_power", "gpu_thermal", "mem_thermal", "sm_clock", "mem_clock",
                    "gpu_util", "mem_util", "nvlink_tx_throughput", "nvlink_rx_throughput")


def make_csvs(root: Path, seconds: int) -> Path:
    """The same signals as the artifact's CSVs: `{metric}_{rank}.csv`, `unix_time_s,value`."""
    out = root / "charllm-ppt-csv"
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = {"gpu_power": "power_w", "mem_power": "mem_power_w", "gpu_thermal": "temp_gpu_c",
             "mem_thermal": "temp_mem_c", "sm_clock": "sm_clock_mhz", "mem_clock": "mem_clock_mhz",
             "gpu_util": "util_gpu_pct", "mem_util": "util_mem_pct",
             "nvlink_tx_throughput": "nvlink_tx_bytes", "nvlink_rx_throughput": "nvlink_rx_bytes"}
    for rank in range(NODES * GPUS_PER_NODE):
        s = gpu_signals(seconds, rank, rng)
        t = T0_NS / 1e9 + s["t"]
        for metric, col in names.items():
            value = s[col] // 1024 if metric.startswith("nvlink") else s[col]  # the artifact logged KiB
            pl.DataFrame({"t": t, "v": value}).write_csv(out / f"{metric}_{rank}.csv", include_header=False)
    (out / "done").touch()
    return out


# --------------------------------------------------------------------------------------------
# Measurements (each in its own process)
# --------------------------------------------------------------------------------------------
def _measure(kind: str, args: list[str]) -> dict:
    code = f"import sys; sys.argv = {['x', kind, *args]!r}; import runpy; runpy.run_path({__file__!r}, run_name='__child__')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(kind: str, args: list[str]) -> None:
    import charllm.probes.summary  # noqa: F401 - imports are not what we measure

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    if kind == "summary":
        from charllm.probes.summary import summarize

        df = summarize(args[0], "steady", by=args[1])
        extra = {"rows": df.height}
    elif kind == "compare":
        from charllm.probes.compare import compare

        result = compare(args)
        extra = {"metrics": result.table.height}
    elif kind == "scan":
        from charllm.probes.rundir import RunDir

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

    def delta_with_overflow(values, max_uint32=4294967295):
        deltas = []
        for i in range(1, len(values)):
            deltas.append((max_uint32 - values[i - 1]) + values[i] if values[i] < values[i - 1]
                          else values[i] - values[i - 1])
        return deltas

    results = []
    for rank in range(NODES * GPUS_PER_NODE):
        load = lambda m: np.loadtxt(csv_dir / f"{m}_{rank}.csv", delimiter=",")  # noqa: E731
        r = {}
        for metric in ("gpu_power", "mem_power", "gpu_thermal", "mem_thermal", "gpu_util", "mem_util"):
            a = load(metric)
            r[metric] = (weighted(a), a[:, 1].max())
        for metric in ("sm_clock", "mem_clock"):
            r[metric] = weighted(load(metric)) / 1000
        for metric in ("nvlink_tx_throughput", "nvlink_rx_throughput"):
            r[metric] = sum(delta_with_overflow(load(metric)[:, 1])) / 1024 / 1024
        power = load("gpu_power")
        r["energy"] = np.trapezoid(power[:, 1], power[:, 0])
        results.append(r)
    return len(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/charllm-bench-summary"))
    ap.add_argument("--seconds", type=int, default=3600)
    ap.add_argument("--chunk-s", type=int, default=1, help="seconds per Arrow chunk (the sampler closes one every second)")
    ap.add_argument("--skip-artifact", action="store_true")
    a = ap.parse_args()
    from rich.console import Console

    console = Console()
    root = a.cache / f"{a.seconds}s-{a.chunk_s}s-chunks-compacted"
    root.mkdir(parents=True, exist_ok=True)
    with console.status("generating recordings (cached after the first time)..."):
        runs = [make_run(root, f"run{i}", a.seconds, a.chunk_s, seed=i) for i in range(4)]
    from charllm.probes.rundir import RunDir

    files = len(RunDir(runs[0]).telemetry_files())
    report = {"load_average_1min": os.getloadavg()[0]}
    report["scan_telemetry"] = r = _measure("scan", [str(runs[0])])
    console.print(f"recording: {r['rows']:,} rows in {files:,} files per run, {NODES * GPUS_PER_NODE} GPUs, {HZ} Hz; "
                  f"RunDir.scan_telemetry() of 3 columns: {r['seconds']:.2f} s wall, {r['cpu_s']:.2f} s CPU")

    import shutil

    def clear_caches():  # summaries of finished runs are cached in RUN_DIR/summaries/
        for p in runs:
            shutil.rmtree(p / "summaries", ignore_errors=True)

    for by in ("gpu", "run"):
        clear_caches()
        report[f"summary_by_{by}"] = r = _measure("summary", [str(runs[0]), by])
        console.print(f"summary --by {by} (cold): {r['seconds']:.2f} s wall, {r['cpu_s']:.2f} s CPU, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB (target < 2 s, < 2048 MB)")
    clear_caches()
    report["compare_4_runs_cold"] = r = _measure("compare", [str(p) for p in runs])
    console.print(f"compare of 4 runs, cold: {r['seconds']:.2f} s wall, {r['cpu_s']:.2f} s CPU, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB (target < 3 s)")
    report["compare_4_runs_cached"] = r = _measure("compare", [str(p) for p in runs])
    console.print(f"compare of 4 runs, summaries cached: {r['seconds']:.2f} s wall, peak RSS {r['peak_rss_mb']:.0f} MB")
    console.print(f"load average during the run: {os.getloadavg()[0]:.1f} (2 cores)")
    if not a.skip_artifact:
        with console.status("writing the artifact's CSVs (cached after the first time)..."):
            csv_dir = make_csvs(root, a.seconds)
        report["artifact_way"] = r = _measure("artifact", [str(csv_dir)])
        ratio = r["seconds"] / report["summary_by_gpu"]["seconds"]
        report["artifact_ratio"] = ratio
        console.print(f"artifact way (numpy loop over {len(ARTIFACT_METRICS) * NODES * GPUS_PER_NODE} CSVs): "
                      f"{r['seconds']:.1f} s wall, {r['cpu_s']:.1f} s CPU, peak RSS {r['peak_rss_mb']:.0f} MB "
                      f"-> {ratio:.1f}x the time of summary --by gpu")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
elif __name__ == "__child__":
    child(sys.argv[1], sys.argv[2:])
