"""One short command on every node of a target (`Target.run_on_nodes`, doctor's fan-out): what each
node printed, its stderr forwarded as progress while it runs, and the target's own reason where the
command could not run or finish there. How the nodes are reached is the kind's (local.py, ssh.py,
slurm.py); what the output means is the caller's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from charllm.probes.core import lifeline

Say = Callable[[str], None]
ArgvFor = Callable[[str | None], list[str]]   # the command for a node the target names (None: it names itself)


@dataclass
class NodeOutput:
    node: str                                        # the node, or where the target lost it ("task 1")
    stdout: str = ""
    stderr: list[str] = field(default_factory=list)  # its non-empty lines, as forwarded
    returncode: int | None = None
    failure: str | None = None   # one line: why the target could not run it to its end (unreachable, late)


class Collect:
    """Reads a stream to its end on a thread (stdout, while stderr is forwarded)."""

    def __init__(self, stream: IO[str]):
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


def forward(stream: IO[str], keep: list[str], say: Say, shown: Callable[[str], str] = lambda line: line) -> None:
    """Each line of a node's stderr, kept for the failure message and said as progress."""
    for line in stream:
        line = line.rstrip("\n")
        if line.strip():
            keep.append(line)
            say(shown(line))


def read_streams(proc: subprocess.Popen, say: Say) -> tuple[threading.Thread, list[str], Collect]:
    """Start reading a node command's output: stderr lines go on as progress (and are kept), stdout is
    collected. Returns the stderr reader (join it once the process ended), the kept lines, the output."""
    assert proc.stdout is not None and proc.stderr is not None
    err: list[str] = []
    reader = threading.Thread(target=forward, args=(proc.stderr, err, say), daemon=True)
    reader.start()
    return reader, err, Collect(proc.stdout)


def run_here(argv: list[str], node: str, *, wait: float, say: Say) -> NodeOutput:
    """Run `argv` on this machine in a session of its own (it dies with this process); after `wait`
    seconds, or on Ctrl-C, its whole group is stopped."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=lifeline.killed_with_parent)
    reader, err, out = read_streams(proc, say)

    def stop() -> None:
        if proc.poll() is None:   # late, or Ctrl-C here: TERM lets it stop what it started
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    failure = wait_then_stop(proc, wait, stop, reader, out)
    return NodeOutput(node, out.text, err, proc.returncode, failure)


def wait_then_stop(proc: subprocess.Popen, wait: float, stop: Callable[[], None], reader: threading.Thread,
                   out: Collect) -> str | None:
    """Wait up to `wait` seconds for a node command, then (late, or on Ctrl-C here) `stop` it and finish
    reading its output. Returns the failure: None when it ended in time."""
    failure = None
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        failure = f"no end within {wait:.0f} s (stopped)"
    finally:
        stop()
        out.join()
        reader.join(timeout=5)
    return failure
