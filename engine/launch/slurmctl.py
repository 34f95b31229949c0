"""What Slurm says, asked gently: every call to Slurm's clients (sbatch, scontrol, sacct, sinfo,
scancel), each with a time limit and its output read strictly, and `Watch`, which follows many
jobs with one call per interval.

A busy controller times out, answers late or not at all, and restarts. None of that is an answer
about a job: each function here returns None for "no answer" (an error, a timeout, output that is
not what the client prints), never a guess. A job is final only on Slurm's own final state, said
twice; a job the controller no longer knows is asked of accounting (sacct) where the cluster keeps
it, else it is FORGOTTEN and its run directory's own end record decides (slurm.py).

`Watch` is the one way a process asks about jobs: every run and campaign member it follows is
answered by one `scontrol show job` per interval (one RPC, REQUEST_JOB_INFO; a watch of a single
job asks for it alone, REQUEST_JOB_INFO_SINGLE), and the interval backs off while nothing changes.
Measured with `sdiag` on the loopback Slurm: benchmarks/bench_slurm_load.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from charllm.probes.core.errors import UserError

# Slurm's job states (squeue(1), "JOB STATE CODES"): anything else in an answer is not an answer.
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
STATES = FINAL_STATES | {"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_FED",
                         "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
# Not a Slurm state: the controller no longer knows the job, and no accounting keeps it.
FORGOTTEN = "FORGOTTEN"

PACE_ENV = "CHARLLM_TEST_ONLY_SLURM_PACE"   # "MIN,MAX,TIMEOUT" seconds: the tests' own, faster pace
# What a client prints when the controller did not answer (it may answer the next call), as opposed
# to a refusal (a bad partition, a policy), which it would give again.
_NO_ANSWER = re.compile(r"timed out|unable to contact|connection refused|connect failure|temporarily|zero bytes|"
                        r"try again|communication|socket|not responding|slurmctld", re.IGNORECASE)
_JOB_LINE = re.compile(r"^JobId=(\d+) ")
_FIELD = re.compile(r"(\w+)=(\S*)")
_JOB_ID = re.compile(r"^\d+$")


@dataclass(frozen=True)
class Pace:
    """How often a watch asks: at most once per `min_s`, backing off (x1.5) to once per `max_s`
    while nothing changes and (x2) while the controller does not answer; a client call taking
    longer than `timeout_s` is no answer."""

    min_s: float = 10.0
    max_s: float = 120.0
    timeout_s: float = 60.0

    @classmethod
    def current(cls) -> "Pace":
        """The pace: Slurm's (the defaults above), or for the tests CHARLLM_TEST_ONLY_SLURM_PACE."""
        said = os.environ.get(PACE_ENV, "")
        try:
            low, high, timeout = (float(word) for word in said.split(","))
        except ValueError:
            return cls()
        return cls(low, max(low, high), timeout)


@dataclass(frozen=True)
class Job:
    """One job as Slurm said it: its state and the fields of `scontrol show job` (or of sacct)."""

    id: str
    state: str
    fields: dict = field(default_factory=dict, compare=False)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES or self.state == FORGOTTEN

    @property
    def uid(self) -> int | None:
        found = re.search(r"\((\d+)\)", self.fields.get("UserId", ""))
        return int(found.group(1)) if found else None

    def get(self, key: str, default: str = "?") -> str:
        return self.fields.get(key) or default


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str

    @property
    def said(self) -> str:
        """The client's last line of complaint ("" if none)."""
        return (self.stderr.strip().splitlines() or [""])[-1]


def call(argv: Sequence[str], *, timeout: float | None = None, env: dict | None = None) -> Done | None:
    """Run one Slurm client; None when it could not run or gave no answer within `timeout` (the
    pace's). It runs in a session of its own, killed whole at the time limit: a site's wrapper
    script that forks the real client must not keep the pipes open past it."""
    limit = Pace.current().timeout_s if timeout is None else timeout
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True)
    except OSError:
        return None
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:   # something outside its session holds the pipes: let go of them
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
        return None
    return Done(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def no_answer(done: Done | None) -> bool:
    """Whether a failed call said the controller did not answer (worth asking again), not a refusal."""
    return done is None or bool(_NO_ANSWER.search(done.stderr + done.stdout))


# -- jobs ------------------------------------------------------------------------------------------
def parse_jobs(text: str) -> dict[str, Job] | None:
    """`scontrol show job --oneliner`'s output, one job a line; None when any line is not one."""
    if text.strip() == "No jobs in the system":
        return {}
    jobs = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        head = _JOB_LINE.match(line)
        fields = dict(_FIELD.findall(line))
        if head is None or fields.get("JobState") not in STATES:
            return None
        jobs[head.group(1)] = Job(head.group(1), fields["JobState"], fields)
    return jobs or None    # (nothing at all is not what scontrol prints: it says there are no jobs)


def show_jobs(ids: Sequence[str] = (), *, timeout: float | None = None) -> dict[str, Job] | None:
    """One call: Slurm's record of the jobs it knows, by id: of `ids` alone where one is given
    (REQUEST_JOB_INFO_SINGLE; {} when Slurm says the id is invalid), else of every job
    (REQUEST_JOB_INFO). `--local`: no federation lookup first (one RPC, not two). None: no answer."""
    single = [ids[0]] if len(ids) == 1 else []
    done = call(["scontrol", "--local", "show", "job", "--oneliner", *single], timeout=timeout)
    if done is None:
        return None
    if done.returncode != 0:
        return {} if single and "invalid job id" in done.stderr.lower() else None
    jobs = parse_jobs(done.stdout)
    if jobs is None or single and set(jobs) - set(single):
        return None
    return jobs


def accounted(job: str, *, timeout: float | None = None) -> Job | None:
    """What Slurm's accounting (sacct) kept of a job the controller forgot: its state, exit code and
    nodes; a FORGOTTEN job where the cluster keeps no accounting or it holds no record of the job;
    None: no answer."""
    done = call(["sacct", "--jobs", job, "--allocations", "--noheader", "--parsable2",
                 "--format=JobID,State,ExitCode,NodeList"], timeout=timeout)
    if done is None:
        return None
    if done.returncode != 0:
        return Job(job, FORGOTTEN) if "accounting storage is disabled" in done.stderr.lower() else None
    rows = [line.split("|") for line in done.stdout.splitlines() if line.strip()]
    if any(len(row) != 4 for row in rows):
        return None
    for jobid, state, exit_code, nodes in rows:
        state = state.split(" ")[0]          # "CANCELLED by 1000"
        if jobid == job and state in STATES:
            return Job(job, state, {"JobState": state, "ExitCode": exit_code, "NodeList": nodes, "Reason": "-"})
    return Job(job, FORGOTTEN) if not rows else None


class Watch:
    """Slurm's word on the jobs a process follows, asked with one call per interval for all of them
    (`look`). Thread-safe: the workbench's workers share the process's watch (`shared()`).

    A job's final state is taken once two answers said it, and a job missing from two answers (taken
    after it was submitted) is asked of accounting: a follower's next answer comes at the shortest
    interval, so that costs no call. A reader, which may not ask again (`confirm_alone`), asks about
    that job alone at once instead: once in a job's life, at most CHECKS_PER_LOOK a look."""

    CHECKS_PER_LOOK = 64

    def __init__(self, *, single: bool = False, confirm_alone: bool = False, pace: Pace | None = None,
                 timeout: float | None = None):
        self.pace = pace or Pace.current()
        self.single = single                  # follows one job: asks for it alone
        self.confirm_alone = confirm_alone
        self.timeout = timeout if timeout is not None else self.pace.timeout_s
        self.interval = self.pace.min_s
        self.next_at = 0.0                    # monotonic: when the next call is due
        self.tried_ns = 0                     # when the latest call was made
        self.asked_ns = 0                     # when the latest answer was asked for
        self.followed: dict[str, int] = {}    # job -> when it was submitted (ns): every job looked at, not settled
        self.latest: dict[str, Job] = {}      # the latest answer: this user's jobs (and those followed)
        self.missing: set[str] = set()        # followed jobs the latest answer lacked
        self.settled: dict[str, Job] = {}     # confirmed final (or FORGOTTEN): never asked again
        self.silent_since_ns: int | None = None   # the first call of the current run of no answers
        self.calls = 0
        self._lock = threading.Lock()

    def hurry(self) -> None:
        """Something changed (a run's own record, a cancel): ask again at the shortest interval."""
        with self._lock:
            self.interval = self.pace.min_s
            self.next_at = min(self.next_at, time.monotonic() + self.pace.min_s)

    def look(self, jobs: dict[str, int]) -> dict[str, Job | None]:
        """Slurm's latest word on each job (id -> when it was submitted, in ns): a Job, final only
        once confirmed, or None while nothing is known (no answer yet, or lately). One call when the
        interval has passed, or a job is newer than the latest call."""
        with self._lock:
            new = {job: at for job, at in jobs.items() if job not in self.settled and _JOB_ID.match(job)}
            self.followed.update(new)
            due = time.monotonic() >= self.next_at or any(at >= self.tried_ns for at in new.values())
            if self.followed and due:
                self._ask()
            out = {}
            for job in jobs:
                seen = self.settled.get(job) or self.latest.get(job)
                out[job] = seen if seen is None or not seen.final or job in self.settled else None
            return out

    def said(self, job: str) -> Job | None:
        """The latest answer's record of a job, final or not, confirmed or not (to name a state the
        job's own records decided); None where it had none."""
        with self._lock:
            return self.settled.get(job) or self.latest.get(job)

    def current(self, job: str) -> Job | None:
        """Slurm's record of one job now, to act on it (a cancel): the latest answer's where it is
        no older than the shortest interval, else a new one (about every job: the next job asked
        about is answered too); a job missing from it is asked about alone. A FORGOTTEN job: Slurm
        says it does not know it; None: no answer."""
        with self._lock:
            if job in self.settled:
                return self.settled[job]
            if time.time_ns() - self.asked_ns >= self.pace.min_s * 1e9:
                asked_ns = time.time_ns()
                answer = self._call([job] if self.single else [])
                if answer is None:
                    return None
                self._take(answer, asked_ns)
            if job in self.latest:
                return self.latest[job]
            alone = {} if self.single else self._call([job])
            return None if alone is None else alone.get(job) or Job(job, FORGOTTEN)

    def _take(self, answer: dict[str, Job], asked_ns: int) -> dict[str, Job]:
        """Keep an answer as the latest (this user's jobs, and those followed); the one before it."""
        before, me = self.latest, os.geteuid()
        self.asked_ns = asked_ns
        self.latest = {job: seen for job, seen in answer.items() if job in self.followed or seen.uid == me}
        return before

    def _ask(self) -> None:
        self.tried_ns = asked_ns = time.time_ns()
        answer = self._call(list(self.followed)[:1] if self.single else [])
        now = time.monotonic()
        if answer is None:
            self.silent_since_ns = self.silent_since_ns or asked_ns
            self.interval = min(max(self.interval, self.pace.min_s) * 2, self.pace.max_s)
            self.next_at = now + self.interval
            return
        self.silent_since_ns = None
        before, missing_before = self._take(answer, asked_ns), self.missing
        self.missing = set()
        waiting, checks = False, self.CHECKS_PER_LOOK
        for job, submitted_ns in list(self.followed.items()):
            seen, was = self.latest.get(job), before.get(job)
            if seen is None and submitted_ns >= asked_ns or seen is not None and not seen.final:
                continue
            if seen is None and job in missing_before:
                self._accounted(job)                      # missing from two answers: Slurm does not know it
            elif seen is not None and was is not None and was.state == seen.state:
                self.settled[job] = seen                  # said twice
            elif self.confirm_alone and checks:
                checks -= 1
                self._confirm(job, seen)
            if seen is None and job not in self.settled:
                self.missing.add(job)
            waiting = waiting or job not in self.settled
        changed = any((before[job].state if job in before else None) != (seen.state if seen else None)
                      for job in self.followed for seen in [self.latest.get(job)])
        self.interval = self.pace.min_s if changed or waiting else min(self.interval * 1.5, self.pace.max_s)
        self.next_at = now + self.interval
        for job in self.settled:
            self.followed.pop(job, None)

    def _confirm(self, job: str, seen: Job | None) -> None:
        """A final state, or a job missing from the answer, asked about again alone: settled when
        Slurm says the state again, or says it does not know the job and accounting answers."""
        alone = self._call([job])
        if alone is None:
            return
        again = alone.get(job)
        if again is None:
            self._accounted(job)
            return
        self.latest[job] = again
        if again.final and seen is not None and seen.state == again.state:
            self.settled[job] = again

    def _accounted(self, job: str) -> None:
        self.calls += 1
        kept = accounted(job, timeout=self.timeout)
        if kept is not None:
            self.settled[job] = kept

    def _call(self, ids: list[str]) -> dict[str, Job] | None:
        self.calls += 1
        return show_jobs(ids, timeout=self.timeout)


_SHARED: dict[tuple, Watch] = {}
_SHARED_LOCK = threading.Lock()
READER_TIMEOUT_S = 15.0   # a reader (runs list, the workbench) waits this long for an answer, at most


def shared() -> Watch:
    """The process's watch for readers (reconcile: runs list, show, the workbench): every run they
    settle is answered by one call per interval, whatever the number of runs. One per cluster the
    clients reach ($SLURM_CONF: job ids are a cluster's own) and pace."""
    pace = Pace.current()
    key = (os.environ.get("SLURM_CONF"), pace)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Watch(confirm_alone=True, pace=pace, timeout=min(READER_TIMEOUT_S, pace.timeout_s))
        return _SHARED[key]


# -- submitting, cancelling, the partition ----------------------------------------------------------
SUBMIT_TRIES = 3


def submit(script_path: str, *, env: dict, name: str, workdir: str) -> str:
    """sbatch the script (the job's environment: `env`, --export=ALL); the job's id. A call with
    no answer (a timeout: the controller may have taken the job and lost the reply) is followed by
    a look for a job of this user's named `name` in `workdir`, and sbatch is asked again only once
    Slurm said there is none: a job is never submitted twice. A refusal (a bad partition, a policy)
    is one UserError line."""
    pace = Pace.current()
    said = "no answer"
    for attempt in range(SUBMIT_TRIES):
        done = call(["sbatch", "--parsable", "--export=ALL", script_path], env=env)
        if done is not None and done.returncode == 0:
            job = done.stdout.strip().split(";")[0]
            if _JOB_ID.match(job):
                return job
        elif done is not None and not no_answer(done):
            raise UserError(f"sbatch refused the job: {done.said or f'exit status {done.returncode}'}")
        said = done.said if done is not None and done.said else f"no answer within {pace.timeout_s:g} s"
        for look in range(SUBMIT_TRIES):
            time.sleep(min(pace.min_s * 2 ** look, pace.max_s) / 4)
            jobs = show_jobs()
            if jobs is not None:
                break
        else:
            raise UserError(f"sbatch: Slurm did not answer ({said}), nor say whether it took the job; look for a job "
                            f"named {name} (squeue --me --name={name}) before launching again")
        found = _named(jobs, name, workdir)
        if found:
            return found
    raise UserError(f"sbatch: Slurm did not answer ({said}), {SUBMIT_TRIES} times; no job was submitted")


def _named(jobs: dict[str, Job], name: str, workdir: str) -> str | None:
    """The id of this user's job named `name` working in `workdir` among `jobs`, if there is one."""
    for job in jobs.values():
        if job.fields.get("JobName") == name and job.uid == os.geteuid() and \
                os.path.realpath(job.fields.get("WorkDir", "")) == os.path.realpath(workdir):
            return job.id
    return None


def scancel(job: str, name: str) -> bool:
    """Cancel job `job` if it is still named `name` (Slurm matches both); False: no answer."""
    done = call(["scancel", f"--name={name}", job])
    return done is not None and (done.returncode == 0 or not no_answer(done))


def partition_nodes(partition: str | None) -> int | None:
    """How many nodes the partition (None: the cluster's default one) has, as sinfo says; None where
    sinfo does not answer or does not list it."""
    done = call(["sinfo", "--noheader", "--format=%P %D", *([f"--partition={partition}"] if partition else [])])
    if done is None or done.returncode != 0:
        return None
    total, found = 0, False
    for line in done.stdout.splitlines():
        words = line.split()
        if len(words) != 2 or not words[1].isdigit():
            return None
        name = words[0]
        if name.rstrip("*") == partition if partition else name.endswith("*"):
            total, found = total + int(words[1]), True
    return total if found else None


def hostnames(nodelist: str) -> list[str] | None:
    """The node names a Slurm node list (`n[1-3],m2`) stands for; None where scontrol does not answer."""
    done = call(["scontrol", "show", "hostnames", nodelist])
    if done is None or done.returncode != 0:
        return None
    return done.stdout.split()
