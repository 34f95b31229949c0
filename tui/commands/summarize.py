"""`charllm-tui summarize RUN`: a run's power, thermal, clock and speed summary; every rank's step
timers with the stragglers named (--by rank|stage); where the step's time goes, from the run's
profiler traces (--kernels)."""

from __future__ import annotations

import argparse

from charllm.probes.analysis import SUMMARY_FORMATS
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import size
from charllm.probes.store.rundir import resolve_run


def register(subparsers, name: str, help: str) -> None:
    p = subparsers.add_parser(
        name, help=help,
        description="Summarize a run per GPU, node or the whole run over a window. Units are in the "
                    "metric names; simulated telemetry is labelled in the 'simulated' column. --by rank "
                    "(or stage) gives every rank's step timers (forward-backward, compute, pipeline wait, "
                    "gradient reduce, optimizer) and names the stragglers; --kernels splits the profiled "
                    "steps' time into kernel categories per pipeline stage (or rank). The table ends with "
                    "what the plan predicts for the run's layout (step time, tokens/s, MFU, power, energy; "
                    "with the board's power limiter: mean, p99 and peak power, share at the limit, SM clock "
                    "and GPU temperature) beside what it measured, with the error.",
    )
    p.add_argument("run", metavar="RUN", help="run id (or unique prefix/suffix) or run directory")
    p.add_argument("--window", default="steady", metavar="steady|all|START:END",
                   help="steady iterations (default; 'all' when the run has no iteration log), the whole "
                        "run, or seconds after the first sample")
    p.add_argument("--by", choices=("gpu", "node", "run", "rank", "stage"), default="auto",
                   help="default: gpu, or node when the run has no GPU telemetry (a CPU run); stage with --kernels; "
                        "rank and stage: the step timers of each rank or pipeline stage")
    p.add_argument("--matrix", metavar="temperature|power|clock|throttle|link",
                   help="a per-GPU matrix: each GPU's figure over time, in --buckets equal spans of the window (all)")
    p.add_argument("--buckets", type=int, default=12, metavar="N", help="time spans of --matrix (12)")
    p.add_argument("--kernels", action="store_true",
                   help="where the profiled steps' time goes (the run's traces/: telemetry.profile_steps), per "
                        "stage (default) or --by rank")
    p.add_argument("--format", choices=SUMMARY_FORMATS, default=None, help="default: table, or from --out's suffix")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from charllm.probes.analysis.render import render, write_summary  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.summary import summarize  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.windows import parse_window, window_phrase  # deferred: loads polars (start-up time)

    out = paths.output_file(args.out, "--out") if args.out is not None else None  # before the work
    window = parse_window(args.window)
    if args.matrix:
        return _matrix(args, out)
    if args.kernels or args.by in ("rank", "stage"):
        return _per_rank(args, window, out)
    df = summarize(args.run, window, by=args.by)
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


def _per_rank(args: argparse.Namespace, window, out) -> int:
    """--kernels, or --by rank|stage: a table per rank or stage, and what it says in a line."""
    from charllm.probes.analysis.kernels import kernel_summary, kernel_table  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.ranks import rank_summary, steps_phrase, straggler_line  # deferred: polars
    from charllm.probes.analysis.render import render, text_table, write_summary  # deferred: polars (start-up time)

    fmt = args.format or "table"
    if args.kernels:
        by = "stage" if args.by == "auto" else args.by
        if by not in ("stage", "rank"):
            raise UserError(f"--by {by}: --kernels gives a table per pipeline stage or per rank (stage, rank)")
        if args.window != "steady":
            raise UserError("--window: --kernels covers the profiled steps (telemetry.profile_steps), not a window")
        df = kernel_summary(args.run, by)
        heading = (
            "time per profiled step, by kernel category "
            f"({'device kernels' if df['source'][0] == 'device' else 'host ops: a CPU run'}; "
            f"{df['traces'].sum()} traces; shares of the step)"
        )
        text = text_table(kernel_table(df), fmt == "markdown") if fmt in ("table", "markdown") else None
    else:
        df = rank_summary(args.run, window, by=args.by)
        key = "rank" if args.by == "rank" else "pp_rank"
        heading = f"step timers per {args.by}, medians over {steps_phrase(df['window'][0])}; {straggler_line(df)}"
        text = render(df.drop("run", "level", "window"), fmt, [f"{args.by} {k}" for k in df[key]]) \
            if fmt in ("table", "markdown") else None
    if out is not None:
        write_summary(df, out, args.format)
        print(f"wrote {args.out}")
        return 0
    if fmt == "parquet":
        raise UserError("--format parquet is binary: give --out FILE")
    if text is None:
        print(render(df, fmt), end="")
        return 0
    print(heading)
    if "notes" in df.columns and df["notes"][0]:
        print(f"note: {df['notes'][0]}")
    print(text, end="")
    return 0


def _matrix(args: argparse.Namespace, out) -> int:
    """--matrix NAME: GPUs x time."""
    from charllm.probes.analysis.matrix import MATRICES, check, gpus_by_time, render_matrix  # deferred: polars
    from charllm.probes.analysis.render import render, text_table, write_summary  # deferred: polars (start-up time)

    name = check(args.matrix)
    window = "all" if args.window == "steady" else args.window   # a matrix shows the whole run unless asked
    df = gpus_by_time(args.run, name, args.buckets, window)
    if out is not None:
        write_summary(df, out, args.format)
        print(f"wrote {args.out}")
        return 0
    fmt = args.format or "table"
    if fmt in ("table", "markdown"):
        what, unit, _ = MATRICES[name]
        print(f"{what} per GPU ({unit}), over time (seconds after the window's first sample)")
        print(text_table(render_matrix(df, name), fmt == "markdown"), end="")
        return 0
    if fmt == "parquet":
        raise UserError("--format parquet is binary: give --out FILE")
    print(render(df, fmt), end="")
    return 0


def predicted_lines(run, window) -> str:
    """The plan's step time, throughput, power and peak memory for the run's layout beside what it
    measured; for a user's command that was not planned, why; else nothing (no experiment recorded)."""
    from charllm.probes.analysis import predicted  # deferred: loads polars (start-up time)

    rd = resolve_run(run)
    try:
        text = predicted.render(predicted.predicted_vs_measured(rd, window))
    except UserError:
        notes = rd.manifest().command.get("notes") or []
        return "".join(f"{note}\n" for note in notes if isinstance(note, str) and note.startswith("not planned"))
    memory = predicted.memory_vs_measured(rd)
    if memory:
        text += (f"peak memory (allocator, busiest rank): planned {size(memory['planned_bytes'])}, measured "
                 f"{size(memory['measured_bytes'])}, error {memory['error_pct']:+.1f}%\n")
    return text
