"""A campaign's execution, on disk: which member ran as which run, and how it ended.

    <runs>/.campaigns/<name>/
        campaign.json     the record below (rewritten atomically)
        supervisor.log    the campaign supervisor's output
        supervisor.lock   flock'ed by the campaign's supervisor while it runs: one per campaign

It lives beside the runs it names, so every login node sharing the runs directory sees it (a
hidden name: run listings and the DuckDB glob pass it by). A member's own run is a run like any
other, whose manifest says which campaign and member it is; the record holds the member's planned
verdict and final status, so a summary of a campaign never depends on reading every run's files.

Every path a record names stays in the runs directory: `.campaigns` and a campaign's folder are
real folders (a link is refused, never followed), and a member's run is a run id, an entry of the
runs directory itself (a record naming `../elsewhere` is damaged, and nothing in it is acted on).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from charllm.engine.campaign.spec import Campaign, Plan, check_name, variant
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, plural, shown
from charllm.probes.core.files import read_bounded
from charllm.probes.core.formatting import clock, duration
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir, check_run_id, write_json_atomic

# A member's statuses: waiting in the queue, its run's own statuses, never run, or its run gone.
QUEUED, SKIPPED, INVALID = "queued", "skipped", "invalid"
REFUSED = "refused"         # its launch was refused (the target could not start it): --resume tries again
MISSING = "missing"         # its run's directory vanished (deleted): --resume runs it again
DAMAGED = "damaged"         # its run's directory holds no readable manifest: --resume runs it again
LOST = (MISSING, DAMAGED)   # its run is no longer one to read
DONE = (*FINAL_STATUSES, SKIPPED, INVALID, REFUSED, *LOST)   # a member in one of these needs nothing more
MAX_RECORD_BYTES = 64 * 2**20
LOCK = "supervisor.lock"
LOCK_WAIT_S = 1.0           # how long `campaign run` waits for a lock a reader's probe holds for a moment


def root() -> Path:
    """<runs>/.campaigns, a real folder of the runs directory: a link there is refused, never followed."""
    base = paths.runs_dir() / ".campaigns"
    if base.is_symlink():
        raise UserError(f"{base}: a symbolic link; campaign records live in a real folder of the runs directory "
                        "(remove the link)")
    return base


@dataclass
class Record:
    """One campaign's execution record (campaign.json), as a plain dict kept in `data`."""

    path: Path
    data: dict

    @classmethod
    def new(cls, campaign: Campaign, plans: list[Plan], target: dict, *, include_oom: bool,
            max_parallel: int) -> "Record":
        members: list[dict] = []
        for p in plans:
            m = p.member
            status = QUEUED if p.runnable or (include_oom and p.verdict != "invalid") else \
                INVALID if p.verdict == "invalid" else SKIPPED
            varied = {k: v for k, v in m.varied.items() if k in campaign.varying}
            exp = m.experiment
            known = m.known     # (a command's flags may give no layout)
            members.append({"index": m.index, "key": m.key, "name": exp.name, "base": m.base,
                            "model": exp.model.name if known else None, "hardware": exp.hardware.name,
                            "layout": m.layout_label,
                            "variant": variant(exp, m.base) if known else None,
                            "micro_batch_size": exp.training.micro_batch_size if known else
                            m.values.get("micro_batch_size"),
                            "varied": varied, "verdict": p.verdict, "reason": p.reason, "planned": p.planned,
                            **({"command": m.command.line} if m.command else {}),
                            "status": status, "run": None, "runs": [], "failure": None,
                            "started_ns": None, "ended_ns": None})
        data = {"name": campaign.name, "source": campaign.source, "description": campaign.description,
                "target": target, "max_parallel": max_parallel, "time_limit_s": campaign.time_limit_s,
                "include_oom": include_oom, "status": "pending", "created_ns": time.time_ns(),
                "started_ns": None, "ended_ns": None, "supervisor": {}, "members": members}
        return cls(directory(campaign.name) / "campaign.json", data)

    @classmethod
    def load(cls, name: str) -> "Record":
        """The record of campaign `name`'s execution; one line if it never ran or is damaged."""
        path = directory(name) / "campaign.json"
        try:
            data = json.loads(read_bounded(path, MAX_RECORD_BYTES, "campaign record"))
        except FileNotFoundError:
            raise UserError(f"campaign {name!r} has not run (charllm-tui campaign run {name} --target T)") from None
        except (ValueError, RecursionError):
            raise UserError(f"{path}: damaged campaign record, not valid JSON") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot read the campaign record ({exc.strerror})") from None
        if not isinstance(data, dict) or not isinstance(data.get("members"), list) or \
                not all(isinstance(m, dict) for m in data["members"]):
            raise UserError(f"{path}: damaged campaign record, not a campaign's")
        for m in data["members"]:
            runs = m.get("runs") if isinstance(m.get("runs"), list) else [m.get("runs")]
            for run in (m.get("run"), *runs):
                if run is not None and not _names_a_run(run):
                    raise UserError(f"{path}: damaged campaign record: member {shown(m.get('index'))} names run "
                                    f"{shown(run)}, not a run of the runs directory")
        return cls(path, data)

    def save(self) -> None:
        folder = directory(self.path.parent.name)     # (checked again: no link was put there meanwhile)
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / self.path.name, self.data)

    # -- reading -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def members(self) -> list[dict]:
        return self.data["members"]

    def run_dir(self, member: dict) -> RunDir | None:
        return RunDir(paths.runs_dir() / member["run"]) if member.get("run") else None

    def counts(self) -> dict[str, int]:
        """How many members are in each status, as their runs say it now (member_status)."""
        out: dict[str, int] = {}
        for m in self.members:
            status = member_status(self, m)
            out[status] = out.get(status, 0) + 1
        return out

    @property
    def finished(self) -> bool:
        return all(m["status"] in DONE for m in self.members)

    def tally(self, counts: dict[str, int] | None = None) -> str:
        """Members by status, as their runs say it now: "3 completed, 12 failed"."""
        counts = self.counts() if counts is None else counts
        order = ("completed", "running", "pending", QUEUED, "failed", "cancelled", "unknown", MISSING, DAMAGED, REFUSED,
                 SKIPPED, INVALID)
        return ", ".join(f"{counts[s]:,} {s}" for s in (*order, *sorted(set(counts) - set(order))) if counts.get(s))

    def progress(self, now_ns: int | None = None) -> str:
        """One line: members by status, and the time left at the current pace."""
        counts = self.counts()
        done = sum(counts.get(s, 0) for s in FINAL_STATUSES)
        line = f"{self.name}: {plural(len(self.members), 'member')} ({self.tally(counts)})"
        left = self.time_left(now_ns)
        if left is not None and left >= 1:
            line += f"; about {duration(left, 0)} left at the current pace"
        elif left is not None:
            line += "; the members left run past the current pace"
        elif self.data.get("status") in FINAL_STATUSES and done:
            line += f"; {self.data['status']} at {clock(self.data.get('ended_ns'))}"
        return line

    def time_left(self, now_ns: int | None = None) -> float | None:
        """Seconds until the queue is through at the pace of the members finished so far (None
        before one has finished, when nothing is left, or once the campaign has ended)."""
        if self.data.get("status") in FINAL_STATUSES:
            return None
        took = [(m["ended_ns"] - m["started_ns"]) / 1e9 for m in self.members
                if m["status"] in FINAL_STATUSES and m.get("started_ns") and m.get("ended_ns")]
        left = [m for m in self.members if m["status"] not in DONE]
        if not took or not left:
            return None
        now = now_ns or time.time_ns()
        # (a pending member waits its turn: under a scheduler it was submitted long before it starts)
        running = [(now - m["started_ns"]) / 1e9 for m in left if m["status"] == "running" and m.get("started_ns")]
        mean = sum(took) / len(took)
        queued = len(left) - len(running)
        lanes = max(1, int(self.data.get("max_parallel") or 1))
        return max(0.0, sum(max(0.0, mean - r) for r in running) / lanes + queued * mean / lanes)


def outcome(record: Record) -> dict:
    """How a campaign whose queue is through ended: completed only where every member it was to run
    completed (members planned not to run never were), else failed, saying how many did not."""
    counts = record.counts()
    short = {s: n for s, n in counts.items() if s not in ("completed", SKIPPED, INVALID)}
    if not short:
        return {"status": "completed"}
    return {"status": "failed", "failure": f"{sum(short.values()):,} of {plural(len(record.members), 'member')} "
                                           f"did not complete ({record.tally(short)})"}


def directory(name: str) -> Path:
    """Campaign `name`'s record folder, a real folder of root() (a link is refused, never followed)."""
    folder = root() / check_name(name)
    if folder.is_symlink():
        raise UserError(f"{folder}: a symbolic link; a campaign's record lives in a real folder (remove the link)")
    return folder


def recorded() -> list[str]:
    """The names of the campaigns that have a record here (a link among them is passed by)."""
    base = root()
    if not base.is_dir():
        return []
    return sorted(d.name for d in base.iterdir()
                  if not d.is_symlink() and d.is_dir() and (d / "campaign.json").is_file())


def _names_a_run(value) -> bool:
    """Whether a record's `run` is a run id: an entry of the runs directory itself, never a path."""
    try:
        return isinstance(value, str) and bool(check_run_id(value))
    except UserError:
        return False


def _gone(rd: RunDir) -> bool:
    """Whether a member's run directory (an entry of the runs directory, Record.load saw to that)
    is no longer a real folder there: deleted, or swapped for a link."""
    return rd.path.is_symlink() or not rd.path.is_dir()


def run_status(rd: RunDir) -> str:
    """A member run's status as its manifest says it, read only; MISSING when its directory is gone
    or holds no manifest, DAMAGED when its manifest cannot be read."""
    if _gone(rd) or not rd.manifest_path.is_file():
        return MISSING
    try:
        return rd.manifest().status
    except UserError:
        return DAMAGED


def member_status(record: Record, member: dict) -> str:
    """A member's status as its run says it now: a running member's run may have ended since the
    record was written, and a completed member's run may have been deleted or damaged since."""
    rd, status = record.run_dir(member), member["status"]
    if rd is None or status in DONE and status != "completed":
        return status
    if status == "completed":
        now = run_status(rd)
        return now if now in LOST else status
    return run_status(rd)


def member_note(member: dict, status: str) -> str:
    """What a member in `status` (member_status) says beside it: why its completed run is lost, how it
    failed, or why it was never run; "" for none."""
    if status in LOST and member["status"] == "completed":
        return f"its run was {'deleted' if status == MISSING else 'damaged'}; --resume runs it again"
    return member.get("failure") or (member.get("reason") if status in (SKIPPED, INVALID) else "") or ""


def ran_line(member: dict) -> str:
    """What a command campaign's member that has a run ran ("ran: CMD"); "" for any other member."""
    return f"ran: {member['command']}" if member.get("command") and member.get("run") else ""


# -- one supervisor per campaign --------------------------------------------------------------------
def take_lock(name: str) -> int:
    """Campaign `name`'s lock, taken for its new supervisor: an open descriptor holding an exclusive
    flock on its supervisor.lock. The lock lasts while any process holds a copy of the descriptor:
    `campaign run` hands it to the supervisor it starts, which holds it until it ends, so no second
    supervisor can start meanwhile. One held by another is one line saying who holds it."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        folder = directory(name)
        folder.mkdir(parents=True, exist_ok=True)
        path = directory(name) / LOCK                 # (checked again: no link was put there meanwhile)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"{path}: cannot open the campaign's lock ({exc.strerror})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{path}: not a regular file; remove it")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                note_holder(fd, os.getpid())
                return fd
            os.close(fd)                              # deleted (campaign delete) between open and lock
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                raise UserError(f"campaign {name!r} is already being run, by {holder(name)}, which holds its lock "
                                f"{path}; wait for it, or cancel it (charllm-tui campaign cancel {name})") from None
            time.sleep(0.05)
        except FileNotFoundError:
            os.close(fd)
        except UserError:
            os.close(fd)
            raise
        except OSError as exc:
            os.close(fd)
            raise UserError(f"{path}: cannot lock it ({exc.strerror}): the runs directory's file system must "
                            "support flock") from None


def note_holder(fd: int, pid: int) -> None:
    """Write who holds the lock into its file (what a refused `campaign run` names)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": pid, "host": socket.gethostname()}).encode(), 0)


def holder(name: str) -> str:
    """Who holds campaign `name`'s lock, as its file says."""
    try:
        said = json.loads(read_bounded(directory(name) / LOCK, 4096, "campaign lock"))
        return f"process {int(said['pid'])} on {str(said['host'])[:64]}"
    except (OSError, ValueError, TypeError, KeyError, UserError):
        return "another process"


def supervisor_alive(name: str) -> bool:
    """Whether a `campaign run` or the supervisor it started holds campaign `name`'s lock now (a
    non-blocking probe, held for a moment: no pid is trusted)."""
    try:
        fd = os.open(directory(name) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, UserError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)                                  # (which lets go of the probe's own lock)
    return False


def delete(name: str) -> None:
    """Remove campaign `name`'s record folder, through <runs>/.campaigns opened without following a
    link: nothing outside it is ever removed. The caller holds its lock (take_lock)."""
    runs = os.open(paths.runs_dir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        base = os.open(".campaigns", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=runs)
    finally:
        os.close(runs)
    try:
        shutil.rmtree(check_name(name), dir_fd=base)
    finally:
        os.close(base)
