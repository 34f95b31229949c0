"""The interface every kind of target implements (local.py, ssh.py, slurm.py), and the steps they plan.

A target's fields are what targets.toml gives it; what differs by kind is a method: which layouts it
can take, the processes it plans per node, how a command is shown, what it checks and prepares
before a run starts, how its supervisor runs the steps (here, or on a node: process.py, ssh.py) or
follows a scheduler's job (slurm.py), how the run's processes are stopped when its supervisor
cannot, how a short command reaches every node (doctor: nodes.py), and what it keeps of a run in the
manifest's target record and how it says it in one line. Parsing targets.toml into the right kind,
and reading a manifest's record, is targets.py; no module outside this package names a kind.
"""

from __future__ import annotations

import dataclasses
import random
import shlex
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Protocol

from charllm.engine.launch.command import Command
from charllm.engine.launch.nodes import ArgvFor, NodeOutput
from charllm.engine.launch.process import Proc
from charllm.engine.workload import TORCHRUN_MODULE, TRAIN_MODULE
from charllm.probes.core import procid
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import Manifest

SAMPLER_MODULE = "charllm.probes"

Say = Callable[[str], None]


class Follower(Protocol):
    def step(self, rds: list) -> None: ...


def number(default, low: int, high: int):
    """An integer field and the range targets.toml may set it in."""
    return dataclasses.field(default=default, metadata={"range": (low, high)})


def switch(default: bool | None = None):
    """A true/false field (None: not given, the kind decides)."""
    return dataclasses.field(default=default, metadata={"switch": True})


@dataclass
class Step:
    """One process of a run on one node: the exact argv run there."""

    node: str
    role: str                 # sampler | train | tail
    argv: list[str]
    host: str | None = None   # ssh: the host it runs on (argv then runs through `ssh`)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def to_dict(self) -> dict:
        out = {"node": self.node, "role": self.role, "argv": self.argv, "command": self.command}
        if self.host:
            out["host"] = self.host
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Step":
        return cls(node=d["node"], role=d["role"], argv=list(d["argv"]), host=d.get("host"))


def sampler_argv(python: str, exp, run_dir: str, node: str, stream: bool = False) -> list[str]:
    argv = [python, "-m", SAMPLER_MODULE, "--backend", exp.telemetry.backend, "--hz", f"{exp.telemetry.hz:g}",
            "--out", run_dir, "--node", node]
    return argv + ["--stream"] if stream else argv


def train_argv(python: str, exp, run_dir: str, *, node_rank, master_addr: str, master_port, node: str = "",
               command: Command | None = None) -> list[str]:
    """torchrun, starting the workload on every rank of the node; or the runner of a user's `command`."""
    if command is not None:
        return command.argv(python, exp, run_dir, node=node, node_rank=node_rank, master_addr=master_addr,
                            master_port=master_port)
    return [python, "-m", TORCHRUN_MODULE, f"--nnodes={exp.cluster.nodes}", f"--node-rank={node_rank}",
            f"--master-addr={master_addr}", f"--master-port={master_port}",
            f"--nproc-per-node={exp.cluster.gpus_per_node}",
            "-m", TRAIN_MODULE, "--run-dir", run_dir]


@dataclass(frozen=True)
class Target(ABC):
    """Fields every kind has. A kind adds its own fields: a text field is a `str`, an integer one
    a `number(...)` with its range, a true/false one a `switch()`, a list a tuple of strings."""

    kind: ClassVar[str]
    default_python: ClassVar[str] = "python3"   # the interpreter when `python` is not given
    on_this_machine: ClassVar[bool] = False     # its runs' processes are this machine's
    shares_files: ClassVar[bool] = False        # its nodes see this machine's files (the runs, the current directory)
    allocates_nodes: ClassVar[bool] = False     # a scheduler picks the nodes (run_on_nodes takes a count)
    nodes_help: ClassVar[str] = ""              # which nodes run_on_nodes reaches, for the CLI's help
    job_script_label: ClassVar[str] = "job script"   # what a scheduler kind calls the script plan() writes

    name: str
    description: str = ""
    env_setup: str = ""               # a shell line run before every remote command
    python: str = ""                  # "" : `default_python`
    gpus_per_node: int | None = number(None, 1, 1024)  # None: the experiment's cluster.gpus_per_node

    @property
    def python_path(self) -> str:
        return self.python or self.default_python

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys its table in targets.toml may have."""
        return ("kind",) + tuple(f.name for f in dataclasses.fields(cls) if f.name != "name")

    @classmethod
    def validate(cls, values: dict, where: str) -> None:
        """What a kind requires of its parsed values beyond their types (one-line UserErrors)."""

    def to_dict(self) -> dict:
        """What the manifest records: the non-default fields (no secrets live in a target). The
        manifest's copy may also hold, under "run", what the target keeps of that run (`prepare`)."""
        out: dict = {"name": self.name, "kind": self.kind}
        defaults = type(self)(name=self.name)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in out and value != getattr(defaults, f.name):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def shell_line(self, argv: list[str], cwd: str | None = None, *, replace_shell: bool = True) -> str:
        """The shell lines that run `argv`: `cd DIR || exit 1`, the env line, `exec ARGV`. The env line
        is the user's own shell, on a line of its own (a `# comment` in it ends there); the rest is
        quoted."""
        lines = [f"cd {shlex.quote(cwd)} || exit 1"] if cwd else []
        if self.env_setup:
            lines.append(self.env_setup)
        lines.append(("exec " if replace_shell else "") + shlex.join(argv))
        return "\n".join(lines)

    # -- what it recorded of a run, in the manifest's "target" ------------------------------------
    @staticmethod
    def run_record(record: dict) -> dict:
        """What the target kept of a run (`record["run"]`, e.g. a scheduler's job); {} for nothing."""
        run = record.get("run")
        return run if isinstance(run, dict) else {}

    @classmethod
    def describe_job(cls, record: dict) -> str:
        """The target's words for the run's job ("slurm job 12, COMPLETED"); "" where it has none."""
        return ""

    @classmethod
    def describe_record(cls, record: dict) -> str:
        """One line for readers: the target a manifest recorded, with its job where it has one."""
        name = record.get("name")
        return f"{name if isinstance(name, str) and name else '-'} ({cls.describe_job(record) or cls.kind})"

    # -- planning ------------------------------------------------------------------------------
    def check_nodes(self, nodes: int) -> None:
        """Refuse a layout of `nodes` nodes this target cannot hold (a UserError naming why)."""

    def rendezvous_port(self) -> int:
        """torchrun's port on the first node, whose free ports cannot be seen from here."""
        return random.randint(20000, 40000)

    @abstractmethod
    def plan(self, exp, run_dir: Path, port, command: Command | None = None) -> tuple[list[Step], str | None]:
        """The processes per node, and the batch script where a scheduler runs them; each node's training
        step runs `command` (a user's) where one is given."""

    def display_command(self, step: Step) -> str:
        """The command line that runs `step`, as the dry run and the manifest show it."""
        return step.command

    # -- launching -----------------------------------------------------------------------------
    def check_ready(self, steps: list[Step], say: Say) -> None:
        """Before anything is created: can the run start there (a UserError naming the fix)?"""

    def prepare(self, rd, steps: list[Step], script: str | None, say: Say) -> dict:
        """Ready the nodes once the run directory exists; returns the fields it added to the
        manifest (its own "target" record with a scheduler's job under "run")."""
        return {}

    def supervise(self, supervisor) -> str:
        """Run the supervisor's part (supervise.py) until the run ends; returns its final status.
        Here the supervisor owns the steps' processes, run on this machine (process.Proc)."""
        return supervisor.own_steps(Proc)

    def follower(self, record_end: Callable) -> "Follower | None":
        """Where a scheduler runs the jobs: one follower for many runs (a campaign's members), whose
        `step(rds)` looks at all their jobs at once (one call to the scheduler per interval) and records
        what became of each, ends through `record_end(rd, fields)`; the runs then need no supervisor
        each (launch(supervised=False)). None where each run's supervisor owns its processes."""
        return None

    def bring_home(self, rd) -> None:
        """After the run: copy into the run directory what the nodes wrote there besides the streams
        (the profiler's traces/); nothing to do where the nodes write into it themselves."""

    # -- a short command on every node (doctor) -------------------------------------------------
    @abstractmethod
    def run_on_nodes(self, argv_for: ArgvFor, nodes: int | None, *, wait: float, say: Say) -> list[NodeOutput]:
        """Run a short command on each of the target's nodes (`nodes` of them where the target
        allocates nodes, else every node it names; nodes.py), stopping it after `wait` seconds; what
        each printed. A node that cannot be reached is a NodeOutput with its `failure`."""

    def no_node_count(self, nodes: int | None) -> None:
        """A target that names its nodes takes no count of them (the caller's --nodes)."""
        if nodes is not None:
            raise UserError(f"--nodes = {nodes}: only for a target whose scheduler allocates its nodes; "
                            f"target {self.name!r} ({self.kind}) names its own")

    def queued(self, after: list[Manifest], time_limit_s: float | None) -> "Target | None":
        """This target with its scheduler told to start a run's job only once the jobs of `after`
        have ended, and to end it after `time_limit_s`: a queue that outlives whoever filled it (a
        campaign's). None where there is no scheduler: the caller keeps the queue itself."""
        return None

    # -- stopping ------------------------------------------------------------------------------
    def cancel_job(self, rd, manifest: Manifest) -> bool:
        """Ask the scheduler that runs the run's job to end it (the supervisor then records the
        end); False where there is no scheduler: the supervisor owns the processes."""
        return False

    def settle_orphan(self, rd, manifest: Manifest, lost: str) -> dict | None:
        """The final fields of a run whose supervisor died (`lost` says how that was found), decided
        from what the run directory holds: completed if every node's workload logged its end, else
        failed, naming what the run recorded. Nothing is signalled here (a reader calls this): the
        processes die with their supervisor (probes.core.lifeline), and `runs cancel` stops any left.
        None where the run goes on without its supervisor (a scheduler's job)."""
        ended = [r.get("status") for r in rd.end_events()]
        done = bool(ended) and all(s == "completed" for s in ended)
        left = f"; it recorded {recorded_line(manifest)}: charllm-tui runs cancel {rd.id} stops any still running" \
            if manifest.processes else ""
        return {"status": "completed" if done else "failed", "note": lost,
                "failure": manifest.failure or (None if done else lost + left)}

    def stop_processes(self, manifest: Manifest, grace: float, token: str | None) -> int:
        """Stop what the manifest recorded, without the supervisor: TERM, `grace`, KILL, to each
        process group proven the run's (it carries `token`); how many took the TERM."""
        recorded = manifest.processes
        sent = sum(self.signal_recorded(proc, "TERM", token) for proc in recorded)
        if sent:
            time.sleep(grace)
            for proc in recorded:
                self.signal_recorded(proc, "KILL", token)
        return sent

    def signal_recorded(self, proc: dict, sig: str, token: str | None) -> bool:
        """Signal one recorded process group (TERM or KILL) on this machine, if it is still the
        run's (probes.core.procid: the same host, boot, PID namespace and group leader, which is
        this user's and carries the run's token); True if sent."""
        return procid.signal_group(proc, getattr(signal, f"SIG{sig}"), token)


def recorded_line(manifest: Manifest) -> str:
    """The processes a manifest recorded, for a status line: "sampler@n1 (pid 12), train@n1 (pid 13)"."""
    return ", ".join(f"{p.get('role', '?')}@{p.get('node', '?')} (pid {p.get('pid', '?')})"
                     for p in manifest.processes)
