"""Deterministic recorded runs for snapshot tests, screenshots and benchmarks.

`make_demo_run()` writes a complete run directory — manifest, experiment, iteration log, logs and
telemetry chunks, through the one synthetic-run builder (`charllm.probes.store.synthetic`) — from
the simulated backend driven by a fixed clock and seed, so every byte
(and every pixel of the screens that show it) is the same on every machine. Everything it writes
says it is simulated (`simulated = true` rows, `"simulated": true` in the manifest).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import polars as pl

from charllm.engine import doctor
from charllm.engine.launch.targets import LOCAL
from charllm.engine.model import calibration, catalog
from charllm.engine.model.experiment import Cluster, Experiment, Hardware, ModelSpec
from charllm.probes.backends import open_backend
from charllm.probes.core import paths
from charllm.probes.core.formatting import GIB
from charllm.probes.store.rundir import run_id_name
from charllm.probes.store.schema import conform
from charllm.probes.store.synthetic import make_run, write_telemetry

T0_NS = 1_763_712_000_000_000_000        # 2025-11-21 08:00:00 UTC: the fixed clock's zero


def demo_experiment(name: str, *, gpus: int = 8, nodes: int = 1, hardware: str = "h100-sxm-80gb",
                    model: str = "llama3-8b", global_batch_size: int = 8) -> Experiment:
    """The demo runs' experiment: bf16 with the distributed optimizer, `global_batch_size` sequences."""
    exp = Experiment(name=name, model=ModelSpec.load(model), hardware=Hardware.load(hardware),
                     cluster=Cluster(nodes=nodes, gpus_per_node=gpus))
    exp.training.global_batch_size = global_batch_size
    exp.training.bf16 = True
    exp.parallel.use_distributed_optimizer = True
    return exp


def make_demo_run(root: Path, run_id: str = "20251121-080000-demo-8gpu", *, gpus: int = 8, nodes: int = 1,
                  seconds: float = 40.0, hz: float = 10.0, seed: int = 7, iteration_s: float = 1.2,
                  power_limit_w: float | None = 550.0, status: str = "completed",
                  hardware: str = "h100-sxm-80gb", model: str = "llama3-8b", experiment: Experiment | None = None,
                  t0_ns: int = T0_NS, record: dict | None = None) -> Path:
    """A recorded run of `experiment` (by default: Llama-3 8B on `nodes` x `gpus` H100s), starting at
    `t0_ns`; `record` adds to its manifest (a campaign member's run says which)."""
    if experiment is None:
        # 8 sequences of 8192 tokens in 1.2 s on 8 H100s: about 40% MFU for Llama-3 8B, as measured runs give
        exp = demo_experiment(run_id_name(run_id) or run_id, gpus=gpus, nodes=nodes, hardware=hardware, model=model)
    else:
        exp = experiment.copy()
        nodes, gpus, hardware = exp.cluster.nodes, exp.cluster.gpus_per_node, exp.hardware.name
    exp.training.train_iters = int(seconds / iteration_s)

    # The iteration log first: the simulator's load follows it (busy inside iterations).
    ns = 10**9
    events: list[dict[str, Any]] = [
        {"event": "start", "world_size": nodes * gpus, "rank": 0, "node": "node0", "start_ns": t0_ns}]
    tokens = exp.training.global_batch_size * exp.seq_length
    for i in range(1, exp.training.train_iters + 1):
        start = t0_ns + int(((i - 1) * iteration_s + 0.5) * ns)
        end = start + int((iteration_s - 0.1 - 0.02 * (i % 3)) * ns)
        events.append({"event": "iteration", "iteration": i, "rank": 0, "node": "node0", "start_ns": start,
                       "end_ns": end, "loss": round(10.5 - 0.12 * i, 4), "grad_norm": 1.0,
                       "samples": exp.training.global_batch_size, "tokens": tokens, "mem_peak_bytes": 61 * GIB,
                       "mem_reserved_bytes": 64 * GIB, "tflops_per_gpu": 388.0 + i % 5, "warmup": i <= 2})
    events.append({"event": "end", "status": status, "rank": 0, "node": "node0",
                   "end_ns": t0_ns + int(seconds * ns)})
    log = "".join(
        f"iteration {e['iteration']:>4} | loss {e['loss']:.4f} | {(e['end_ns'] - e['start_ns']) / 1e6:.0f} ms\n"
        for e in events
        if e["event"] == "iteration"
    )
    manifest = {"id": run_id, "kind": "train", "name": exp.name, "status": status, "simulated": True,
                "created_ns": t0_ns, "started_ns": t0_ns, "ended_ns": t0_ns + int(seconds * ns),
                "target": {"name": LOCAL.name, "kind": LOCAL.kind},
                "nodes": [f"node{n}" for n in range(nodes)], "world_size": nodes * gpus, **(record or {})}
    rd = make_run(root, run_id=run_id, manifest=manifest, experiment=exp.to_toml(), iterations=events,
                  logs={"rank0.log": log})

    frames = []
    for n in range(nodes):
        now = [0.0]
        sim = open_backend("sim", gpus=gpus, seed=seed + n, clock=lambda: now[0], profile="iterations:" + str(rd.path),
                           hardware=hardware, power_limit_w=power_limit_w, tau_s=6.0)
        rows = []
        for k in range(int(seconds * hz)):
            now[0] = k / hz
            ts = t0_ns + int(k / hz * ns)
            it = next((e["iteration"] for e in events[1:-1] if e["start_ns"] <= ts <= e["end_ns"]), None)
            for row in sim.sample():
                row.update(ts_ns=ts, mono_ns=int(k / hz * ns), node=f"node{n}", iteration=it, missed_deadlines=0)
                rows.append(row)
        frames.append(conform(pl.from_dicts(rows, infer_schema_length=None)))
    write_telemetry(rd, frames, chunk_rows=int(hz * 10) * gpus)  # ten-second chunks, as a sampler would flush
    return rd.path


DEMO_CAMPAIGN = "demo-microbatch"


def make_demo_campaign(root: Path, name: str = DEMO_CAMPAIGN, seconds: float = 24.0) -> Path:
    """A finished campaign of recorded runs, as `charllm-tui campaign run` leaves one: Llama-3 8B
    (sequences of 4096) on 8 H100s in three tensor-parallel layouts x micro batch 1, 2 and 4, one
    member at a time. Its
    file and base experiment are the user's (`<config>/campaigns`, `<config>/experiments`); each
    member that its plan runs has a recorded run from `make_demo_run` (the fixed clock and seeds);
    the others are recorded as the plan left them (does not fit, or the rule it breaks). Returns the
    record's path."""
    from charllm.engine.campaign import spec, state  # deferred: only the campaign demo needs them
    from charllm.engine.launch.targets import get_target  # deferred: only the campaign demo needs it

    base = demo_experiment("demo-llama3-8b", global_batch_size=16)
    base.training.seq_length = 4096
    base.save(catalog.new_user_preset("experiments", base.name))
    folder = paths.config_dir() / spec.KIND
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.toml").write_text(
        f'description = "Simulated: Llama-3 8B on 8 H100s, TP 1/2/4 x micro batch 1/2/4"\n'
        f'experiments = ["{base.name}"]\n\n[axes]\nmicro_batch_size = [1, 2, 4]\n\n'
        + "".join(f"[[layouts]]\ntensor_model_parallel_size = {tp}\n" for tp in (1, 2, 4)))
    campaign = spec.Campaign.load(name)
    record = state.Record.new(campaign, campaign.plan(), get_target("local").to_dict(), include_oom=False,
                              max_parallel=1)
    experiments = {m.index: m.experiment for m in campaign.members()}
    ns, start = 10**9, T0_NS
    for m in record.members:
        if m["status"] != state.QUEUED:
            continue
        tp, mbs = m["varied"]["tensor_model_parallel_size"], m["micro_batch_size"]
        # bigger micro batches run more efficiently, wider tensor parallelism pays more communication
        iteration_s = 1.0 * (1 + 0.12 * (tp - 1)) * (1 - 0.08 * (mbs - 1))
        run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(start // ns))}-{m['name']}"
        make_demo_run(root, run_id, seconds=seconds, seed=11 + m["index"], iteration_s=iteration_s,
                      experiment=experiments[m["index"]], t0_ns=start,
                      record={"campaign": {"name": name, "member": m["index"]}})
        m.update(status="completed", run=run_id, runs=[run_id], started_ns=start, ended_ns=start + int(seconds * ns))
        start += int((seconds + 5) * ns)
    record.data.update(created_ns=T0_NS, started_ns=T0_NS, ended_ns=start, status="completed")
    record.save()
    return record.path


def save_demo_calibration(node: str = "node0", date: str = "2025-11-21") -> Path:
    """A fixed CPU-node calibration, as `charllm-tui doctor --train` saved it on a 2-core CPU machine
    (its figures rounded), for the Doctor screen's snapshot and screenshot. No GPU is claimed."""
    host = {"device": "host", "backend": "host", "target_hz": 20.0, "rows": 40, "achieved_hz": 20.0}
    report: dict[str, Any] = {
        "node": node, "date": date, "hardware": "cpu", "hardware_reason": "no GPU: training runs on the CPU",
        "errors": [], "driver": None, "devices": [], "stack": {"cuda": False, "capability": None, "extensions": []},
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None, "nccl": None,
                     "megatron_core": "0.16.1", "transformer_engine": None},
        "implementation": {"transformer_impl": "local", "attention": "sdpa", "fusions": [], "device": "cpu",
                           "describe": "local (megatron-core), attention sdpa, fusions none, on CPU"},
        "telemetry": {"backend": "host", "reason": "nvml: NVML Shared Library Not Found; amdsmi: libamd_smi.so "
                                                   "not found; using host only",
                      "devices": [{"device": "host", "backend": "host", "simulated": False, "name": node,
                                   "uuid": f"host-{node}", "metrics": ["cpu_util_pct", "cpu_freq_mhz",
                                   "host_mem_used_bytes", "host_mem_total_bytes", "net_tx_bytes", "net_rx_bytes"]}]},
        "sampling": [
            {"hz": 20.0, "seconds": 2.0, "ticks": 40, "missed_deadlines": 0,
             "devices": [{**host, "interval_ms": {"median": 50.0, "p99": 50.2, "max": 50.2}}]},
            {"hz": 100.0, "seconds": 2.0, "ticks": 200, "missed_deadlines": 0,
             "devices": [{**host, "interval_ms": {"median": 50.0, "p99": 51.6, "max": 51.6}}]},
        ],
        "train": {
            "node": node, "date": date, "world_size": 2, "device": "cpu",
            "experiment": "tiny-dense: 4 layers, hidden 64, FFN 256, 4/4 heads, sequence 32, micro-batch 2, "
                          "global batch 8, fp32, DP2",
            "implementation": {"transformer_impl": "local", "attention": "sdpa", "fusions": [], "device": "cpu",
                               "describe": "local (megatron-core), attention sdpa, fusions none, on CPU"},
            "iterations": 10, "steady_iterations": 8, "iteration_ms_median": 87.0, "tflops_per_gpu": 0.00239,
            "peak_tflops": 0.5, "mfu_pct": 0.478, "planned_bytes": 39447040, "rss_bytes": 430080000,
            "outside_allocator_bytes": None,
            "stages": [{"pp_rank": 0, "allocated_bytes": 430080000, "reserved_bytes": None,
                        "outside_allocator_bytes": None}],
        },
    }
    return calibration.save(doctor.calibration_record(report))
