"""`charllm-tui attach slurm JOBID | pid PID [--log-format FORMAT] [--log FILE] [--set k=v] [--follow]`."""

from __future__ import annotations

import argparse

from charllm.engine.launch.attach import ATTACH_KINDS, attach
from charllm.probes.store.trainlogs import FORMATS, REGEX_GROUPS
from charllm.tui.commands.launch import follow


def register(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help,
                       description="Record a job that already runs, as a run of its own: a telemetry sampler on "
                                   "every node of a running Slurm job (a step of its own inside the job, srun "
                                   "--overlap), or on this machine for a process here; its log followed for "
                                   "iterations when its format is known. The attach ends when the job does; "
                                   "`charllm-tui runs cancel RUN` stops the attach only, never the job.")
    p.add_argument("kind", choices=tuple(ATTACH_KINDS),
                   help="; ".join(f"{kind}: {what}" for kind, what in ATTACH_KINDS.items()))
    p.add_argument("ident", metavar="JOBID_OR_PID")
    p.add_argument("--log-format", default="none", metavar="FORMAT",
                   help=f"how its log reports steps: {', '.join(FORMATS)}, or a regular expression with named "
                        f"groups ({', '.join(REGEX_GROUPS)}; iteration required) (default: none)")
    p.add_argument("--log", metavar="FILE",
                   help="the log to follow (default: the job's stdout file, where Slurm or /proc names one)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="a telemetry setting, e.g. --set telemetry.hz=50 (repeatable)")
    p.add_argument("--follow", action="store_true", help="print iterations and telemetry until the attach ends")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    with console.status("attaching") as status:
        result = attach(args.kind, args.ident, log_format=args.log_format, log=args.log,
                        assignments=args.assignments, on_progress=lambda message: status.update(message))
    for note in result.notes:
        console.print(f"[cyan]{note}[/]")
    print(f"run {result.run_id}: attached")
    print(f"  {result.run_dir}")
    if not args.follow:
        print(f"  follow with: charllm-tui runs logs {result.run_id} -f; stop with: charllm-tui runs cancel "
              f"{result.run_id} (the job goes on)")
        return 0
    return follow(result.run_dir)
