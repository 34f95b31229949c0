"""`charllm-tui summarize RUN`: a run's power, thermal, clock and speed summary."""

from __future__ import annotations

import argparse

from charllm.probes.analysis import SUMMARY_FORMATS
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "summarize", help="summarize a run: power, energy, thermals, throttling, MFU",
        description="Summarize a run per GPU, node or the whole run over a window. Units are in the "
                    "metric names; simulated telemetry is labelled in the 'simulated' column. The table "
                    "ends with what the plan predicts for the run's layout (step time, tokens/s, MFU, "
                    "power, energy) beside what it measured, with the error.",
    )
    p.add_argument("run", metavar="RUN", help="run id (or unique prefix/suffix) or run directory")
    p.add_argument("--window", default="steady", metavar="steady|all|START:END",
                   help="steady iterations (default; 'all' when the run has no iteration log), the whole "
                        "run, or seconds after the first sample")
    p.add_argument("--by", choices=("gpu", "node", "run"), default="auto",
                   help="default: gpu, or node when the run has no GPU telemetry (a CPU run)")
    p.add_argument("--format", choices=SUMMARY_FORMATS, default=None, help="default: table, or from --out's suffix")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from charllm.probes.analysis.render import render, write_summary  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.summary import summarize  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.windows import parse_window, window_phrase  # deferred: loads polars (start-up time)

    out = paths.output_file(args.out, "--out") if args.out is not None else None  # before the work
    df = summarize(args.run, parse_window(args.window), by=args.by)
    if out is not None:
        write_summary(df, out, args.format)
        print(f"wrote {args.out}")
    else:
        fmt = args.format or "table"
        if fmt == "parquet":
            raise UserError("--format parquet is binary: give --out FILE")
        if fmt == "table":      # which window the figures cover, in words (Live names its own too)
            print(f"figures over {window_phrase(df['window'][0])}")
        print(render(df, fmt), end="")
        if fmt == "table":
            print(predicted_lines(args.run, parse_window(args.window)), end="")
    return 0


def predicted_lines(run, window) -> str:
    """The plan's step time, throughput and power for the run's layout beside what it measured, or
    nothing where the run recorded no experiment."""
    from charllm.probes.analysis import predicted  # deferred: loads polars (start-up time)

    try:
        return predicted.render(predicted.predicted_vs_measured(run, window))
    except UserError:
        return ""
