"""`charllm-tui import charllm-ppt DIR`: other tools' results as runs of ours."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("import", help="import other tools' results as runs (CharLLM-PPT / Zeus CSVs)",
                              description="Import results recorded by other tools into a new run directory, "
                                          "so they can be summarized and compared with new runs.")
    sub = p.add_subparsers(dest="import_format", metavar="FORMAT", required=True)
    ppt = sub.add_parser("charllm-ppt", help="a CharLLM-PPT / Zeus result directory ({metric}_{rank}.csv)",
                         description="Import a CharLLM-PPT / Zeus result directory: {metric}_{rank}.csv files "
                                     "of unix_time_s,value rows, plus system_* host files. Units are mapped "
                                     "(KiB and KB/s to bytes); what the files cannot tell (throttle reasons, "
                                     "energy counter, power limit, memory use, all NVLink links) is listed in "
                                     "the run's manifest. Prints the new run id.")
    ppt.add_argument("dir", metavar="DIR")
    ppt.add_argument("--name", help="run name (default: the directory's name)")
    ppt.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="rank r is on node r // N (8)")
    ppt.set_defaults(func=_charllm_ppt)


def _charllm_ppt(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from charllm.probes.importers import import_charllm_ppt

    with Progress(transient=True) as progress:
        task = progress.add_task("importing ranks", total=None)
        run = import_charllm_ppt(args.dir, name=args.name, gpus_per_node=args.gpus_per_node,
                                 on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    print(run.id)
    return 0
