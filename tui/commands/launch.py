"""`charllm-tui launch EXPERIMENT_OR_PRESET --target NAME [--set k=v] [--dry-run] [--follow] [--force]`, or
`charllm-tui launch --command "CMD" [--log-format FORMAT] ...`: a user's own command in place of the workload."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from charllm.engine.launch.command import megatron_lm_command, plan_command
from charllm.engine.launch.launcher import (
    PORT_AT_LAUNCH,
    SUPERVISOR_EXIT_S,
    LayoutRefused,
    cancel,
    launch,
    problems,
    reconcile,
    wait_for_supervisor,
)
from charllm.engine.launch.targets import KINDS, get_target
from charllm.engine.model.experiment import Experiment, layout_label
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import GIB, size
from charllm.probes.store.rundir import RunDir
from charllm.probes.store.trainlogs import FORMATS, REGEX_GROUPS


def register(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help,
                       description=f"Check the layout, create a run directory on a target ({', '.join(KINDS)}), "
                                   "start a telemetry sampler on every node and train with torchrun. Runs detached; "
                                   "see `charllm-tui runs`. With --command, your own command runs on every node "
                                   "instead, its log read for iterations.")
    p.add_argument("experiment", metavar="EXPERIMENT_OR_PRESET", nargs="?",
                   help="an experiment file or preset name (or give --command)")
    p.add_argument("--runner", choices=("workload", "megatron-lm"), default="workload",
                   help="what trains the experiment: charllm's workload (default), or Megatron-LM's own "
                        "pretrain_gpt.py with the flags `export megatron` writes (--megatron-lm DIR)")
    p.add_argument("--megatron-lm", metavar="DIR", default=os.environ.get("MEGATRON_LM"),
                   help="the Megatron-LM checkout --runner megatron-lm runs, on the nodes (default: $MEGATRON_LM)")
    own = p.add_argument_group("your own command (instead of an experiment)")
    own.add_argument("--command", dest="command_line", metavar="CMD",   # (args.command names the subcommand)
                     help="a shell command run once per node under the supervisor and the probes, with MASTER_ADDR, "
                          "MASTER_PORT, NNODES, NODE_RANK (and torchrun's PET_* defaults) set; its Megatron flags and "
                          "torchrun prefix give the layout that is planned")
    own.add_argument("--log-format", default="megatron", metavar="FORMAT",
                     help=f"how its log reports steps: {', '.join(FORMATS)}, or a regular expression with named "
                          f"groups ({', '.join(REGEX_GROUPS)}; iteration required) (default: megatron)")
    own.add_argument("--hardware", metavar="NAME",
                     help="the nodes' device preset (default: cpu on this machine without a GPU; else required)")
    own.add_argument("--nodes", type=int, metavar="N", help="nodes to run it on (default: torchrun's --nnodes, else 1)")
    own.add_argument("--cwd", metavar="DIR",
                     help="where it runs on each node (default: this directory where the target's nodes share "
                          "this machine's files, else the directory a login on the node starts in)")
    own.add_argument("--name", help="the run's name (default: the script it runs)")
    p.add_argument("--target", default="local", help="target name: local (default) or one from targets.toml")
    p.add_argument("--target-file", type=Path, help="targets TOML file (default: <config>/targets.toml)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment field, e.g. --set tensor_model_parallel_size=2 (repeatable; "
                        "charllm-tui fields lists them)")
    p.add_argument("--nproc", type=int, help="processes per node (CPU runs; default: cluster.gpus_per_node)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands (and the job script a scheduler target submits); touch nothing")
    p.add_argument("--follow", action="store_true", help="print iterations and telemetry until the run ends")
    p.add_argument("--force", action="store_true",
                   help="launch a layout that fails validation or does not fit (recorded in the manifest)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    target = get_target(args.target, args.target_file)
    exp, command, notes = what_runs(args, target)
    with console.status("launching") as status:
        result = launch(exp, target, dry_run=args.dry_run, force=args.force, nproc=None if command else args.nproc,
                        on_progress=lambda message: status.update(message), command=command, notes=notes)
    for reason in result.forced:
        console.print(f"[yellow]forced:[/] {reason}")
    for note in result.notes:
        console.print(f"[cyan]{note}[/]")
    if args.dry_run:
        print(f"# run {result.run_id} on target {target.name!r} (dry run: nothing was created; "
              f"{PORT_AT_LAUNCH}: torchrun's rendezvous port, picked at launch)")
        if result.profile:
            print(f"# {result.profile}")
        for command in result.commands:
            print(command)
        if result.job_script:
            print(f"# {result.job_script_label}:")
            print(result.job_script)
        return 0
    print(f"run {result.run_id}: launched on {target.name!r}" + (f" ({result.job})" if result.job else ""))
    print(f"  {result.run_dir}")
    if result.profile:
        print(f"  {result.profile}")
    if not args.follow:
        print(f"  follow with: charllm-tui runs logs {result.run_id} -f")
        return 0
    return follow(result.run_dir)


def follow(run_dir) -> int:
    """Print iterations and a telemetry headline until the run ends; exit status says how it ended."""
    import polars as pl

    from charllm.probes.store.follow import (
        NewIterations,
        NewTelemetry,
        StatusChanged,
        follow as follow_run,  # deferred: loads polars (start-up time)
    )

    # Rank 0 and the last rank both log each step; the last rank's line carries the loss. Every rank
    # logs the end too, rank 0 often before the last rank's last step: the end is said with the last
    # rank's, or, where that rank logs none, after the last pass's steps; the final status after it
    # (a pass reads the status before the data it is followed by).
    last_rank = RunDir(run_dir).manifest().world_size - 1
    seen = set()
    ended: dict | None = None
    final = None
    pending, last_headline = [], 0.0

    def say(key: tuple, row: dict) -> None:
        if key not in seen:
            seen.add(key)
            print(_iteration_line(row), flush=True)

    try:
        for event in follow_run(run_dir, settle=reconcile):
            if isinstance(event, StatusChanged):
                if event.manifest.final:
                    final = event.status
                else:
                    print(f"status: {event.status}", flush=True)
            elif isinstance(event, NewIterations):
                for row in event.events:
                    key = (
                        row.get("event"),
                        row.get("iteration"),
                        row.get("rank") if row.get("event") in ("profile", "memory") else
                        row.get("node") if row.get("event") == "end" and "exit_code" in row else None,
                    )
                    if key[0] == "end" and "exit_code" not in row and row.get("rank") != last_rank:
                        ended = ended or row
                    elif key[0] != "iteration" or row.get("rank") in (last_rank, None):   # (None: a command's log)
                        say(key, row)
            elif isinstance(event, NewTelemetry):  # one headline every HEADLINE_S, over the rows since the last
                pending.append(event.rows)
                if time.monotonic() - last_headline >= HEADLINE_S:
                    print(_telemetry_line(pl.concat(pending, how="diagonal_relaxed")), flush=True)
                    pending, last_headline = [], time.monotonic()
    except KeyboardInterrupt:
        print("cancelling...", flush=True)
        cancel(run_dir)
    if ended is not None:
        say(("end", ended.get("iteration"), None), ended)
    if final:
        print(f"status: {final}", flush=True)
    rd = RunDir(run_dir)
    if not wait_for_supervisor(rd):   # so that nothing of the run outlives this command
        print(f"the supervisor is still finishing after {SUPERVISOR_EXIT_S:g} s (see logs/supervisor.log)")
    manifest = rd.manifest()
    if manifest.failure:
        print(f"failed: {manifest.failure}")
    return {"completed": 0, "cancelled": 130}.get(manifest.status, 1)


HEADLINE_S = 2.0


def what_runs(args: argparse.Namespace, target):
    """(experiment, the user's Command or None, notes) from the command line: an experiment, or --command."""
    own = {"--command": args.command_line, "--hardware": args.hardware, "--nodes": args.nodes, "--cwd": args.cwd,
           "--name": args.name}
    if args.command_line is None:
        given = [flag for flag, value in own.items() if value is not None]
        if given:
            raise UserError(f"launch: {given[0]} goes with --command")
        if args.experiment is None:
            raise UserError("launch: give an EXPERIMENT_OR_PRESET, or --command \"CMD\"")
        exp = Experiment.load(args.experiment).apply(args.assignments)
        if args.runner == "workload":
            return exp, None, []
        if not args.megatron_lm:
            raise UserError("--runner megatron-lm: give --megatron-lm DIR (a Megatron-LM checkout), or set MEGATRON_LM")
        if args.nproc is not None:     # (the command says how many processes torchrun starts)
            exp.cluster.gpus_per_node = args.nproc
        found = [] if args.force else problems(exp)
        if found:
            raise LayoutRefused(found[0])
        command, notes = megatron_lm_command(exp, args.megatron_lm, python=target.python_path,
                                             check_here=target.shares_files)
        return exp, command, notes
    if args.experiment is not None:
        raise UserError(f"launch: give an experiment ({args.experiment!r}) or --command, not both")
    if args.runner != "workload":
        raise UserError(f"--runner {args.runner}: runs an experiment; --command runs your own line as it is")
    if args.nodes is not None and args.nodes < 1:
        raise UserError(f"--nodes = {args.nodes}: must be at least 1")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc = {args.nproc}: must be at least 1")
    cwd = args.cwd or (os.getcwd() if target.shares_files else None)
    exp, command, notes = plan_command(args.command_line, log_format=args.log_format, hardware=args.hardware,
                                       nodes=args.nodes, nproc=args.nproc, name=args.name, cwd=cwd,
                                       on_this_machine=target.on_this_machine)
    return exp.apply(args.assignments), command, notes


def _iteration_line(row: dict) -> str:
    event = row.get("event", "iteration")
    if event == "start":
        layout = row.get("layout")
        layout = layout if isinstance(layout, dict) else {}
        return (f"training started: world size {row.get('world_size')} ({layout_label(layout)}) "
                f"on {layout.get('device', '?')}")
    if event == "end" and row.get("exit_code", False) is not False:   # a command's runner
        return f"command ended on {row.get('node')}: {row.get('status')} (exit status {row.get('exit_code')})"
    if event == "end":
        return f"training ended: {row.get('status')} at iteration {row.get('iteration')}"
    if event == "memory":
        peak, reserved = row.get("mem_peak_bytes"), row.get("mem_reserved_bytes")
        return (f"memory of rank {row.get('rank')} after {row.get('iteration')} iterations: max allocated "
                f"{size(peak) if isinstance(peak, int) else '?'}, max reserved "
                f"{size(reserved) if isinstance(reserved, int) else '?'}")
    if event == "profile":
        written = row.get("bytes")
        return (
            f"profiler trace of step {row.get('iteration')} by rank {row.get('rank')} (stage {row.get('pp_rank')}): "
            f"{row.get('file')}" + (f", {size(written)}" if isinstance(written, int) else "")
        )
    parts = [f"iter {row.get('iteration', '?'):>5}"]
    if row.get("rank") is not None:     # (a command's log names no rank)
        parts.append(f"rank {row['rank']}")
    if row.get("loss") is not None:
        parts.append(f"loss {row['loss']:.4f}")
    start, end = row.get("start_ns"), row.get("end_ns")
    if start and end:
        parts.append(f"{(end - start) / 1e6:8.1f} ms")
    if row.get("tflops_per_gpu") is not None:
        parts.append(f"{row['tflops_per_gpu']:.3f} TFLOP/s/gpu (this step)")
    if row.get("warmup"):
        parts.append("(warm-up)")
    return "  ".join(parts)


def _telemetry_line(rows) -> str:
    """The mean of the headline metrics over the rows new since the last line (its window, said)."""
    span = (rows["ts_ns"].max() - rows["ts_ns"].min()) / 1e9 if "ts_ns" in rows.columns and rows.height else 0.0
    parts = [f"telemetry {plural(rows.height, 'row')}, means over the last {span:.0f} s:"]
    for column, label, scale in (("power_w", "GPU power {:.0f} W", 1), ("temp_gpu_c", "GPU {:.0f} C", 1),
                                 ("cpu_util_pct", "CPU {:.0f} %", 1), ("temp_cpu_c", "CPU {:.0f} C", 1),
                                 ("host_mem_used_bytes", "host memory {:.1f} GiB", GIB)):
        if column in rows.columns:
            value = rows[column].mean()
            if value is not None:
                parts.append(label.format(value / scale))
    return "  ".join(parts)
