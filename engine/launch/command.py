"""A user's own command in place of charllm's workload: `launch --command "CMD"`.

On every node the supervisor (or Slurm, or ssh) runs `python -m charllm.engine.launch.command ...`,
this module's runner, as the node's training step. It runs CMD with `bash -c` in the step's process
group, so cancelling the run stops it as it stops our workload, and it carries the run's token like
every process of the run. It gives CMD the rendezvous a torchrun line needs: MASTER_ADDR, MASTER_PORT,
NNODES, NODE_RANK, and torchrun's own defaults for them (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,
PET_MASTER_PORT, PET_NPROC_PER_NODE: torch/distributed/run.py reads an unset option from
PET_<OPTION>), so a bare `torchrun --nproc-per-node 8 train.py` runs across the nodes; and
CHARLLM_RUN_DIR, the run directory. Python output is
unbuffered (PYTHONUNBUFFERED=1), so each line is read as it is printed.

The runner copies CMD's output (stdout and stderr together) to its own stdout, the step's log, and reads
each line with the format's parser (probes.store.trainlogs) into the run's iteration log, where the
node's sampler picks up the iteration in progress. When CMD ends it logs the node's end (status, exit
code, the lines read and parsed) and exits with CMD's status.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from charllm.engine.workload import CANCELLED_EXIT
from charllm.probes.core import lifeline
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.trainlogs import LogReader, check_format

RUNNER_MODULE = "charllm.engine.launch.command"


@dataclass(frozen=True)
class Command:
    """What runs on every node instead of charllm's workload: `line` through `bash -c`, in `cwd` (None:
    where the node's step starts: the run directory here and under Slurm, the remote home over ssh), its
    log read in `log_format` (probes.store.trainlogs)."""

    line: str
    log_format: str = "megatron"
    cwd: str | None = None
    planned: bool = False     # the layout is known (from the command's flags): its sequence length counts tokens
    attached: str | None = None   # what an attach follows (attach.py: "slurm job 12 (...)"), in words
    samples_here: bool = True     # the target's own samplers record it (an attach to a Slurm job starts its own)

    def argv(self, python: str, exp, run_dir: str, *, node: str, node_rank, master_addr: str,
             master_port) -> list[str]:
        """The runner's command line on one node (node values may be a target's placeholders)."""
        argv = [python, "-m", RUNNER_MODULE, "--run-dir", run_dir, "--node", node, "--node-rank", str(node_rank),
                "--nnodes", str(exp.cluster.nodes), "--nproc-per-node", str(exp.cluster.gpus_per_node),
                "--master-addr", master_addr, "--master-port", str(master_port),
                f"--log-format={self.log_format}",   # (one word: a regular expression may start with '-')
                "--warmup-iters", str(exp.training.warmup_iters)]
        if self.planned:
            argv += ["--seq-length", str(exp.seq_length)]
        if self.cwd:
            argv += ["--cwd", self.cwd]
        return argv + ["--", self.line]

    def to_dict(self) -> dict:
        return {"line": self.line, "log_format": self.log_format, "planned": self.planned,
                **({"cwd": self.cwd} if self.cwd else {}), **({"attached": self.attached} if self.attached else {})}


def gpus_here() -> bool:
    """Whether this machine has GPU device nodes (NVIDIA's or AMD's), without loading a GPU library."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()


def run_name(line: str) -> str:
    """A run's name from its command: the script it runs (pretrain_gpt), else its first word."""
    words = line.split()
    script = next((w for w in words if w.endswith(".py")), None)
    return Path(script).stem if script else Path(words[0]).name if words else "command"


def plan_command(line: str, *, log_format: str, hardware: str | None = None, nodes: int | None = None,
                 nproc: int | None = None, name: str | None = None, cwd: str | None = None,
                 on_this_machine: bool = True):
    """The experiment a user's command describes, the Command to run, and what was learned, in words.

    The layout comes from the command line where it can: Megatron's flags through the reader of
    `plan --megatron-args` (engine.model.megatron), the world size and processes per node from a
    torchrun prefix (`--nnodes`, `--nproc-per-node`), else `nodes` and `nproc` (default 1 each). With
    the layout and the hardware known it is planned, and the run compares the plan with what it
    measures. Otherwise the experiment holds only the run's shape and its telemetry settings, and the
    notes say why it is not planned. `hardware`: the nodes' device preset (what a scheduler allocates,
    and the plan's device); `cpu` by default for a target on this machine when it has no GPU, else
    required."""
    from charllm.engine.model.experiment import Experiment, Hardware  # deferred: the models (not on the node)
    from charllm.engine.model.megatron import (  # deferred: the models (not on the node)
        import_megatron_args,
        launcher_shape,
        split_command_line,
    )

    if not split_command_line(line):
        raise UserError(f"--command {line!r}: no command in it")
    check_format(log_format)
    world, per_node = launcher_shape(line)
    nproc = nproc or per_node or 1
    if nodes is None:
        nodes = world // per_node if world and per_node else 1
    if hardware is None:
        if not on_this_machine or gpus_here():
            raise UserError("launch --command: give --hardware NAME, the nodes' devices (charllm-tui presets list "
                            "hardware), which the plan and a scheduler's allocation need")
        hardware = "cpu"
    notes: list[str] = []
    planned = False
    exp = Experiment(name=name or run_name(line), hardware=Hardware.load(hardware))
    try:
        imported = import_megatron_args(line, world_size=nodes * nproc, gpus_per_node=nproc, hardware=hardware)
    except UserError as exc:
        notes.append(f"not planned: the command's flags give no layout ({exc})")
    else:
        planned, exp = True, imported.experiment
        exp.name = name or run_name(line)
        notes.append(f"planned from the command's flags: {exp.layout_label} on {plural(nodes, 'node')} x {nproc}")
    exp.cluster.nodes, exp.cluster.gpus_per_node = nodes, nproc
    return exp, Command(line=line, log_format=log_format, cwd=cwd, planned=planned), notes


def megatron_lm_command(exp, directory: str, *, python: str, check_here: bool) -> tuple[Command, list[str]]:
    """Megatron-LM's own pretrain_gpt.py for `exp` (`launch EXP --runner megatron-lm`): the flags `export
    megatron` writes for it and those that make Megatron run what the workload runs (megatron.runtime_flags),
    every step logged, under torchrun on every node (its rendezvous from the runner's PET_* variables),
    through engine.workload.megatron_lm (the checkout first on the path; the CPU path where there is no
    CUDA), in DIR, with the environment export gives. `check_here`: DIR is on this machine's filesystem
    (the target's nodes share it), so a missing script is said now."""
    from charllm.engine.model.megatron import (  # deferred: the models (not on the node)
        export_environment,
        export_megatron_args,
        runtime_flags,
    )

    script = Path(directory).expanduser() / "pretrain_gpt.py"
    if check_here and not script.is_file():
        raise UserError(f"--megatron-lm {directory!r}: no pretrain_gpt.py there (a Megatron-LM checkout is needed: "
                        "git clone https://github.com/NVIDIA/Megatron-LM, or set MEGATRON_LM)")
    flags = export_megatron_args(exp) + runtime_flags(exp) + ["--log-interval", "1"]
    env = [f"{name}={shlex.quote(value)}" for name, value in export_environment(exp).items()]   # (assignments)
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={exp.cluster.gpus_per_node}",
            "-m", "charllm.engine.workload.megatron_lm", str(script.resolve() if check_here else script), *flags]
    notes = [f"runner: Megatron-LM's pretrain_gpt.py in {directory}, with the flags export megatron writes for "
             f"{exp.name} (and the workload's fusions, learning rate and split)"]
    line = " ".join([*env, shlex.join(argv)])
    return Command(line=line, log_format="megatron", cwd=str(script.parent), planned=True), notes


# --------------------------------------------------------------------------------------------
# The runner, on the node
# --------------------------------------------------------------------------------------------
def environment(args: argparse.Namespace) -> dict[str, str]:
    """The command's environment: this one (the run's token included) and the rendezvous."""
    rendezvous = {"MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
                  "NNODES": str(args.nnodes), "NODE_RANK": str(args.node_rank)}
    torchrun = {"PET_NNODES": str(args.nnodes), "PET_NODE_RANK": str(args.node_rank),
                "PET_MASTER_ADDR": args.master_addr, "PET_MASTER_PORT": str(args.master_port),
                "PET_NPROC_PER_NODE": str(args.nproc_per_node)}
    run_dir = str(Path(args.run_dir).resolve())   # (where the command may keep files of the run's)
    return {**os.environ, **rendezvous, **torchrun, "CHARLLM_RUN_DIR": run_dir, "PYTHONUNBUFFERED": "1"}


def append_line(path: Path, record: dict) -> None:
    """One iteration-log line, in one write to a file opened for appending (several nodes may append to
    a shared run directory's log, as the workload's ranks do)."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def run(args: argparse.Namespace) -> int:
    iterations = Path(args.run_dir).resolve() / "iterations.jsonl"
    reader = LogReader(args.log_format, node=args.node, warmup_iters=args.warmup_iters, seq_length=args.seq_length)
    stopping = []

    def note_stop(signum, frame) -> None:
        stopping.append(signum)   # the whole step's group got it: wait for the command to end on it

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, note_stop)
    try:
        child = subprocess.Popen(["bash", "-c", args.command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, cwd=args.cwd, env=environment(args),
                                 preexec_fn=lifeline.killed_with_parent)
    except OSError as exc:   # no such --cwd, say
        print(f"charllm command runner: cannot start the command: {exc}", flush=True)
        append_line(iterations, {"event": "end", "node": args.node, "status": "failed", "exit_code": None,
                                 "ts_ns": time.time_ns(), "failure": str(exc)})
        return 1
    out = sys.stdout.buffer
    assert child.stdout is not None
    for raw in iter(child.stdout.readline, b""):
        out.write(raw)
        out.flush()
        record = reader.read(raw.decode(errors="replace"))
        if record is not None:
            append_line(iterations, record)
    code = child.wait()
    status = "completed" if code == 0 else "cancelled" if stopping else "failed"
    append_line(iterations, {"event": "end", "node": args.node, "status": status, "exit_code": code,
                             "ts_ns": time.time_ns(), "lines": reader.lines, "records": reader.records,
                             "source": args.log_format})
    if code == 0:
        return 0
    if stopping:
        return CANCELLED_EXIT
    return 128 - code if code < 0 else code      # killed by signal N: 128+N, as a shell says it


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {RUNNER_MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--log-format", required=True)
    p.add_argument("--warmup-iters", type=int, default=2)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--cwd")
    p.add_argument("command")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
