"""The probe command, shared by `charllm-tui probe` and `python -m charllm.probes` (compute nodes
need no TUI). Heavy imports stay inside `run` so `--help` is fast."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from charllm.probes.backends import BACKEND_NAMES, inventory, not_supported, open_backends
from charllm.probes.backends.base import DEFAULT_HZ, MAX_HZ, check_hz, hostname
from charllm.probes.core import paths, procid
from charllm.probes.core.errors import UserError, disk_full_on, plural
from charllm.probes.core.formatting import GIB
from charllm.probes.store.rundir import FINAL_STATUSES, Reserve, RunDir, check_node_name, node_chunks

MAX_DURATION_S = 366 * 24 * 3600
RESERVE_BYTES = 64 * 1024   # what a probe-only run holds on its disk to record its final status
CANCEL_POLL_S = 0.5         # how often a probe-only run looks for a cancel request

# %(prog)s: `charllm-tui probe` or `python -m charllm.probes`, whichever shows the help.
USAGE_EXAMPLES = """\
examples:
  %(prog)s --list
      devices, backend and metrics (and why no GPU)
  %(prog)s --out RUN_DIR --hz 20
      record until Ctrl-C / SIGTERM
  %(prog)s --backend sim --sim-gpus 8 --follow
      simulated GPUs, live table
  %(prog)s --backend replay:RUN --speed 10 --follow
      a recorded run again, 10 times as fast
  %(prog)s --out RUN_DIR --node n1 --stream > n1.arrows
      Arrow batches on stdout too (what an SSH launch reads)"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.epilog = USAGE_EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--list", action="store_true", help="list devices, backend and supported metrics, then exit")
    parser.add_argument("--backend", default="auto", metavar="NAME",
                        help=f"{' | '.join(BACKEND_NAMES)} (default: auto)")
    parser.add_argument("--hz", type=float, default=DEFAULT_HZ,
                        help=f"samples per second, at most {MAX_HZ:g} (default: {DEFAULT_HZ:g})")
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (default: until signalled)")
    parser.add_argument("--out", metavar="RUN_DIR",
                        help="a new (or empty) run directory; 1-s chunks go to RUN_DIR/telemetry/<node>/NNNNNN.arrow "
                             "and are compacted into NNNNNN-MMMMMM.parquet every minute")
    parser.add_argument("--node", help="node name in the data (default: this host's name)")
    parser.add_argument("--stream", action="store_true", help="also write Arrow batches to stdout (for SSH)")
    parser.add_argument("--follow", action="store_true", help="show a live table on the terminal")
    sim = parser.add_argument_group("sim and replay backends")
    sim.add_argument("--sim-gpus", type=int, default=8, metavar="N", help="simulated GPUs (default: 8)")
    sim.add_argument("--sim-profile", default="steady", metavar="PROFILE",
                     help="steady | bursty | iterations:RUN (a run's iteration timeline) (default: steady)")
    sim.add_argument("--sim-hardware", default="h100-sxm-80gb", metavar="NAME", help="hardware preset to simulate")
    sim.add_argument("--seed", type=int, default=0, help="simulation seed (default: 0)")
    sim.add_argument("--speed", type=float, default=1.0, help="replay speed-up (default: 1)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Execute the probe command; raises UserError for bad input."""
    from charllm.probes.sampler import Sampler  # deferred: loads polars (start-up time)

    check_hz(args.hz)
    if args.node is not None:
        check_node_name(args.node)
    if args.out is not None:
        paths.output_dir(args.out, "--out")
    if args.duration is not None and not 0 < args.duration <= MAX_DURATION_S:
        raise UserError(f"duration = {args.duration:g}: must be > 0 seconds and at most a year "
                        f"({MAX_DURATION_S:g} s; leave it out to record until stopped)")
    backends, reason = open_backends(args.backend, gpus=args.sim_gpus, profile=args.sim_profile,
                                     seed=args.seed, hardware=args.sim_hardware, speed=args.speed)
    err = _console(sys.stderr)
    try:
        if args.list:
            _print_list(_console(sys.stdout), backends, reason)
            return 0
        run_dir, own_manifest = _prepare_run_dir(args.out, args, reason) if args.out is not None else (None, False)
        owned = run_dir if own_manifest else None     # the run whose manifest (status) this probe writes
        # A probe-only run owns its status: room to record how it ends is held from the start.
        reserve = Reserve(owned.path, RESERVE_BYTES) if owned is not None else None
        if owned is not None and reserve is not None and not reserve.held:
            why = f"{disk_full_on(owned.path)}: no room to record the run; nothing was recorded"
            owned.update_manifest(status="failed", failure=why, disk_full=disk_full_on(owned.path))
            raise UserError(f"--out {args.out!r}: {why}")
        follow = args.follow or (run_dir is None and not args.stream)
        view = _LiveTable(err if args.stream else _console(sys.stdout), reason) if follow else None
        sampler = Sampler(backends, hz=args.hz, node=args.node, run_dir=run_dir.path if run_dir else None,
                          on_sample=view.update if view else None,
                          stream=sys.stdout.buffer if args.stream else None)
        # SIGUSR1 too: it is how a Slurm job stops its sampler step, since srun turns a SIGTERM
        # into a SIGKILL of its tasks but forwards SIGUSR1 as it is (engine.launch.slurm).
        previous = {sig: signal.signal(sig, lambda *_: sampler.stop())
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        devices = sum(len(b.devices()) for b in backends)
        target = f" -> {sampler.writer.dir}" if sampler.writer else ""
        slower = "".join(f"; {s}" for s in sampler.slower_backends())
        if owned is not None:
            owned.update_manifest(rates={b.name: sampler.backend_hz(b) for b in backends})
            asked = _stop_when_asked(owned, sampler)
        if not view:
            err.print(
                f"probe: {plural(devices, 'device')} at {args.hz:g} Hz{slower}{target} ({reason}); SIGTERM/Ctrl-C stops"
            )
            if lacking := not_supported(backends):    # said once: these columns stay null, never 0
                err.print(f"probe: not supported here, recorded as null: {lacking}")
        started = time.monotonic()
        try:
            if view:
                with view:
                    sampler.run(args.duration)
            else:
                sampler.run(args.duration)
        except BaseException as exc:
            from charllm.probes.store.recorder import DiskFull  # deferred: loads polars (start-up time)

            changes: dict[str, Any] = {"status": "failed"} if owned is not None else {}
            if isinstance(exc, DiskFull):
                changes["telemetry_stopped"] = {"node": sampler.node, "reason": str(exc)}
                if owned is not None:   # the status line says why (a launched run's supervisor says it for its run)
                    changes.update(failure=str(exc), disk_full=disk_full_on(owned.path))
            if reserve is not None:
                reserve.release()   # room for the status, on a full disk
            try:
                if changes and run_dir is not None:
                    run_dir.update_manifest(**changes)
            except OSError:
                pass  # the full disk may refuse even the manifest; the error line still says why
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        chunks = f", {plural(sampler.writer.chunks_written, 'chunk')}" if sampler.writer else ""
        err.print(f"probe: {plural(sampler.rows, 'row')} in {plural(sampler.ticks, 'tick')} at "
                  f"{sampler.achieved(time.monotonic() - started)}{slower}{chunks}")
        if owned is not None:
            if reserve is not None:
                reserve.release()
            owned.update_manifest(status="cancelled" if asked.is_set() else "completed", ended_ns=time.time_ns())
        return 0
    finally:
        for backend in backends:
            backend.close()


def _stop_when_asked(run: RunDir, sampler) -> threading.Event:
    """Stop the sampler once `runs cancel` asks (RunDir.cancel_request_path): a probe started by
    hand carries no run token, so nothing may signal it on a manifest's word. The event is set
    when it was asked."""
    asked = threading.Event()

    def watch() -> None:
        while not sampler.stopped:
            if run.cancel_request_path.exists():
                asked.set()
                sampler.stop()
                return
            time.sleep(CANCEL_POLL_S)

    threading.Thread(target=watch, name="cancel-request", daemon=True).start()
    return asked


def _prepare_run_dir(out: str, args: argparse.Namespace, reason: str):
    """(RunDir, whether we own its manifest). A new directory (or an empty one) becomes a probe-only
    run with a {"kind": "probe"} manifest; an existing one only if it is a launched run's, prepared
    for its samplers, that has not ended and that no sampler of this node records into yet.
    Anything else (a folder with files in it, another probe's run, an ended run, a link) is refused
    before anything is written: of several probes given the same --out, one records and the others
    say so."""
    path = Path(out).expanduser().absolute()
    if path.is_symlink():
        raise UserError(f"--out {out!r}: a symbolic link; give the run directory itself")
    try:
        run = RunDir.create(path, "probe")
    except FileExistsError:
        run = RunDir(path)
        if run.made_by == "launch":   # a launched run's sampler (the launcher wrote its manifest)
            # (a node's copy over ssh holds no manifest: its status is the launcher's to say)
            status = run.manifest().status if run.manifest_path.is_file() else None
            if status in FINAL_STATUSES:
                raise UserError(f"--out {out!r}: the directory of a launched run that has ended ({status}); "
                                "a probe records into a new directory") from None
            node = args.node or hostname()
            if node_chunks(run.node_telemetry_dir(node)):
                raise UserError(f"--out {out!r}: node {node!r} already records telemetry into this launched run; "
                                "a probe records into a new directory (or give another --node)") from None
            return run, False
        if run.made_by is not None:
            raise UserError(f"--out {out!r}: already the run directory of a {run.made_by}; give a new directory")
        if any(path.iterdir()) or not run.claim("probe"):
            raise UserError(f"--out {out!r}: exists and is not empty; a probe records into a new directory "
                            "(or an empty one)")
    except OSError as exc:
        raise UserError(f"--out {out!r}: cannot create the run directory ({exc.strerror})") from None
    # Who owns the run, and where: if it dies, the next reader on that host finishes the run.
    run.write_manifest({"id": run.id, "kind": "probe", "status": "running", "backend": args.backend,
                        "backend_reason": reason, "hz": args.hz, "created_ns": time.time_ns(),
                        "sampler": procid.identify(os.getpid())})
    return run, True


def _console(file):
    from rich.console import Console

    return Console(file=file, highlight=False)


def _print_list(console, backends, reason: str) -> None:
    from rich.table import Table

    console.print(f"backend: {', '.join(b.name for b in backends)} — {reason}")
    table = Table("device", "backend", "name", "uuid", "metrics", "not supported", show_lines=False)
    for dev in inventory(backends):
        label = f"{dev['backend']} (SIMULATED)" if dev["simulated"] else dev["backend"]
        table.add_row(dev["device"], label, dev["name"], dev["uuid"], " ".join(dev["metrics"]),
                      " ".join(dev["not_supported"]) or "-")
    console.print(table)


class _LiveTable:
    """A compact rich table of the latest row per device, redrawn at most 4 times a second."""

    COLUMNS = (("power_w", "W", "{:.0f}"), ("temp_gpu_c", "°C", "{:.0f}"), ("sm_clock_mhz", "MHz", "{:.0f}"),
               ("util_gpu_pct", "util%", "{:.0f}"), ("mem_used_bytes", "GiB", "{:.1f}"),
               ("throttle_reasons", "throttle", "{}"), ("cpu_util_pct", "cpu%", "{:.0f}"),
               ("iteration", "iter", "{}"))

    def __init__(self, console, reason: str) -> None:
        from rich.live import Live

        self.reason = reason
        self.latest: dict[tuple, dict] = {}
        self.live = Live(self._render(), console=console, auto_refresh=False, transient=False)
        self._last_draw = 0.0

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.live.update(self._render(), refresh=True)
        self.live.__exit__(*exc)
        if not self.live.console.is_terminal:    # rich leaves a piped table's last line open
            self.live.console.line()

    def update(self, rows: list[dict]) -> None:
        for row in rows:
            self.latest[(row["node"], row["device"])] = row
        now = time.monotonic()
        if now - self._last_draw >= 0.25:
            self._last_draw = now
            self.live.update(self._render(), refresh=True)

    def _render(self):
        from rich.table import Table

        from charllm.probes.store.schema import THROTTLE_BITS  # deferred: loads polars (start-up time)

        simulated = any(row.get("simulated") for row in self.latest.values())
        title = f"[bold yellow]SIMULATED DATA[/] — {self.reason}" if simulated else self.reason
        table = Table(title=title, title_justify="left", pad_edge=False)
        table.add_column("device")
        table.add_column("backend")
        for _col, header, _fmt in self.COLUMNS:
            table.add_column(header, justify="right")
        several_nodes = len({node for node, _ in self.latest}) > 1
        for (node, device), row in sorted(self.latest.items()):
            cells = []
            for col, _header, fmt in self.COLUMNS:
                value = row.get(col)
                if value is None:
                    cells.append("–")
                elif col == "mem_used_bytes":
                    cells.append(fmt.format(value / GIB))
                elif col == "throttle_reasons":
                    cells.append(
                        ",".join(n for n, bit in THROTTLE_BITS.items() if value & bit and n != "gpu_idle") or "-"
                    )
                else:
                    cells.append(fmt.format(value))
            backend = f"[bold yellow]{row['backend']}*[/]" if row.get("simulated") else row["backend"]
            table.add_row(f"{node}/{device}" if several_nodes else device, backend, *cells)
        return table
