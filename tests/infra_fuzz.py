"""Calling the CLI in-process on hostile input: the outcome of one call, with a watchdog for hangs."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

from charllm.tui.cli import main

HANG_S = 2.0          # of CPU time: a loop that grows with a hostile number
BLOCKED_S = 20.0      # of wall time: a call that waits on something that never comes
# CPU time, not wall time, is what a hostile input can run up; on a loaded 2-core CI machine a
# call's wall time stretches several-fold (a 36-minute suite run timed `runs show` out at 2 s).


class Hang(BaseException):
    """Raised in the main thread by the watchdogs when a call runs past HANG_S of CPU or BLOCKED_S."""


@dataclass
class Outcome:
    argv: list[str]
    code: int | None
    out: str
    err: str
    crash: str | None = None     # the traceback of an exception that escaped main()
    hung: bool = False

    @property
    def one_clear_line(self) -> bool:
        lines = self.err.strip().splitlines()
        return (len(lines) == 1 and lines[0].startswith("charllm-tui: error: ")
                and "Traceback" not in self.err + self.out)

    def __str__(self) -> str:
        what = "hung" if self.hung else f"crashed:\n{self.crash}" if self.crash else f"exit {self.code}"
        return f"charllm-tui {' '.join(map(repr, self.argv))}: {what}\nstderr: {self.err[-800:]}"


def _alarm(signum, frame):
    raise Hang()


@contextlib.contextmanager
def watchdog(cpu_s: float = HANG_S):
    """Raise Hang in the main thread past `cpu_s` of this process's CPU time (all threads), or past
    BLOCKED_S of wall time."""
    previous = {sig: signal.signal(sig, _alarm) for sig in (signal.SIGALRM, signal.SIGPROF)}
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    signal.setitimer(signal.ITIMER_REAL, max(cpu_s, BLOCKED_S))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def call(argv: list[str], timeout: float = HANG_S) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    code, crash, hung = None, None, False
    try:
        with watchdog(timeout), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
        if not isinstance(exc.code, int) and exc.code:
            err.write(str(exc.code))
    except Hang:
        hung = True
    except BaseException:  # noqa: BLE001 - what the test counts
        crash = traceback.format_exc()
    return Outcome(list(argv), code, out.getvalue(), err.getvalue(), crash, hung)


def tree(root: Path) -> dict[str, object]:
    """Every file (with its mtime and size) and directory under `root`: what a call wrote, created
    or removed shows as a change (a directory's own mtime is not compared: its entries are)."""
    found = {}
    for base, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.join(base, name)] = "dir"
        for name in files:
            path = os.path.join(base, name)
            try:
                st = os.lstat(path)
                found[path] = (st.st_mtime_ns, st.st_size)
            except OSError:
                pass
    return found
