"""Checking a node: what `charllm-tui doctor` gathers, headless (the CLI and the TUI show it).

`gather()` returns the report, a plain JSON-able dict, so that a remote node's report (`doctor
--json` over ssh or srun, `on_target()`) reads exactly like this node's:

    node, date                 the node's name and the UTC date (YYYY-MM-DD)
    hardware, hardware_reason  the hardware preset this node is: matched by device name and memory
                               (`match_hardware`), or --hardware; None for an unknown GPU
    versions, driver, devices, stack
                               `runtime.describe(runtime.detect())`, run in a child interpreter so
                               that importing torch and every extension stays out of this process
                               (the TUI's)
    implementation             what transformer_impl = "auto" becomes here for a Llama-style model
    telemetry                  the backend `auto` picks, why, and each device's supported metrics
    sampling                   the real sampler, ~2 s at 20 Hz and at 100 Hz: rows per device per
                               second, intervals between a device's rows, missed deadlines
    train                      (--train) a short real training job sized to the device: allocator
                               peak against the plan, reserved against allocated, memory outside
                               the allocator, TFLOP/s and MFU, what implementation ran, the step
                               time the speed model assumed for it and the large-GEMM efficiency
                               that gives the measured one (engine.model.speed)
    errors                     one line per failed check (the CLI exits 1 when there is any)

`calibration_record()` turns a report into the node calibration `engine.model.calibration` saves and
planning reads. Without a train check the record holds the stack and torch's capacity only; a
memory or speed measurement an earlier `--train` made on the same stack is kept, never replaced by
less.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from charllm.engine.launch.launcher import CANCEL_GRACE_S
from charllm.engine.launch.local import free_port
from charllm.engine.launch.process import describe_exit, root_cause
from charllm.engine.launch.target import train_argv
from charllm.engine.model import calibration, catalog, runtime, speed
from charllm.engine.model.experiment import Experiment, Hardware
from charllm.engine.model.flops import peak_tflops
from charllm.engine.model.memory import estimate
from charllm.engine.model.runtime import Implementation
from charllm.engine.model.validate import check
from charllm.probes.backends import inventory, open_backends
from charllm.probes.backends.base import check_hz, hostname
from charllm.probes.core import lifeline, procid
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import gib

SAMPLING_HZ = (20.0, 100.0)
SAMPLE_SECONDS = 2.0
TRAIN_ITERS = 10
TRAIN_TIMEOUT_S = 900.0
SOFTWARE_TIMEOUT_S = 300.0

# A node's GPUs are a hardware preset when their name matches one of its device_names, their compute
# capability is its compute_capability (where both are known), and their memory is its usable_bytes
# within MEMORY_TOLERANCE (an A100 80GB from a 40GB that reports the same name pattern).
MEMORY_TOLERANCE = 0.05

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

# What a calibration keeps of a report (besides its memory figures and the train check).
RECORD_KEYS = ("hardware", "hardware_reason", "node", "date", "stack", "versions", "driver", "devices",
               "implementation", "telemetry", "sampling")

Progress = Callable[[str], None]


class CheckFailed(Exception):
    """A check could not be done on this node; the message is one line naming the cause."""


# --------------------------------------------------------------------------------------------
# The node
# --------------------------------------------------------------------------------------------
def node_name(node: str | None = None) -> str:
    """The node's name as runs record it: given, the launcher's, Slurm's, else the host's."""
    return node or os.environ.get("CHARLLM_NODE") or os.environ.get("SLURMD_NODENAME") or hostname()


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def software(timeout: float = SOFTWARE_TIMEOUT_S) -> dict:
    """`runtime.describe(runtime.detect())` of this node, from a child interpreter."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"importing torch and its extensions took over {timeout:.0f} s") from None
    if done.returncode != 0:
        raise CheckFailed(f"cannot read this node's software stack: {error_line(done.stderr, done.returncode)}")
    # The last line: an extension's C library may print to the child's stdout as it loads.
    return json.loads(done.stdout.strip().splitlines()[-1])


def error_line(text: str, returncode: int | None = None) -> str:
    """The line of a process's output that says why it failed: our own error line, else the last
    exception line (not torchrun's summary of it), else the last line."""
    import re

    lines = [re.sub(r"^\[(default|rank)\d+\]:\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    ours = [line for line in lines if "charllm-tui: error:" in line]
    if ours:
        return ours[-1].split("charllm-tui: error:", 1)[1].strip()
    exception = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:.*)?$")
    raised = [line for line in lines if exception.match(line) and "ChildFailedError" not in line]
    if raised:
        return raised[-1]
    if lines:
        return lines[-1]
    return f"exit status {returncode}" if returncode is not None else "no output"


def match_hardware(devices: list[dict]) -> tuple[str | None, str]:
    """(hardware preset, why) for the node's devices as `runtime.describe` lists them; the preset is
    None for a GPU no preset matches, and the reason then asks for --hardware."""

    if not devices:
        return "cpu", "no GPU: training runs on the CPU"
    names = sorted({d["name"] for d in devices})
    if len(names) > 1:
        return None, f"mixed GPUs ({', '.join(names)}): say which preset with --hardware NAME"
    name, total = devices[0]["name"], min(d["total_bytes"] for d in devices)
    capability = devices[0].get("capability")
    found = [hw.name for hw in hardware_presets() if is_device(hw, name, capability, total)]
    if len(found) == 1:
        return found[0], f"{len(devices)} x {name}, {gib(total)}"
    seen = f"unknown GPU {name!r} with {gib(total)}" if not found else \
        f"{name!r} with {gib(total)} matches several hardware presets ({', '.join(found)})"
    return None, (f"{seen}: pass --hardware NAME (`charllm-tui presets list hardware`, or add one with this "
                  "name in device_names to <config>/hardware/)")


def hardware_presets():
    """Every hardware preset, the user's and the shipped ones (a user's file over a shipped one of its name)."""
    for name in catalog.entries("hardware"):
        try:
            yield Hardware.load(name)
        except UserError:   # a damaged preset of the user's says so where it is used, not in every doctor
            continue


def is_device(hardware, name: str, capability: str | None, total_bytes: int) -> bool:
    """Whether a device of this name, compute capability and memory (as torch reports them) is `hardware`."""
    if not any(fnmatch.fnmatchcase(name.lower(), pattern.lower()) for pattern in hardware.device_names):
        return False
    if hardware.compute_capability and capability and hardware.compute_capability != capability:
        return False
    expected = hardware.usable_bytes or hardware.memory_bytes
    return not expected or abs(total_bytes - expected) <= MEMORY_TOLERANCE * expected


def check_hardware(hardware, devices: list[dict]) -> None:
    """--hardware must be what this node is: a GPU preset on a node without GPUs (or the CPU preset
    on a GPU node) would file this node's software under hardware it is not."""
    if (hardware.vendor == "cpu") != (not devices):
        has = f"{plural(len(devices), 'GPU')} ({devices[0]['name']})" if devices else "no GPU"
        raise UserError(f"--hardware {hardware.name!r}: a {hardware.vendor} preset, and this node has {has}")


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


# --------------------------------------------------------------------------------------------
# Telemetry: what the probe sees, and how fast it really samples
# --------------------------------------------------------------------------------------------
def telemetry_check(backends, reason: str) -> dict:
    return {"backend": ", ".join(b.name for b in backends), "reason": reason, "devices": inventory(backends)}


def sampling_check(backends, hz: float, seconds: float, node: str) -> dict:
    """Run the real sampler for `seconds` at `hz`; per device, rows per second and the spacing of
    its rows (a backend slower than `hz`, like the host's, is asked every n-th tick: `target_hz`)."""
    from charllm.probes.sampler import Sampler  # deferred: loads polars (start-up time)

    rows: list[dict] = []
    sampler = Sampler(backends, hz=hz, node=node, on_sample=rows.extend)
    sampler.run(seconds)
    stamps: dict[tuple, list[int]] = {}
    for row in rows:
        stamps.setdefault((row["backend"], row["device"]), []).append(row["mono_ns"])
    devices = []
    for backend in backends:
        for dev in backend.devices():
            times = sorted(stamps.get((backend.name, dev.label), []))
            gaps = sorted((b - a) / 1e6 for a, b in zip(times, times[1:], strict=False))
            devices.append({
                "device": dev.label, "backend": backend.name, "target_hz": sampler.backend_hz(backend),
                "rows": len(times), "achieved_hz": len(times) / seconds,
                "interval_ms": {"median": statistics.median(gaps), "p99": gaps[math.ceil(0.99 * len(gaps)) - 1],
                                "max": gaps[-1]} if gaps else None,
            })
    return {"hz": hz, "seconds": seconds, "ticks": sampler.ticks, "missed_deadlines": sampler.missed_deadlines,
            "devices": devices}


# --------------------------------------------------------------------------------------------
# The train check
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# The whole report
# --------------------------------------------------------------------------------------------
def check_options(*, sample_seconds: float, iters: int, timeout: float, rates=SAMPLING_HZ) -> None:
    """The figures a user gives, checked before anything runs (here and on a target's nodes)."""
    for hz in rates:
        check_hz(hz)
    if not sample_seconds > 0:
        raise UserError(f"--sample-seconds = {sample_seconds:g}: must be > 0")
    if iters < 1:
        raise UserError(f"--iters = {iters}: must be at least 1")
    if not timeout > 0:
        raise UserError(f"--timeout = {timeout:g}: must be > 0 seconds")


def gather(*, hardware: str | None = None, train: bool = False, node: str | None = None,
           rates: tuple[float, ...] = SAMPLING_HZ, sample_seconds: float = SAMPLE_SECONDS,
           iters: int = TRAIN_ITERS, timeout: float = TRAIN_TIMEOUT_S, progress: Progress | None = None,
           stop: threading.Event | None = None) -> dict:
    """Every check on this node. Bad input (an unknown --hardware, bad figures) is a UserError raised
    before anything slow runs; a check that fails is one line in `errors`, the others still report."""
    say = progress or (lambda message: None)
    chosen = Hardware.load(hardware) if hardware else None
    check_options(rates=rates, sample_seconds=sample_seconds, iters=iters, timeout=timeout)
    node = node_name(node)
    report: dict = {"node": node, "date": today(), "hardware": None, "hardware_reason": "", "errors": []}

    say(f"{node}: reading versions and devices (torch and its extensions, in a child process)")
    try:
        facts = software()
    except CheckFailed as exc:
        report["errors"].append(str(exc))
        facts = None
    stack = None
    if facts is not None:
        report.update(versions=facts["versions"], driver=facts["driver"], devices=facts["devices"],
                      stack=facts["stack"])
        if chosen is not None:
            check_hardware(chosen, facts["devices"])
            report["hardware"], report["hardware_reason"] = chosen.name, "--hardware"
        else:
            report["hardware"], report["hardware_reason"] = match_hardware(facts["devices"])
            if report["hardware"] is None:
                report["errors"].append(report["hardware_reason"])
        stack = runtime.Stack.from_dict(facts["stack"], source=f"found on {node}")
        impl = runtime.resolve(llama_experiment(Hardware.load("cpu"), 1), stack)
        report["implementation"] = {**impl.to_dict(), "describe": impl.describe()}

    say(f"{node}: opening telemetry (backend auto)")
    backends, reason = open_backends("auto")
    try:
        report["telemetry"] = telemetry_check(backends, reason)
        report["sampling"] = []
        for hz in rates:
            say(f"{node}: sampling at {hz:g} Hz for {sample_seconds:g} s")
            report["sampling"].append(sampling_check(backends, hz, sample_seconds, node))
    finally:
        for backend in backends:
            backend.close()

    if train:
        report["train"] = None
        if report["hardware"] is None:
            report["errors"].append("train check: not run (the hardware is not known: see above)")
        else:
            hw = chosen or Hardware.load(report["hardware"])
            try:
                exp, plan = train_experiment(hw, len(report["devices"]), iters, stack)
                say(f"{node}: train check: {exp.model.name}, {exp.world_size} process(es), planned peak "
                    f"{gib(plan.stages[-1].total_bytes)} per device, planned as {plan.implementation.describe()}")
                report["train"] = run_train(exp, plan, node=node, progress=say, timeout=timeout, stop=stop)
                say(f"{node}: train check: done")
            except CheckFailed as exc:
                report["train"] = {"error": str(exc)}
                report["errors"].append(str(exc))
    return report


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------
def calibration_record(report: dict, previous: dict | None = None) -> dict:
    """The calibration `engine.model.calibration.save` writes for this report's hardware. `previous` is the
    record saved before: its train measurement stays while the stack is the same and this report
    has none of its own."""
    train = report.get("train") if report.get("train") and not report["train"].get("error") else None
    gpus = report.get("devices") or []
    memory = {
        "usable_bytes": min(d["total_bytes"] for d in gpus) if gpus else None,   # torch's total capacity
        "outside_allocator_bytes": train.get("outside_allocator_bytes") if train else None,
        "devices": train["world_size"] if train else max(1, len(gpus)),
        "reserve_fraction": train.get("reserve_fraction") if train else None,
        "expandable_segments": train.get("expandable_segments") if train else None,
    }
    figures = {"matmul_efficiency": (train.get("speed") or {}).get("matmul_efficiency")} if train else {}
    if train is None and previous and previous.get("train") and previous.get("stack") == report.get("stack"):
        train = previous["train"]
        old = previous.get("memory") or {}
        memory["outside_allocator_bytes"] = old.get("outside_allocator_bytes")
        memory["devices"] = old.get("devices", memory["devices"])
        memory["reserve_fraction"] = old.get("reserve_fraction")
        memory["expandable_segments"] = old.get("expandable_segments")
        figures = previous.get("speed") or {}
    record = {key: report[key] for key in RECORD_KEYS if key in report}
    record.update(memory=memory, train=train, speed=figures)
    return record


def save_calibration(report: dict) -> Path:
    if report.get("hardware") is None or report.get("stack") is None:
        raise CheckFailed("no calibration saved: " + (report["errors"][0] if report.get("errors") else
                                                      "the node's hardware or software is not known"))
    previous = calibration.load(report["hardware"])
    return calibration.save(calibration_record(report, previous.data if previous else None))


def saved_calibrations() -> list[dict]:
    """Every saved calibration record, newest first (damaged files are skipped, with a warning)."""
    found = [calibration.load(p.stem) for p in sorted(calibration.directory().glob("*.json"))]
    return sorted((c.data for c in found if c is not None), key=lambda r: (r.get("date", ""), r["hardware"]),
                  reverse=True)


# --------------------------------------------------------------------------------------------
# Every node of a target
# --------------------------------------------------------------------------------------------
@dataclass
class NodeResult:
    node: str
    report: dict | None           # None when the node gave no report
    error: str | None = None      # the first failure, one line

    @classmethod
    def of(cls, report: dict) -> "NodeResult":
        return cls(report["node"], report, report["errors"][0] if report.get("errors") else None)

    def to_dict(self) -> dict:
        return {"node": self.node, "report": self.report, "error": self.error}


def doctor_argv(python: str, *, train: bool, hardware: str | None, node: str | None, sample_seconds: float,
                iters: int, timeout: float) -> list[str]:
    """`doctor --json` as run on a node of a target (which saves nothing: this side does)."""
    argv = [python, "-m", "charllm.tui.cli", "doctor", "--json", "--no-save",
            f"--sample-seconds={sample_seconds:g}", f"--iters={iters}", f"--timeout={timeout:g}"]
    if train:
        argv.append("--train")
    if hardware:
        argv.append(f"--hardware={hardware}")
    if node:
        argv.append(f"--node={node}")
    return argv


def on_target(target, *, nodes: int | None = None, train: bool = False, hardware: str | None = None,
              sample_seconds: float = SAMPLE_SECONDS, iters: int = TRAIN_ITERS,
              timeout: float = TRAIN_TIMEOUT_S, progress: Progress | None = None) -> list[NodeResult]:
    """Run `doctor --json` on every node of an ssh target (each host) or a slurm target (one srun
    step over `nodes` nodes); a node that fails or cannot be reached is a NodeResult with an error."""

    say = progress or (lambda message: None)
    if hardware:
        Hardware.load(hardware)   # a bad name is said once, here, not by every node
    check_options(sample_seconds=sample_seconds, iters=iters, timeout=timeout)
    options = dict(train=train, hardware=hardware, sample_seconds=sample_seconds, iters=iters, timeout=timeout)
    return target.run_doctor(_OnNodes(options, say), nodes)


class _OnNodes:
    """doctor on a target's nodes, one method per way of reaching them (Target.run_doctor picks)."""

    def __init__(self, options: dict, say: Progress):
        self.options, self.say = options, say

    def here(self, target, nodes: int | None) -> list[NodeResult]:
        _no_node_count(target, nodes)
        return [NodeResult.of(gather(progress=self.say, **self.options))]

    def over_ssh(self, target, nodes: int | None) -> list[NodeResult]:
        _no_node_count(target, nodes)
        return _on_ssh(target, self.options, self.say)

    def over_slurm(self, target, nodes: int | None) -> list[NodeResult]:
        if nodes is not None and nodes < 1:
            raise UserError(f"--nodes = {nodes}: must be at least 1")
        return _on_slurm(target, nodes or 1, self.options, self.say)


def _no_node_count(target, nodes: int | None) -> None:
    """--nodes picks how many nodes Slurm allocates; other targets name their nodes."""
    if nodes is not None:
        raise UserError(f"--nodes = {nodes}: only for a slurm target (target {target.name!r} is {target.kind})")


def _remote_wait(timeout: float, train: bool) -> float:
    """How long a node's doctor may take: the checks, the train job, and slack for the imports."""
    return timeout + SOFTWARE_TIMEOUT_S + 120 if train else SOFTWARE_TIMEOUT_S + 120


def _on_ssh(target, options: dict, say: Progress) -> list[NodeResult]:
    running: dict[str, tuple] = {}   # host -> (its ssh client, that client's stdout)

    def one(host: str) -> NodeResult:
        try:
            target.run_on(host)
        except UserError as exc:
            return NodeResult(host, None, str(exc))
        argv = doctor_argv(target.python_path, node=host, **options)
        proc = subprocess.Popen(target.ssh_argv(host) + [target.in_process_group(argv)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, text=True,   # its end stops the remote group
                                preexec_fn=lifeline.killed_with_parent)
        err: list[str] = []
        reader = threading.Thread(target=_forward, args=(proc.stderr, err, say), daemon=True)
        reader.start()
        out = _Collect(proc.stdout)
        running[host] = (proc, out)
        wait = _remote_wait(options["timeout"], options["train"])
        try:
            proc.wait(timeout=wait)
            late = False
        except subprocess.TimeoutExpired:
            late = True
        finally:
            _stop_ssh(target, host, proc, out)
            running.pop(host, None)
            out.join()
            reader.join(timeout=5)
        first, _, rest = out.text.partition("\n")
        report = _parse_report(rest) if procid.parse_remote_identity(first) else None
        if report is not None:
            return NodeResult.of(report)
        if late:
            why = f"no report within {wait:.0f} s (stopped)"
        elif proc.returncode == 255:
            why = f"lost the ssh connection ({err[-1] if err else 'exit status 255'})"
        else:
            why = error_line("\n".join(err), proc.returncode)
        return NodeResult(host, None, why)

    pool = ThreadPoolExecutor(max_workers=min(16, len(target.hosts)))
    try:
        return list(pool.map(one, target.hosts))
    except BaseException:   # Ctrl-C or SIGTERM here: stop every node's doctor, then leave
        for host, (proc, out) in list(running.items()):
            _stop_ssh(target, host, proc, out)
        raise
    finally:
        pool.shutdown(wait=True)


def _stop_ssh(target, host: str, proc, out: "_Collect") -> None:
    """Stop a node's doctor: its remote process group (closing the channel does not stop it, see
    engine/launch/ssh.py; the group's identity is the first line it printed), then the ssh client."""
    if proc.poll() is not None:
        return
    group = procid.parse_remote_identity(out.first_line(timeout=1))
    if group:
        target.kill_group(host, group)
    proc.kill()
    proc.wait()


class _Collect:
    """Reads a stream to its end on a thread (stdout, while stderr is forwarded)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self.thread.start()

    def first_line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.lines and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.lines[0] if self.lines else ""

    def join(self) -> None:
        self.thread.join(timeout=30)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def _forward(stream, keep: list[str], say: Progress, shown=lambda line: line) -> None:
    """Each line of a node's stderr, kept for the failure message and said as progress."""
    for line in stream:
        line = line.rstrip("\n")
        if line.strip():
            keep.append(line)
            say(shown(line))


def _parse_report(text: str) -> dict | None:
    try:
        report = json.loads(text)
    except ValueError:
        return None
    return report if isinstance(report, dict) and "node" in report else None


def _on_slurm(target, nodes: int, options: dict, say: Progress) -> list[NodeResult]:
    import re

    if shutil.which("srun") is None:
        raise UserError(f"target {target.name!r}: `srun` is not on PATH (run from a Slurm login node)")
    label = re.compile(r"^\s*(\d+): ?(.*)$")
    argv = target.srun_argv(nodes, target.shell_line(doctor_argv(target.python_path, node=None, **options)))
    say(f"srun: {plural(nodes, 'node')} of target {target.name!r}")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lifeline.terminated_with_parent)   # srun cancels its step on SIGTERM
    err: list[str] = []
    def unlabelled(line: str) -> str:
        match = label.match(line)
        return match.group(2) if match else line

    reader = threading.Thread(target=_forward, args=(proc.stderr, err, say, unlabelled), daemon=True)
    reader.start()
    out = _Collect(proc.stdout)
    wait = _remote_wait(options["timeout"], options["train"]) + 600   # + time in the queue
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        err.append(f"srun: error: no report within {wait:.0f} s (stopped)")
    finally:
        if proc.poll() is None:
            proc.terminate()   # srun cancels its step on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.join()
        reader.join(timeout=5)

    def by_task(lines: list[str]) -> dict[int, list[str]]:
        tasks: dict[int, list[str]] = {}
        for line in lines:
            match = label.match(line)
            if match:
                tasks.setdefault(int(match.group(1)), []).append(match.group(2))
        return tasks

    reports, errors = by_task(out.text.splitlines()), by_task(err)
    srun_said = [line for line in err if line.startswith("srun:")]
    results = []
    for task in range(nodes):
        report = _parse_report("\n".join(reports.get(task, [])))
        if report is not None:
            results.append(NodeResult.of(report))
            continue
        # srun names a failed task's node: "srun: error: n2: task 1: Exited with exit code 2".
        named = [m.group(1) for m in (re.match(rf"srun: error: (\S+): tasks? ([\d,-]*\b)?{task}\b", line)
                                      for line in srun_said) if m]
        where = named[0] if named else f"task {task}"
        why = error_line("\n".join(errors.get(task) or srun_said), proc.returncode)
        results.append(NodeResult(where, None, why))
    return results


if __name__ == "__main__":
    # The child of `software()`: this interpreter may import torch and try every extension.
    print(json.dumps(runtime.describe(runtime.detect())))
