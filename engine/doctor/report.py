"""The whole report of one node: every check, run here (`gather`), as the CLI, the TUI and a
target's nodes (`python -m charllm.engine.doctor report`) produce it."""

from __future__ import annotations

import threading

from charllm.engine.doctor.hardware import check_hardware, match_hardware
from charllm.engine.doctor.sampling import SAMPLE_SECONDS, SAMPLING_HZ, sampling_check, telemetry_check
from charllm.engine.doctor.software import CheckFailed, Progress, node_name, software, today
from charllm.engine.doctor.train import TRAIN_ITERS, TRAIN_TIMEOUT_S, llama_experiment, run_train, train_experiment
from charllm.engine.model import runtime
from charllm.engine.model.experiment import Hardware
from charllm.probes.backends import open_backends
from charllm.probes.backends.base import check_hz
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import gib


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
