"""What the tools that rebuild a dev set (build_memory_dev.py, build_public_dev.py) share: reading a git
mirror of the upstream repository, and writing the set with what was left out and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from charllm.probes.core.atomic import write_atomic


def git(checkout: Path, *args: str) -> str:
    """`git -C checkout ARGS`'s output; LookupError with git's words when it fails."""
    # GIT_NO_LAZY_FETCH: a partial clone answers from what it holds instead of reaching the network
    done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GIT_NO_LAZY_FETCH": "1"})
    if done.returncode:
        raise LookupError(done.stderr.strip() or f"git {' '.join(args)} failed")
    return done.stdout


def build_and_write(tool: str, build: Callable[[], tuple[list, list[tuple[str, str]]]], out: Path) -> int:
    """A tool's exit status: 2 with one line when the upstream repository does not hold what `build` reads
    (LookupError) or says otherwise than the tool expects (ValueError); else 0 once the set is written."""
    try:
        items, left_out = build()
    except (LookupError, ValueError) as error:
        print(f"{tool}: {error}", file=sys.stderr)
        return 2
    write_set(out, items, left_out)
    return 0


def write_set(out: Path, items: list, left_out: list[tuple[str, str]]) -> None:
    """The set as JSON at `out`, whole or not at all, and what it left out."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(items, indent=1) + "\n")
    print(f"wrote {len(items)} to {out}")
    for label, why in left_out:
        print(f"  left out {label}: {why}")
