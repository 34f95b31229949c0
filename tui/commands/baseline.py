"""`charllm-tui baseline save|list|show|delete`: named run summaries to compare against."""

from __future__ import annotations

import argparse

from charllm.probes.analysis import COMPARE_FORMATS


def register(subparsers, name: str, help: str) -> None:
    p = subparsers.add_parser(name, help=help,
                              description="Baselines keep a run's summary and experiment under a name "
                                          "(in the user's data dir; shipped ones come with charllm-tui).")
    sub = p.add_subparsers(dest="baseline_command", metavar="ACTION", required=True)
    save = sub.add_parser("save", help="keep a run's summary as a named baseline")
    save.add_argument("run", metavar="RUN")
    save.add_argument("--name", required=True)
    save.add_argument("--window", default="steady", metavar="steady|all|START:END")
    save.add_argument("--description", default="")
    save.add_argument("--force", action="store_true", help="replace an existing baseline of that name")
    save.set_defaults(func=_save)
    sub.add_parser("list", help="list baselines").set_defaults(func=_list)
    show = sub.add_parser("show", help="show a baseline's summary")
    show.add_argument("name")
    show.add_argument("--format", choices=COMPARE_FORMATS, default="table")
    show.set_defaults(func=_show)
    delete = sub.add_parser("delete", help="delete a user baseline")
    delete.add_argument("name")
    delete.set_defaults(func=_delete)


def _save(args: argparse.Namespace) -> int:
    from charllm.probes.analysis import baselines  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.windows import parse_window  # deferred: loads polars (start-up time)

    path = baselines.save(args.run, args.name, window=parse_window(args.window),
                          description=args.description, overwrite=args.force)
    print(f"saved baseline {args.name} ({path})")
    return 0


def _list(args: argparse.Namespace) -> int:
    from charllm.probes.analysis import baselines  # deferred: loads polars (start-up time)

    rows = baselines.list()
    if not rows:
        print("no baselines (save one with: charllm-tui baseline save RUN --name NAME)")
        return 0
    for b in rows:
        sim = " [simulated]" if b["simulated"] else ""
        print(f"{b['name']:<32} {b['source']:<8} {b['window'] or '':<7} {b['description']}{sim}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from charllm.probes.analysis import baselines  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.render import render  # deferred: loads polars (start-up time)

    b = baselines.show(args.name)
    if args.format in ("table", "markdown"):
        print(f"baseline {b.name} ({b.source}): {b.description}")
    print(render(b.summary, args.format), end="")
    return 0


def _delete(args: argparse.Namespace) -> int:
    from charllm.probes.analysis import baselines  # deferred: loads polars (start-up time)

    baselines.delete(args.name)
    print(f"deleted baseline {args.name}")
    return 0
