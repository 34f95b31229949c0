"""Launching an experiment onto a target, cancelling it, and settling a run whose owner died.

`launch()` checks the layout, creates the run directory, and hands the run to a detached
supervisor (`python -m charllm.engine.launch.supervise RUN_DIR`) that owns the processes: a sampler per
node, then torchrun per node with a static rendezvous on the first node. Under Slurm it submits an
sbatch script instead and the supervisor follows the job. Logs, iterations and telemetry land in
the local run directory for every target, so the live view and summaries work the same way;
`probes.store.follow` follows a run, with `reconcile` settling it on each pass.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from charllm.engine.launch.command import Command
from charllm.engine.launch.target import Step, Target, recorded_line
from charllm.engine.launch.targets import LOCAL, from_record
from charllm.probes.core import lifeline, paths, procid
from charllm.probes.core.errors import UserError, mount_point, os_error_line
from charllm.probes.core.formatting import clock, size
from charllm.probes.store.rundir import (
    FINAL_STATUSES,
    Manifest,
    RunDir,
    new_run_id,
    remove_abandoned_staging,
    unique_run_dir,
)

CANCEL_GRACE_S = 10.0
# In a run's supervisor record: the campaign whose supervisor follows the run (with the campaign's
# other runs, on a scheduler: launch(supervised=False)); it carries the campaign's token, not the run's.
FOLLOWER_KEY = "campaign"
RESERVE_BYTES = 256 * 1024   # what a supervisor holds on the run's disk to record its final status
MIN_FREE_BYTES = 4 * RESERVE_BYTES   # a launch needs that, its manifest, experiment and first logs


@dataclass
class LaunchResult:
    run_id: str
    run_dir: Path | None              # None for a dry run (nothing was created)
    commands: list[str]
    job_script: str | None = None     # the script a scheduler target submits (plan's), else None
    job_script_label: str = "job script"   # the target's word for it ("sbatch script")
    forced: list[str] = field(default_factory=list)
    dry_run: bool = False
    job_id: str | None = None         # the scheduler's id of the run's job, where the target has one
    job: str = ""                     # the target's words for it ("slurm job 12"); "" without a scheduler
    profile: str | None = None        # what the profiler window records and costs (engine.model.profiling)
    notes: list[str] = field(default_factory=list)   # a user's command: how it was planned, or why not


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def problems(exp) -> list[str]:
    """Why this layout should not run: validation problems, else what the node it is planned for
    cannot run (engine.model.runtime) and a memory overflow. The workload checks the first two again
    on the node itself, against the software it finds there."""
    from charllm.engine.model.memory import DOES_NOT_FIT, estimate  # deferred: the models (runs commands' start-up)
    from charllm.engine.model.validate import validate  # deferred: the models (runs commands' start-up)

    found = [str(p) for p in validate(exp)]
    if found:
        return found  # the memory model assumes a valid layout
    report = estimate(exp)
    found = list(report.runtime_problems)
    if report.verdict == DOES_NOT_FIT:   # a tight plan launches: the allocator may still manage
        stage = report.peak_stage
        found.append(f"memory: peak {size(report.peak_bytes, 1)} on pipeline stage {stage} exceeds the "
                     f"{size(report.budget.allocator_bytes, 1)} the allocator may use per device of "
                     f"{exp.hardware.name!r} (charllm-tui plan shows the arithmetic)")
    return found


def _fit_to_target(exp, target: Target, nproc: int | None):
    exp = exp.copy()
    if nproc is not None:
        if nproc < 1:
            raise UserError(f"--nproc = {nproc}: must be at least 1")
        exp.cluster.gpus_per_node = nproc
    if target.gpus_per_node and exp.cluster.gpus_per_node > target.gpus_per_node:
        raise UserError(f"cluster.gpus_per_node = {exp.cluster.gpus_per_node}: target {target.name!r} "
                        f"has {target.gpus_per_node} per node")
    target.check_nodes(exp.cluster.nodes)
    return exp


def checked(exp, target: Target, *, force: bool = False, nproc: int | None = None,
            say: Callable[[str], None] = lambda message: None, planned: bool = True) -> tuple:
    """What `launch` checks of `exp` on `target` before it creates anything (campaign run checks every
    member with it): returns the experiment fitted to the target and its layout's problems (those
    `force` launches anyway; none where it is not `planned`: a user's command without a layout); a
    UserError for what refuses it (LayoutRefused: a layout problem)."""
    exp = _fit_to_target(exp, target, nproc)
    say("checking the layout")
    found = problems(exp) if planned else []
    if found and not force:
        raise LayoutRefused(found[0])
    return exp, found


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
# What a dry run shows for torchrun's rendezvous port: the port is picked when the run launches
# (a port free now may not be free then), so a dry run names none.
PORT_AT_LAUNCH = "PORT"


def plan(exp, target: Target, run_dir: Path, *, dry_run: bool = False,
         command: Command | None = None) -> tuple[list[Step], str | None]:
    """The processes per node (and the job script of a scheduler target)."""
    return target.plan(exp, run_dir, PORT_AT_LAUNCH if dry_run else target.rendezvous_port(), command)


def display_commands(steps: list[Step], target: Target) -> list[str]:
    return [f"[{step.role}@{step.node}] {target.display_command(step)}" for step in steps]


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------
class LayoutRefused(UserError):
    """A launch refused for a problem of the layout (`problems`), which `force` launches anyway."""

    def __init__(self, problem: str):
        super().__init__(f"{problem} (launch anyway with --force)")
        self.problem = problem


def launch(exp, target: Target, *, dry_run: bool = False, force: bool = False, nproc: int | None = None,
           on_progress: Callable[[str], None] | None = None, record: dict | None = None,
           tied: bool = False, supervised: bool = True, command: Command | None = None,
           notes: list[str] | None = None) -> LaunchResult:
    """Start `exp` on `target`: a run directory and its detached supervisor. `record`: fields the
    manifest also holds (a campaign's member). `tied`: the supervisor is asked to stop (and stops
    the run) when the process that launched it dies, as a campaign's members do. Not `supervised`:
    no supervisor is started, the caller follows the run (a campaign's supervisor following all its
    members' jobs on a scheduler, Target.follower) and `record` names it as the run's supervisor.

    `command`: a user's own command runs on every node instead of charllm's workload (command.py,
    `plan_command` gives `exp` and `notes`). Its layout, where its flags give one, is planned and its
    problems are noted, never refused: the job is the user's; where it gives none, the run keeps no
    experiment.toml (nothing to plan from)."""
    say = on_progress or (lambda message: None)
    # A user's command is never refused for its layout (the job is the user's): its problems are noted.
    planned = command is None or command.planned
    exp, found = checked(exp, target, force=force or command is not None, nproc=nproc, say=say, planned=planned)
    notes = list(notes or [])
    if command is not None:
        notes += [f"the plan says: {problem}" for problem in found]
        found = []
    run_id = new_run_id(exp.name)
    run_dir = unique_run_dir(paths.runs_dir() / run_id)
    steps, script = plan(exp, target, run_dir, dry_run=dry_run, command=command)
    commands = display_commands(steps, target)
    from charllm.engine.model import profiling  # deferred: the models (runs commands' start-up)

    window = profiling.plan(exp) if command is None else None   # (a command profiles itself, if at all)
    result = LaunchResult(run_id=run_dir.name, run_dir=None, commands=commands, job_script=script,
                          job_script_label=target.job_script_label, notes=notes,
                          forced=found, dry_run=dry_run, profile=window.describe() if window else None)
    if dry_run:
        return result

    target.check_ready(steps, say)

    base = run_dir.with_name(run_id)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    _check_room(run_dir.parent)
    remove_abandoned_staging(run_dir.parent)
    while True:  # claim the name: a simultaneous launch may have taken it since (never remove theirs)
        try:
            rd = RunDir.create(run_dir, "launch")
            break
        except FileExistsError:
            run_dir = unique_run_dir(base)
            steps, script = plan(exp, target, run_dir, command=command)
            result.run_id, result.job_script = run_dir.name, script
            result.commands = commands = display_commands(steps, target)
    say(f"creating {run_dir}")
    manifest = {
        "id": rd.id, "kind": "train", "name": exp.name, "status": "pending",
        "created_ns": time.time_ns(), "target": target.to_dict(),
        "nodes": [] if target.allocates_nodes else sorted({s.node for s in steps}),   # (a scheduler picks them)
        "steps": [s.to_dict() for s in steps],
        "commands": commands, "forced": found if force else [], "world_size": exp.world_size,
        "launched_from": procid.place(),   # who may judge the run until its supervisor records itself
        **({"command": {**command.to_dict(), "notes": notes}} if command else {}),
        **(record or {}),
    }
    if window:   # what it will record and cost; the supervisor adds what it did (RunDir.profile_account)
        manifest["profile"] = {**window.to_dict(), "cost": window.describe()}
    try:
        rd.logs_dir.mkdir()
        token = procid.write_token(rd.path)   # every process of the run carries it: the proof a signal needs
        if planned:
            exp.save(rd.experiment_path)
        rd.write_manifest(manifest)
        manifest.update(target.prepare(rd, steps, script, say))
        recorded = manifest["target"]
        result.job_id, result.job = target.run_record(recorded).get("job_id"), target.describe_job(recorded)
        if not supervised:
            result.run_dir = rd.path
            return result
        say("starting the supervisor")
        with open(rd.logs_dir / "supervisor.log", "ab") as log:
            subprocess.Popen([sys.executable, "-m", "charllm.engine.launch.supervise", str(rd.path)],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                             close_fds=True, preexec_fn=lifeline.terminated_with_parent if tied else None,
                             env=procid.run_environment(token, rd.id))
    except BaseException:
        # A launch that did not start leaves nothing behind. A job the scheduler took but cannot be
        # asked to end now fails at once without its directory; the launch's own cause is what is said.
        try:
            target.cancel_job(rd, Manifest.from_dict(manifest))
        except UserError:
            pass
        shutil.rmtree(rd.path, ignore_errors=True)
        raise
    result.run_dir = rd.path
    return result


# --------------------------------------------------------------------------------------------
# Cancel
# --------------------------------------------------------------------------------------------
def reconcile(rd: RunDir) -> str:
    """The run's status, after recording it as ended if whoever owned it died without saying so.

    A reader: it never signals anything, whatever the manifest says (a manifest is a file anyone
    with the user's rights may have edited, and a copied identity is no proof: probes.core.procid).
    A launched run is owned by its supervisor, a probe-only run by its sampler. When that process
    is gone but the status is not final, the target says what the run became (Target.settle_orphan:
    from the nodes' own end records, or the scheduler's job) and it is recorded, naming what the run
    recorded; `cancel`, which the user asks for, stops anything left.

    Only the host, boot and PID namespace the owner was recorded in can tell whether it lives: a
    reader elsewhere (another login node sharing the runs directory, a container) leaves the run
    alone, and its status line says where it runs. A run whose manifest or directory someone else
    could have written (RunDir.trust_problem) is only read."""
    manifest = rd.manifest()
    status = manifest.status
    if manifest.final or not rd.ours() or rd.trust_problem():
        return status       # (a directory charllm-tui did not make, or one not to be trusted, is only read)
    owner = manifest.owner
    if procid.where(owner) == "elsewhere":
        return status       # its own host judges it
    # A probe started by hand carries no token, nor does a campaign's supervisor carry its members'
    # (it follows their scheduler's jobs: FOLLOWER_KEY): whether they live is read from who they are.
    token = None if manifest.kind == "probe" or owner.get(FOLLOWER_KEY) else rd.token
    if not manifest.supervisor and manifest.kind != "probe":
        if not _supervisor_never_started(rd, manifest, token):
            return status   # not started yet: launch records it within moments
        lost = "the supervisor died before it started the run (see logs/supervisor.log)"
    elif not owner or procid.live(owner, token) is not None:
        return status       # alive
    elif manifest.kind == "probe":
        lost = f"the sampler died (found at {clock()}); telemetry up to then is kept"
    else:
        lost = f"the supervisor died (found at {clock()})"
    manifest = rd.manifest()
    if manifest.final:      # it wrote its last word just now
        return manifest.status
    lost += disk_note(rd.path)
    if manifest.kind == "probe":
        return _record(rd, status="failed", ended_ns=time.time_ns(), failure=lost)
    fields = _target(manifest).settle_orphan(rd, manifest, lost)
    if fields is None:
        return status       # it goes on without its supervisor (a scheduler's job)
    if fields.get("status", status) not in FINAL_STATUSES:
        return _record(rd, **fields)   # (a scheduler's job started, or its nodes are known now: said as it goes)
    return _record(rd, orphaned_ns=time.time_ns(), ended_ns=time.time_ns(), **fields)


SUPERVISOR_START_S = 60  # launch hands a run to its supervisor within seconds (ssh checks included)


def _supervisor_never_started(rd: RunDir, manifest: Manifest, token: str | None) -> bool:
    """Whether a run launched here a while ago has no supervisor: none recorded itself, none is running."""
    if procid.where(manifest.launched_from) not in ("here", "unknown"):
        return False
    if not manifest.created_ns or time.time_ns() - manifest.created_ns < SUPERVISOR_START_S * 1_000_000_000:
        return False
    return not _supervisor_processes(rd, token) and not rd.manifest().supervisor  # (recorded meanwhile)


def _supervisor_processes(rd: RunDir, token: str | None) -> list:
    """The run's supervisor processes found by command line (before it recorded itself); with the
    run's token, only those that carry it."""
    import psutil

    return [proc for proc in psutil.process_iter(["cmdline"])
            if (proc.info["cmdline"] or [])[-3:] == ["-m", "charllm.engine.launch.supervise", str(rd.path)]
            and _alive(proc) and (token is None or procid.carries(proc.pid, token))]


def _target(manifest: Manifest) -> Target:
    """The target the run was launched on (local where its manifest recorded none)."""
    return from_record(manifest.target or LOCAL.to_dict())


def _check_room(runs: Path) -> None:
    """Refuse a launch onto a disk without room for the run to record itself (a UserError line)."""
    free = shutil.disk_usage(runs).free
    if free < MIN_FREE_BYTES:
        raise UserError(f"disk full on {mount_point(runs)}: {free // 1024:,} KiB free, a run needs at least "
                        f"{MIN_FREE_BYTES // 1024:,} KiB to record itself; free some space and launch again")


def disk_note(path: Path) -> str:
    """'; disk full on /x' when the run's disk has no room left (the likely cause of a failure)."""
    try:
        full = shutil.disk_usage(path).free < RESERVE_BYTES
    except OSError:
        return ""
    return f"; disk full on {mount_point(path)}" if full else ""


def _record(rd: RunDir, **fields) -> str:
    """Record a final status; a run directory that cannot take it (a full disk, made read-only)
    is one line saying the processes are stopped regardless."""
    try:
        return rd.update_manifest(**fields)["status"]
    except OSError as exc:
        raise UserError(f"run {rd.id!r}: its status ({fields.get('status', rd.status)}) could not be recorded: "
                        f"{os_error_line(exc, rd.path)}") from None


def cancel(run_dir, *, grace: float = CANCEL_GRACE_S, wait: float = 60.0) -> str:
    """Stop every process of the run on every node; returns the final status. Only what is proven
    the run's is signalled (probes.core.procid: this user's, carrying the run's token). A run that
    ended because its supervisor died may have left processes: they are stopped, and the run keeps
    its status (a UserError says what it ended as when nothing was left)."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    problem = rd.trust_problem()
    if problem:
        raise UserError(f"run {rd.id!r}: {problem}; nothing its manifest names is acted on")
    reconcile(rd)
    manifest = rd.manifest()
    token = rd.token
    if manifest.kind == "probe" and not manifest.final:
        return _cancel_probe(rd, manifest.sampler, grace)
    target = _target(manifest)
    elsewhere = procid.where(manifest.owner) == "elsewhere"
    if manifest.orphaned_ns and not elsewhere and token and target.stop_processes(manifest, grace, token):
        rd.update_manifest(note=f"{manifest.note + '; ' if manifest.note else ''}what it left running was "
                                f"stopped at {clock()} (runs cancel)")
        return manifest.status
    if manifest.final:
        raise UserError(f"run {rd.id!r} is already {manifest.status_line}")
    sup = None
    scheduled = target.cancel_job(rd, manifest)  # under a scheduler, the supervisor sees the job end and records it
    if token is None and not elsewhere and not scheduled:
        raise UserError(f"run {rd.id!r} was recorded without a run token (before charllm-tui kept one), so its "
                        f"processes cannot be proven its own; stop them yourself ({recorded_line(manifest) or '-'})")
    if elsewhere and not scheduled:
        raise UserError(f"run {rd.id!r} runs on {procid.described(manifest.owner)}, not visible from here; "
                        f"cancel it there (charllm-tui runs cancel {rd.id})")
    if not scheduled:
        deadline = time.monotonic() + 10
        while not manifest.supervisor and time.monotonic() < deadline:  # just launched
            time.sleep(0.1)
            manifest = rd.manifest()
        # One still starting (a loaded machine) has not recorded itself yet: found by its command
        # line, a SIGTERM ends it before it starts a step (it handles SIGTERM before it records itself).
        sup = procid.live(manifest.supervisor, token) or next(iter(_supervisor_processes(rd, token)), None)
        if sup is not None:
            sup.send_signal(signal.SIGTERM)  # it stops its steps (TERM, grace, KILL) and records the status
    status = _wait_final(rd, wait if scheduled or sup else 0, sup)
    if status in FINAL_STATUSES or elsewhere:
        return status   # (a scheduler's job cancelled from another host: its supervisor records it there)
    if scheduled:       # the scheduler was asked; its follower (or the next reader) records the end it confirms
        if wait > 0:
            raise UserError(f"run {rd.id!r}: {target.describe_job(manifest.target) or 'its job'} was asked to end, "
                            f"and the scheduler has not confirmed it within {wait:.0f} s; the run records its end once "
                            f"it does (charllm-tui runs show {rd.id})")
        return status
    # The supervisor is gone or stuck: stop what it recorded ourselves.
    manifest = rd.manifest()
    procid.signal(manifest.supervisor, signal.SIGKILL, token)
    target.stop_processes(manifest, grace, token)
    return _record(rd, status="cancelled", ended_ns=time.time_ns(), note="cancelled without its supervisor")


def _cancel_probe(rd: RunDir, owner: dict, grace: float) -> str:
    """A probe-only run: its sampler is a command the user started, with no run token to prove it, so
    it is asked to stop (RunDir.cancel_request_path, which it watches; it closes its last chunk), never
    signalled."""
    if procid.where(owner) == "elsewhere":
        raise UserError(f"run {rd.id!r}: its sampler runs on {procid.described(owner)}, not visible from here; "
                        f"stop it there (charllm-tui runs cancel {rd.id})")
    rd.cancel_request_path.touch()
    status = _wait_final(rd, grace + 5.0, procid.live(owner, None))
    if status in FINAL_STATUSES:
        return status
    if procid.live(owner, None) is None:   # it died without a word: the request settles it
        return _record(rd, status="cancelled", ended_ns=time.time_ns())
    raise UserError(f"run {rd.id!r}: its sampler (pid {owner.get('pid')}) did not stop within {grace + 5.0:.0f} s "
                    f"of the request; if it is stuck, stop it yourself (kill {owner.get('pid')})")


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# How long a follower waits for the supervisor to exit after the final status (it keeps the run's
# summaries first: about a second for an hour of 64 GPUs, see benchmarks/bench_summary.py)
SUPERVISOR_EXIT_S = 60.0


def wait_for_supervisor(rd: RunDir, timeout: float = SUPERVISOR_EXIT_S) -> bool:
    """Wait until the run's supervisor has exited, at most `timeout` seconds; True once it has (or
    the run has none). After the final status it keeps the run's summaries, and only when it exits
    is every process of the run gone."""
    supervisor = procid.live(rd.manifest().supervisor, rd.token)
    return supervisor is None or _wait_gone(supervisor, timeout)


def _wait_gone(proc, timeout: float) -> bool:
    """Wait until `proc` has exited (a zombie counts), at most `timeout` seconds; True once it has."""
    deadline = time.monotonic() + timeout
    while _alive(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _wait_final(rd: RunDir, timeout: float, supervisor=None) -> str:
    """The run's final status, or its current one once `timeout` passed or its supervisor died
    (settled as a reader does: a job that ends without its supervisor is recorded from Slurm)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = reconcile(rd)
        if status in FINAL_STATUSES or (supervisor is not None and not _alive(supervisor)):
            return rd.status
        time.sleep(0.2)
    return rd.status


# --------------------------------------------------------------------------------------------
# Follow
# --------------------------------------------------------------------------------------------
