"""Tying a process's life to its parent's, so nothing a run starts outlives whoever started it.

torchrun starts its ranks in new sessions (`start_new_session=True`), so signalling torchrun's
process group misses them, and a killed parent leaves its children running with PPID 1. Each
process a run starts therefore asks the kernel for a signal when its parent dies
(`PR_SET_PDEATHSIG`, Linux), and the ranks also poll their parent id, which works everywhere and
catches a parent that died before the request was made; a rank whose parent is no longer torchrun
when it starts (torchrun died while the rank's interpreter loaded) ends at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


# Loaded here, in the parent, so a `preexec_fn` in a forked child only makes the call.
_prctl = _load_prctl()


def signal_on_parent_death(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent (the thread that forked it) dies."""
    return _prctl is not None and _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def killed_with_parent() -> None:
    """A `preexec_fn` for steps whose own children follow them (torchrun's ranks do)."""
    signal_on_parent_death(signal.SIGKILL)


def terminated_with_parent() -> None:
    """A `preexec_fn` for steps that stop cleanly on SIGTERM (the sampler closes its last chunk)."""
    signal_on_parent_death(signal.SIGTERM)


def _command_line(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None          # no /proc (not Linux), or the process is gone


def die_with_parent(started_by: tuple[str, ...] = ()) -> None:
    """For a rank: SIGKILL when the parent dies, by the kernel and by a polling thread.

    `started_by`: words of the command line of the parent this process was started by (torchrun).
    A parent that died while this process started up, before it got here, left it to init or a
    subreaper, whose command line has none of them: no signal would ever come, so it ends now.
    """
    parent = os.getppid()
    signal_on_parent_death(signal.SIGKILL)
    command = _command_line(parent) if started_by else None
    orphaned = command is not None and not any(word in command for word in started_by)
    if orphaned or os.getppid() != parent:  # the parent died before the request: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
