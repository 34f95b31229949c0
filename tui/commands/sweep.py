"""`charllm-tui sweep`: every valid parallel layout of a model on a cluster, with its peak memory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """\
layouts: TP (powers of two within a node) x CP x PP x VP x EP (MoE) x micro batch (1, 2, 4, 8),
each with recompute none / selective / full and the distributed optimizer on / off; sequence
parallelism is on whenever TP > 1 and the node planned for runs it (with Transformer Engine; a node
calibrated without it, see `charllm-tui doctor`, gets TP without SP and no CP). Only layouts that
`engine.validate` accepts are listed.

ranking (rank 1 = most promising):
  1. layouts that fit first;
  2. less recompute (none, then selective, then full: full recompute re-runs the forward pass);
  3. a smaller pipeline bubble, (PP - 1) / (micro-batches x VP), in whole percent;
  4. fewer ranks in the communication-heavy dimensions TP x CP (their collectives sit on the
     critical path of every layer), then fewer expert-parallel ranks, then fewer pipeline
     stages and virtual stages (point-to-point traffic);
  5. more memory headroom.

peak/headroom are per device, in GiB in the table and in bytes in --json/--parquet; headroom is
usable memory minus memory outside the allocator, the fragmentation margin and the peak. The line
under the table gives that arithmetic and where each figure comes from (the hardware preset, or a
node calibrated with `charllm-tui doctor`).

--set KEY=VALUE fixes a training or parallel option of every layout (what the sweep varies itself,
listed above, cannot be fixed; --recompute narrows the recompute choices).

examples:
  charllm-tui sweep --model llama3-70b --hardware h100-sxm-80gb --nodes 8 --gpus-per-node 8 --global-batch-size 128
  charllm-tui sweep --model mixtral-8x7b --hardware h200-141gb --nodes 4 --gpus-per-node 8 \\
      --global-batch-size 128 --fits-only --parquet layouts.parquet
  charllm-tui sweep --model llama3-70b --hardware h100-sxm-80gb --nodes 8 --gpus-per-node 8 \\
      --global-batch-size 128 --recompute none --set overlap_grad_reduce=true --set attention_backend=unfused
"""


def register(sub) -> None:
    p = sub.add_parser("sweep", help="every valid parallel layout with its peak memory, ranked",
                       description="Enumerate the valid parallel layouts of a model on a cluster and estimate "
                                   "the peak memory of each.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="M", help="model preset")
    p.add_argument("--hardware", required=True, metavar="H", help="hardware preset")
    p.add_argument("--nodes", required=True, type=int, metavar="N")
    p.add_argument("--gpus-per-node", required=True, type=int, metavar="G")
    p.add_argument("--global-batch-size", required=True, type=int, metavar="B")
    p.add_argument("--seq-length", type=int, metavar="S", help="default: the model's")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="fix a training/parallel option of every layout, e.g. --set seq_length=4096 (repeatable)")
    p.add_argument("--recompute", default="none,selective,full", metavar="LIST",
                   help="recompute choices to sweep, comma-separated (default none,selective,full)")
    p.add_argument("--top", type=int, default=20, metavar="K", help="rows in the table (default 20; 0 = all)")
    p.add_argument("--fits-only", action="store_true", help="only layouts that fit")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print every row as JSON records")
    out.add_argument("--parquet", type=Path, metavar="FILE", help="write every row to a Parquet file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from charllm.probes.errors import UserError

    for flag in ("nodes", "gpus_per_node", "global_batch_size", "seq_length"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} = {value!r}: must be a positive integer")
    if args.top < 0:
        raise UserError(f"--top = {args.top!r}: must be 0 (all) or more")
    import polars as pl
    from rich.console import Console

    from charllm.engine.experiment import parse_value
    from charllm.engine.sweep import sweep

    options = {}
    for item in args.sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected key=value, e.g. seq_length=4096")
        options[key.strip()] = parse_value(raw.strip())
    recompute = tuple(name.strip() for name in args.recompute.split(",") if name.strip())

    console = Console(stderr=True)
    with console.status("sweeping layouts..."):
        df = sweep(args.model, args.hardware, args.nodes, args.gpus_per_node, args.global_batch_size,
                   args.seq_length, recompute=recompute, training=options)
    if df.height == 0:
        raise UserError(f"no valid layout: {why_none(args, recompute, options)}")
    if args.fits_only:
        df = df.filter(pl.col("fits"))
    if args.json:
        import json

        print(json.dumps(df.to_dicts()))
    elif args.parquet:
        tmp = args.parquet.with_name(f".{args.parquet.name}.tmp")
        try:
            args.parquet.parent.mkdir(parents=True, exist_ok=True)
            df.write_parquet(tmp)
            tmp.replace(args.parquet)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise UserError(f"--parquet {str(args.parquet)!r}: cannot write ({exc.strerror})") from None
        console.print(f"wrote {df.height} layouts to {args.parquet}")
    else:
        render(df, args)
        print(basis(args, options))
    return 0


def basis(args: argparse.Namespace, options: dict) -> str:
    """What every row's verdict assumes: the device budget and where its figures come from."""
    from charllm.engine.memory import budget
    from charllm.engine.sweep import base_experiment

    base = base_experiment(args.model, args.hardware, args.nodes, args.gpus_per_node, args.global_batch_size,
                           args.seq_length, options)
    return budget(base).describe()


def why_none(args: argparse.Namespace, recompute: tuple[str, ...], options: dict) -> str:
    """What `engine.validate` says about the plainest layout (no parallelism, micro batch 1)."""
    from charllm.engine.sweep import base_experiment
    from charllm.engine.validate import validate

    base = base_experiment(args.model, args.hardware, args.nodes, args.gpus_per_node, args.global_batch_size,
                           args.seq_length, options)
    problems = validate(base)
    return str(problems[0]) if problems else f"none passes validation with --recompute {','.join(recompute)}"


def render(df, args) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    fitting = int(df["fits"].sum()) if df.height else 0
    shown = df if args.top == 0 else df.head(args.top)
    table = Table(box=box.SIMPLE_HEAD, title_justify="left",
                  title=f"{args.model} on {args.nodes} x {args.gpus_per_node} {args.hardware}, global batch "
                        f"{args.global_batch_size}: {df.height} layouts, {fitting} fit (GiB)")
    for column in ("rank", "TP", "PP", "VP", "CP", "EP", "DP", "mbs", "recompute", "dist-opt", "bubble",
                   "peak", "stage", "headroom", "fits"):
        table.add_column(column, justify="left" if column in ("recompute", "fits") else "right", no_wrap=True)
    for r in shown.iter_rows(named=True):
        table.add_row(str(r["rank"]), str(r["tensor_model_parallel_size"]), str(r["pipeline_model_parallel_size"]),
                      str(r["virtual_pipeline_model_parallel_size"]), str(r["context_parallel_size"]),
                      str(r["expert_model_parallel_size"]), str(r["data_parallel_size"]),
                      str(r["micro_batch_size"]), r["recompute"], "on" if r["use_distributed_optimizer"] else "off",
                      f"{r['bubble']:.1%}", f"{r['peak_bytes'] / (1 << 30):.1f}", str(r["peak_stage"]),
                      f"{r['headroom_bytes'] / (1 << 30):.1f}", "[green]yes[/]" if r["fits"] else "[red]no[/]")
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    if shown.height < df.height:
        print(f"({df.height - shown.height} more; --top 0 shows all, --json/--parquet give every column)")
