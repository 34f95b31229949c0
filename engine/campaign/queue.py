"""Running a campaign: `start`, `cancel` and `refresh`, and the campaign supervisor that owns the queue,
`python -m charllm.engine.campaign.queue NAME`.

`start` plans every member, writes the campaign's record (state.py) and hands the queue to a
detached supervisor, so the queue outlives the terminal that started it. Each member is launched
as a run of its own (engine.launch), which records itself in its run directory like any other.

- Where the target has a scheduler (Slurm), the queue lives in it: the supervisor submits every
  member at once, each job told to wait for the job `max_parallel` places before it among those
  submitted (Target.queued: Slurm's --dependency=afterany, and --time for the time limit; a member
  the scheduler refuses takes no place, so the chain holds), and then only watches: one follower
  for all members' jobs (Target.follower: one call to the scheduler per interval, no process per
  member). Killing the supervisor leaves the queue and the jobs going; readers settle the runs.
- Elsewhere (local, ssh) the supervisor is the queue: it launches members `max_parallel` at a time,
  stops one past its time limit, and ties every member's run to its own life, so killing the
  supervisor stops everything it started (probes.core.lifeline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from charllm.engine.campaign import state
from charllm.engine.campaign.spec import Campaign, Member, Plan, check_max_parallel
from charllm.engine.campaign.state import DONE, LOST, MISSING, QUEUED, Record, directory
from charllm.engine.launch.launcher import (
    FOLLOWER_KEY,
    LayoutRefused,
    cancel as cancel_run,
    checked,
    launch,
    plan as plan_steps,
    reconcile,
)
from charllm.engine.launch.supervise import keep_summaries, with_profile
from charllm.engine.launch.target import Follower, Target
from charllm.engine.launch.targets import from_record
from charllm.engine.model.memory import FITS, TIGHT
from charllm.probes.core import paths, procid
from charllm.probes.core.errors import UserError, os_error_line, plural
from charllm.probes.core.formatting import clock
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir

POLL_S = 1.0
MODULE = "charllm.engine.campaign.queue"


# --------------------------------------------------------------------------------------------
# What the command line and the workbench call
# --------------------------------------------------------------------------------------------
def start(campaign: Campaign, target: Target, *, max_parallel: int | None = None, include_oom: bool = False,
          resume: bool = False) -> Record:
    """Plan every member, record the campaign and start its supervisor (detached); returns the record.
    `resume`: a campaign that ran before runs again only its members without a completed run.
    The campaign's lock is taken first and handed to the supervisor, which holds it until it ends: of
    two `campaign run` at once, one starts a supervisor and the other is refused, saying who runs it."""
    parallel = check_max_parallel(max_parallel if max_parallel is not None else campaign.max_parallel,
                                  "--max-parallel")
    if campaign.command is not None:   # before anything is recorded: a command on other machines names them
        campaign.command_hardware(None if target.on_this_machine else target.name)
    plans = campaign.plan()
    lock = state.take_lock(campaign.name)
    try:
        with _supervisor_log(campaign.name) as out:   # first: a log it cannot write leaves no record
            record = _record_for_run(campaign, plans, target, parallel, include_oom, resume)
            token = procid.write_token(directory(campaign.name))   # the supervisor carries it: what cancel needs
            supervisor = subprocess.Popen([sys.executable, "-m", MODULE, campaign.name, "--lock-fd", str(lock)],
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                          close_fds=True, pass_fds=(lock,), env=procid.run_environment(token))
        state.note_holder(lock, supervisor.pid)
    except UserError:
        if not os.path.lexists(directory(campaign.name) / "campaign.json"):
            state.delete(campaign.name)           # the folder the lock made, and nothing else
            with contextlib.suppress(OSError):
                os.rmdir(state.root())            # and <runs>/.campaigns where it holds nothing else
        raise
    finally:
        os.close(lock)                            # (the supervisor holds its own copy)
    return record


def wait_handed_over(name: str, timeout: float = 3600.0) -> Record:
    """The record once the campaign's supervisor has taken the queue over (where a scheduler keeps it,
    every member submitted: the scheduler shows each job), the campaign ended, or the supervisor is
    gone; at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        record = Record.load(name)
        if record.data.get("handed_over_ns") or record.data.get("status") in FINAL_STATUSES or \
                not state.supervisor_alive(name) or time.monotonic() > deadline:
            return record
        time.sleep(0.2)


def _supervisor_log(name: str):
    """The campaign supervisor's log, opened to append (never through a link)."""
    path = directory(name) / "supervisor.log"
    try:
        return open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "ab")
    except OSError as exc:
        raise UserError(f"{path}: a symbolic link; remove it" if exc.errno == errno.ELOOP else
                        os_error_line(exc, path)) from None


def _record_for_run(campaign: Campaign, plans: list[Plan], target: Target, parallel: int, include_oom: bool,
                    resume: bool) -> Record:
    """The campaign's new record, written: every member planned, and with `resume` those that
    completed before kept. Refused while the previous record has not ended, or without `resume`."""
    try:
        previous = Record.load(campaign.name)
    except UserError:
        if os.path.lexists(directory(campaign.name) / "campaign.json"):
            raise                                 # damaged: kept for the user to read or delete
        previous = None
    if previous is not None:
        refresh(previous)
        if previous.data.get("status") not in FINAL_STATUSES:
            raise UserError(f"campaign {campaign.name!r} is {previous.data.get('status')}; wait for it or cancel it "
                            f"(charllm-tui campaign cancel {campaign.name})")
        if not resume:
            raise UserError(f"campaign {campaign.name!r} has run before: --resume runs its members that have no "
                            f"completed run (or delete its record: charllm-tui campaign delete {campaign.name})")
    elif resume:
        raise UserError(f"campaign {campaign.name!r} has not run: nothing to resume (run it without --resume)")
    record = Record.new(campaign, plans, target.to_dict(), include_oom=include_oom, max_parallel=parallel)
    if previous is not None:
        _keep_completed(record, previous)
    if record.finished:
        raise UserError(f"campaign {campaign.name!r}: no member left to run ({record.progress()})")
    check_target(record, {p.member.key: p.member for p in plans}, target)
    record.save()
    return record


class Refused(UserError):
    """A campaign refused before anything started: `reasons`, one line each (the CLI prints them so)."""

    def __init__(self, head: str, reasons: list[str]):
        super().__init__(f"{head}: {'; '.join(reasons)}")
        self.head, self.reasons = head, reasons


def forced(member: dict) -> bool:
    """Whether a member is launched past its layout's problems: one planned not to fit (--include-oom)."""
    return member["verdict"] not in (FITS, TIGHT)


def check_target(record: Record, members: dict[str, Member], target: Target) -> None:
    """Refuse the campaign (Refused, one line per reason) unless every member it would run can start
    on `target`, as `launch` checks each (launcher.checked: node count, GPUs per node, the layout),
    and the target is ready for them all (Target.check_ready: a scheduler's commands, reachable hosts)."""
    why: dict[str, list[str]] = {}                 # reason -> the members it refuses
    steps = []
    for m in record.members:
        if m["status"] != QUEUED:
            continue
        member = members[m["key"]]
        try:
            exp, _ = checked(member.experiment, target, force=forced(m), planned=member.known)
            steps += plan_steps(exp, target, paths.runs_dir() / f"{record.name}-check", dry_run=True,
                                command=member.command)[0]
        except LayoutRefused as exc:               # (its "--force" is launch's, no campaign's)
            why.setdefault(exc.problem, []).append(m["name"])
        except UserError as exc:
            why.setdefault(str(exc), []).append(m["name"])
    try:
        target.check_ready(steps, lambda message: None)
    except UserError as exc:
        why.setdefault(str(exc), []).append("every member")
    if why:
        lines = [f"{reason} ({_members_named(names)})" for reason, names in why.items()]
        raise Refused(f"campaign {record.name!r} cannot run on target {target.name!r}; nothing was started "
                      f"({plural(len(lines), 'reason')})", lines)


def _members_named(names: list[str]) -> str:
    if names == ["every member"]:
        return "every member"
    shown_names = ", ".join(names[:3]) + (f" and {len(names) - 3:,} more" if len(names) > 3 else "")
    return f"{plural(len(names), 'member')}: {shown_names}"


def _keep_completed(record: Record, previous: Record) -> None:
    """Members that completed before keep their runs (where they still are); the others' earlier runs
    are remembered."""
    before = {m["key"]: m for m in previous.members}
    for m in record.members:
        old = before.get(m["key"])
        if old is None:
            continue
        if state.member_status(previous, old) == "completed":
            m.update({k: old[k] for k in ("status", "run", "runs", "failure", "started_ns", "ended_ns")})
        elif m["status"] == QUEUED:
            m["runs"] = old.get("runs", []) + ([old["run"]] if old.get("run") else [])


def refresh(record: Record) -> Record:
    """The record as it stands now: members' statuses from their runs, and, where the supervisor
    died here, the campaign finished as what it can still become (a scheduler's queue goes on).
    Written back only when the supervisor is gone (it writes the record while it lives)."""
    owner = record.data.get("supervisor") or {}
    if record.data.get("status") in FINAL_STATUSES or procid.where(owner) == "elsewhere" or _trust_problem(record):
        return record       # (a record someone else could have written is only read)
    if owner and procid.live(owner, procid.read_token(record.path.parent)) is not None:
        return record
    if not owner and time.time_ns() - record.data.get("created_ns", 0) < 60 * 10**9:
        return record                                   # handed over moments ago
    for m in record.members:
        rd = record.run_dir(m)
        if rd is not None and m["status"] not in DONE:
            _settle(m, rd, _observed(rd))
    ending = any(m["status"] in ("pending", "running") for m in record.members)
    scheduled = from_record(record.data["target"]).queued([], None) is not None
    if not scheduled and not ending:   # nothing goes on without the supervisor: what never started stays queued
        record.data.update(status="failed", ended_ns=time.time_ns(),
                           failure=f"the campaign supervisor died (found at {clock()}); "
                                   f"--resume runs the members left")
    elif scheduled and record.finished:
        record.data.update(ended_ns=time.time_ns(), **state.outcome(record))
    try:
        record.save()
    except OSError:
        pass
    return record


def cancel(name: str, wait: float = 120.0) -> Record:
    """Stop every member of the campaign and its queue; returns the final record."""
    record = refresh(Record.load(name))
    if record.data.get("status") in FINAL_STATUSES:
        raise UserError(f"campaign {name!r} is already {record.data['status']}")
    owner = record.data.get("supervisor") or {}
    problem = _trust_problem(record)
    if problem:
        raise UserError(f"campaign {name!r}: {problem}; nothing its record names is acted on")
    if procid.where(owner) == "elsewhere":
        raise UserError(f"campaign {name!r} is run by {procid.described(owner)}, not visible from here; cancel it "
                        f"there (charllm-tui campaign cancel {name})")
    token = procid.read_token(record.path.parent)
    if procid.signal(owner, signal.SIGTERM, token):    # only the supervisor proven its: it cancels its members
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and procid.live(owner, token) is not None:
            record = Record.load(name)
            if record.data.get("status") in FINAL_STATUSES:
                return record
            time.sleep(0.5)
        procid.signal(owner, signal.SIGKILL, token)   # stuck (or gone already: then nothing is sent)
    record = Record.load(name)
    if record.data.get("status") in FINAL_STATUSES:   # it recorded its end as it went
        return record
    _cancel_members(record)
    record.data.update(status="cancelled", ended_ns=time.time_ns())
    record.save()
    return record


def _trust_problem(record: Record) -> str | None:
    """Why nothing the record names may be acted on (procid.trust_problem), or None."""
    return procid.trust_problem(record.path.parent, record.path)


CANCEL_WAIT_S = 120.0   # how long a cancel waits for the scheduler to confirm its members' jobs ended


def _cancel_members(record: Record, follower: Follower | None = None) -> None:
    """Cancel every member's run that has not ended, and what is still queued; a member whose run
    vanished is settled as missing, never acted on. Without a scheduler each cancel waits for its
    run (side by side); with one, every job is asked to end first and then all are followed together
    (`follower`: the campaign supervisor's own; else each run is settled as a reader settles it)."""
    live = [(m, rd) for m in record.members if m["status"] not in DONE and (rd := record.run_dir(m)) is not None]
    scheduled = from_record(record.data["target"]).queued([], None) is not None

    def stop(pair):
        m, rd = pair
        status = state.run_status(rd)
        if status not in LOST and status not in FINAL_STATUSES:
            try:
                cancel_run(rd, wait=0 if scheduled else 60.0)
            except UserError:
                pass                                 # it ended first
        if not scheduled:
            _settle(m, rd, _cancelled(state.run_status(rd)))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(stop, live))
    deadline = time.monotonic() + (CANCEL_WAIT_S if scheduled else 0)
    while live:
        if follower is not None:
            follower.step([rd for _, rd in live])
        for m, rd in live:
            _settle(m, rd, _cancelled(_observed(rd)))
        live = [(m, rd) for m, rd in live if m["status"] not in DONE]
        if not live or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    for m in record.members:
        if m["status"] == QUEUED:
            m["status"] = "cancelled"


def _cancelled(status: str) -> str:
    """A member's status once the campaign cancelled its run: "cancelled" for a run that ended other
    than completed, whatever it is recorded as later (a scheduler's job may end "failed"), so what
    cancel reports is what status shows from then on; a lost run, or one not ended yet, as it is."""
    return "cancelled" if status in FINAL_STATUSES and status != "completed" else status


def _observed(rd: RunDir) -> str:
    """A member run's status now: MISSING or DAMAGED where its directory or manifest is gone or
    damaged (and nothing in it is acted on), else its status once reconciled (launcher.reconcile)."""
    status = state.run_status(rd)
    if status in LOST or status in FINAL_STATUSES:
        return status
    try:
        return reconcile(rd)
    except UserError:                                # damaged just now
        return state.DAMAGED
    except FileNotFoundError:                        # deleted just now
        return MISSING


def _settle(member: dict, rd: RunDir, status: str) -> None:
    """Copy a finished run's outcome into its member (MISSING, DAMAGED: its run is lost; the queue
    goes on)."""
    if status in LOST:
        member.update(status=status, ended_ns=time.time_ns(),
                      failure=f"its run {rd.id} is {'gone' if status == MISSING else 'damaged'}; "
                              f"--resume runs it again")
        return
    if status not in FINAL_STATUSES:
        member["status"] = status if status in ("pending", "running") else member["status"]
        if status == "running" and not member.get("started_ns"):
            member["started_ns"] = _run_started(rd)
        return
    try:
        m = rd.manifest()
    except UserError as exc:
        member.update(status="failed", failure=str(exc), ended_ns=time.time_ns())
        return
    member["status"] = "failed" if member.get("timed_out") else status
    member["failure"] = member.get("failure") or m.failure
    member["started_ns"] = m.started_ns or member.get("started_ns") or m.created_ns
    member["ended_ns"] = m.ended_ns or time.time_ns()


def _run_started(rd: RunDir) -> int | None:
    try:
        return rd.manifest().started_ns
    except UserError:
        return None


# --------------------------------------------------------------------------------------------
# The campaign supervisor
# --------------------------------------------------------------------------------------------
class Queue:
    def __init__(self, name: str):
        self.record = Record.load(name)
        self.target = from_record(self.record.data["target"])
        self.scheduler = self.target.queued([], None) is not None
        # The members, expanded again from the campaign file the record was made from.
        self.expanded = {m.key: m for m in Campaign.load(self.record.data["source"]).members()}
        self.cancel_requested = False
        self.started: dict[int, float] = {}            # member index -> monotonic start (time limits)
        # Where a scheduler runs the jobs, this process follows all of them (its members have no
        # supervisor each); elsewhere each member's own supervisor owns its processes.
        self.follower = self.target.follower(self.record_end) if self.scheduler else None

    def _on_signal(self, signum, frame) -> None:
        self.cancel_requested = True

    def run(self) -> str:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.record.data.update(status="running", started_ns=time.time_ns(),
                                supervisor={**procid.identify(os.getpid()), "pgid": os.getpgid(0)})
        self.record.save()
        if self.scheduler:
            self.submit_all()
        self.record.data["handed_over_ns"] = time.time_ns()    # (what `campaign run --detach` waits for)
        self.record.save()
        while not self.cancel_requested and not self.record.finished:
            if not self.scheduler:
                self.fill()
            self.poll()
            time.sleep(POLL_S)
        if self.cancel_requested:
            _cancel_members(self.record, self.follower)
            self.record.data.update(status="cancelled", ended_ns=time.time_ns())
        else:
            self.record.data.update(ended_ns=time.time_ns(), **state.outcome(self.record))
        self.record.save()
        return self.record.data["status"]

    # -- launching ---------------------------------------------------------------------------
    def members(self, *statuses) -> list[dict]:
        return [m for m in self.record.members if m["status"] in statuses]

    def fill(self) -> None:
        """Launch queued members while fewer than max_parallel run (this process is the queue)."""
        running = self.members("pending", "running")
        for m in self.members(QUEUED)[: max(0, self.record.data["max_parallel"] - len(running))]:
            if self.cancel_requested:
                return
            self.start_member(m, self.target, tied=True)

    def submit_all(self) -> None:
        """Submit every queued member at once, each after the one max_parallel places before it
        among those submitted (the scheduler keeps the queue from now on). A member the scheduler
        refuses takes no place: the next one waits for the job before it, so no more than
        max_parallel ever run at once."""
        lanes = self.record.data["max_parallel"]
        submitted: list[RunDir] = []
        for m in self.members(QUEUED):
            if self.cancel_requested:
                return
            before = submitted[-lanes] if len(submitted) >= lanes else None
            after = [before.manifest()] if before is not None else []
            target = self.target.queued(after, self.record.data.get("time_limit_s"))
            assert target is not None            # submit_all runs only where a scheduler keeps the queue
            rd = self.start_member(m, target, tied=False)
            if rd is not None:
                submitted.append(rd)

    def start_member(self, m: dict, target: Target, *, tied: bool) -> RunDir | None:
        """Start one member's run; a member that cannot start is failed with the reason, and the
        campaign goes on. Under a scheduler this process is the run's supervisor (its follower)."""
        member = self.expanded.get(m["key"])
        if member is None:
            m.update(status="failed", failure=f"not started: no longer in {self.record.data['source']}")
            self.record.save()
            return None
        record: dict = {"campaign": {"name": self.record.name, "member": m["index"]}}
        if self.follower is not None:
            record["supervisor"] = {**procid.identify(os.getpid()), FOLLOWER_KEY: self.record.name}
        command = member.command
        if command is not None and command.cwd is None and target.shares_files:
            command = dataclasses.replace(command, cwd=os.getcwd())   # (where `campaign run` ran, as launch's)
        try:
            result = launch(member.experiment, target, force=forced(m), tied=tied, record=record,
                            supervised=self.follower is None, command=command, notes=list(member.notes))
        except (UserError, OSError) as exc:
            why = str(exc) if isinstance(exc, UserError) else os_error_line(exc)
            m.update(status=state.REFUSED, failure=f"not started: {why}", started_ns=time.time_ns(),
                     ended_ns=time.time_ns())
            self.record.save()
            return None
        m.update(status="pending", run=result.run_id, submitted_ns=time.time_ns(), failure=None)
        self.started[m["index"]] = time.monotonic()
        self.record.save()
        assert result.run_dir is not None        # not a dry run
        return RunDir(result.run_dir)

    # -- watching ----------------------------------------------------------------------------
    def record_end(self, rd: RunDir, fields: dict) -> None:
        """Record how a member's run ended (the follower found it), as its own supervisor would."""
        rd.update_manifest(**with_profile(rd, fields))
        keep_summaries(rd)

    def poll(self) -> None:
        """Follow the members' jobs (under a scheduler), settle members whose runs ended; stop one
        past its time limit (where no scheduler does)."""
        if self.follower is not None:
            runs = [self.record.run_dir(m) for m in self.members("pending", "running")]
            self.follower.step([rd for rd in runs if rd is not None])
        changed = False
        limit = self.record.data.get("time_limit_s")
        for m in self.members("pending", "running"):
            rd = self.record.run_dir(m)
            if rd is None:                       # a pending member always names its run
                continue
            status = _observed(rd)
            if status != m["status"]:
                _settle(m, rd, status)
                changed = True
            elif (
                not self.scheduler
                and limit
                and time.monotonic() - self.started.get(m["index"], time.monotonic()) > limit
            ):
                m.update(timed_out=True, failure=f"time limit ({limit:g} s) reached; stopped")
                try:
                    cancel_run(rd)
                except UserError:
                    pass
                _settle(m, rd, rd.status)
                changed = True
        if changed:
            self.record.save()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 3) or len(argv) == 3 and (argv[1] != "--lock-fd" or not argv[2].isdigit()):
        print(f"usage: python -m {MODULE} NAME [--lock-fd FD]", file=sys.stderr)
        return 2
    try:   # the campaign's lock, held until its record says how it ended (`start` hands over the one it took)
        lock = int(argv[2]) if len(argv) == 3 else state.take_lock(argv[0])
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # (a no-op on the lock it holds: the proof it does)
        os.set_inheritable(lock, False)          # (no member run holds it after this process is gone)
        state.note_holder(lock, os.getpid())
    except (UserError, OSError) as exc:
        print(f"campaign supervisor: not started: {exc}", file=sys.stderr)
        return 2
    queue = Queue(argv[0])
    try:
        status = queue.run()
    except BaseException as exc:
        _cancel_members(queue.record, queue.follower)  # never leave members running without their queue
        queue.record.data.update(
            status="failed", ended_ns=time.time_ns(), failure=f"campaign supervisor error: {exc!r}"
        )
        queue.record.save()
        raise
    finally:
        os.close(lock)       # its record says how it ended: the next `campaign run` may start now
    print(f"campaign {argv[0]}: {status} ({queue.record.tally()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
