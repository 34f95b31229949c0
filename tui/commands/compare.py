"""`charllm-tui compare RUN_OR_BASELINE ...`: runs and baselines side by side."""

from __future__ import annotations

import argparse

from charllm.probes.analysis import COMPARE_FORMATS


def register(subparsers, name: str, help: str) -> None:
    p = subparsers.add_parser(
        name, help=help,
        description="Compare runs and/or baselines (run-level summaries). Each metric shows its % change "
                    "from the baseline (the first ref unless --baseline); changes beyond --threshold are "
                    "flagged better/worse by direction (lower energy is better, higher throughput is "
                    "better). Experiment fields that differ are listed first.",
    )
    p.add_argument("refs", nargs="+", metavar="RUN_OR_BASELINE",
                   help="run id/prefix/directory or baseline name ('baseline:NAME' to force a baseline)")
    p.add_argument("--baseline", metavar="NAME", help="the ref (run or baseline) to measure changes against")
    p.add_argument("--format", choices=COMPARE_FORMATS, default="table")
    p.add_argument("--threshold", type=float, default=5.0, metavar="PCT", help="flag changes beyond this %% (5)")
    p.add_argument("--window", default="steady", metavar="steady|all|START:END", help="window for runs (steady)")
    p.add_argument("--kernels", action="store_true",
                   help="each run's profiled step by kernel category, averaged over its pipeline stages, side by side")
    p.add_argument("--matrix", metavar="temperature|power|clock|throttle|link",
                   help="a per-GPU matrix: each GPU's figure (steady window) in each run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from charllm.probes.analysis.compare import compare, render  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.windows import parse_window  # deferred: loads polars (start-up time)

    if args.kernels or args.matrix:
        return _side_by_side(args, parse_window(args.window))
    result = compare(args.refs, args.baseline, threshold_pct=args.threshold, window=parse_window(args.window))
    print(render(result, args.format), end="")
    return 0


def _side_by_side(args: argparse.Namespace, window) -> int:
    """--kernels or --matrix: runs (not baselines: they keep summaries only) as columns."""
    from charllm.probes.analysis.kernels import compare_kernels, kernels_side_by_side  # deferred: polars
    from charllm.probes.analysis.matrix import MATRICES, check, gpus_by_runs, render_matrix  # deferred: polars
    from charllm.probes.analysis.render import render, text_table  # deferred: loads polars (start-up time)
    from charllm.probes.core.errors import UserError  # deferred: with the rest

    if args.kernels and args.matrix:
        raise UserError("--kernels and --matrix: one table at a time")
    if args.matrix:
        name = check(args.matrix)
        df = gpus_by_runs(args.refs, name, window)
        heading = f"{MATRICES[name][0]} per GPU ({MATRICES[name][1]}), each run's steady window"
        shown, notes = render_matrix(df, name), list[str]()
    else:
        df, notes = compare_kernels(args.refs)
        if df.height == 0:
            raise UserError("compare --kernels: none of these runs holds profiler traces: " + "; ".join(notes))
        heading = "each run's profiled step by kernel category, mean over its pipeline stages (share of the step, time)"
        shown = kernels_side_by_side(df)
    if args.format in ("csv", "json"):
        print(render(df, args.format), end="")
        return 0
    print(heading)
    print(text_table(shown, args.format == "markdown"), end="")
    for note in notes:
        print(f"note: {note}")
    return 0
