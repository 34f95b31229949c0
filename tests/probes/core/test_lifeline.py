"""A process tied to its parent: it ends with the parent, and at once if the parent it was started by
is already gone when it gets to ask (torchrun killed while a rank's interpreter was still loading)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = ("from charllm.probes.core.lifeline import die_with_parent\n"
         "die_with_parent(started_by={words!r})\n"
         "print('alive', flush=True)\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the parent's command line from /proc")
def test_a_process_whose_parent_is_not_its_starter_ends_at_once():
    # Started by this pytest process, which is not torchrun: as a rank reparented to init would be.
    done = subprocess.run([sys.executable, "-c", CHILD.format(words=("torch.distributed.run", "torchrun"))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -9 and "alive" not in done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the parent's command line from /proc")
def test_a_process_started_by_its_parent_lives_on():
    program = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().split(b"\0")[0].decode()   # this process's
    done = subprocess.run([sys.executable, "-c", CHILD.format(words=(program,))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "alive\n", done
