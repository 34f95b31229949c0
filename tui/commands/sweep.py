"""`charllm-tui sweep`: every valid parallel layout of an experiment or a model on a cluster, with its peak memory."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from charllm.engine.model.experiment import parse_value
from charllm.engine.model.memory import VERDICT_STYLE, budget
from charllm.engine.model.sweep import RECOMPUTE, SWEPT, layout_to_experiment, recompute_name, sweep
from charllm.engine.model.validate import validate
from charllm.probes.core import paths
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, did_you_mean, os_error_line, plural
from charllm.probes.core.formatting import GIB
from charllm.tui.commands import add_command
from charllm.tui.commands.plan import (
    MODEL_FLAGS,
    add_model_arguments,
    check_sizes,
    flag,
    load_experiment,
    model_experiment,
    percent,
    seconds,
    speed_basis,
    watts,
)

EPILOG = """\
what is swept: the layout of an experiment (a preset or TOML file, as Compose and `plan` take it),
or of a model given with --model, --hardware, --nodes, --gpus-per-node and --global-batch-size:
TP (powers of two within a node) x CP x PP x VP x EP (MoE) x micro batch (1, 2, 4, 8). Everything
else (precision, attention, recompute settings, optimizer options) is the experiment's, so a row
loaded into Compose or `plan` gives the same peak. --recompute and --distributed-optimizer vary
those two as well (default: an experiment's own settings; with --model, recompute none / selective
/ full and the distributed optimizer on / off). Sequence parallelism is on whenever TP > 1 and the
node planned for runs it (with Transformer Engine; a node calibrated without it, see `charllm-tui
doctor`, gets TP without SP and no CP), unless the experiment runs TP without it. Only layouts
that `engine.model.validate` accepts are listed.

ranking (rank 1 = most promising; --sort orders by another column):
  1. layouts that fit first, then tight ones (within the plan's error of the limit, or without
     room for the allocator's reserve; see `charllm-tui plan --help`), then those that do not fit;
  2. more tokens per second, as the step-time model estimates them (recompute, pipeline bubble
     and exposed communication all cost time; see `charllm-tui plan --help`);
  3. more memory headroom.

speed per layout: the step time (s), tokens/s, MFU (against the dense peak of the precision the
matmuls run in) and estimated power per device (W); --json/--parquet add the shares of the step in
compute, exposed communication, pipeline bubble, host-bound time (the GPUs waiting on the host to
launch their work) and the rest, the energy per token, Megatron's FLOPs per iteration and the
parameters (all, and the most on one device). The table's bubble column is the schedule's own,
(PP - 1) / (micro-batches x VP). The line under the table says where the rates come from: assumed,
or a node calibrated with `charllm-tui doctor --train`.

peak/headroom are per device, in GiB in the table and in bytes in --json/--parquet; headroom is
usable memory minus memory outside the allocator, the peak and the allocator's reserve beyond it
(see `charllm-tui plan --help`), on the stage with the least. The line under the table gives that
arithmetic and where each figure comes from (the hardware preset, or a node calibrated with
`charllm-tui doctor`).

--set KEY=VALUE fixes a training or parallel option of every layout (what the sweep varies itself,
listed above, cannot be fixed).

examples:
  charllm-tui sweep ppt-h100-llama3-70b-1-01000
  charllm-tui sweep --model llama3-70b --hardware h100-sxm-80gb --nodes 8 --gpus-per-node 8 --global-batch-size 128
  charllm-tui sweep --model mixtral-8x7b --hardware h200-141gb --nodes 4 --gpus-per-node 8 \\
      --global-batch-size 128 --fits-only --parquet layouts.parquet
  charllm-tui sweep --model llama3-70b --hardware h100-sxm-80gb --nodes 8 --gpus-per-node 8 \\
      --global-batch-size 128 --recompute none --set overlap_grad_reduce=true --set attention_backend=unfused
"""


def register(sub, name: str, help: str) -> None:
    p = add_command(sub, name, help,
                    "Enumerate the valid parallel layouts of a model on a cluster and estimate "
                    "the peak memory of each.",
                    EPILOG)
    p.add_argument("experiment", nargs="?", metavar="EXPERIMENT_OR_PRESET",
                   help="sweep this experiment's layout (else give --model ... --global-batch-size)")
    add_model_arguments(p, "sweep")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="fix a training/parallel option of every layout, e.g. --set seq_length=4096 (repeatable; "
                        "charllm-tui fields lists them)")
    p.add_argument("--recompute", metavar="LIST",
                   help=f"recompute choices to sweep, comma-separated from {','.join(RECOMPUTE)} (default: the "
                        "experiment's own; with --model all three)")
    p.add_argument("--distributed-optimizer", metavar="LIST",
                   help="distributed optimizer settings to sweep, comma-separated from on,off (default: the "
                        "experiment's own; with --model both)")
    p.add_argument("--top", type=int, default=20, metavar="K", help="rows in the table (default 20; 0 = all)")
    p.add_argument("--sort", metavar="COLUMN",
                   help="order by this column instead of the rank, largest first where larger is better "
                        "(tokens_per_s, mfu, headroom_bytes), else smallest first; a - prefix reverses it, "
                        "as in --sort=-mfu "
                        "(--json lists the columns)")
    p.add_argument("--fits-only", action="store_true", help="only layouts that fit")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print every row as JSON records")
    out.add_argument("--parquet", metavar="FILE", help="write every row to a Parquet file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.parquet is not None:  # before the work
        args.parquet = paths.output_file(args.parquet, "--parquet")
    check_sizes(args)
    if args.top < 0:
        raise UserError(f"--top = {args.top!r}: must be 0 (all) or more")
    import polars as pl
    from rich.console import Console

    base, from_model = load(args)
    recompute = _choices("--recompute", args.recompute, {"none": "none", "selective": "selective", "full": "full"})
    dists = _choices("--distributed-optimizer", args.distributed_optimizer, {"on": True, "off": False})
    if from_model:
        recompute = recompute or ("none", "selective", "full")
        dists = dists or (True, False)
    console = Console(stderr=True)
    with console.status("sweeping layouts..."):
        df = sweep(base, recompute=recompute, distributed_optimizer=dists)
    if df.height == 0:
        raise UserError(f"no valid layout: {why_none(base, recompute, dists)}")
    counted = f"{plural(df.height, 'layout')}, {int(df['fits'].sum()):,} fit"     # before --fits-only lists fewer
    if args.fits_only:
        df = df.filter(pl.col("fits"))
        counted += ", only those listed"
    if args.sort:
        df = sort_by(df, args.sort)
        counted += f", by {args.sort}"
    if args.json:
        print(df.write_json())   # (polars writes the records 8x as fast as json.dumps of its dicts)
    elif args.parquet is not None:
        try:
            write_atomic(args.parquet, df.write_parquet)
        except OSError as exc:
            raise UserError(f"--parquet {str(args.parquet)!r}: cannot write ({os_error_line(exc)})") from None
        console.print(f"wrote {plural(df.height, 'layout')} to {args.parquet}")
    else:
        render(df, args, base, counted)
        print(budget(base).describe())
        print(speed_basis(base))
    return 0


def load(args: argparse.Namespace):
    """(the experiment whose layouts are swept, whether it was built from --model and friends)."""
    options = {}
    for item in args.sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected key=value, e.g. seq_length=4096")
        options[key.strip()] = parse_value(raw.strip())
    if args.experiment:
        given = [flag(f) for f in (*MODEL_FLAGS, "seq_length") if getattr(args, f) is not None]
        if given:
            raise UserError(
                f"sweep: {given[0]} goes with --model, not with an experiment (use --set on the experiment)"
            )

        exp = load_experiment(args.experiment, "sweep")
        for key, value in options.items():
            if key.rpartition(".")[2] in SWEPT:
                raise UserError(
                    f"{key} = {value!r}: the sweep varies {key.rpartition('.')[2]} itself; it cannot be fixed"
                )
        return exp.apply(args.sets), False
    if args.model is None:
        missing = [flag(f) for f in MODEL_FLAGS if getattr(args, f) is None]
        raise UserError(f"sweep: give an EXPERIMENT_OR_PRESET, or {' '.join(missing)}")
    return model_experiment(args, "sweep", options), True


# Columns where more is better: --sort puts the largest first
LARGER_FIRST = ("tokens_per_s", "mfu", "headroom_bytes", "compute_share", "data_parallel_size")


def sort_by(df, text: str):
    """The sweep ordered by `text`: a column (--sort), best first; a leading - reverses."""
    name = text.removeprefix("-")
    if name not in df.columns:
        raise UserError(f"--sort = {text!r}: not a column{did_you_mean(name, df.columns)}; the columns: "
                        f"{', '.join(df.columns)}")
    descending = (name in LARGER_FIRST) != text.startswith("-")
    return df.sort(name, descending=descending, nulls_last=True, maintain_order=True)


def _choices(flag: str, text: str | None, allowed: dict) -> tuple | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in allowed:
            raise UserError(f"{flag} = {name!r}: expected one of {', '.join(allowed)}")
    if not names:
        raise UserError(f"{flag} = {text!r}: expected one or more of {', '.join(allowed)}")
    return tuple(dict.fromkeys(allowed[name] for name in names))


def why_none(base, recompute: tuple | None, dists: tuple | None) -> str:
    """What `engine.model.validate` says about the plainest layout (no parallelism, micro batch 1) with the
    first recompute and optimizer choice swept."""
    plain = layout_to_experiment(base, {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "micro_batch_size": 1,
        "recompute": (recompute or (recompute_name(base),))[0],
        "use_distributed_optimizer": (dists or (base.parallel.use_distributed_optimizer,))[0]})
    problems = validate(plain)
    return str(problems[0]) if problems else "none passes validation with these recompute and optimizer choices"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


# The table's columns: (heading, the sweep's column, its text)
TABLE: tuple[tuple[str, str, Callable[[Any], str]], ...] = (   # heading, column, how a value is written
    ("rank", "rank", str), ("TP", "tensor_model_parallel_size", str), ("PP", "pipeline_model_parallel_size", str),
    ("VP", "virtual_pipeline_model_parallel_size", str), ("CP", "context_parallel_size", str),
    ("EP", "expert_model_parallel_size", str), ("DP", "data_parallel_size", str), ("mbs", "micro_batch_size", str),
    ("recompute", "recompute", str), ("dist-opt", "use_distributed_optimizer", lambda on: "on" if on else "off"),
    ("bubble", "bubble", lambda v: f"{v:.1%}"), ("step s", "step_s", seconds), ("tok/s", "tokens_per_s", _tokens),
    ("MFU", "mfu", percent), ("W", "power_w", watts), ("peak", "peak_bytes", lambda v: f"{v / GIB:.1f}"),
    ("stage", "peak_stage", str), ("headroom", "headroom_bytes", lambda v: f"{v / GIB:.1f}"),
    ("verdict", "verdict", lambda v: f"[{VERDICT_STYLE[v]}]{v}[/]"),
)


def _value(value) -> str:
    """A sweep value of a column the table does not show by itself (--sort by it)."""
    if value is None or isinstance(value, float) and value != value:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def render(df, args, base, counted: str) -> None:
    """The ranked layouts as a table titled with how many were swept and how many fit (`counted`); a
    --sort column the table does not show comes second, beside the rank."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    shown = df if args.top == 0 else df.head(min(args.top, df.height))
    table = Table(box=box.SIMPLE_HEAD, title_justify="left",
                  title=f"{base.model.name} on {base.cluster.nodes} x {base.cluster.gpus_per_node} "
                        f"{base.hardware.name}, global batch {base.training.global_batch_size}: {counted} (GiB)")
    columns = list(TABLE)
    sorted_by = (args.sort or "").removeprefix("-")
    if sorted_by and sorted_by not in (name for _, name, _ in TABLE):
        columns.insert(1, (sorted_by, sorted_by, _value))
    for heading, _, _ in columns:
        table.add_column(heading, justify="left" if heading in ("recompute", "verdict") else "right", no_wrap=True)
    for r in shown.iter_rows(named=True):
        table.add_row(*(text(r[name]) for _, name, text in columns))
    # pipes and files get the whole table (with a --sort column too), a terminal what fits it
    wide = Console(width=10_000).measure(table).maximum
    Console(width=None if sys.stdout.isatty() else max(160, wide)).print(table)
    if shown.height < df.height:
        print(f"({df.height - shown.height} more; --top 0 shows all, --json/--parquet give every column)")
