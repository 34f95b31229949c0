"""The node and its software: its name, the software stack found by a child interpreter (torch and
its extensions never load in this process, the TUI's), and the line of a failed process's output
that says why."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from typing import Callable

from charllm.engine.model import runtime
from charllm.probes.backends.base import hostname

SOFTWARE_TIMEOUT_S = 300.0

Progress = Callable[[str], None]


class CheckFailed(Exception):
    """A check could not be done on this node; the message is one line naming the cause."""


def node_name(node: str | None = None) -> str:
    """The node's name as runs record it: given, the launcher's, Slurm's, else the host's."""
    return node or os.environ.get("CHARLLM_NODE") or os.environ.get("SLURMD_NODENAME") or hostname()


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def software(timeout: float = SOFTWARE_TIMEOUT_S) -> dict:
    """`runtime.describe(runtime.detect())` of this node, from a child interpreter."""
    try:
        done = subprocess.run([sys.executable, "-m", "charllm.engine.doctor", "software"], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"importing torch and its extensions took over {timeout:.0f} s") from None
    if done.returncode != 0:
        raise CheckFailed(f"cannot read this node's software stack: {error_line(done.stderr, done.returncode)}")
    # The last line: an extension's C library may print to the child's stdout as it loads.
    return json.loads(done.stdout.strip().splitlines()[-1])


def error_line(text: str, returncode: int | None = None) -> str:
    """The line of a process's output that says why it failed: our own error line, else the last
    exception line (not torchrun's summary of it), else the last line."""
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



def describe_here() -> dict:
    """This node's stack, read in this interpreter: what `software()`'s child prints (imports torch)."""
    return runtime.describe(runtime.detect())
