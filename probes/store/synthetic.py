"""Synthetic run directories: the one builder behind the tests, the demo, benchmarks and screenshots.

`make_run()` writes a run in the format the probe and the launcher write — manifest, experiment,
iteration log, rank logs and telemetry chunks through the recorder's own `ChunkWriter` — from
signals its caller knows. The helpers build those signals: `gpu_frame()` (one device's samples),
`iteration_rows()` (an iteration log), `tiny_experiment()` (a small experiment whose FLOPs are easy
to check) and `cpu_run()` (a local CPU run as the host sampler records it). The demo
(`charllm.tui.demo`) drives the simulated backend and hands its samples to the same builder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from charllm.probes.core.formatting import GIB
from charllm.probes.store.recorder import ChunkWriter
from charllm.probes.store.rundir import RunDir
from charllm.probes.store.schema import conform

T0_NS = 1_700_000_000 * 10**9            # the synthetic clock's zero (2023-11-14 22:13:20 UTC)


def make_run(root: str | Path, frames: Sequence[pl.DataFrame] = (), *, run_id: str = "run-a",
             manifest: dict | None = None, experiment: str | None = None, iterations: list[dict] | None = None,
             logs: dict[str, str] | None = None, chunks: int = 2, chunk_rows: int | None = None) -> RunDir:
    """A run directory `root/run_id`: its manifest (a completed test run unless given), the
    experiment's TOML, the iteration log's rows, rank logs by file name, and `frames` as telemetry
    chunks per node (see `write_telemetry`)."""
    run = RunDir(Path(root) / run_id)
    run.path.mkdir(parents=True, exist_ok=True)
    run.claim("synthetic")
    run.write_manifest(manifest if manifest is not None else {"id": run_id, "status": "completed", "kind": "test"})
    if experiment is not None:
        run.experiment_path.write_text(experiment)
    if iterations is not None:
        run.iterations_path.write_text("".join(json.dumps(row) + "\n" for row in iterations))
    if logs is not None:
        run.logs_dir.mkdir(parents=True, exist_ok=True)
        for name, text in logs.items():
            (run.logs_dir / name).write_text(text)
    write_telemetry(run, frames, chunks=chunks, chunk_rows=chunk_rows)
    return run


def write_telemetry(
    run: RunDir, frames: Sequence[pl.DataFrame], *, chunks: int = 2, chunk_rows: int | None = None
) -> None:
    """Each node's rows of `frames`, in time order, as numbered Arrow chunks: `chunk_rows` rows a
    chunk (as a sampler flushes), or else split into `chunks` nearly equal chunks."""
    if not len(frames):
        return
    data = pl.concat(frames).sort("ts_ns", maintain_order=True)
    for part in data.partition_by("node", maintain_order=True):
        writer = ChunkWriter(run.node_telemetry_dir(part["node"][0]), compact_every=None)
        if chunk_rows:
            pieces = [part.slice(lo, chunk_rows) for lo in range(0, part.height, chunk_rows)]
        else:
            pieces = [part[int(i[0]):int(i[-1]) + 1] for i in np.array_split(np.arange(part.height), chunks) if len(i)]
        for piece in pieces:
            writer.write(piece)


def gpu_frame(t_s, node="n0", device="gpu0", **metrics) -> pl.DataFrame:
    """One GPU's samples at times `t_s` (seconds after T0) with the given metric columns."""
    t_ns = T0_NS + np.round(np.asarray(t_s, dtype=float) * 1e9).astype(np.int64)
    n = len(t_ns)
    data = {"ts_ns": t_ns, "mono_ns": t_ns - T0_NS, "node": [node] * n, "device": [device] * n,
            "uuid": [f"GPU-{node}-{device}"] * n, "backend": ["sim"] * n, "simulated": [True] * n}
    data.update({k: (list(v) if np.ndim(v) else [v] * n) for k, v in metrics.items()})
    return conform(pl.DataFrame(data))


def iteration_rows(starts_s, duration_s, *, warmup: int = 0, samples=8, tokens=None) -> list[dict]:
    """Iteration-log lines (rank 0 and last rank each log every step, as the workload does)."""
    rows = [{"event": "start", "rank": 0}]
    for i, s in enumerate(starts_s, start=1):
        for rank in (0, 1):
            rows.append({
                "event": "iteration", "iteration": i, "rank": rank, "node": "n0",
                "start_ns": T0_NS + int(round(s * 1e9)), "end_ns": T0_NS + int(round((s + duration_s) * 1e9)),
                "samples": samples, "tokens": tokens, "warmup": i <= warmup,
            })
    return rows


def tiny_experiment(name: str = "x", *, bf16_tflops: float = 1.0, gpus_per_node: int | None = 1,
                    micro_batch_size: int | None = None, extra_hardware: str = "") -> str:
    """The TOML of a tiny experiment (2 layers, hidden 64, 4 heads, 32 tokens, vocabulary 1,024,
    global batch 8) whose FLOPs the summaries' figures are checked against; `gpus_per_node=None`
    leaves the cluster at its default."""
    cluster = f"[cluster]\nnodes = 1\ngpus_per_node = {gpus_per_node}\n" if gpus_per_node else ""
    mbs = f"micro_batch_size = {micro_batch_size}\n" if micro_batch_size else ""
    return (f'name = "{name}"\n[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n'
            f"seq_length = 32\nvocab_size = 1024\n[hardware]\nbf16_tflops = {bf16_tflops}\n{extra_hardware}"
            f"{cluster}[training]\n{mbs}global_batch_size = 8\n")


def cpu_run(root, run_id: str, step_s: float, *, with_iterations: bool = True, busy_pct: float = 80.0) -> RunDir:
    """A local CPU run as the host sampler records it: host rows only (no accelerator), each
    tagged with the training iteration in progress, and its iteration log."""
    t = np.round(np.arange(0, 121) * 0.1, 10)  # 12 s at 10 Hz
    starts = np.arange(0, 12 - step_s, step_s)
    iteration = np.searchsorted(starts, t, side="right") if with_iterations else None
    metrics = {"cpu_util_pct": busy_pct + 5 * np.sin(t), "cpu_freq_mhz": 2400.0, "temp_cpu_c": 50.0 + t,
               "host_mem_used_bytes": 3 * GIB}
    if iteration is not None:
        metrics["iteration"] = iteration
    rows = iteration_rows(starts, step_s * 0.95, warmup=2, tokens=256)
    return make_run(root, [gpu_frame(t, node="node0", device="host", **metrics)], run_id=run_id,
                    experiment=tiny_experiment(run_id), iterations=rows)
