"""`charllm-tui runs [list | show RUN | logs RUN [-f] | cancel RUN | delete RUN]`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from charllm.engine.launch import targets
from charllm.engine.launch.launcher import cancel, reconcile
from charllm.probes.analysis.cache import kept_places, kept_row
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.files import open_regular
from charllm.probes.core.formatting import duration, local_time, size
from charllm.probes.store.rundir import Manifest, command_line, list_runs, resolve_run, runtime_line

# summary column -> (Runs table heading, format): a run's headline figures, over its steady window
# (non-warm-up iterations), as `summarize` and `compare` give them, so one run shows one tokens/s everywhere.
HEADLINE = {
    "iterations": ("iters", "{:.0f}"),
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "power_mean_w": ("mean W", "{:.0f}"),
    "power_peak_w": ("peak W", "{:.0f}"),
    "energy_per_token_j": ("J/token", "{:.3g}"),
    "temp_gpu_peak_c": ("peak °C", "{:.0f}"),
    "throttle_perf_frac": ("throttled", "{:.0%}"),
}
WINDOW = "steady"
WINDOW_TEXT = "figures over each run's steady window (non-warm-up iterations), as summarize and compare give them"
# The ones `runs list` shows (a terminal's width has room for three).
LIST_FIGURES = {column: HEADLINE[column][0] for column in ("tokens_per_s", "power_peak_w", "energy_per_token_j")}


def register(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help,
                       description="Runs live in the runs directory (CHARLLM_RUNS_DIR); RUN is an id, a unique "
                                   "prefix or suffix of one, or a path.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="every run, newest first, with its headline figures (steady window)")
    listing.add_argument("--json", action="store_true",
                         help="one object per run: its status, place, times and every headline figure, raw")
    show = actions.add_parser("show", help="a run's manifest: target, status, commands, failure")
    show.add_argument("run", metavar="RUN")
    logs = actions.add_parser("logs", help="a run's logs (launcher, samplers, torchrun per node)")
    logs.add_argument("run", metavar="RUN")
    logs.add_argument("-f", "--follow", action="store_true", help="follow iterations and telemetry until it ends")
    cancel = actions.add_parser("cancel", help="stop every process of the run on every node")
    cancel.add_argument("run", metavar="RUN")
    delete = actions.add_parser("delete", help="delete a finished run's directory")
    delete.add_argument("run", metavar="RUN")
    p.set_defaults(func=run, action=None, json=False)


def run(args: argparse.Namespace) -> int:
    action = args.action or "list"
    if action == "list":
        return _list(args.json)
    if not args.run.strip():
        raise UserError("RUN = '': give a run id, a unique prefix or suffix of one, or a path")
    rd = resolve_run(args.run)
    try:
        reconcile(rd)  # a run whose supervisor died is finished here, so what follows tells the truth
    except UserError:
        if action != "delete":  # a damaged manifest: deleting is the way to get rid of the run
            raise
    return {"show": _show, "logs": _logs, "cancel": _cancel, "delete": _delete}[action](rd, args)


SIMULATED = "SIMULATED"
OTHER_WINDOW = "*"     # marks figures over another window than WINDOW (a run without steady iterations)


def _list(as_json: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = [_listed(rd) for rd in reversed(list_runs())]     # newest first, as the Runs screen lists them
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no runs yet (start one with `charllm-tui launch tiny-local --target local`)")
        return 0
    caption = WINDOW_TEXT
    others = sorted({r["window"] for r in rows if r.get("window") not in (None, WINDOW)})
    if others:
        from charllm.probes.analysis.windows import window_phrase  # deferred: loads polars (start-up time)

        caption += "".join(f"; {OTHER_WINDOW} over {window_phrase(w)} (no steady iterations)" for w in others)
    table = Table(box=None, header_style="bold", caption=caption, caption_justify="left")
    table.add_column("run", no_wrap=True, overflow="fold")
    for column in ("status", *LIST_FIGURES.values(), "target", "nodes", "started", "duration"):
        figure = column in LIST_FIGURES.values()
        table.add_column(column, justify="right" if figure else "left", no_wrap=figure or column == "started")
    for row in rows:
        if "error" in row:     # a damaged run costs only its own row
            table.add_row(row["run"], "damaged", *["-"] * len(LIST_FIGURES), "-", "-", "-", "-")
            continue
        mark = OTHER_WINDOW if row["window"] not in (None, WINDOW) else ""
        figures = ["-" if row[c] is None else HEADLINE[c][1].format(row[c]) + mark for c in LIST_FIGURES]
        status = row["status_line"] + (f" [b]{SIMULATED}[/b]" if row["simulated"] else "")
        table.add_row(row["run"], status, *figures, row["target"], str(len(row["nodes"]) or "-"),
                      local_time(row["started_ns"], "%Y-%m-%d %H:%M"), _duration(row["duration_s"]))
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    for row in rows:
        if "error" in row:
            print(f"charllm-tui: warning: {row['error']}", file=sys.stderr)
    return 0


def _listed(rd) -> dict:
    """A run as `runs list` shows it, raw: status, place, times and its headline figures over the
    window they are over (WINDOW where the run has steady iterations); a damaged run, why."""
    try:
        reconcile(rd)
        m = rd.manifest()
    except UserError as exc:
        return {"run": rd.id, "path": str(rd.path), "status": "damaged", "error": str(exc)}
    figures = _figures(rd, m)
    return {"run": rd.id, "path": str(rd.path), "status": m.status, "status_line": m.status_line, "kind": m.kind,
            "target": m.target_name, "nodes": m.nodes, "started_ns": _started(m), "ended_ns": m.ended_ns,
            "duration_s": _seconds(m), "simulated": bool(figures.get("simulated")), "window": figures.get("window"),
            **{column: figures.get(column) for column in HEADLINE}}


def _figures(rd, m: Manifest) -> dict:
    """A finished run's kept summary over WINDOW, by run ({} where it has none): the row its key file
    holds (no polars to load), else the kept table, else the summary pass that keeps it."""
    if not m.final:
        return {}
    places = kept_places(rd, WINDOW, ("run",))
    row = kept_row(*places["run"]) if places else None
    if row is not None:
        return row
    from charllm.probes.analysis import summary  # deferred: loads polars (start-up time)

    try:    # the kept summary; once only, the summary pass that keeps it
        kept = summary.cached_summary(rd, window=WINDOW, by="run")
        return (kept if kept is not None else summary.summarize(rd, WINDOW, by="run")).row(0, named=True)
    except Exception:  # noqa: BLE001 - a run with no figures (or unreadable ones) still lists
        return {}


def _started(m: Manifest) -> int | None:
    """When the run started, or (a probe-only run, one still pending) when it was made."""
    return m.started_ns or m.created_ns or None


def _seconds(m: Manifest) -> float | None:
    if not m.started_ns:
        return None
    return ((m.ended_ns or time.time_ns()) - m.started_ns) / 1e9


def _duration(seconds: float | None) -> str:
    return "-" if seconds is None else duration(seconds)


def _show(rd, args) -> int:
    m = rd.manifest()
    print(f"run       {rd.id}")
    print(f"path      {rd.path}")
    print(f"status    {m.status_line}")
    if m.failure:
        print(f"failure   {m.failure}")
    for lost in m.telemetry_lost:
        print(f"telemetry {lost.get('reason', 'lost')}")
    if m.note:
        print(f"note      {m.note}")
    print(f"target    {targets.describe(m.target) if m.target else m.target_name}")
    print(f"nodes     {', '.join(m.nodes) or '-'}")
    print(f"started   {local_time(_started(m))}   duration {_duration(_seconds(m))}")
    if said := command_line(m):
        print(f"ran:      {said}")
        for note in m.command.get("notes") or []:
            if note != said:      # (an attach's first note names what it attached to, said just above)
                print(f"          {note}")
    elif m.kind in ("train", ""):   # a launched run (one without a kind predates probe-only runs)
        print(f"ran as    {runtime_line(rd.runtime())}")
    for reason in m.forced:
        print(f"forced    {reason}")
    print("commands")
    for command in m.commands:
        print(f"  {command}")
    steps = rd.read_iterations()
    print(f"iterations {plural(steps.filter(steps['event'] == 'iteration')['iteration'].n_unique(), 'step')} logged")
    profile = rd.read_manifest().get("profile")
    if isinstance(profile, dict):   # what the profiler window was to record, and (once ended) did
        print(f"profiler  {profile.get('cost', '')}")
        if isinstance(profile.get("traces"), int):
            slower = f", the profiled steps {profile['slowdown']:.2f}x the others' time" \
                if isinstance(profile.get("slowdown"), (int, float)) else ""
            print(f"          {plural(profile['traces'], 'trace')} written, {size(profile.get('bytes') or 0)}{slower} "
                  f"(summarize {rd.id} --kernels)")
    print(f"telemetry {plural(len(rd.telemetry_files()), 'chunk')}")
    return 0


def _logs(rd, args) -> int:
    if args.follow:
        from charllm.tui.commands.launch import follow  # deferred: the launch command's imports (start-up time)

        return follow(rd.path)
    files = sorted(rd.logs_dir.glob("*.log")) if rd.logs_dir.is_dir() else []
    if not files:
        print(f"run {rd.id}: no logs yet")
    for path in files:
        print(f"==> {path.name} <==")
        try:
            with open_regular(path, "log") as fh:
                text = fh.read().decode(errors="replace")
        except UserError as exc:   # a pipe or a device in its place: it costs only itself
            text = f"({exc})\n"
        print(text, end="" if text else "\n")
    return 0


def _cancel(rd, args) -> int:
    m = rd.manifest()
    # Nothing to stop, said before anything else; a run orphaned by its supervisor's death may have
    # left processes, which cancel stops.
    if m.final and not m.orphaned_ns:
        raise UserError(f"run {rd.id!r} is already {m.status}: nothing to cancel")
    print(f"run {rd.id}: cancelling...", flush=True)
    status = cancel(rd)
    print(f"run {rd.id}: {status}")
    return 0 if status == "cancelled" else 1


def _delete(rd, args) -> int:
    rd.delete()
    print(f"run {rd.id}: deleted")
    return 0
