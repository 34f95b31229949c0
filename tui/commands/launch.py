"""`charllm-tui launch EXPERIMENT_OR_PRESET --target NAME [--set k=v] [--dry-run] [--follow] [--force]`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from charllm.engine.launch.launcher import (
    PORT_AT_LAUNCH,
    SUPERVISOR_EXIT_S,
    cancel,
    launch,
    reconcile,
    wait_for_supervisor,
)
from charllm.engine.launch.targets import KINDS, get_target
from charllm.engine.model.experiment import Experiment, layout_label
from charllm.probes.core.errors import plural
from charllm.probes.core.formatting import GIB, size
from charllm.probes.store.rundir import RunDir


def register(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help,
                       description=f"Check the layout, create a run directory on a target ({', '.join(KINDS)}), "
                                   "start a telemetry sampler on every node and train with torchrun. Runs detached; "
                                   "see `charllm-tui runs`.")
    p.add_argument("experiment", metavar="EXPERIMENT_OR_PRESET", help="an experiment file or preset name")
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
    exp = Experiment.load(args.experiment).apply(args.assignments)
    target = get_target(args.target, args.target_file)
    with console.status("launching") as status:
        result = launch(exp, target, dry_run=args.dry_run, force=args.force, nproc=args.nproc,
                        on_progress=lambda message: status.update(message))
    for reason in result.forced:
        console.print(f"[yellow]forced:[/] {reason}")
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
                        row.get("rank") if row.get("event") == "profile" else None,
                    )
                    if key[0] == "end" and row.get("rank") != last_rank:
                        ended = ended or row
                    elif key[0] != "iteration" or row.get("rank") == last_rank:
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


def _iteration_line(row: dict) -> str:
    event = row.get("event", "iteration")
    if event == "start":
        layout = row.get("layout")
        layout = layout if isinstance(layout, dict) else {}
        return (f"training started: world size {row.get('world_size')} ({layout_label(layout)}) "
                f"on {layout.get('device', '?')}")
    if event == "end":
        return f"training ended: {row.get('status')} at iteration {row.get('iteration')}"
    if event == "profile":
        written = row.get("bytes")
        return (
            f"profiler trace of step {row.get('iteration')} by rank {row.get('rank')} (stage {row.get('pp_rank')}): "
            f"{row.get('file')}" + (f", {size(written)}" if isinstance(written, int) else "")
        )
    parts = [f"iter {row.get('iteration', '?'):>5}", f"rank {row.get('rank', '?')}"]
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
