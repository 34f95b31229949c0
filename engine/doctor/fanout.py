"""Doctor on every node of a target: the target runs `python -m charllm.engine.doctor report` on
its nodes (`Target.run_on_nodes`, engine/launch: how nodes are reached is the target's), and each
node's stdout is its report, read here. Nothing is saved on the nodes: the caller saves here."""

from __future__ import annotations

import json
from dataclasses import dataclass

from charllm.engine.doctor.hardware import match_hardware
from charllm.engine.doctor.report import check_options
from charllm.engine.doctor.sampling import SAMPLE_SECONDS
from charllm.engine.doctor.software import SOFTWARE_TIMEOUT_S, Progress, error_line
from charllm.engine.doctor.train import TRAIN_ITERS, TRAIN_TIMEOUT_S
from charllm.engine.launch.nodes import NodeOutput
from charllm.engine.model.experiment import Hardware

ENTRY = "charllm.engine.doctor"   # its __main__.py: the node's side


@dataclass
class NodeResult:
    node: str
    report: dict | None           # None when the node gave no report
    error: str | None = None      # the first failure, one line

    @classmethod
    def of(cls, report: dict) -> "NodeResult":
        return cls(report["node"], report, report["errors"][0] if report.get("errors") else None)

    @classmethod
    def from_output(cls, output: NodeOutput) -> "NodeResult":
        """A node's report where it printed one, else why not: the target's reason (unreachable,
        late), else the node's own error line."""
        report = parse_report(output.stdout)
        if report is not None:
            return cls.of(match_here(report))
        return cls(output.node, None, output.failure or error_line("\n".join(output.stderr), output.returncode))

    def to_dict(self) -> dict:
        return {"node": self.node, "report": self.report, "error": self.error}


def node_argv(python: str, *, train: bool, hardware: str | None, node: str | None, sample_seconds: float,
              iters: int, timeout: float) -> list[str]:
    """The report command a node runs (__main__.py's own options, not the CLI's)."""
    argv = [python, "-m", ENTRY, "report", f"--sample-seconds={sample_seconds:g}", f"--iters={iters}",
            f"--timeout={timeout:g}"]
    if train:
        argv.append("--train")
    if hardware:
        argv.append(f"--hardware={hardware}")
    if node:
        argv.append(f"--node={node}")
    return argv


def remote_wait(timeout: float, train: bool) -> float:
    """How long a node's doctor may take: the checks, the train job, and slack for the imports."""
    return timeout + SOFTWARE_TIMEOUT_S + 120 if train else SOFTWARE_TIMEOUT_S + 120


def on_target(target, *, nodes: int | None = None, train: bool = False, hardware: str | None = None,
              sample_seconds: float = SAMPLE_SECONDS, iters: int = TRAIN_ITERS,
              timeout: float = TRAIN_TIMEOUT_S, progress: Progress | None = None) -> list[NodeResult]:
    """Doctor on every node of `target` (`nodes` of them where its scheduler allocates nodes); a
    node that fails or cannot be reached is a NodeResult with an error."""
    say = progress or (lambda message: None)
    if hardware:
        Hardware.load(hardware)   # a bad name is said once, here, not by every node
    check_options(sample_seconds=sample_seconds, iters=iters, timeout=timeout)

    def argv_for(node: str | None) -> list[str]:
        return node_argv(target.python_path, node=node, train=train, hardware=hardware,
                         sample_seconds=sample_seconds, iters=iters, timeout=timeout)

    outputs = target.run_on_nodes(argv_for, nodes, wait=remote_wait(timeout, train), say=say)
    return [NodeResult.from_output(output) for output in outputs]


def match_here(report: dict) -> dict:
    """A node matches its GPUs against the presets it has; the user's own presets live in this
    side's <config>/hardware/, which the node may not share: a GPU the node did not know is matched
    again here (a train check it could not run still says so)."""
    devices = report.get("devices")
    if report.get("hardware") is not None or not isinstance(devices, list) or not devices:
        return report
    found, why = match_hardware(devices)
    if found is not None:
        unknown = report.get("hardware_reason")
        report.update(hardware=found, hardware_reason=f"{why} (preset of this machine)",
                      errors=[e for e in report.get("errors", []) if e != unknown])
    return report


def parse_report(text: str) -> dict | None:
    try:
        report = json.loads(text)
    except ValueError:
        return None
    return report if isinstance(report, dict) and "node" in report else None
