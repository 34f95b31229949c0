"""`charllm-tui plan`: per-stage peak memory, step time and power of an experiment or of a Megatron-LM
command line."""

from __future__ import annotations

import argparse
import json
import sys

from charllm.engine.model import catalog, power, profiling, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.megatron import (
    DEFAULT_GPUS_PER_NODE,
    import_megatron_args,
    launcher_world_size,
    nodes_of,
    split_command_line,
)
from charllm.engine.model.memory import DOES_NOT_FIT, FITS, PEAK_MARGIN, TIGHT, VERDICT_STYLE, estimate
from charllm.engine.model.sweep import base_experiment
from charllm.engine.model.validate import check
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import count, gib, si
from charllm.tui.commands import add_command

EPILOG = f"""\
what the numbers mean:
  total      the PyTorch caching-allocator peak (torch.cuda.max_memory_allocated) over a training
             iteration on the stage's most loaded rank = weights + gradients + optimizer state +
             activations + other (logits and loss on the last stage, embedding input on the first,
             workspaces, pipeline buffers, backward temporaries)
  reserve    what the caching allocator holds beyond its allocated peak (cached blocks it cannot
             reuse): a share of what each iteration allocates and frees (activations, logits,
             backward buffers), 3% with expandable segments (the workload's default), 15% without;
             `charllm-tui doctor --train` measures it on a node
  headroom   usable memory - memory outside the allocator (CUDA context, NCCL; with the flex MoE
             dispatcher also DeepEP's buffers) - total - reserve.
             Usable and outside-allocator memory come from the hardware preset, or from a node
             calibrated with `charllm-tui doctor --train` (said as "calibrated on NODE, DATE")
  verdict    fits: total + reserve fit, with more to spare than the plan's error ({PEAK_MARGIN:.1%} of the
             total: the 90th percentile over the measured runs of tests/data/memory_dev); tight:
             within that error of the limit either side, or the total fits but not the reserve (it
             may run out of memory); does not fit: over by more than the error. The lines under the
             table give the arithmetic
  runs as    the transformer implementation, attention kernel and fusions the plan assumes: what
             transformer_impl / attention_backend become on the calibrated node's software, or on
             an assumed one (NVIDIA: Transformer Engine); "will not launch" lines say what that
             node cannot run
  step       the estimated time of one training iteration (engine/model/speed.py): each layer's
             GEMMs, attention and element-wise work per micro-batch, the TP/CP/EP collectives and
             pipeline sends Megatron waits on, the pipeline schedule (1F1B or interleaved), the
             data-parallel gradient sync, the optimizer step and fixed per-step costs; then
             tokens/s, MFU (Megatron's FLOPs over the dense peak of the matmul precision) and the
             share of the step in compute, exposed communication, pipeline bubble (fill, drain,
             slower stages), host-bound (the GPUs waiting on the host to launch their work, at
             any PP) and the rest.
             Large-GEMM efficiency, link and memory bandwidths come from the hardware preset
             ("assumed") or, for the GEMMs, from `charllm-tui doctor --train` ("calibrated on NODE")
  power      the average power per device over a step, from the hardware's idle power, its board
             limit and how busy each part of the step keeps it, without the limiter ("no limiter"; the
             sweep's power column); energy per token and samples/(s·MJ) follow. "calibrated from N
             recorded runs" where runs of that hardware have been summarized
  limit      the step laid out in time (the busiest stage, 1 ms bins), each phase's power from its kind
             and precision, through the board's power limiter (engine/model/power.py): the share of the
             step it holds the SM clock down, NVML's mean, p99 and peak power readings (this mean is
             the one to expect on the board), the mean SM clock, and the step and energy per token with
             the throttled GEMMs; "power limit:" says what its constants were calibrated on
  temperature  the GPU's temperature as a first-order lag of that power (ambient, K/W, time constant
             per vendor): its mean once the steps repeat, and its peak over train_iters steps from an
             idle board; "temperature:" says where its constants come from (assumed until calibrated)

exit status: 0 every stage fits, 1 some stage does not fit, 3 tight, 2 bad input (one line on stderr)

examples:
  charllm-tui plan ppt-h100-llama3-70b-1-00000 --set micro_batch_size=2 --json
  charllm-tui plan --model llama3-70b --hardware h200 --nodes 8 --gpus-per-node 8 --global-batch-size 128 \\
      --set tensor_model_parallel_size=8 --set pipeline_model_parallel_size=4 --set micro_batch_size=1
  charllm-tui plan --megatron-args "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \\
      --num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu --seq-length 8192 \\
      --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 \\
      --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --bf16" \\
      --world-size 64 --hardware h100-sxm-80gb
  charllm-tui plan --megatron-args "$(cat train.sh)" --hardware h100-sxm-80gb   # torchrun line, env, flags
"""


def register(sub, name: str, help: str) -> None:
    p = add_command(sub, name, help,
                    "Estimate the peak GPU memory of every pipeline stage and whether it fits, "
                    "and the step time, throughput and power of the layout: of an experiment, of a "
                    "model on a cluster (--model), or of a Megatron-LM command line (--megatron-args).",
                    EPILOG)
    p.add_argument("experiment", nargs="?", metavar="EXPERIMENT_OR_PRESET",
                   help="an experiment TOML file or preset name")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set tensor_model_parallel_size=4, or the model or hardware "
                        "preset, e.g. --set model=llama3-8b (repeatable; charllm-tui fields lists the fields)")
    add_model_arguments(p, "plan")
    p.add_argument("--megatron-args", metavar="FLAGS", help="a pretrain_gpt.py command line instead of an experiment")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="number of GPUs, in nodes of --gpus-per-node (default 8), with --model instead of --nodes, "
                        "or with --megatron-args (default: what a torchrun prefix in the line says)")
    p.add_argument("--megatron-version", metavar="V",
                   help="the megatron-core release the line is for, for defaults that changed between releases "
                        "(with --megatron-args; default: the installed one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------------------------
# A model on a cluster instead of an experiment: plan and sweep take it the same way
# --------------------------------------------------------------------------------------------
MODEL_FLAGS = ("model", "hardware", "nodes", "gpus_per_node", "global_batch_size")
SIZE_FLAGS = ("nodes", "gpus_per_node", "global_batch_size", "seq_length", "world_size")


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_model_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """--model, --hardware, --nodes, --gpus-per-node, --global-batch-size and --seq-length."""
    p.add_argument("--model", metavar="NAME",
                   help=f"model preset: {command} it on --hardware, --nodes x --gpus-per-node, with "
                        "--global-batch-size (instead of an experiment)")
    p.add_argument("--hardware", metavar="NAME",
                   help=f"hardware preset, or its short name ({', '.join(sorted(catalog.ALIASES['hardware']))}); "
                        "`charllm-tui presets list hardware` lists them")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes (with --model)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per node (with --model or --megatron-args)")
    p.add_argument("--global-batch-size", type=int, metavar="B", help="sequences per step (with --model)")
    p.add_argument("--seq-length", type=int, metavar="S", help="sequence length (with --model; default: the model's)")


def check_sizes(args: argparse.Namespace) -> None:
    for name in SIZE_FLAGS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"{flag(name)} = {value!r}: must be a positive integer")


def model_experiment(args: argparse.Namespace, command: str, training: dict | None = None,
                     nodes: int | None = None, gpus_per_node: int | None = None) -> Experiment:
    """The experiment of --model on its cluster (`nodes` and `gpus_per_node` where the command worked
    them out otherwise); `training`: the options every layout of a sweep keeps."""
    nodes, gpus_per_node = nodes or args.nodes, gpus_per_node or args.gpus_per_node
    given = {"nodes": nodes, "gpus_per_node": gpus_per_node}
    missing = [flag(f) for f in MODEL_FLAGS if given.get(f, getattr(args, f)) is None]
    if missing:
        raise UserError(f"{command} --model: give {' '.join(missing)} too")
    return base_experiment(args.model, args.hardware, nodes, gpus_per_node, args.global_batch_size,
                           args.seq_length, training, name=command)


def load(args: argparse.Namespace):
    """(experiment, ignored Megatron flags, warnings) from any form of the command line."""
    check_sizes(args)
    forms = [name for name, given in (("EXPERIMENT_OR_PRESET", args.experiment), ("--model", args.model),
                                      ("--megatron-args", args.megatron_args is not None)) if given]
    if len(forms) > 1:
        raise UserError(f"plan: give one of EXPERIMENT_OR_PRESET, --model or --megatron-args, "
                        f"not {' and '.join(forms)}")
    if args.megatron_args is not None:
        return from_megatron_args(args)
    if args.megatron_version is not None:
        raise UserError("plan: --megatron-version goes with --megatron-args (an experiment is planned for the "
                        "installed megatron-core)")
    if args.model:
        nodes = gpus = None
        if args.world_size is not None:
            if args.nodes is not None:
                raise UserError(f"plan --model: give --nodes or --world-size, not both (--world-size {args.world_size} "
                                f"is nodes of --gpus-per-node, default {DEFAULT_GPUS_PER_NODE})")
            nodes, gpus = nodes_of(args.world_size, args.gpus_per_node)
        return model_experiment(args, "plan", nodes=nodes, gpus_per_node=gpus).apply(args.sets), [], []
    if not args.experiment:
        raise UserError("plan: say what to plan: an EXPERIMENT_OR_PRESET, --model NAME (with --hardware, --nodes and "
                        "--gpus-per-node or --world-size, --global-batch-size), or --megatron-args FLAGS")
    exp = load_experiment(args.experiment, "plan")
    for name in (*MODEL_FLAGS[1:], "seq_length", "world_size"):
        value = getattr(args, name)
        if value is not None:
            goes_with = ("--model or --megatron-args" if name in ("hardware", "gpus_per_node", "world_size")
                         else "--model")
            raise UserError(f"plan {args.experiment}: {flag(name)} goes with {goes_with}; for an experiment, "
                            f"{instead_of(name, value, exp)}")
    return exp.apply(args.sets), [], []


def instead_of(name: str, value, exp: Experiment) -> str:
    """The --set that says for an experiment what flag `name` says for --model."""
    if name == "world_size":
        gpn = exp.cluster.gpus_per_node
        if value % gpn:
            return (f"--world-size {value} is not a whole number of its nodes of {gpn}: --set nodes=N "
                    "--set gpus_per_node=G")
        return f"--set nodes={value // gpn} (nodes of {gpn} devices; --set gpus_per_node=G for others)"
    return f"--set {name}={value}"


def load_experiment(ref: str, command: str) -> Experiment:
    """The experiment `ref` names; a model preset's name says how to plan the model instead."""
    try:
        return Experiment.load(ref)
    except UserError:
        if catalog.resolve("models", ref) not in catalog.entries("models"):
            raise
    raise UserError(f"{command} {ref!r}: a model preset, not an experiment; {command} it on a cluster with "
                    f"--model {ref} --hardware NAME --nodes N --gpus-per-node G --global-batch-size B")


def from_megatron_args(args: argparse.Namespace):
    if not split_command_line(args.megatron_args):     # "" or only comments: an empty $(cat FILE)?
        raise UserError(f"--megatron-args = {args.megatron_args!r}: no arguments in it; give Megatron-LM's "
                        "flags, a launch script's text or a model_config.yaml's")
    for name in ("nodes", "global_batch_size", "seq_length"):
        if getattr(args, name) is not None:
            raise UserError(f"plan --megatron-args: {flag(name)} goes with --model (the line gives the "
                            f"{'world size with --world-size' if name == 'nodes' else 'batch and sequence'})")
    if args.hardware is None:
        raise UserError("plan --megatron-args: --hardware is required")
    if args.world_size is None and launcher_world_size(args.megatron_args) is None:
        raise UserError("plan --megatron-args: --world-size is required unless the line starts with "
                        "torchrun --nnodes N --nproc-per-node G")
    imported = import_megatron_args(args.megatron_args, world_size=args.world_size,
                                    gpus_per_node=args.gpus_per_node, hardware=args.hardware,
                                    version=args.megatron_version)
    notes = [f"no memory effect: {line}" for line in imported.no_effect]
    return imported.experiment.apply(args.sets), imported.ignored, imported.warnings + notes


def run(args: argparse.Namespace) -> int:
    exp, ignored, warnings = load(args)
    check(exp)
    report = estimate(exp, ignored_args=ignored, warnings=warnings, megatron_version=args.megatron_version)
    window = profiling.plan(exp)   # what a profiler window records and costs
    fast = speed.estimate(exp)
    limited = power.predict(exp) if fast else None
    if args.json:
        print(json.dumps({**report.to_dict(), "speed": fast.to_dict() if fast else {"unknown": speed.unknown(exp)},
                          "power_limit": limited.to_dict() if limited else None,
                          **({"profile": {**window.to_dict(), "cost": window.describe()}} if window else {})},
                         indent=2))
    else:
        render(exp, report, fast, limited)
        if window:
            print(window.describe())
    return EXIT[report.verdict]


EXIT = {FITS: 0, DOES_NOT_FIT: 1, TIGHT: 3}


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def percent(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0%}"


def watts(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0f}"


def speed_basis(exp: Experiment) -> str:
    return speed.describe(exp)


def speed_lines(fast) -> list[str]:
    """The layout's speed, parameters and power, a line each (under 100 characters)."""
    sh = fast.shares
    mfu = f"MFU {fast.mfu:.1%} ({fast.precision})" if fast.mfu is not None else f"MFU n/a (no {fast.precision} peak)"
    stages = fast.params_per_stage
    per_stage = count(stages[0]) + " each" if len(set(stages)) == 1 else " / ".join(count(n) for n in stages)
    lines = [f"step {fast.step_s:.3g} s · {fast.tokens_per_s:,.0f} tokens/s · {fast.samples_per_s:,.3g} samples/s · "
             f"{mfu}",
             f"of the step: compute {sh['compute']:.0%} · exposed communication {sh['communication']:.0%} · "
             f"pipeline bubble {sh['bubble']:.0%} · host-bound {sh['host']:.0%} · optimizer and fixed "
             f"{sh['other']:.0%}",
             f"parameters {count(fast.params_total)} · per stage {per_stage} · at most "
             f"{count(max(fast.params_per_device))} on one device",
             f"{si(fast.flops_per_iteration, 'FLOP')} per iteration, Megatron's count (causal); "
             f"{si(fast.flops_full_attention, 'FLOP')} counting attention's whole square"]
    if fast.ramp:
        (first, _, first_s), (last, _, last_s) = fast.ramp[0], fast.ramp[-1]
        lines.append(f"batch ramp-up first: {sum(n for _, n, _ in fast.ramp):,} steps, batch {first} ({first_s:.3g} "
                     f"s/step) to {last} ({last_s:.3g} s/step), {sum(n * s for _, n, s in fast.ramp):,.0f} s")
    if fast.power_w is not None:
        lines.append(f"power {fast.power_w:.0f} W per device (no limiter) · {fast.energy_per_token_j:.3g} J/token · "
                     f"{fast.samples_per_s_mj:,.3g} samples/(s·MJ)")
    return lines


def limit_lines(limited: power.PowerReport, steps: int) -> list[str]:
    """The power the board's limit lets through over a step, NVML's readings of it, the GPU temperature over
    `steps` steps, and where they come from."""
    lines = [f"at the {limited.limit_w:.0f} W limit {limited.limit_share:.0%} of the step · power mean "
             f"{limited.mean_w:.0f} W, p99 {limited.p99_w:.0f} W, peak {limited.peak_w:.0f} W (NVML, "
             f"{power.SAMPLE_HZ:.0f} Hz) · SM clock {limited.sm_clock_mhz:.0f} MHz",
             f"with the limit: step {limited.step_s:.3g} s ({limited.slowdown - 1:+.1%}) · "
             f"{limited.energy_per_token_j:.3g} J/token",
             f"[dim]power limit: {limited.source}[/]"]
    if limited.temp_steady_c is not None and limited.temp_peak_c is not None:
        lines += [f"GPU temperature {limited.temp_steady_c:.0f} °C once the steps repeat, peak "
                  f"{limited.temp_peak_c:.0f} °C over {plural(steps, 'step', 'steps')}",
                  f"[dim]temperature: {limited.temp_source}[/]"]
    return lines


def render(exp: Experiment, report, fast, limited: power.PowerReport | None = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)   # pipes and files get the whole table
    p = exp.parallel
    layout = (exp.layout_label + (" SP" if p.sequence_parallel else "")
              + (" dist-opt" if p.use_distributed_optimizer else ""))
    batches = plural(exp.num_microbatches, "micro-batch", "micro-batches")
    table = Table(box=box.SIMPLE_HEAD,
                  caption="layers: per virtual chunk (NxV: N layers in each of V chunks); mb: micro-batch chunks "
                          "held at the peak",
                  caption_justify="left",
                  title=f"{exp.name}: {exp.model.name} on {exp.world_size} x {exp.hardware.name} ({layout}), "
                        f"micro batch {exp.training.micro_batch_size}, {batches}, GiB",
                  title_justify="left")
    columns = ("PP", "layers", "mb", "weights", "grads", "optim", "acts", "other", "total", "reserve", "headroom",
               "verdict")
    for column in columns:
        table.add_column(column, justify="left" if column in ("layers", "verdict") else "right", no_wrap=True)
    for s in report.stages:
        sizes = [len(c.layers) for c in s.chunks]
        layers = f"{sizes[0]}x{len(sizes)}" if len(sizes) > 1 and len(set(sizes)) == 1 else "+".join(map(str, sizes))
        held = (s.weights, s.gradients, s.optimizer, s.activations, s.other, s.total_bytes, s.reserve_bytes,
                 s.headroom_bytes)
        table.add_row(str(s.pp_rank), layers, str(s.in_flight), *(gib(n, unit=False) for n in held),
                      f"[{VERDICT_STYLE[s.verdict]}]{s.verdict}[/]")
    console.print(table)
    if fast is None:
        console.print(f"[yellow]{speed.unknown(exp)}[/]", highlight=False)
    else:
        for line in speed_lines(fast):
            console.print(line, highlight=False)
        console.print(f"[dim]{speed_basis(exp)}[/]", highlight=False)
        for line in limit_lines(limited, exp.training.train_iters) if limited else []:
            console.print(line, highlight=False)
        for note in fast.notes:
            console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(f"runs as: {report.implementation.describe()} ({report.stack_source})", highlight=False)
    *arithmetic, conclusion = report.explain()
    for line in arithmetic:
        console.print(line, highlight=False)
    console.print(f"[b {VERDICT_STYLE[report.verdict]}]{conclusion}[/]", highlight=False)
    if report.verdict == DOES_NOT_FIT and exp.description:   # a preset says why it is listed at all
        console.print(f"{exp.name}: {exp.description}", highlight=False)
    for problem in report.runtime_problems:
        console.print(f"[red]will not launch:[/] {problem}", highlight=False)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if report.ignored_args:
        console.print(f"ignored Megatron flags (not modelled): {' '.join(report.ignored_args)}", highlight=False)
    sys.stdout.flush()
