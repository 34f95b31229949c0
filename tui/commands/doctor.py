"""`charllm-tui doctor`: check a node (or every node of a target) and save its calibration.

The checks are `charllm.engine.doctor`'s; this module is the command line and the one renderer of
a report (`render`), which the TUI's Doctor screen shows too.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from charllm.engine import doctor
from charllm.engine.launch.targets import KINDS, get_target
from charllm.engine.model import calibration, catalog
from charllm.probes.core.errors import UserError, did_you_mean, plural
from charllm.probes.core.formatting import size
from charllm.tui.commands import add_command

EPILOG = """\
what the figures mean:
  hardware       the hardware preset this node is, from its GPU's name and memory (--hardware to say
                 it yourself); a node without a GPU is "cpu" and trains on its CPU
  runs as        what transformer_impl = "auto" becomes on this node's software: Transformer Engine
                 where it imports on a CUDA GPU, else megatron-core's local layers with SDPA attention
  C compiler     the one torch.compile (Triton's launchers) builds with: $CC, else gcc, else clang,
                 checked by building a tiny extension; without one the compiled fusions are off
  telemetry      the backend `auto` picks (NVML, AMD SMI, else the host alone) and the metrics each
                 device reports (`probe --list` shows the same)
  sampling       the real sampler run for a few seconds at 20 and at 100 Hz. target: the rate a device
                 is asked at (the host only every n-th tick, at most 20 Hz); achieved: rows per device
                 per second; median/p99/max: time between one device's rows; missed: ticks skipped
                 because a tick ran past the next deadline
  train (--train)  a short real training job (torchrun, the workload) sized to the device:
    peak         torch.cuda.max_memory_allocated on the last pipeline stage, against the plan's
                 total for that stage (`charllm-tui plan`), as an error in percent
    reserved     torch.cuda.max_memory_reserved: reserved/allocated and the difference are the real
                 fragmentation of the caching allocator
    outside      memory the process holds outside the allocator (CUDA context, NCCL buffers):
                 NVML's figure for the process minus torch's reserved; not measured on a CPU
    TFLOP/s      model FLOPs (Megatron-LM's count) per second per device, median of the steady
                 iterations; MFU: that over the hardware preset's dense peak in the precision the
                 job's matrix multiplies ran in (bf16 here; not applicable where the preset has none)
  calibration    saved under <data>/calibrations/<hardware>.json: plan, sweep and Compose then use this
                 node's software and memory for that hardware and say "calibrated on NODE, DATE".
                 Without --train only the stack and torch's device capacity are saved; a memory
                 measurement an earlier --train made on the same stack is kept

targets: --target NAME runs doctor on the target's nodes and saves the calibrations here; a node
that fails is one line, the others still report. Which nodes, by the target's kind:
{kinds}

exit status: 0 every check passed, 1 a check or a node failed, 2 bad input (one line on stderr)

examples:
  charllm-tui doctor                       this node: versions, devices, telemetry, sampling
  charllm-tui doctor --train               and a short training job; saves the calibration
  charllm-tui doctor --json --no-save      the report as JSON, nothing saved
  charllm-tui doctor --target local        the same, through the targets machinery
  charllm-tui doctor --show                the saved calibrations
""".format(kinds="\n".join(f"  {kind:<14} {cls.nodes_help}" for kind, cls in KINDS.items()))


def register(sub, name: str, help: str) -> None:
    p = add_command(sub, name, help,
                    "Check a node: versions, devices, telemetry and the sampling rate it achieves; "
                    "with --train a short training job measures memory and speed. Saves a node "
                    "calibration that plan, sweep and Compose use for that hardware.",
                    EPILOG)
    p.add_argument("--train", action="store_true", help="also run a short training job sized to the device")
    p.add_argument("--hardware", metavar="NAME",
                   help="the hardware preset this node is (default: matched from its GPU)")
    p.add_argument("--target", metavar="NAME", help="run on every node of this target (default: this node)")
    p.add_argument("--target-file", metavar="PATH", help="targets TOML file (default: <config>/targets.toml)")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="how many nodes, for a target whose scheduler allocates them "
                        f"({', '.join(k for k, cls in KINDS.items() if cls.allocates_nodes)}; default: 1)")
    p.add_argument("--node", metavar="NAME",
                   help="this node's name in the report (default: $SLURMD_NODENAME or the host name)")
    p.add_argument("--no-save", action="store_true", help="only report; save no calibration")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (with --show: the saved calibrations and power models)")
    p.add_argument("--show", nargs="?", const="", metavar="HARDWARE",
                   help="show the saved calibration(s) (of HARDWARE) and exit")
    p.add_argument("--drop-power", metavar="HARDWARE",
                   help="forget HARDWARE's power model fitted to recorded runs (plans use the preset's idle power "
                        "and board limit until a finished run refits it) and exit")
    p.add_argument("--iters", type=int, default=10, metavar="N", help="train check iterations (default: 10)")
    p.add_argument("--sample-seconds", type=float, default=2.0, metavar="S",
                   help="seconds of sampling at each rate (default: 2)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="stop the train check after S seconds (default: 900)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.show is not None:
        return show(args.show, args.json)
    if args.drop_power is not None:
        hardware = catalog.resolve("hardware", args.drop_power)    # a short name (h100) is its preset's
        if not calibration.drop_power(hardware):
            raise UserError(f"--drop-power {args.drop_power}: no power model is fitted for {hardware}")
        print(f"power model of {hardware} dropped: plans use its preset's idle power and board limit again")
        return 0

    def interrupted(signum, frame):
        raise KeyboardInterrupt   # unwinds through the train check, which stops its job

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        return check(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def check(args: argparse.Namespace) -> int:
    options = dict(train=args.train, hardware=args.hardware, sample_seconds=args.sample_seconds,
                   iters=args.iters, timeout=args.timeout, progress=_progress)
    if args.target is not None and not args.target.strip():
        raise UserError("--target '': give a target name (see <config>/targets.toml), or leave it out")
    if args.target or args.nodes is not None:
        target = get_target(args.target or "local", Path(args.target_file) if args.target_file else None)
        if args.node:
            raise UserError("--node names this node; with --target the target names its nodes")
        results = doctor.on_target(target, nodes=args.nodes, **options)
    else:
        target = None
        results = [doctor.NodeResult.of(doctor.gather(node=args.node, **options))]

    saved = {} if args.no_save else save(results)
    for result in results:
        if result.report is not None:
            result.report["saved_calibration"] = str(saved[result.node]) if result.node in saved else None
    if args.json:
        if target is None:
            print(json.dumps(results[0].report, indent=2))
        else:
            print(json.dumps({"target": target.name, "nodes": [r.to_dict() for r in results]}, indent=2))
    else:
        print_results(results, saved, args.no_save)
    return 1 if any(r.error for r in results) else 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def save(results) -> dict:
    """Save one calibration per hardware, from the first node without errors that has it."""
    saved, by_hardware = {}, {}
    for result in results:
        report = result.report
        if report is None or result.error or report.get("hardware") in by_hardware:
            continue
        by_hardware[report["hardware"]] = result.node
        saved[result.node] = doctor.save_calibration(report)
    return saved


def print_results(results, saved: dict, no_save: bool) -> None:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120, highlight=False)
    first_of: dict = {}
    for result in results:
        if result.report is None:
            console.print(f"[red]✗ node {_escape(result.node)}:[/] {_escape(result.error)}", soft_wrap=True)
            continue
        console.print(render(result.report))
        hardware = result.report.get("hardware")
        if result.node in saved:
            first_of[hardware] = result.node
            console.print(f"[green]calibration saved:[/] {saved[result.node]} — plan, sweep and Compose now use it "
                          f"for hardware {hardware} (\"calibrated on {result.node}, {result.report['date']}\")")
        elif result.error:
            console.print("no calibration saved (a check failed)")
        elif no_save:
            console.print("no calibration saved (--no-save)")
        elif hardware in first_of:
            console.print(f"no calibration saved: {first_of[hardware]} already calibrated {hardware}")
        console.print()
    failed = [r for r in results if r.error]
    if len(results) > 1:
        console.print(f"{len(results) - len(failed)} of {plural(len(results), 'node')} passed"
                      + (f"; failed: {', '.join(r.node for r in failed)}" if failed else ""))


def show(hardware: str, as_json: bool) -> int:
    from rich.console import Console

    records = doctor.saved_calibrations()
    power = calibration.saved_power()
    if hardware:
        hardware = catalog.resolve("hardware", hardware)    # a short name (h100) is its preset's
        names = [r["hardware"] for r in records] + [f["hardware"] for f in power]
        if hardware not in names:
            saved = f"; saved: {', '.join(names)}" if names else "; none is saved (run `charllm-tui doctor`)"
            raise UserError(f"--show {hardware!r}: no calibration for this hardware"
                            + did_you_mean(hardware, names, saved, cutoff=0.5))
        records = [r for r in records if r["hardware"] == hardware]
        power = [f for f in power if f["hardware"] == hardware]
    if as_json:   # the node calibrations, and the power models fitted to recorded runs (doctor --drop-power)
        print(json.dumps({"calibrations": records, "power_models": power}, indent=2))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 120, highlight=False)
    if not records and not power:
        console.print("no calibration saved yet: `charllm-tui doctor` (or --train) saves one for this node's hardware")
    for record in records:
        console.print(render(record))
        console.print()
    for fit in power:
        console.print(power_lines(fit), soft_wrap=True)
    return 0


def power_lines(fit: dict) -> str:
    """A saved power calibration (probes.analysis.power_fit), as the lines --show prints: its figures,
    and the runs it came from and those it left out."""
    came = ", ".join(str(p.get("run")) for p in fit.get("points") or [])
    lines = [f"power model of {_escape(fit['hardware'])}: idle {fit['idle_w']:g} W, full load {fit['max_w']:g} W "
             f"({_escape(fit.get('how', ''))}), fitted from {plural(fit['runs'], 'recorded run')}: {_escape(came)}"]
    lines += [f"  left out: {_escape(p.get('run'))} ({_escape(p.get('power_w'))} W, {_escape(p.get('why'))})"
              for p in fit.get("left_out") or []]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# One report, as rich renderables (the CLI prints them, the TUI's Doctor screen shows them)
# --------------------------------------------------------------------------------------------
def _escape(text) -> str:
    from rich.markup import escape

    return escape(str(text))


def _size(n) -> str:
    if n is None:
        return "–"
    return size(n)


def _num(value, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def render(report: dict):
    """A report (or a saved calibration record, which holds the same) as a rich Group."""
    from rich import box
    from rich.console import Group, RenderableType
    from rich.table import Table

    e = _escape
    parts: list[RenderableType] = []
    hardware = report.get("hardware") or "unknown"
    if "memory" in report:   # a saved calibration
        parts.append(f"[b]calibration for {e(hardware)}[/b]: node {e(report.get('node', '?'))}, "
                     f"{e(report.get('date', '?'))} (UTC) — {e(report.get('hardware_reason', ''))}")
    else:
        parts.append(f"[b]node {e(report.get('node', '?'))}[/b] · {e(report.get('date', '?'))} (UTC) · "
                     f"hardware [b]{e(hardware)}[/b] — {e(report.get('hardware_reason', ''))}")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="dim", no_wrap=True)
    facts.add_column()
    versions = report.get("versions")
    if versions:
        names = (("python", "python"), ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"),
                 ("megatron_core", "megatron-core"), ("transformer_engine", "Transformer Engine"))
        facts.add_row("versions", " · ".join(f"{label} {e(versions.get(key) or '–')}" for key, label in names))
        facts.add_row("driver", e(report.get("driver") or "–"))
        devices = report.get("devices") or []
        if devices:
            by_name: dict = {}
            for d in devices:
                by_name.setdefault((d["name"], d["total_bytes"], d.get("capability")), []).append(d["index"])
            facts.add_row("devices", "; ".join(f"{len(ix)} x {e(name)}, {_size(total)}, compute {e(cap)}"
                                               for (name, total, cap), ix in by_name.items()))
        else:
            facts.add_row("devices", "[b]no GPU[/b]: torch sees no CUDA device; this node trains on its CPU "
                                     "(gloo, one process per device)")
        extensions = (report.get("stack") or {}).get("extensions") or []
        facts.add_row("extensions", e(", ".join(extensions) or "none (no Transformer Engine, Apex, ...)"))
        stack = report.get("stack") or {}
        if "compiler" in stack:   # reports from before the check have none
            facts.add_row("C compiler", e(stack["compiler"]) + " [dim](torch.compile builds with it)[/]"
                          if stack["compiler"] else "[b]none works[/b]: torch.compile is off, and with it the "
                                                    "bias-activation and bias-dropout fusions")
    if report.get("implementation"):
        facts.add_row("runs as", f"{e(report['implementation']['describe'])} [dim](what transformer_impl = "
                                 "\"auto\" becomes here)[/]")
    telemetry = report.get("telemetry")
    if telemetry:
        facts.add_row("telemetry", f"{e(telemetry['backend'])} — {e(telemetry['reason'])}")
        for dev in telemetry["devices"]:
            facts.add_row("", f"[b]{e(dev['device'])}[/b] ({e(dev['backend'])}"
                              f"{', SIMULATED' if dev.get('simulated') else ''}) {e(dev['name'])}: "
                              f"{e(' '.join(dev['metrics']))}")
    memory = report.get("memory")
    if memory and not memory.get("usable_bytes"):
        facts.add_row("memory", "no device memory on a CPU: planning keeps the hardware preset's figures")
    elif memory:
        outside = memory.get("outside_allocator_bytes")
        facts.add_row("memory", f"usable {_size(memory['usable_bytes'])} per device (torch's capacity); "
                                + (f"outside the allocator {_size(outside)} (measured on a {memory.get('devices')}-"
                                   "device job)" if outside is not None else
                                   "outside the allocator not measured (`doctor --train`): the preset's figure stays"))
    parts.append(facts)

    sampling = report.get("sampling") or []
    if sampling:
        table = Table(box=box.SIMPLE_HEAD, title="sampling (the real sampler; rows per device per second)",
                      title_justify="left", pad_edge=False)
        for column in ("asked", "device", "target", "achieved", "median ms", "p99 ms", "max ms", "ticks/s", "missed"):
            table.add_column(column, justify="left" if column == "device" else "right", no_wrap=True)
        for run in sampling:
            for i, dev in enumerate(run["devices"]):
                interval = dev.get("interval_ms") or {}
                table.add_row(f"{run['hz']:g} Hz" if i == 0 else "", e(dev["device"]), f"{dev['target_hz']:g} Hz",
                              f"{dev['achieved_hz']:.1f} Hz", _num(interval.get("median")), _num(interval.get("p99")),
                              _num(interval.get("max")), f"{run['ticks'] / run['seconds']:.0f}" if i == 0 else "",
                              str(run["missed_deadlines"]) if i == 0 else "")
        parts.append(table)

    train = report.get("train")
    if train and not train.get("error"):   # a failed one is among the errors
        parts.append(_render_train(train, report))
    for error in report.get("errors") or []:
        parts.append(f"[red]✗ {e(error)}[/]")
    return Group(*parts)


def _render_train(train: dict, report: dict):
    from rich.console import Group
    from rich.table import Table

    e = _escape
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column()
    where = "" if (train.get("node"), train.get("date")) == (report.get("node"), report.get("date")) else \
        f" [dim](measured on {e(train.get('node'))}, {e(train.get('date'))})[/]"
    ranks = (plural(train["world_size"], "GPU") if train["device"] == "cuda"
             else plural(train["world_size"], "CPU process", "CPU processes"))
    grid.add_row("job", f"{e(train['experiment'])}; {plural(train['iterations'], 'iteration')} on {ranks}")
    grid.add_row("ran as", e(train["implementation"]["describe"]))
    planned = train["planned_bytes"]
    if train["device"] == "cuda":
        grid.add_row("allocator peak", f"{_size(train['allocated_bytes'])}, plan {_size(planned)} "
                                       f"([b]{train['plan_error_pct']:+.1f}%[/b])")
        if train.get("reserved_bytes") is not None:
            grid.add_row("reserved", f"{_size(train['reserved_bytes'])} = {train['reserved_over_allocated']:.2f} x "
                                     f"allocated ({_size(train['fragmentation_bytes'])} cached, not in tensors: "
                                     "fragmentation)" + (f"; {train['reserve_fraction']:.1%} of the iteration's "
                                     "churn, what plans on this hardware assume" if train.get("reserve_fraction")
                                     is not None else ""))
        outside = train.get("outside_allocator_bytes")
        grid.add_row("outside allocator", "not measured (NVML could not attribute memory to the process)"
                     if outside is None else f"{_size(outside)} (NVML process memory - torch reserved)")
    else:
        grid.add_row("memory", f"peak RSS {_size(train.get('rss_bytes'))} per process (a CPU has no caching "
                               f"allocator; the plan's {_size(planned)} counts tensors only); outside the "
                               "allocator: not measured on a CPU")
    peak, precision = train.get("peak_tflops"), train.get("peak_precision", "bf16")
    mfu = (f" · MFU [b]{train['mfu_pct']:.1f}%[/b] of {peak:g} TFLOP/s ({e(report.get('hardware'))} {precision} peak"
           f"{', nominal' if train['device'] == 'cpu' else ''})") if train.get("mfu_pct") is not None else \
        f" · MFU not applicable ({e(report.get('hardware'))} gives no {precision} peak)"
    grid.add_row("speed", f"[b]{train['tflops_per_gpu']:.3g}[/b] TFLOP/s per device (median of "
                          f"{train['steady_iterations']} steady iterations, {train['iteration_ms_median']:.0f} ms each)"
                          + mfu)
    model = train.get("speed")
    if model:
        found = model.get("matmul_efficiency")
        grid.add_row(
            "step-time model",
            f"assumed {model['assumed_step_s'] * 1e3:.0f} ms a step for this job; "
            + (
                f"the measured one takes GEMMs at [b]{found:.1%}[/b] of the peak, what plans on this hardware "
                "now assume"
                if found is not None
                else "no GEMM efficiency gives the measured step (fixed costs set it), so plans keep the assumed one"
            ),
        )
    return Group(f"[b]train check[/b]{where}", grid)
