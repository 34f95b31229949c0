"""Slurm targets: the generated sbatch script, submission, job state and cancellation.

The run directory is on a filesystem shared with the compute nodes, so the job writes logs,
iterations and telemetry there directly. One `srun --overlap` step runs the sampler on every
node; one `srun` step runs torchrun on every node (static rendezvous on the first node's
address); `--kill-on-bad-exit` stops every node when one fails.
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
from typing import TYPE_CHECKING, ClassVar

from charllm.engine.launch.command import Command
from charllm.engine.launch.nodes import ArgvFor, Collect, NodeOutput, forward
from charllm.engine.launch.process import (
    NO_END,
    describe_exit,
    killed_first,
    last_line,
    rank_failure,
    shell_status,
    training_ended,
)
from charllm.engine.launch.target import Say, Step, Target, sampler_argv, train_argv
from charllm.probes.core import lifeline, procid
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.rundir import Manifest

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment

# Per-node values in the argv given to `script`, expanded by each node's shell.
PLACEHOLDERS = {"@@NODE@@": '"$SLURMD_NODENAME"', "@@NODE_RANK@@": '"$SLURM_NODEID"',
                "@@MASTER_ADDR@@": '"$MASTER_ADDR"'}
JOB_NAME = "charllm-{run_id}"   # every run's job is named after the run (script), and cancelled by it
_JOB_ID = re.compile(r"^\d+$")
QUEUE_WAIT_S = 600   # run_on_nodes: how long its step may wait for nodes, on top of the command's time
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


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
    sbatch_lines: tuple[str, ...] = ()

    @classmethod
    def validate(cls, values: dict, where: str) -> None:
        for line in values.get("sbatch_lines", ()):
            try:  # srun takes them as words too (doctor's step)
                shlex.split(line)
            except ValueError as exc:
                raise UserError(f"{where}.sbatch_lines: {line!r} is not shell words ({exc})") from None

    def options(self) -> list[tuple[str, str]]:
        """(option, value): the job options the target sets, for sbatch and srun alike."""
        return [(option, value) for option in ("partition", "account", "qos", "time", "constraint")
                if (value := getattr(self, option))]

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
        job = submit(str(script_path), procid.run_environment(rd.token or "", rd.id))   # the job's processes carry it
        recorded = {"target": {**self.to_dict(), "run": {"job_id": job}}}
        try:
            rd.update_manifest(**recorded)
        except BaseException:
            cancel(job, rd.id)
            raise
        return recorded

    def supervise(self, supervisor) -> str:
        return follow(supervisor)

    def queued(self, after: list[Manifest], time_limit_s: float | None) -> "SlurmTarget":
        jobs = [job for m in after if _JOB_ID.match(job := job_id(m))]
        lines = self.sbatch_lines + ((f"--dependency=afterany:{':'.join(jobs)}",) if jobs else ())
        return dataclasses.replace(self, sbatch_lines=lines,
                                   time=_slurm_time(time_limit_s) if time_limit_s else self.time)

    def cancel_job(self, rd, manifest: Manifest) -> bool:
        """scancel the run's job, once Slurm says it is this run's: named after the run (scancel
        matches the name with the id), this user's, and working in this run's directory (a copied
        or planted manifest can name a job, never own one)."""
        job = job_id(manifest)
        if job:
            problem = not_the_runs(job, rd)
            if problem:
                raise UserError(f"run {rd.id!r}: slurm job {job} {problem}; it is left alone")
            cancel(job, manifest.id)
        return True

    def settle_orphan(self, rd, manifest: Manifest, lost: str) -> dict | None:
        """Slurm runs the job whether or not its supervisor lives: while the job is known and not
        ended, the run goes on (None: the next reader asks again); once it ended, its final state
        decides, or, purged from the controller, the job's own exit record. Nothing is cancelled."""
        job = job_id(manifest)
        if not _JOB_ID.match(job):   # never submitted (or not a job id at all)
            return {"status": "failed", "note": lost, "failure": f"{lost}; no slurm job was recorded"}
        info = job_info(job)
        state = info.get("JobState") if info else None
        if info is None or state and state not in FINAL_STATES:
            return None      # Slurm runs it (or did not answer): the next reader asks again
        # ({}: purged from the controller, its exit record decides)
        fields = final_fields(rd, state or exit_state(rd), info, cancelled=False)
        run = {**Target.run_record(manifest.target), "state": state or "UNKNOWN"}
        return {**fields, "note": lost, "target": {**manifest.target, "run": run}}

    @classmethod
    def describe_job(cls, record: dict) -> str:
        run = cls.run_record(record)
        job, state = run.get("job_id"), run.get("state")
        if not isinstance(job, str) or not job:
            return ""
        return f"slurm job {job}" + (f", {state}" if isinstance(state, str) and state else "")

    def stop_processes(self, manifest: Manifest, grace: float, token: str | None) -> int:
        return 0   # the processes are Slurm's: cancel_job ended the job, and Slurm reaps what it ran

    def run_on_nodes(self, argv_for: ArgvFor, nodes: int | None, *, wait: float, say: Say) -> list[NodeOutput]:
        """One srun step, one task on each of `nodes` nodes (default 1); each task's output is told
        apart by srun's label, and a task with none is named by srun's error line about it."""
        if nodes is not None and nodes < 1:
            raise UserError(f"--nodes = {nodes}: must be at least 1")
        nodes = nodes or 1
        if shutil.which("srun") is None:
            raise UserError(f"target {self.name!r}: `srun` is not on PATH (run from a Slurm login node)")
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
        argv.append(f"--gpus-per-node={self.gpus_per_node}" if self.gpus_per_node else "--cpus-per-task=2")
        argv += [word for extra in self.sbatch_lines for word in shlex.split(extra)]
        return argv + ["bash", "-c", line]


def job_id(manifest: Manifest) -> str:
    """The run's Slurm job id as the manifest's target record keeps it ("" before submission)."""
    job = Target.run_record(manifest.target).get("job_id")
    return job if isinstance(job, str) else ""


def script(*, target: SlurmTarget, run_dir: str, run_id: str, nodes: int, nproc: int, gpus: bool,
           sampler: list[str], train: list[str]) -> str:
    """The sbatch script. `sampler` and `train` are argv lists run on each node, where the
    placeholders in PLACEHOLDERS become the node's values at run time."""
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={q(JOB_NAME.format(run_id=run_id))}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --cpus-per-task={nproc}" if not gpus else f"#SBATCH --gpus-per-node={nproc}",
             f"#SBATCH --output={q(run_dir + '/logs/slurm-%j.out')}",
             f"#SBATCH --chdir={q(run_dir)}"]
    lines += [f"#SBATCH --{option}={q(value)}" for option, value in target.options()]
    lines += [f"#SBATCH {line}" for line in target.sbatch_lines]
    for line in lines:  # targets.parse_target refuses these already; a header line must stay one line
        if "\n" in line or "\r" in line:
            raise UserError(f"target {target.name!r}: {line!r} would span several lines of the sbatch script")
    lines += ["set -u"]
    if target.env_setup:
        lines.append(target.env_setup)
    lines += [
        f"export RUN_DIR={q(run_dir)}",
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export MASTER_ADDR=$(scontrol show node "$FIRST_NODE" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
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
        'echo "$RC" > "$RUN_DIR/logs/train.exit"',
        # srun answers a SIGTERM with a SIGKILL of its tasks (the last chunk would be lost);
        # SIGUSR1 it forwards as it is, and the sampler stops on it.
        "kill -USR1 $SAMPLERS 2>/dev/null; wait $SAMPLERS",
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
    """exec ARGV > logs/ROLE-$NODE.log."""
    return f'exec {_words(argv)} > "$RUN_DIR/logs/{role}-$SLURMD_NODENAME.log" 2>&1'


# Written by a node's sampler task when the sampler ends: "EXIT_STATUS END_NS" (shell status, so
# 128+N for a sampler killed by signal N). The supervisor, which cannot see the node's processes,
# reads it to tell a sampler lost mid-run from one stopped at the end.
SAMPLER_EXIT = "sampler-{node}.exit"


def _sampler_line(argv: list[str]) -> str:
    """ARGV > logs/sampler-$NODE.log, then its exit record (SAMPLER_EXIT). The shell waits for
    the sampler even on SIGTERM or SIGUSR1 (a trap runs only after the foreground command ends;
    untrapped, SIGUSR1 would end the shell), so the sampler closes its last chunk first."""
    log = '"$RUN_DIR/logs/sampler-$SLURMD_NODENAME.log"'
    record = '"$RUN_DIR/logs/' + SAMPLER_EXIT.format(node="$SLURMD_NODENAME") + '"'
    return f'trap : TERM USR1; {_words(argv)} > {log} 2>&1; echo "$? $(date +%s%N)" > {record}'


def submit(script_path: str, env: dict | None = None) -> str:
    """sbatch the script with `env` as the job's environment (--export=ALL); the job's id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", "--export=ALL", script_path],
                              capture_output=True, text=True, timeout=60, env=env)
    except FileNotFoundError:
        raise UserError("slurm target: `sbatch` is not on PATH (run from a login node)") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise UserError(f"sbatch refused the job: {last}")
    return done.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str] | None:
    """scontrol's fields for the job (JobState, ExitCode, Reason, NodeList...); {} once Slurm has
    forgotten it (it says the id is invalid); None when the controller did not answer (a timeout,
    an error): nothing is known then, and the caller asks again later."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0:
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    return {} if "invalid job id" in done.stderr.lower() else None


def hostnames(nodelist: str) -> list[str]:
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          timeout=30)
    return done.stdout.split()


def _slurm_time(seconds: float) -> str:
    """Seconds as Slurm's --time, D-HH:MM:SS, rounded up to a whole minute."""
    minutes = -(-int(seconds) // 60)
    days, minutes = divmod(minutes, 1440)
    return f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"


def not_the_runs(job: str, rd) -> str | None:
    """Why Slurm's job `job` is not the run's, or None: it must be this user's and work in the run's
    directory (sbatch --chdir). A job Slurm no longer knows is nobody's to cancel: None."""
    info = job_info(job) if _JOB_ID.match(job) else {}
    if not info:   # (None: the controller did not answer, and scancel will not reach it either)
        return None
    uid = re.search(r"\((\d+)\)", info.get("UserId", ""))
    if not uid or int(uid.group(1)) != os.geteuid():
        return f"belongs to {info.get('UserId', 'someone else')}, not to you"
    if os.path.realpath(info.get("WorkDir", "")) != os.path.realpath(rd.path):
        return f"works in {info.get('WorkDir', '?')}, not in this run's directory {rd.path}"
    return None


def cancel(job_id: str, run_id: str) -> None:
    """Cancel the run's job, and only that: Slurm matches the id and the run's job name together
    (a manifest can name any job id; it may be another user's or another run's by now)."""
    if _JOB_ID.match(job_id):
        subprocess.run(["scancel", f"--name={JOB_NAME.format(run_id=run_id)}", job_id], capture_output=True,
                       timeout=30)


# -- the supervisor's part: Slurm owns the processes, the supervisor follows the job --------------
def follow(supervisor) -> str:
    """Follow the run's Slurm job until it ends, recording its start, lost samplers and its end;
    returns the final status."""
    rd, job = supervisor.rd, job_id(supervisor.manifest)
    running = False
    while True:
        answer = job_info(job)
        if answer is None:      # the controller did not answer: nothing is known, ask again
            watch_samplers(supervisor)
            time.sleep(0.5)
            continue
        info = answer
        state = info.get("JobState", "UNKNOWN")
        if state == "RUNNING" and not running:
            running = True
            rd.update_manifest(status="running", started_ns=time.time_ns(),
                               nodes=hostnames(info.get("NodeList", "")))
        watch_samplers(supervisor)
        if state in FINAL_STATES or state == "UNKNOWN":
            break
        time.sleep(0.5)
    if state == "UNKNOWN":  # purged from the controller: the job's own exit record decides
        state = exit_state(rd)
    fields = final_fields(rd, state, info, cancelled=supervisor.cancel_requested)
    record = supervisor.manifest.target
    supervisor.record_final(**fields, ended_ns=time.time_ns(), runtime=rd.runtime(),
                            target={**record, "run": {**Target.run_record(record), "state": state}})
    return fields["status"]


def exit_state(rd) -> str:
    """The state of a job the controller no longer knows, from its own exit record (train.exit)."""
    exit_file = rd.logs_dir / "train.exit"
    return "COMPLETED" if exit_file.is_file() and exit_file.read_text().strip() == "0" else "FAILED"


def final_fields(rd, state: str, info: dict, *, cancelled: bool) -> dict:
    """The run's final status and failure from its job's final state (and the nodes' logs)."""
    if state == "COMPLETED" and not training_ended(rd):
        return {"status": "failed", "failure": NO_END}
    if state == "COMPLETED":
        return {"status": "completed", "failure": None}
    if state == "CANCELLED" or cancelled:
        return {"status": "cancelled", "failure": None}
    return {"status": "failed", "failure": _failure(rd, state, info)}


def _failure(rd, state: str, info: dict) -> str:
    """The rank that failed first where a node's torchrun summary names one, else the job's end."""
    for log in killed_first(sorted(rd.logs_dir.glob("train-*.log"))):
        line = rank_failure(log.stem.removeprefix("train-"), log)
        if line:
            return line
    details = f"exit code {info.get('ExitCode', '?')}, reason {info.get('Reason', '?')}"
    return f"slurm job {state.lower()} ({details}) on {info.get('NodeList', '?')}"


def watch_samplers(supervisor) -> None:
    """Record the samplers lost, from each node's sampler exit record (SAMPLER_EXIT): one that died
    or failed, or that stopped before training ended. One stopped with the job (a cancel, a time
    limit) is no separate loss: the job's own status says it."""
    logs = supervisor.rd.logs_dir
    train_exit = logs / "train.exit"
    for record in logs.glob(SAMPLER_EXIT.format(node="*")):
        try:
            code, at_ns = (int(word) for word in record.read_text().split())
            train_end = train_exit.stat().st_mtime_ns if train_exit.is_file() else None
        except (OSError, ValueError):
            continue  # being written; read again at the next poll
        if code != 0 or (train_end is not None and at_ns < train_end):
            node = record.name.removeprefix("sampler-").removesuffix(".exit")
            log = logs / f"sampler-{node}.log"
            supervisor.lose_sampler(node, at_ns, f"sampler {describe_exit(shell_status(code))}: {last_line(log)}")
