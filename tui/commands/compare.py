"""`charllm-tui compare RUN_OR_BASELINE ...`: runs and baselines side by side."""

from __future__ import annotations

import argparse

from charllm.probes.analysis import COMPARE_FORMATS


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare runs and baselines side by side",
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from charllm.probes.analysis.compare import compare, render  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.windows import parse_window  # deferred: loads polars (start-up time)

    result = compare(args.refs, args.baseline, threshold_pct=args.threshold, window=parse_window(args.window))
    print(render(result, args.format), end="")
    return 0
