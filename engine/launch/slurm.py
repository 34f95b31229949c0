"""Slurm targets: the generated sbatch script, submission, following the job, and cancellation.

The run directory is on a filesystem shared with the compute nodes, so the job writes logs,
iterations and telemetry there directly. One `srun --overlap` step runs the sampler on every
node; one `srun` step runs torchrun on every node (static rendezvous on the first node's
address); `--kill-on-bad-exit` stops every node when one fails.

The job owns its outcome: its batch script records its own start (logs/job.start: the time and
its nodes), each node's training exit (logs/train-NODE.exit), its end (logs/train.exit: the
training step's exit status and end time, written once the samplers stopped) and a failing
`env_setup` command (logs/env_setup.failed). Whoever follows the job (the run's supervisor, a
campaign's supervisor for all its members, or any later reader: `Follower`, `settle_orphan`)
reads those records, and asks Slurm (slurmctl.Watch: one call per interval for every job it
follows) only for what the job cannot say itself: that it started or ended without reaching its
own end (a cancel, a time limit, a node lost). Nothing on the login node is needed for the job to
run or for its outcome to be known.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

from charllm.engine.launch import slurmctl
from charllm.engine.launch.command import Command
from charllm.engine.launch.nodes import ArgvFor, Collect, NodeOutput, forward
from charllm.engine.launch.process import (
    END_LOG_S,
    NO_END,
    describe_exit,
    killed_first,
    last_line,
    rank_failure,
    shell_status,
    training_ended,
)
from charllm.engine.launch.slurmctl import FORGOTTEN, Job, Watch
from charllm.engine.launch.target import Say, Step, Target, number, sampler_argv, switch, train_argv
from charllm.probes.core import lifeline, procid
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import clock
from charllm.probes.store.rundir import Manifest, RunDir, check_node_name

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment

# Per-node values in the argv given to `script`, expanded by each node's shell.
PLACEHOLDERS = {"@@NODE@@": '"$SLURMD_NODENAME"', "@@NODE_RANK@@": '"$SLURM_NODEID"',
                "@@MASTER_ADDR@@": '"$MASTER_ADDR"'}
_JOB_ID = re.compile(r"^\d+$")
_MEMORY = re.compile(r"^[1-9]\d*[KMGT]?$")
QUEUE_WAIT_S = 600   # run_on_nodes: how long its step may wait for nodes, on top of the command's time
RUNNING_STATES = {"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED"}
POLL_S = 0.5         # how often a follower reads the run directory (Slurm is asked at the watch's pace)

# The job's own records, in logs/ (the batch script writes each whole: a hidden file, then renamed).
START = "job.start"                  # "START_NS" then one node name a line
END = "train.exit"                   # "EXIT_STATUS TRAIN_END_NS" (runs before the end time: "EXIT_STATUS")
NODE_EXIT = "train-{node}.exit"      # "EXIT_STATUS END_NS": a node's training step
ENV_FAILED = "env_setup.failed"      # "EXIT_STATUS COMMAND": the env_setup command that failed
# Written by a node's sampler task when the sampler ends: "EXIT_STATUS END_NS" (shell status, so
# 128+N for a sampler killed by signal N). The follower, which cannot see the node's processes,
# reads it to tell a sampler lost mid-run from one stopped at the end.
SAMPLER_EXIT = "sampler-{node}.exit"


def job_name(run_id: str) -> str:
    """The job's name: the run's id, whole (squeue's default NAME column shows its first 8
    characters; `squeue --me -o "%.10i %.9T %j"` shows it all)."""
    return run_id


def _names_of(run_id: str) -> set[str]:
    """The names a run's job may have: job_name's, or charllm-RUN_ID (runs launched before)."""
    return {job_name(run_id), f"charllm-{run_id}"}


@dataclass(frozen=True)
class SlurmTarget(Target):
    """Slurm owns the processes: the supervisor submits the job and follows it."""

    kind: ClassVar[str] = "slurm"
    job_script_label: ClassVar[str] = "sbatch script"
    allocates_nodes: ClassVar[bool] = True
    shares_files: ClassVar[bool] = True    # the run directory is on a filesystem the nodes share
    nodes_help: ClassVar[str] = "--nodes N nodes (default 1), one srun step"

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    constraint: str | None = None
    cpus_per_gpu: int | None = number(None, 1, 4096)   # --cpus-per-gpu
    mem_per_gpu: str = ""                              # --mem-per-gpu, e.g. "64G"
    exclusive: bool | None = switch()                  # whole nodes; the default without the two above
    sbatch_lines: tuple[str, ...] = ()

    @classmethod
    def validate(cls, values: dict, where: str) -> None:
        for line in values.get("sbatch_lines", ()):
            try:  # srun takes them as words too (doctor's step)
                shlex.split(line)
            except ValueError as exc:
                raise UserError(f"{where}.sbatch_lines: {line!r} is not shell words ({exc})") from None
        memory = values.get("mem_per_gpu")
        if memory is not None and not _MEMORY.match(memory):
            raise UserError(f"{where}.mem_per_gpu = {memory!r}: must be a size as sbatch takes it, a whole number "
                            "with an optional K, M, G or T (\"64G\")")

    def options(self) -> list[tuple[str, str]]:
        """(option, value): the job options the target sets, for sbatch and srun alike."""
        return [(option, value) for option in ("partition", "account", "qos", "time", "constraint")
                if (value := getattr(self, option))]

    @property
    def whole_nodes(self) -> bool:
        """Whether the job takes its nodes whole: `exclusive`, or by default when no CPUs or memory
        per GPU are given (a characterization wants no neighbour on its nodes, and its ranks their CPUs)."""
        return self.exclusive if self.exclusive is not None else not (self.cpus_per_gpu or self.mem_per_gpu)

    def resources(self, gpus: int | None, cpus: int) -> list[str]:
        """The resource options of the job (and of doctor's step): `gpus` GPUs per node with the
        target's CPUs and memory per GPU, or (a CPU run) `cpus` CPUs for the node's one task; whole
        nodes where whole_nodes says so (--mem=0: all of each node's memory)."""
        if gpus and self.exclusive is False and not self.cpus_per_gpu:
            raise UserError(f"target {self.name!r}: exclusive = false without cpus_per_gpu: the job's {gpus} GPUs per "
                            "node would share the CPUs a site gives a job by default (often 1); give cpus_per_gpu "
                            "(and mem_per_gpu)")
        out = [f"--gpus-per-node={gpus}"] if gpus else [f"--cpus-per-task={cpus}"]
        if gpus and self.cpus_per_gpu:
            out.append(f"--cpus-per-gpu={self.cpus_per_gpu}")
        if gpus and self.mem_per_gpu:
            out.append(f"--mem-per-gpu={self.mem_per_gpu}")
        if self.whole_nodes:
            out += ["--exclusive"] + ([] if gpus and self.mem_per_gpu else ["--mem=0"])
        return out

    def plan(self, exp: Experiment, run_dir: Path, port, command: Command | None = None) -> tuple[list[Step], str]:
        python = self.python_path
        sampler = sampler_argv(python, exp, str(run_dir), "@@NODE@@")
        train = train_argv(python, exp, str(run_dir), node="@@NODE@@", node_rank="@@NODE_RANK@@",
                           master_addr="@@MASTER_ADDR@@", master_port=port, command=command)
        text = script(target=self, run_dir=str(run_dir), run_id=run_dir.name, nodes=exp.cluster.nodes,
                      nproc=exp.cluster.gpus_per_node, gpus=exp.hardware.vendor != "cpu", sampler=sampler,
                      train=train)
        return [Step("every-node", "sampler", sampler), Step("every-node", "train", train)], text

    def check_ready(self, steps: list[Step], say: Say) -> None:
        if shutil.which("sbatch") is None:
            raise UserError(f"target {self.name!r}: `sbatch` is not on PATH (run from a Slurm login node)")

    def prepare(self, rd, steps: list[Step], script: str | None, say: Say) -> dict:
        assert script is not None                # plan() writes the batch script for Slurm
        script_path = rd.path / "job.sbatch"
        script_path.write_text(script)
        say("submitting to Slurm")
        job = slurmctl.submit(str(script_path), env=procid.run_environment(rd.token or "", rd.id),  # the job carries it
                              name=job_name(rd.id), workdir=str(rd.path))
        recorded = {"target": {**self.to_dict(), "run": {"job_id": job}}}
        try:
            rd.update_manifest(**recorded)
        except BaseException:
            slurmctl.scancel(job, job_name(rd.id))
            raise
        return recorded

    def supervise(self, supervisor) -> str:
        """Follow the job (its own records each POLL_S, Slurm at the watch's pace) until it ends. A
        supervisor told to stop (SIGTERM: a logout, a reaper) lets go: the job is Slurm's and goes on,
        and the next reader settles the run."""
        follower = Follower(Watch(single=True), lambda rd, fields: supervisor.record_final(**fields))
        while not supervisor.cancel_requested:
            follower.step([supervisor.rd])
            manifest = supervisor.rd.manifest()
            if manifest.final:
                return manifest.status
            time.sleep(POLL_S)
        return supervisor.rd.manifest().status

    def follower(self, record_end: Callable[[RunDir, dict], None]) -> "Follower":
        return Follower(Watch(), record_end)

    def queued(self, after: list[Manifest], time_limit_s: float | None) -> "SlurmTarget":
        jobs = [job for m in after if _JOB_ID.match(job := job_id(m))]
        lines = self.sbatch_lines + ((f"--dependency=afterany:{':'.join(jobs)}",) if jobs else ())
        return dataclasses.replace(self, sbatch_lines=lines,
                                   time=_slurm_time(time_limit_s) if time_limit_s else self.time)

    def cancel_job(self, rd, manifest: Manifest) -> bool:
        """scancel the run's job, once Slurm says it is this run's: named after the run (scancel
        matches the name with the id), this user's, and working in this run's directory (a copied
        or planted manifest can name a job, never own one). Then the run's follower is told
        (RunDir.cancel_request_path) and records the end once Slurm confirms it."""
        job = job_id(manifest)
        if not job:
            return True
        found = slurmctl.shared().current(job) if _JOB_ID.match(job) else Job(job, FORGOTTEN)
        if found is None:
            raise UserError(f"run {rd.id!r}: Slurm did not answer about job {job}; nothing was cancelled, try again")
        problem = not_the_runs(found, rd)
        if problem:
            raise UserError(f"run {rd.id!r}: slurm job {job} {problem}; it is left alone")
        if found.state != FORGOTTEN and not found.final:
            if not slurmctl.scancel(job, found.get("JobName", job_name(rd.id))):
                raise UserError(f"run {rd.id!r}: Slurm did not answer scancel of job {job}; try again")
            slurmctl.shared().hurry()
        rd.cancel_request_path.touch()
        return True

    def settle_orphan(self, rd, manifest: Manifest, lost: str) -> dict | None:
        """Slurm runs the job whether or not its supervisor lives: the run follows the job's own
        records and Slurm's word (asked through the process's shared watch: one call for every run
        a reader settles). Its start is recorded; its end once the job recorded it or Slurm said
        it, confirmed; until then None (the next reader asks again). Nothing is cancelled."""
        job = job_id(manifest)
        if not _JOB_ID.match(job):   # never submitted (or not a job id at all)
            return {"status": "failed", "note": lost, "failure": f"{lost}; no slurm job was recorded"}
        records = JobRecords.read(rd)
        seen = slurmctl.shared().look({job: manifest.created_ns})[job]
        fields = decide(rd, records, seen, end_wait=0)
        if fields is None:
            started = _started(manifest, records, seen)
            run = _run_record(manifest, seen, None)
            return {**started, "target": {**manifest.target, "run": run}} if started else None
        run = _final_run_record(manifest, slurmctl.shared().said(job))
        return {**fields, "note": lost, "exit_codes": node_exits(rd), "target": {**manifest.target, "run": run}}

    @classmethod
    def describe_job(cls, record: dict) -> str:
        run = cls.run_record(record)
        job, state, silent = run.get("job_id"), run.get("state"), run.get("silent_since_ns")
        if not isinstance(job, str) or not job:
            return ""
        line = f"slurm job {job}" + (f", {state}" if isinstance(state, str) and state else "")
        if isinstance(silent, int) and not isinstance(silent, bool):
            line += f", no answer from Slurm since {clock(silent)}"
        return line

    def stop_processes(self, manifest: Manifest, grace: float, token: str | None) -> int:
        return 0   # the processes are Slurm's: cancel_job ended the job, and Slurm reaps what it ran

    def check_nodes_available(self, nodes: int) -> None:
        """Refuse more nodes than the partition has (sinfo), which would wait for them for ever."""
        has = slurmctl.partition_nodes(self.partition)
        if has is not None and nodes > has:
            where = f"partition {self.partition!r}" if self.partition else "the default partition"
            raise UserError(f"--nodes = {nodes}: {where} has {plural(has, 'node')} (sinfo)")

    def run_on_nodes(self, argv_for: ArgvFor, nodes: int | None, *, wait: float, say: Say) -> list[NodeOutput]:
        """One srun step, one task on each of `nodes` nodes (default 1); each task's output is told
        apart by srun's label, and a task with none is named by srun's error line about it."""
        if nodes is not None and nodes < 1:
            raise UserError(f"--nodes = {nodes}: must be at least 1")
        nodes = nodes or 1
        if shutil.which("srun") is None:
            raise UserError(f"target {self.name!r}: `srun` is not on PATH (run from a Slurm login node)")
        self.check_nodes_available(nodes)
        label = re.compile(r"^\s*(\d+): ?(.*)$")
        argv = self.srun_argv(nodes, self.shell_line(argv_for(None)))
        say(f"srun: {plural(nodes, 'node')} of target {self.name!r}")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,
                                preexec_fn=lifeline.terminated_with_parent)   # srun cancels its step on SIGTERM
        err: list[str] = []

        def unlabelled(line: str) -> str:
            match = label.match(line)
            return match.group(2) if match else line

        reader = threading.Thread(target=forward, args=(proc.stderr, err, say, unlabelled), daemon=True)
        reader.start()
        out = Collect(proc.stdout)   # type: ignore[arg-type]
        wait += QUEUE_WAIT_S
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            err.append(f"srun: error: no end within {wait:.0f} s (stopped)")
        finally:
            if proc.poll() is None:
                proc.terminate()   # srun cancels its step on SIGTERM
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            out.join()
            reader.join(timeout=5)

        def by_task(lines: list[str]) -> dict[int, list[str]]:
            tasks: dict[int, list[str]] = {}
            for line in lines:
                match = label.match(line)
                if match:
                    tasks.setdefault(int(match.group(1)), []).append(match.group(2))
            return tasks

        printed, errors = by_task(out.text.splitlines()), by_task(err)
        srun_said = [line for line in err if line.startswith("srun:")]
        results = []
        for task in range(nodes):
            # srun names a failed task's node: "srun: error: n2: task 1: Exited with exit code 2".
            named = [m.group(1) for m in (re.match(rf"srun: error: (\S+): tasks? ([\d,-]*\b)?{task}\b", line)
                                          for line in srun_said) if m]
            results.append(NodeOutput(named[0] if named else f"task {task}", "\n".join(printed.get(task, [])),
                                      errors.get(task) or srun_said, proc.returncode))
        return results

    def srun_argv(self, nodes: int, line: str) -> list[str]:
        """One srun step, one task per node, every task's output labelled with its task id."""
        argv = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--label",
                "--job-name=charllm-doctor", "--kill-on-bad-exit=0"]   # a failing node leaves the others be
        argv += [f"--{option}={value}" for option, value in self.options()]
        # As the sbatch script: the node's GPUs, or the CPUs of the 2-process CPU job.
        argv += self.resources(self.gpus_per_node, 2)
        argv += [word for extra in self.sbatch_lines for word in shlex.split(extra)]
        return argv + ["bash", "-c", line]


def job_id(manifest: Manifest) -> str:
    """The run's Slurm job id as the manifest's target record keeps it ("" before submission)."""
    job = Target.run_record(manifest.target).get("job_id")
    return job if isinstance(job, str) else ""


# -- the batch script ---------------------------------------------------------------------------
def script(*, target: SlurmTarget, run_dir: str, run_id: str, nodes: int, nproc: int, gpus: bool,
           sampler: list[str], train: list[str]) -> str:
    """The sbatch script. `sampler` and `train` are argv lists run on each node, where the
    placeholders in PLACEHOLDERS become the node's values at run time."""
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={q(job_name(run_id))}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1"]
    lines += [f"#SBATCH {option}" for option in target.resources(nproc if gpus else None, nproc)]
    lines += [f"#SBATCH --output={q(run_dir + '/logs/slurm-%j.out')}",
              f"#SBATCH --chdir={q(run_dir)}"]
    lines += [f"#SBATCH --{option}={q(value)}" for option, value in target.options()]
    lines += [f"#SBATCH {line}" for line in target.sbatch_lines]
    for line in lines:  # targets.parse_target refuses these already; a header line must stay one line
        if "\n" in line or "\r" in line:
            raise UserError(f"target {target.name!r}: {line!r} would span several lines of the sbatch script")
    lines += [
        f"export RUN_DIR={q(run_dir)}",
        "# The job's own records (slurm.py): each written whole, a hidden file renamed into place.",
        'record() { printf "%s\\n" "$2" > "$RUN_DIR/logs/.$1" && mv -f "$RUN_DIR/logs/.$1" "$RUN_DIR/logs/$1"; }',
        # (scontrol expands the node list here: no call to the controller)
        f'record {START} "$(date +%s%N) $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr "\\n" " ")"',
    ]
    if target.env_setup:
        # Its first failing command (at its own level: not one inside a file it sources) ends the job, named.
        lines += [f"trap 'rc=$?; [ ${{#BASH_SOURCE[@]}} -gt 1 ] || {{ record {ENV_FAILED} \"$rc $BASH_COMMAND\"; "
                  "exit $rc; }' ERR",
                  target.env_setup,
                  "trap - ERR"]
    lines += [
        "set -u",
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "for try in 1 2 3 4 5 6; do   # the controller may be restarting: ask again",
        '    [ -n "$FIRST_NODE" ] || break   # no job\'s node (the script run by hand): nothing to ask',
        '    MASTER_ADDR=$(scontrol show node "$FIRST_NODE" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
        '    [ -n "$MASTER_ADDR" ] && break',
        "    sleep 10",
        "done",
        "export MASTER_ADDR",
        "",
        "# The sampler: one task per node, sharing the node with training.",
        f"srun --overlap --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 bash -c "
        + q(_sampler_line(sampler)) + " &",
        "SAMPLERS=$!",
        "",
        "# Training: torchrun on every node; one failing node stops the others.",
        f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
        + q(_node_line(train, "train")),
        "RC=$?",
        "TRAIN_END=$(date +%s%N)",
        # srun answers a SIGTERM with a SIGKILL of its tasks (the last chunk would be lost);
        # SIGUSR1 it forwards as it is, and the sampler stops on it.
        "kill -USR1 $SAMPLERS 2>/dev/null; wait $SAMPLERS",
        f'record {END} "$RC $TRAIN_END"   # last: the telemetry is whole once it is there',
        "exit $RC",
        ""]
    return "\n".join(lines)


def _words(argv: list[str]) -> str:
    """ARGV as shell words, with the per-node placeholders expanded by the node's shell."""
    words = []
    for word in argv:
        # Placeholders may sit inside a word (--node-rank=@@NODE_RANK@@); quote the rest of it.
        parts = re.split(f"({'|'.join(PLACEHOLDERS)})", word)
        words.append("".join(PLACEHOLDERS.get(p) or (shlex.quote(p) if p else "") for p in parts))
    return " ".join(words)


def _node_line(argv: list[str], role: str) -> str:
    """ARGV > logs/ROLE-$NODE.log, then the node's exit record (NODE_EXIT), exiting as ARGV did."""
    record = '"$RUN_DIR/logs/' + NODE_EXIT.format(node="$SLURMD_NODENAME") + '"'
    return (f'{_words(argv)} > "$RUN_DIR/logs/{role}-$SLURMD_NODENAME.log" 2>&1; rc=$?; '
            f'echo "$rc $(date +%s%N)" > {record}; exit $rc')


def _sampler_line(argv: list[str]) -> str:
    """ARGV > logs/sampler-$NODE.log, then its exit record (SAMPLER_EXIT). The shell waits for
    the sampler even on SIGTERM or SIGUSR1 (a trap runs only after the foreground command ends;
    untrapped, SIGUSR1 would end the shell), so the sampler closes its last chunk first."""
    log = '"$RUN_DIR/logs/sampler-$SLURMD_NODENAME.log"'
    record = '"$RUN_DIR/logs/' + SAMPLER_EXIT.format(node="$SLURMD_NODENAME") + '"'
    return f'trap : TERM USR1; {_words(argv)} > {log} 2>&1; echo "$? $(date +%s%N)" > {record}'


def _slurm_time(seconds: float) -> str:
    """Seconds as Slurm's --time, D-HH:MM:SS, rounded up to a whole minute."""
    minutes = -(-int(seconds) // 60)
    days, minutes = divmod(minutes, 1440)
    return f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"


def not_the_runs(job: Job, rd) -> str | None:
    """Why Slurm's job is not the run's, or None: it must be this user's, named after the run and
    work in the run's directory (sbatch --chdir). A job Slurm no longer knows is nobody's to cancel."""
    if job.state == FORGOTTEN or not job.fields:
        return None
    if job.uid != os.geteuid():
        return f"belongs to {job.get('UserId', 'someone else')}, not to you"
    if job.fields.get("JobName") not in _names_of(rd.id):
        return f"is named {job.get('JobName')}, not after this run"
    if os.path.realpath(job.fields.get("WorkDir", "")) != os.path.realpath(rd.path):
        return f"works in {job.get('WorkDir')}, not in this run's directory {rd.path}"
    return None


# -- following: the job's own records, and Slurm's word -----------------------------------------
@dataclass(frozen=True)
class JobRecords:
    """What the job wrote of itself into the run directory (None / empty where not yet)."""

    started_ns: int | None = None
    nodes: tuple[str, ...] = ()
    exit: int | None = None               # the training step's exit status: the job is through
    train_end_ns: int | None = None
    env_failure: tuple[int, str] | None = None   # (status, command) of the env_setup line's failure
    cancel_requested: bool = False

    @classmethod
    def read(cls, rd) -> "JobRecords":
        logs = rd.logs_dir
        start = _words_of(logs / START)
        started = int(start[0]) if start and start[0].isdigit() else None
        nodes = tuple(node for node in start[1:] if _node_name(node)) if started else ()
        end = _words_of(logs / END)
        code = int(end[0]) if end and end[0].lstrip("-").isdigit() else None
        end_ns = int(end[1]) if code is not None and len(end) > 1 and end[1].isdigit() else None
        if code is not None and end_ns is None:      # runs launched before the end time was recorded
            try:
                end_ns = (logs / END).stat().st_mtime_ns
            except OSError:
                pass
        failed = _read_small(logs / ENV_FAILED).split(" ", 1)
        env = (int(failed[0]), failed[1].strip()) if len(failed) == 2 and failed[0].isdigit() else None
        return cls(started, nodes, code, end_ns, env, rd.cancel_request_path.exists())


def _read_small(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(64 * 1024).decode(errors="replace").strip()
    except OSError:
        return ""


def _words_of(path: Path) -> list[str]:
    return _read_small(path).split()


def _node_name(node: str) -> bool:
    try:
        return bool(check_node_name(node))
    except UserError:
        return False


def node_exits(rd) -> dict[str, int]:
    """Each node's training exit status, as its exit record (NODE_EXIT) says: {"train@n1": 0}."""
    out = {}
    for record in sorted(rd.logs_dir.glob(NODE_EXIT.format(node="*"))):
        words = _words_of(record)
        node = record.name.removeprefix("train-").removesuffix(".exit")
        if words and words[0].isdigit() and _node_name(node):
            out[f"train@{node}"] = int(words[0])
    return out


def decide(rd, records: JobRecords, job: Job | None, *, end_wait: float = END_LOG_S) -> dict | None:
    """The run's final status and failure, or None while it is not known yet.

    The job's own records decide first: a failed env_setup command, else its end record (the
    training step's exit status, checked against the workload's own end log). Without them Slurm's
    final state decides, once confirmed (`job`: slurmctl.Watch), and a job Slurm and its accounting
    no longer know is "unknown", said so. A cancel the user asked for is told apart from a failure."""
    cancelled = records.cancel_requested
    if records.env_failure:
        code, command = records.env_failure
        why = " (command not found)" if code == 127 else ""
        return {"status": "cancelled" if cancelled else "failed",
                "failure": f"env_setup stopped the job: `{command}` exited with status {code}{why} "
                           f"(see logs/slurm-*.out)"}
    if records.exit is not None:
        if records.exit == 0:
            return {"status": "completed", "failure": None} if training_ended(rd, end_wait) else \
                {"status": "failed", "failure": NO_END}
        if cancelled:
            return {"status": "cancelled", "failure": None}
        return {"status": "failed", "failure": _failure(rd, job, f"training exited with status {records.exit}")}
    if job is None or not job.final:
        return None
    if job.state == FORGOTTEN:
        return {"status": "unknown",
                "failure": f"slurm job {job.id} ended without its end record (logs/{END}), and Slurm no longer "
                           "knows it, nor does any accounting (sacct): how it ended is unknown"}
    if job.state == "COMPLETED" and not training_ended(rd, end_wait):
        return {"status": "failed", "failure": NO_END}
    if job.state == "COMPLETED":
        return {"status": "completed", "failure": None}
    if job.state == "CANCELLED" or cancelled:
        return {"status": "cancelled", "failure": None}
    details = f"exit code {job.get('ExitCode')}, reason {job.get('Reason')}"
    return {"status": "failed",
            "failure": _failure(rd, job, f"slurm job {job.state.lower()} ({details}) on {job.get('NodeList')}")}


def _failure(rd, job: Job | None, otherwise: str) -> str:
    """The rank that failed first where a node's torchrun summary names one, else a node whose
    training failed (its exit record), else `otherwise` (the job's end)."""
    for log in killed_first(sorted(rd.logs_dir.glob("train-*.log"))):
        line = rank_failure(log.stem.removeprefix("train-"), log)
        if line:
            return line
    for step, code in node_exits(rd).items():
        if code != 0:
            return f"node {step.removeprefix('train@')}: training {describe_exit(shell_status(code))}"
    return otherwise


def _started(manifest: Manifest, records: JobRecords, job: Job | None) -> dict:
    """The fields that record the job's start (and its nodes), where it started and the run does
    not say so yet; {} otherwise."""
    running = records.started_ns is not None or job is not None and job.state in RUNNING_STATES
    nodes = list(records.nodes)
    out: dict = {}
    if running and manifest.status == "pending":
        out.update(status="running", started_ns=records.started_ns or time.time_ns())
    if nodes and manifest.nodes != nodes:
        out["nodes"] = nodes
    return out


def _run_record(manifest: Manifest, job: Job | None, silent_since_ns: int | None) -> dict:
    """The target's record of the run with Slurm's latest word: the job's state, and since when Slurm
    has not answered (said, not guessed)."""
    run = dict(Target.run_record(manifest.target))
    if job is not None and job.state != FORGOTTEN:
        run["state"] = job.state
    if silent_since_ns:
        run.setdefault("silent_since_ns", silent_since_ns)
    else:
        run.pop("silent_since_ns", None)
    return run


def _final_run_record(manifest: Manifest, said: Job | None) -> dict:
    """The target's record of an ended run: Slurm's final state where it said one, else none (a state
    the job ran in is no end, and a run may end on its own record before Slurm says so)."""
    run = _run_record(manifest, said, None)
    if not (said and said.final and said.state != FORGOTTEN):
        run.pop("state", None)
    return run


class Follower:
    """Follows the Slurm jobs of runs, one `step` a pass: each run's own records (a file read, no
    call to Slurm), then one look through the watch for all of them (at most one call per
    interval), recording each job's start and, through `record_end`, its end. A run's supervisor
    follows its one job; a campaign's supervisor all its members' (no process per member)."""

    def __init__(self, watch: Watch, record_end: Callable[[RunDir, dict], None]):
        self.watch = watch
        self.record_end = record_end
        self._records: dict[Path, JobRecords] = {}
        self._through_at: dict[Path, float] = {}   # when a job's end record was first seen (monotonic)

    def step(self, rds: list[RunDir]) -> None:
        followed = []
        for rd in rds:
            try:
                manifest = rd.manifest()
            except (UserError, OSError):      # damaged or deleted meanwhile: its reader says so
                continue
            if manifest.final or not job_id(manifest):
                continue
            records = JobRecords.read(rd)
            if self._records.get(rd.path, records) != records:
                self.watch.hurry()             # the job wrote something (or a cancel came): Slurm's word follows
            self._records[rd.path] = records
            followed.append((rd, manifest, records))
        said = self.watch.look({job_id(m): m.created_ns for _, m, _ in followed})
        for rd, manifest, records in followed:
            try:
                self._advance(rd, manifest, records, said.get(job_id(manifest)))
            except (UserError, OSError) as exc:   # this run's directory only: the others go on
                print(f"run {rd.id}: not followed this pass: {exc}", flush=True)

    def _advance(self, rd: RunDir, manifest: Manifest, records: JobRecords, job: Job | None) -> None:
        silent = self.watch.silent_since_ns
        said_silent = silent if silent and time.time_ns() - silent > 2e9 * self.watch.pace.min_s else None
        watch_samplers(rd)
        fields = decide(rd, records, job)
        said = self.watch.said(job_id(manifest)) or job
        if fields is not None and (records.exit is not None or records.env_failure) and not (said and said.final):
            # Through by its own record: Slurm's final state follows within moments, recorded with it
            # (its word, not yet said twice, names the state; the job's own record decided).
            first = self._through_at.setdefault(rd.path, time.monotonic())
            if time.monotonic() - first < 4 * self.watch.pace.min_s:
                self.watch.hurry()
                fields = None
        run = _run_record(manifest, job, said_silent) if fields is None else _final_run_record(manifest, said)
        started = _started(manifest, records, job)
        if fields is not None:
            self.record_end(rd, {**started, **fields, "ended_ns": time.time_ns(), "runtime": rd.runtime(),
                                 "exit_codes": node_exits(rd), "target": {**manifest.target, "run": run}})
            self._records.pop(rd.path, None)
            self._through_at.pop(rd.path, None)
        elif started or run != Target.run_record(manifest.target):
            rd.update_manifest(**started, target={**manifest.target, "run": run})


def watch_samplers(rd) -> None:
    """Record the samplers lost, from each node's sampler exit record (SAMPLER_EXIT): one that died
    or failed, or that stopped before training ended. One stopped with the job (a cancel, a time
    limit) is no separate loss: the job's own status says it."""
    logs = rd.logs_dir
    train_end = JobRecords.read(rd).train_end_ns
    lost = {entry.get("node"): entry for entry in rd.manifest().telemetry_lost if isinstance(entry, dict)}
    new = []
    for record in logs.glob(SAMPLER_EXIT.format(node="*")):
        node = record.name.removeprefix("sampler-").removesuffix(".exit")
        try:
            code, at_ns = (int(word) for word in record.read_text().split())
        except (OSError, ValueError):
            continue  # being written; read again at the next pass
        if node not in lost and (code != 0 or (train_end is not None and at_ns < train_end)):
            reason = f"sampler {describe_exit(shell_status(code))}: {last_line(logs / f'sampler-{node}.log')}"
            new.append({"node": node, "at_ns": at_ns, "reason": reason})
    if new:
        rd.update_manifest(telemetry_lost=[*lost.values(), *sorted(new, key=lambda e: e["node"])])
