"""A step's process as the supervisor runs it, and how a step ended.

`Proc` runs a step here, in a process group of its own (the local target's steps); ssh.py's
`SshProc` runs one on a node. The supervisor (supervise.py) treats both alike; the target picks
the class. How a step ended is read from its exit status and its log: torchrun's error summary
names the rank that failed first.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from charllm.probes.core import lifeline, procid
from charllm.probes.store.rundir import RunDir


class Proc:
    """One step's process on this machine: its own process group, its output in the step's log."""

    def __init__(self, rd, target, step, sink=None):
        self.rd, self.target, self.step = rd, target, step
        self.sink = sink                      # receives each iteration line a remote tail reads
        self.log_path = rd.logs_dir / f"{step.role}-{step.node}.log"
        self.reader: threading.Thread | None = None   # a thread reading the process's output, if any
        self.popen: subprocess.Popen | None = None
        self.token = rd.token   # the run's, which the step carries (the supervisor's environment holds it)

    def with_parent(self):
        """What ties the step to the supervisor's life: the sampler is asked to stop (it closes
        its last chunk), anything else is killed (torchrun's ranks follow it, see
        probes.core.lifeline)."""
        return lifeline.terminated_with_parent if self.step.role == "sampler" else lifeline.killed_with_parent

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.step.argv, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=self.rd.path, start_new_session=True,
                                      preexec_fn=self.with_parent())

    @property
    def started(self) -> subprocess.Popen:
        """The step's process, once start() ran (every caller runs after it)."""
        assert self.popen is not None, "the step was not started"
        return self.popen

    def wait_started(self) -> None:
        """Until the step's process group is known (here at once)."""

    def catch_up(self) -> None:
        """Once the step stopped, bring home what it streamed too late (nothing streams here)."""

    def poll(self) -> int | None:
        return self.started.poll()

    def exit_status(self) -> int:
        """How the step ended, as Popen says (-N: killed by signal N); asked once it ended."""
        status = self.poll()
        assert status is not None, "the step is still running"
        return status

    def connection_lost(self) -> bool:
        """Whether the step ended because its node could not be reached (never, here)."""
        return False

    def how_ended(self) -> str:
        """The train step's end, when torchrun's summary names no rank."""
        return f"torchrun {describe_exit(self.exit_status())}"

    def describe_failure(self) -> str:
        """Name the node and, from torchrun's error summary, the rank that failed first."""
        return rank_failure(self.step.node, self.log_path) or f"node {self.step.node}: {self.how_ended()}"

    def signal(self, sig: signal.Signals) -> None:
        """Signal the whole process group (a dead leader can leave ranks behind in it)."""
        try:
            os.killpg(self.started.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def descendants(self) -> list:
        """Every process below the step (torchrun's ranks live in sessions of their own)."""
        import psutil

        try:
            return psutil.Process(self.started.pid).children(recursive=True)
        except psutil.Error:
            return []

    def record(self) -> dict:
        """What the manifest records, so that `cancel` can stop the step without the supervisor:
        its process group, and who leads it where (procid: nothing is signalled unless that
        process still leads it)."""
        return {"node": self.step.node, "role": self.step.role, **procid.identify(self.started.pid),
                "pgid": self.started.pid}


NO_END = ("every node's training exited with status 0, but the workload never logged its end: it did not run "
          "(a shell line that skipped torchrun? see logs/train-*.log)")
END_LOG_S = 10.0   # how long an end line may take to come home (a remote tail polls each second)


def training_ended(rd: RunDir, timeout: float = END_LOG_S) -> bool:
    """Whether the workload logged that it completed (waiting up to `timeout` for the line): a node's
    step that exits 0 without having trained (its shell line skipped torchrun) is no completed run."""
    deadline = time.monotonic() + timeout
    while not any(e.get("status") == "completed" for e in rd.end_events()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


# One failure entry of torchrun's ChildFailedError summary ("Failures:" and "Root Cause" alike).
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def shell_status(code: int) -> int:
    """A shell's exit status as Popen's: 128+N (a command killed by signal N) becomes -N."""
    return 128 - code if 128 < code < 128 + signal.NSIG else code


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def root_cause(log_path: Path) -> tuple[int, int, int] | None:
    """(rank, local rank, exit code) of the cause in torchrun's error summary in a node's log.

    torchrun's "first observed failure" can be a peer that exited 1 because the killed rank
    vanished; a rank killed by a signal is the cause whenever the summary lists one."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    summary = text[text.rfind("ChildFailedError"):] if "ChildFailedError" in text else ""
    failures = [(int(m.group(1)), int(m.group(2)), int(m.group(3))) for m in _FAILED_RANK.finditer(summary)]
    return min(failures, key=lambda f: f[2] >= 0) if failures else None


def rank_failure(node: str, log_path: Path) -> str | None:
    """"node N, rank R (local rank L) was killed by SIGKILL", from the node's torchrun summary;
    None where the log has none."""
    cause = root_cause(log_path)
    if not cause:
        return None
    rank, local_rank, code = cause
    return f"node {node}, rank {rank} (local rank {local_rank}) {describe_exit(code)}"


def killed_first(logs: list[Path]) -> list[Path]:
    """Order node logs so a rank killed by a signal comes before the peers that merely exited
    non-zero because it vanished (they fail too, and may report first)."""
    def key(log: Path) -> int:
        cause = root_cause(log)
        return 0 if cause and cause[2] < 0 else 1 if cause else 2
    return sorted(logs, key=key)


def last_line(log_path: Path) -> str:
    """The last non-empty line of a log (a step's own account of why it ended)."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"
