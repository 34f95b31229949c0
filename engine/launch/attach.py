"""Attaching to what already runs: `charllm-tui attach slurm JOBID` and `charllm-tui attach pid PID`.

An attach is a run of its own (a new run directory, its supervisor, its token) whose training step is a
follower, run under the command runner (command.py) on this machine: the runner reads what the follower
prints, the job's own log, in the job's log format, and the follower ends when the job ends. Telemetry:

- `slurm`: the follower starts one sampler per node of the job, inside the job's allocation
  (`srun --jobid JOBID --overlap`, one task per node), writing into the run directory, which the nodes
  share with this machine as they do for the slurm target; it follows the job's stdout file (scontrol's
  StdOut) and ends once Slurm says the job ended;
- `pid`: the run's sampler samples this machine; the follower follows the process's stdout where it is a
  file (or `--log FILE`) and ends when the process ends.

Cancelling an attach (`runs cancel`) stops only its own processes: the follower and the samplers'
step. Nothing here ever signals the job or the process attached to, nor asks Slurm to cancel anything:
the samplers' srun step is a step of its own in the job, and ending it ends only it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from charllm.engine.launch import slurmctl
from charllm.engine.launch.command import Command
from charllm.engine.launch.launcher import launch
from charllm.engine.launch.target import SAMPLER_MODULE
from charllm.engine.launch.targets import LOCAL
from charllm.probes.core import lifeline, procid
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.trainlogs import check_format

# What `attach KIND IDENT` attaches to, and what IDENT is for it (the CLI's words).
ATTACH_KINDS = {"slurm": "a running Slurm job's id", "pid": "a process on this machine"}
FOLLOW_MODULE = "charllm.engine.launch.attach"
POLL_S = 0.2          # how often the job's log is read
STATE_S = 1.0         # how often the job's state is asked
STOP_S = 10.0         # how long the samplers get to close their last chunk


# --------------------------------------------------------------------------------------------
# Before the run: what is attached to
# --------------------------------------------------------------------------------------------
def slurm_job(job_id: str) -> dict:
    """A running Slurm job of this user's: {"job", "nodes", "stdout", "name"}; else one UserError line."""
    if not job_id.isdigit():
        raise UserError(f"attach slurm {job_id!r}: a job id is a number (squeue --me lists yours)")
    jobs = slurmctl.show_jobs([job_id])
    if jobs is None:
        raise UserError(f"attach slurm {job_id}: the Slurm controller did not answer (scontrol show job {job_id})")
    job = jobs.get(job_id)
    if job is None:
        raise UserError(f"attach slurm {job_id}: Slurm knows no such job (squeue --me lists yours)")
    if job.state != "RUNNING":
        raise UserError(f"attach slurm {job_id}: the job is {job.state}, not RUNNING (attach once it runs)")
    if job.uid != os.geteuid():
        raise UserError(f"attach slurm {job_id}: the job belongs to {job.get('UserId', 'someone else')}, not to you")
    nodes = slurmctl.hostnames(job.get("NodeList", ""))
    if not nodes:
        raise UserError(f"attach slurm {job_id}: Slurm names no nodes for it ({job.get('NodeList')!r})")
    info = job.fields
    return {"job": job_id, "nodes": nodes, "stdout": info.get("StdOut") or None, "name": info.get("JobName", "")}


def local_process(pid: int) -> dict:
    """A process of this user's on this machine: {"pid", "started", "name", "stdout"} (its stdout where it
    is a regular file); else one UserError line."""
    import psutil  # deferred: only an attach needs it

    try:
        proc = psutil.Process(pid)
        cmdline, user = proc.cmdline(), proc.uids().real
        started = procid.start_ticks(pid)   # since boot: no wall-clock move makes it another process
    except (psutil.NoSuchProcess, ValueError):
        raise UserError(f"attach pid {pid}: no such process") from None
    except psutil.AccessDenied:
        raise UserError(f"attach pid {pid}: not your process") from None
    if user != os.getuid():
        raise UserError(f"attach pid {pid}: not your process")
    if pid == os.getpid():
        raise UserError(f"attach pid {pid}: that is this command itself")
    stdout = None
    try:
        found = os.readlink(f"/proc/{pid}/fd/1")
        stdout = found if Path(found).is_file() else None
    except OSError:
        pass
    return {"pid": pid, "started": started, "name": shlex.join(cmdline)[:200] or f"pid {pid}", "stdout": stdout}


def plan_attach(kind: str, ident: str, *, log_format: str, log: str | None = None,
                assignments: list[str] | None = None):
    """(the experiment that holds the run's shape and telemetry settings, the Command its supervisor runs,
    the nodes it records, notes) for attaching to Slurm job `ident` (kind "slurm") or to local process
    `ident` (kind "pid"); `assignments`: --set's (telemetry.hz, telemetry.backend)."""
    from charllm.engine.model.experiment import Experiment, Hardware  # deferred: the models (not on the node)

    check_format(log_format)
    exp = Experiment(name=f"attach-{kind}-{ident}", hardware=Hardware.load("cpu")).apply(assignments or [])
    exp.cluster.nodes = exp.cluster.gpus_per_node = 1        # the follower, on this machine
    follow = [sys.executable, "-m", FOLLOW_MODULE, kind, ident]
    if kind == "slurm":
        job = slurm_job(ident)
        path, nodes = log or job["stdout"], job["nodes"]
        follow += ["--nodes", str(len(nodes)), "--backend", exp.telemetry.backend, "--hz", f"{exp.telemetry.hz:g}"]
        what = f"slurm job {ident} ({job['name']}) on {plural(len(nodes), 'node')}: {', '.join(nodes)}"
    elif kind == "pid":
        if not ident.isdigit():
            raise UserError(f"attach pid {ident!r}: a process id is a number")
        proc = local_process(int(ident))
        path, nodes = log or proc["stdout"], None
        follow += ["--started", repr(proc["started"])]
        what = f"pid {ident} ({proc['name']})"
    else:
        raise UserError(f"attach {kind!r}: attach slurm JOBID or attach pid PID")
    if path:
        follow += ["--log", str(Path(path).resolve())]
    notes = [f"attached to {what}", "not planned: an attached job's layout is not known",
             f"its log: {path}, read as {log_format}" if path else
             "no log to read: give --log FILE (the job's stdout) for its iterations"]
    command = Command(line=shlex.join(follow), log_format=log_format, attached=what, samples_here=nodes is None)
    return exp, command, nodes, notes


def attach(kind: str, ident: str, *, log_format: str = "none", log: str | None = None,
           assignments: list[str] | None = None, on_progress=None):
    """Attach to Slurm job or local process `ident`: a new run on this machine (launcher.launch), its
    follower under the command runner; the LaunchResult."""
    exp, command, nodes, notes = plan_attach(kind, ident, log_format=log_format, log=log, assignments=assignments)
    return launch(exp, LOCAL, command=command, notes=notes, record={"nodes": nodes} if nodes else None,
                  on_progress=on_progress)


# --------------------------------------------------------------------------------------------
# The follower, under the command runner
# --------------------------------------------------------------------------------------------
class LogTail:
    """A log file read from where it ends now, a line at a time (a file cut shorter is read anew)."""

    def __init__(self, path: str | None):
        self.path, self.fh, self.rest = path, None, b""
        if path:
            try:
                self.fh = open(path, "rb")
                self.fh.seek(0, os.SEEK_END)
            except OSError as exc:
                print(f"charllm attach: cannot read {path}: {exc.strerror}", flush=True)

    def copy(self, out) -> None:
        """Copy the whole lines written since the last call to `out`."""
        if self.fh is None:
            return
        try:
            if os.fstat(self.fh.fileno()).st_size < self.fh.tell():
                self.fh.seek(0)        # truncated (or rotated in place): from its start
            data = self.fh.read()
        except OSError:
            return
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            out.write(line + b"\n")
        out.flush()


def _samplers(run_dir: Path, job: str, nodes: int, args: argparse.Namespace) -> subprocess.Popen:
    """One sampler per node of the job, as a step of its own inside the job (srun --overlap): in a process
    group of its own, so that cancelling the attach reaches it only through the follower, which stops it
    with SIGUSR1 (srun forwards it; on SIGTERM it would kill the samplers before their last chunk)."""
    sampler = [sys.executable, "-m", SAMPLER_MODULE, "--backend", args.backend, "--hz", args.hz,
               "--out", str(run_dir), "--node"]
    line = "trap : TERM USR1; " + shlex.join(sampler) + ' "$SLURMD_NODENAME"'
    argv = ["srun", f"--jobid={job}", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            f"--job-name=charllm-attach-{run_dir.name}", "--kill-on-bad-exit=0", "bash", "-c", line]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lifeline.terminated_with_parent)


def follow(args: argparse.Namespace) -> int:
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    out = sys.stdout.buffer
    tail = LogTail(args.log)
    samplers = _samplers(Path(args.run_dir).resolve(), args.ident, args.nodes, args) if args.kind == "slurm" else None
    # Slurm's pace for the job: one call per interval at most, a final state once two answers said it
    watch = slurmctl.Watch(single=True) if args.kind == "slurm" else None
    ended, asked = None, 0.0
    while not stopping and ended is None:
        tail.copy(out)
        if time.monotonic() - asked >= STATE_S:
            asked = time.monotonic()
            ended = _ended(args, watch)
        time.sleep(POLL_S)
    tail.copy(out)
    if samplers is not None:
        if samplers.poll() is None:
            samplers.send_signal(signal.SIGUSR1)
        try:
            samplers.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            samplers.terminate()
            samplers.wait()
    if stopping:
        print(f"charllm attach: stopped; {args.kind} {args.ident} left running", flush=True)
        return 128 + stopping[0]
    print(f"charllm attach: {args.kind} {args.ident} ended: {ended}", flush=True)
    return 0


def _ended(args: argparse.Namespace, watch: slurmctl.Watch | None) -> str | None:
    """How the job or process ended, once it has; None while it runs (or Slurm does not answer)."""
    if watch is not None:             # a Slurm job (follow() makes its watch)
        job = watch.look({args.ident: 0})[args.ident]
        if job is None or not job.final:
            return None
        return "gone from the controller" if job.state == slurmctl.FORGOTTEN else job.state
    import psutil  # deferred: only a pid attach needs it

    try:
        proc = psutil.Process(int(args.ident))
        if str(procid.start_ticks(proc.pid)) != args.started:   # the pid was taken by another process
            return "exited"
        return "exited" if proc.status() == psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return "exited"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {FOLLOW_MODULE}", description="follow a job charllm attached to")
    p.add_argument("kind", choices=tuple(ATTACH_KINDS))
    p.add_argument("ident")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--started", default="0")
    p.add_argument("--log")
    p.add_argument("--run-dir", default=os.environ.get("CHARLLM_RUN_DIR", "."))
    p.add_argument("--backend", default="auto")
    p.add_argument("--hz", default="20")
    return follow(p.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
