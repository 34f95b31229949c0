"""`charllm-tui export megatron|toml EXPERIMENT_OR_PRESET [--set key=value ...] [--out FILE] [--no-validate]`;
megatron also takes `--script` (a runnable launch script) and `--megatron-version V`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from charllm.engine.model.experiment import Experiment
from charllm.engine.model.megatron import export_environment, export_megatron_args, export_script, format_megatron_args
from charllm.engine.model.validate import check
from charllm.probes.core import paths
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, plural


def register(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help,
                       description="EXPERIMENT_OR_PRESET is an experiment TOML file or a preset name. "
                                   "Invalid experiments are refused unless --no-validate.")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    for name, help_text in (("megatron", "pretrain_gpt.py flags, one per line with backslash continuations"),
                            ("toml", "the experiment with model and hardware resolved (what a run directory keeps)")):
        f = formats.add_parser(name, help=help_text)
        f.add_argument("experiment", metavar="EXPERIMENT_OR_PRESET")
        f.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, e.g. --set tensor_model_parallel_size=4 (repeatable; charllm-tui fields "
                            "lists them)")
        f.add_argument("--out", metavar="FILE", help="write to FILE (atomically) instead of stdout")
        f.add_argument("--no-validate", action="store_true", help="export even if the layout is invalid")
        if name == "megatron":
            f.add_argument("--script", action="store_true",
                           help="write a bash launch script: the environment Megatron needs, then torchrun "
                                "pretrain_gpt.py with the flags (run it from a Megatron-LM checkout, or set "
                                "MEGATRON_LM; across nodes set NODE_RANK and MASTER_ADDR on each)")
            f.add_argument("--megatron-version", metavar="V",
                           help="the megatron-core release the flags are for, where releases differ "
                                "(default: the installed one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    exp = Experiment.load(args.experiment).apply(args.sets)
    if not args.no_validate:
        check(exp)
    if args.format == "toml":
        text = exp.to_toml()
    elif args.script:
        text = export_script(exp, args.megatron_version)
    else:
        text = format_megatron_args(export_megatron_args(exp, args.megatron_version)) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        _write_atomically(paths.output_file(args.out, "--out"), text,
                          executable=args.format == "megatron" and args.script)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.format == "megatron" and not args.script:   # the world size and environment are the launcher's

        env = "".join(f"{name}={value} " for name, value in export_environment(exp).items())
        print(f"# world size {exp.world_size} = {plural(exp.cluster.nodes, 'node')} x {exp.cluster.gpus_per_node}: "
              f"{env}torchrun --nnodes {exp.cluster.nodes} --nproc-per-node {exp.cluster.gpus_per_node} "
              "pretrain_gpt.py <flags>", file=sys.stderr)
    return 0


def _write_atomically(path: Path, text: str, *, executable: bool = False) -> None:
    try:
        write_atomic(path, text, mode=0o755 if executable else None)
    except OSError as exc:
        raise UserError(f"--out {str(path)!r}: cannot write ({exc.strerror})") from None
