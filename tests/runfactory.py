"""Build run directories from known signals: Arrow chunks in RunDir layout, an experiment, a log."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl

from charllm.probes.store.rundir import RunDir
from charllm.probes.store.schema import conform

T0_NS = 1_700_000_000 * 10**9


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


def gpu_frame(t_s, node="n0", device="gpu0", **metrics) -> pl.DataFrame:
    """One GPU's samples at times `t_s` (seconds after T0) with the given metric columns."""
    t_ns = T0_NS + np.round(np.asarray(t_s, dtype=float) * 1e9).astype(np.int64)
    n = len(t_ns)
    data = {"ts_ns": t_ns, "mono_ns": t_ns - T0_NS, "node": [node] * n, "device": [device] * n,
            "uuid": [f"GPU-{node}-{device}"] * n, "backend": ["sim"] * n, "simulated": [True] * n}
    data.update({k: (list(v) if np.ndim(v) else [v] * n) for k, v in metrics.items()})
    return conform(pl.DataFrame(data))


def make_run(root: Path, frames: list[pl.DataFrame], *, experiment: str | None = None,
             iterations: list[dict] | None = None, chunks: int = 2, run_id: str = "run-a") -> RunDir:
    """A run directory holding `frames` as Arrow IPC chunks per node (split into `chunks` files)."""
    run = RunDir(Path(root) / run_id)
    run.write_manifest({"id": run_id, "status": "completed", "kind": "test"})
    data = pl.concat(frames).sort("ts_ns")
    for (node,), part in data.group_by(["node"]):
        out = run.node_telemetry_dir(node)
        out.mkdir(parents=True, exist_ok=True)
        for i, piece in enumerate(np.array_split(np.arange(part.height), chunks)):
            if len(piece):
                part[int(piece[0]):int(piece[-1]) + 1].write_ipc(out / f"{i:06d}.arrow")
    if experiment is not None:
        run.experiment_path.write_text(experiment)
    if iterations is not None:
        with open(run.iterations_path, "w") as fh:
            for row in iterations:
                fh.write(json.dumps(row) + "\n")
    return run


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


def cpu_run(root, run_id: str, step_s: float, *, with_iterations: bool = True, busy_pct: float = 80.0):
    """A local CPU run as the host sampler records it: host rows only (no accelerator), each
    tagged with the training iteration in progress, and its iteration log."""
    t = np.round(np.arange(0, 121) * 0.1, 10)  # 12 s at 10 Hz
    starts = np.arange(0, 12 - step_s, step_s)
    iteration = np.searchsorted(starts, t, side="right") if with_iterations else None
    metrics = {"cpu_util_pct": busy_pct + 5 * np.sin(t), "cpu_freq_mhz": 2400.0, "temp_cpu_c": 50.0 + t,
               "host_mem_used_bytes": 3 * 2**30}
    if iteration is not None:
        metrics["iteration"] = iteration
    rows = iteration_rows(starts, step_s * 0.95, warmup=2, tokens=256)
    return make_run(root, [gpu_frame(t, node="node0", device="host", **metrics)], run_id=run_id,
                    experiment=tiny_experiment(run_id), iterations=rows)
