"""The train check: a short real training job sized to the node's devices, run under torchrun as
the launcher runs it, and the figures it measures against the plan (memory, TFLOP/s and MFU, what
implementation ran, the step time the speed model assumed)."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from charllm.engine.doctor.software import CheckFailed, Progress, error_line, today
from charllm.engine.launch.launcher import CANCEL_GRACE_S
from charllm.engine.launch.local import free_port
from charllm.engine.launch.process import describe_exit, root_cause
from charllm.engine.launch.target import train_argv
from charllm.engine.model import runtime, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import peak_tflops
from charllm.engine.model.memory import estimate
from charllm.engine.model.runtime import Implementation
from charllm.engine.model.validate import check
from charllm.probes.core import lifeline

TRAIN_ITERS = 10
TRAIN_TIMEOUT_S = 900.0

# The train check's model on a GPU: a Llama-style 1.5B layout (Llama 3's vocabulary, GQA 32/8,
# SwiGLU, RMSNorm, RoPE), shrunk along TRAIN_SHAPES until the memory plan fits the device. Its
# untied 128k-token embeddings alone are 0.5B parameters, so the last shapes take Llama 2's 32k.
LLAMA_1_5B = {
    "name": "llama-1.5b", "description": "Llama-style 1.5B layout for `doctor --train`",
    "num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 32,
    "num_query_groups": 8, "seq_length": 4096, "max_position_embeddings": 4096, "vocab_size": 128256,
    "swiglu": True, "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
    "normalization": "RMSNorm", "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
}
TRAIN_SHAPES = (   # layers, micro-batch, sequence, vocabulary
    (16, 2, 4096, 128256), (16, 1, 4096, 128256), (8, 1, 4096, 128256), (4, 1, 2048, 128256),
    (4, 1, 2048, 32000), (2, 1, 1024, 32000))
MICROBATCHES = 2                      # per step and rank: the gradient-accumulation path runs too
CPU_EXPERIMENT = "tiny-local"         # 2 CPU processes (DP2), the tiny model


def llama_experiment(hardware, gpus: int, layers: int = 16, micro_batch: int = 1, seq: int = 4096,
                     vocab: int = 128256, iters: int = TRAIN_ITERS):
    """The Llama-style train-check experiment on `gpus` devices of `hardware` (data parallel)."""
    exp = Experiment.from_dict({
        "name": f"doctor-{LLAMA_1_5B['name']}", "model": {**LLAMA_1_5B, "num_layers": layers, "vocab_size": vocab},
        "cluster": {"nodes": 1, "gpus_per_node": max(1, gpus)},
        "training": {"micro_batch_size": micro_batch, "global_batch_size": micro_batch * max(1, gpus) * MICROBATCHES,
                     "seq_length": seq, "train_iters": iters, "warmup_iters": min(2, iters - 1), "bf16": True},
    }, source="doctor")
    exp.hardware = hardware
    return exp


def train_experiment(hardware, gpus: int, iters: int = TRAIN_ITERS, stack: runtime.Stack | None = None):
    """(experiment, its memory plan) for the train check: on a GPU node the largest of TRAIN_SHAPES
    whose plan fits the device, on all its GPUs; on a CPU node the tiny model on 2 processes. The
    plan is for `stack`, the software found on the node (default: the hardware's planning stack),
    so that it plans what the job will run."""
    if hardware.vendor == "cpu":
        exp = Experiment.load(CPU_EXPERIMENT)
        exp.name = f"doctor-{CPU_EXPERIMENT}"
        exp.hardware = hardware
        exp.training.train_iters, exp.training.warmup_iters = iters, min(2, iters - 1)
        check(exp)
        return exp, estimate(exp, stack=stack)
    for layers, micro_batch, seq, vocab in TRAIN_SHAPES:
        exp = llama_experiment(hardware, gpus, layers, micro_batch, seq, vocab, iters)
        check(exp)
        plan = estimate(exp, stack=stack)
        if plan.fits:
            return exp, plan
    raise CheckFailed(f"even the smallest train check ({layers} layers, sequence {seq}, vocabulary {vocab}) "
                      f"does not fit {hardware.name}: {plan.budget.describe()}")



def run_train(exp, plan, *, node: str, progress: Progress, timeout: float = TRAIN_TIMEOUT_S,
              stop: threading.Event | None = None) -> dict:
    """Train `exp` with the workload under torchrun, as the launcher does, in a temporary run
    directory (removed afterwards, whatever happens; nothing is left running); the measurements.
    A failure raises CheckFailed with the failing rank's error line."""
    run_dir = Path(tempfile.mkdtemp(prefix="charllm-doctor-"))
    try:
        exp.save(run_dir / "experiment.toml")
        argv = train_argv(sys.executable, exp, str(run_dir), node_rank=0, master_addr="127.0.0.1",
                          master_port=free_port())
        log_path = run_dir / "train.log"
        progress(f"{node}: train check: starting torchrun, {exp.world_size} process(es) "
                 f"(importing torch and megatron-core takes a while)")
        with open(log_path, "wb") as log:
            # Its own session: the whole group (torchrun and its ranks) is stopped together; and
            # torchrun dies with this process (its ranks follow it), whoever kills it.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=run_dir, start_new_session=True, env={**os.environ, "CHARLLM_NODE": node},
                                    preexec_fn=lifeline.killed_with_parent)
        try:
            events = _follow(proc, run_dir, exp, node, progress, timeout, stop)
        finally:
            _stop_group(proc)
        if proc.returncode != 0:
            raise CheckFailed(f"train check failed: {_train_failure(log_path, proc.returncode)}")
        return measurements(exp, plan, events, node)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _follow(proc, run_dir: Path, exp, node: str, progress: Progress, timeout: float,
            stop: threading.Event | None) -> list[dict]:
    """The iteration log until torchrun exits, with a progress line per phase and iteration."""
    from charllm.probes.store.tail import IterationTail  # deferred: loads polars (start-up time)

    tail, events, seen = IterationTail(run_dir), [], set()
    deadline = time.monotonic() + timeout
    while True:
        finished = proc.poll() is not None
        for event in tail.poll():
            events.append(event)
            kind = event.get("event")
            if kind == "start" and "start" not in seen:
                seen.add("start")
                impl = Implementation.from_dict(event["runtime"]["implementation"])
                progress(f"{node}: train check: training {exp.model.name} on {event.get('world_size')} "
                         f"process(es), runs as {impl.describe()}")
            elif kind == "iteration" and event["iteration"] not in seen:
                seen.add(event["iteration"])
                ms = (event["end_ns"] - event["start_ns"]) / 1e6
                progress(f"{node}: train check: iteration {event['iteration']}/{exp.training.train_iters} "
                         f"{ms:.0f} ms")
        if finished:
            return events
        if stop is not None and stop.is_set():
            raise CheckFailed("train check: cancelled")
        if time.monotonic() > deadline:
            raise CheckFailed(f"train check: no end within {timeout:.0f} s (stopped; --timeout gives it longer)")
        time.sleep(0.2)


def _stop_group(proc) -> None:
    """TERM the job's process group, KILL what is left after a grace period, reap torchrun."""
    def alive() -> bool:
        proc.poll()   # reap torchrun: a zombie leader still counts as a member of its group
        try:
            os.killpg(proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    for sig, grace in ((signal.SIGTERM, CANCEL_GRACE_S), (signal.SIGKILL, 5.0)):
        if not alive():
            break
        os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
    proc.wait()


def _train_failure(log_path: Path, returncode: int) -> str:
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    cause = root_cause(log_path)
    who = f"rank {cause[0]} {describe_exit(cause[2])}" if cause else f"torchrun {describe_exit(returncode)}"
    return f"{who}: {error_line(text, returncode)}"


def measurements(exp, plan, events: list[dict], node: str) -> dict:
    """The train check's figures from the job's iteration log."""
    start = next((e for e in events if e.get("event") == "start"), None)
    end = next((e for e in reversed(events) if e.get("event") == "end" and e.get("memory")), None)
    iterations = {e["iteration"]: e for e in events if e.get("event") == "iteration"}
    if start is None or end is None or not iterations:
        raise CheckFailed("train check: the job exited 0 without a complete iteration log")
    steady = [e for e in iterations.values() if not e.get("warmup")] or list(iterations.values())
    tflops = statistics.median(e["tflops_per_gpu"] for e in steady)
    precision, peak = peak_tflops(exp, start["runtime"].get("tf32"))
    impl = start["runtime"]["implementation"]
    m, t = exp.model, exp.training
    out = {
        "node": node, "date": today(),
        "experiment": (f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, FFN {m.ffn}, "
                       f"{m.num_attention_heads}/{m.query_groups} heads, sequence {exp.seq_length}, "
                       f"micro-batch {t.micro_batch_size}, global batch {t.global_batch_size}, "
                       f"{'bf16' if t.bf16 else 'fp16' if t.fp16 else 'fp32'}, DP{exp.data_parallel_size}"),
        "world_size": start.get("world_size"), "device": start["layout"]["device"],
        "implementation": {**impl, "describe": Implementation.from_dict(impl).describe()},
        "planned_implementation": {**plan.implementation.to_dict(), "describe": plan.implementation.describe()},
        "iterations": len(iterations), "steady_iterations": len(steady),
        "iteration_ms_median": statistics.median((e["end_ns"] - e["start_ns"]) / 1e6 for e in steady),
        "tflops_per_gpu": tflops, "peak_precision": precision, "peak_tflops": peak,
        "mfu_pct": 100 * tflops / peak if peak else None,
        "planned_bytes": plan.stages[-1].total_bytes, "stages": end["memory"],
    }
    # the speed model's step for this job (assumed rates, what ran), and the GEMM efficiency that gives the measured one
    ran = Implementation.from_dict(impl)
    measured_s = out["iteration_ms_median"] / 1e3
    out["speed"] = {"measured_step_s": measured_s,
                    "assumed_step_s": float(speed.step_times(exp, speed.layouts_of(exp), ran,
                                                             exp.hardware.matmul_efficiency or None).step_s[0]),
                    "matmul_efficiency": speed.calibrated_efficiency(exp, measured_s, ran)}
    last = end["memory"][-1]
    outside = [s["outside_allocator_bytes"] for s in end["memory"] if s.get("outside_allocator_bytes") is not None]
    if out["device"] == "cuda":
        allocated, reserved = last["allocated_bytes"], last["reserved_bytes"]
        planned = out["planned_bytes"]
        # the allocator's reserve beyond the allocated peak, per byte of the iteration's churn (the
        # peak less what stays allocated between iterations): what engine.model.memory.Budget assumes
        churn = allocated - plan.stages[-1].steady_bytes
        out.update(allocated_bytes=allocated, plan_error_pct=100 * (allocated - planned) / planned,
                   reserved_bytes=reserved,
                   reserved_over_allocated=reserved / allocated if reserved and allocated else None,
                   fragmentation_bytes=reserved - allocated if reserved is not None else None,
                   reserve_fraction=max(0.0, (reserved - allocated) / churn) if reserved is not None and churn > 0
                   else None,
                   expandable_segments=exp.training.expandable_segments,
                   outside_allocator_bytes=max(outside) if outside else None)
    else:
        # No caching allocator on a CPU: the workload records each process's peak RSS instead.
        out.update(rss_bytes=last["allocated_bytes"], outside_allocator_bytes=None)
    return out
