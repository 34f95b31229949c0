"""The local target: this machine, one node; sampler and torchrun are child processes of the supervisor."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from charllm.engine.launch.command import Command
from charllm.engine.launch.nodes import ArgvFor, NodeOutput, run_here
from charllm.engine.launch.target import Say, Step, Target, sampler_argv, train_argv
from charllm.probes.core.errors import UserError

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalTarget(Target):
    kind: ClassVar[str] = "local"
    default_python: ClassVar[str] = sys.executable   # this interpreter
    on_this_machine: ClassVar[bool] = True
    shares_files: ClassVar[bool] = True
    nodes_help: ClassVar[str] = "this machine"

    def check_nodes(self, nodes: int) -> None:
        if nodes != 1:
            raise UserError(f"cluster.nodes = {nodes}: the local target is one node; "
                            "use an ssh or slurm target for more")

    def rendezvous_port(self) -> int:
        return free_port()   # a free port here

    def plan(self, exp: Experiment, run_dir: Path, port, command: Command | None = None) -> tuple[list[Step], None]:
        node, python = socket.gethostname(), self.python_path
        sampler = [Step(node, "sampler", sampler_argv(python, exp, str(run_dir), node))] \
            if command is None or command.samples_here else []   # (an attach to a Slurm job samples its nodes)
        train = train_argv(python, exp, str(run_dir), node=node, node_rank=0, master_addr="127.0.0.1",
                           master_port=port, command=command)
        return sampler + [Step(node, "train", train)], None

    def run_on_nodes(self, argv_for: ArgvFor, nodes: int | None, *, wait: float, say: Say) -> list[NodeOutput]:
        self.no_node_count(nodes)
        return [run_here(argv_for(None), socket.gethostname(), wait=wait, say=say)]
