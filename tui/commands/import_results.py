"""`charllm-tui import charllm-ppt DIR`: other tools' results as runs of ours."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers, name: str, help: str) -> None:
    p = subparsers.add_parser(name, help=help,
                              description="Import results recorded by other tools into a new run directory, "
                                          "so they can be summarized and compared with new runs.")
    sub = p.add_subparsers(dest="import_format", metavar="FORMAT", required=True)
    ppt = sub.add_parser("charllm-ppt", help="a CharLLM-PPT / Zeus result directory ({metric}_{rank}.csv), or a "
                                             "tree of them",
                         description="Import a CharLLM-PPT / Zeus result directory: {metric}_{rank}.csv files "
                                     "of unix_time_s,value rows, plus system_* host files (one host stream per "
                                     "node, however many ranks wrote it). Units are mapped (KiB and KB/s to "
                                     "bytes); what the files cannot tell (throttle reasons, energy counter, power "
                                     "limit, memory use, all NVLink links) is listed in the run's manifest. "
                                     "Prints the new run id. Given a tree such as the artifact's "
                                     "results/<sweep>/<model>/<run>/, imports every folder that holds such files "
                                     "as its own run named <sweep>-<model>-<run>, prints one run id per line, and "
                                     "reports a folder that fails on stderr without stopping the others (exit 1 "
                                     "if any failed).")
    ppt.add_argument("dir", metavar="DIR")
    ppt.add_argument("--name", help="run name (default: the directory's name); for a tree, a prefix of every name")
    ppt.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="rank r is on node r // N (8)")
    ppt.set_defaults(func=_charllm_ppt)


def _charllm_ppt(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from charllm.engine.campaign import artifact  # deferred: loads the experiment catalog (start-up time)
    from charllm.probes.analysis.summary import keep_summaries  # deferred: loads polars (start-up time)
    from charllm.probes.store.importers import (  # deferred: numpy, polars
        import_charllm_ppt,
        import_charllm_ppt_tree,
        is_result_folder,
    )

    src = Path(args.dir).expanduser()
    if not src.is_dir() or is_result_folder(src):
        with Progress(transient=True) as progress:
            task = progress.add_task("importing ranks", total=None)
            run = import_charllm_ppt(src, name=args.name, gpus_per_node=args.gpus_per_node,
                                     on_progress=lambda done, total: progress.update(task, completed=done, total=total))
            artifact.attach(run, src.resolve())   # the experiment it ran, where the folder names one
            progress.update(task, description="summarizing")
            keep_summaries(run)  # compares and lists of it read this, not its telemetry
        print(run.id)
        _warn(run)
        return 0
    campaign, renamed = artifact.campaign_name(src, args.name)   # before anything is imported: never one taken
    with Progress(transient=True) as progress:
        task = progress.add_task("importing run folders", total=None)
        results = import_charllm_ppt_tree(
            src, prefix=args.name, gpus_per_node=args.gpus_per_node,
            on_folder=lambda done, total, folder: progress.update(task, completed=done, total=total,
                                                                  description=f"imported {folder.name}"))
    failed, imported = 0, []
    with Progress(transient=True) as progress:
        task = progress.add_task("summarizing runs", total=len(results))
        for folder, outcome in results:
            if isinstance(outcome, Exception):
                failed += 1
                print(f"charllm-tui: error: {folder}: {outcome}", file=sys.stderr)
            else:
                artifact.attach(outcome, folder)   # the experiment it ran, where the folder names one
                keep_summaries(outcome)  # compares and lists of it read this, not its telemetry
                print(outcome.id)
                _warn(outcome)
                imported.append((folder, outcome))
            progress.advance(task)
    if imported:   # the tree reads as one campaign (campaign summary / report NAME)
        record = artifact.record_tree(campaign, src.resolve(), imported)
        print(f"charllm-tui: the imported runs are campaign {record.name!r}{renamed} (charllm-tui campaign summary "
              f"{record.name})", file=sys.stderr)
    if failed:
        print(f"charllm-tui: {failed} of {len(results)} folders not imported (above)", file=sys.stderr)
    return 1 if failed else 0


def _warn(run) -> None:
    """A crash imported as a failed run, and the rows an import left out, one line per run (the
    manifest keeps the counts per file)."""
    manifest = run.read_manifest()
    for note in ([manifest["failure"]] if manifest.get("failure") else []) + (manifest.get("notes") or []):
        print(f"charllm-tui: warning: {run.id}: {note}", file=sys.stderr)
