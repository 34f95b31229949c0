"""`charllm-tui campaign list|show|keys|plan|run|status|cancel|summary|report|compare|delete`: many experiments as
one planned, queued, resumable job (engine.campaign), and its figures."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time

from charllm.engine.campaign import queue, spec, state
from charllm.engine.launch.targets import get_target
from charllm.engine.model.memory import VERDICT_STYLE
from charllm.probes.analysis import COMPARE_FORMATS, SUMMARY_FORMATS
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, one_line as one_error_line, plural
from charllm.probes.core.formatting import local_time
from charllm.probes.store.rundir import FINAL_STATUSES
from charllm.tui.commands import add_command

EXAMPLES = """\
examples:
  %(prog)s plan ppt-microbatch
      every member of the shipped micro-batch sweep, planned: fits, tight, does not fit, or the rule it breaks
  %(prog)s run tiny-local
      run the tiny CPU campaign here (6 short runs, 2 at once), showing progress
  %(prog)s status tiny-local
      members by status, and the time left at the current pace
  %(prog)s summary tiny-local
      one row per member: speed, energy, power and its bursts, temperature, clocks, throttling
  %(prog)s report tiny-local --figure microbatch
      a figure of the paper's kind, drawn in the terminal
  %(prog)s report tiny-local --findings
      what the runs show, in sentences with their numbers and the members they rest on
  %(prog)s compare ppt-optimization ppt-h100
      scale-up (4 x 8 H200) against scale-out (8 x 8 H100): each model's best layout in each, predicted and
      measured"""


RECORDED = "the campaign's name, or the campaign file it was run from"


def register(sub, name: str, help: str) -> None:
    p = add_command(sub, name, help,
                    description="A campaign is a TOML file (<config>/campaigns/NAME.toml, or shipped): base "
                                "experiments (or your own command, its {placeholders} filled by the axes), axes "
                                "that vary any field, layouts, and a target with its limits. `campaign keys` says "
                                "what a file may hold.",
                    epilog=EXAMPLES)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="every campaign, shipped and yours, and how far each has run")
    listing.add_argument("--json", action="store_true",
                         help="one object per campaign: members, status, members by status, description")
    actions.add_parser("keys", help="the keys a campaign file takes")
    show = actions.add_parser("show", help="a campaign's file and its members' count")
    show.add_argument("name", metavar="NAME")
    plan = actions.add_parser("plan", help="every member, planned: its layout, varied values and verdict")
    plan.add_argument("name", metavar="NAME")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    run = actions.add_parser("run", help="run every member that fits, a few at a time; the queue outlives the terminal")
    run.add_argument("name", metavar="NAME")
    run.add_argument("--target", help="the target members run on (default: the campaign's, else local)")
    run.add_argument("--target-file", metavar="FILE", help="read targets from FILE instead of targets.toml")
    run.add_argument(
        "--max-parallel", type=int, metavar="N", help="at most N members at once (default: the campaign's)"
    )
    run.add_argument("--include-oom", action="store_true", help="run members that do not fit too")
    run.add_argument("--resume", action="store_true", help="run only the members without a completed run")
    run.add_argument("--detach", action="store_true",
                     help="return once the supervisor holds the queue (on a scheduler: every member submitted)")
    status = actions.add_parser("status", help="members by status, each member's run, and the time left")
    status.add_argument("name", metavar="NAME", help=RECORDED)
    status.add_argument("--json", action="store_true", help="print the campaign's record as JSON")
    cancel = actions.add_parser("cancel", help="stop every member and the queue")
    cancel.add_argument("name", metavar="NAME", help=RECORDED)
    summary = actions.add_parser("summary", help="one row per member, from each run's kept summary")
    summary.add_argument("name", metavar="NAME", help=RECORDED)
    summary.add_argument(
        "--format", choices=SUMMARY_FORMATS, default=None, help="default: table, or from --out's suffix"
    )
    summary.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    report = actions.add_parser("report", help="the paper's figures from the campaign's runs")
    report.add_argument("name", metavar="NAME", help=RECORDED)
    what = report.add_mutually_exclusive_group(required=True)
    what.add_argument("--figure", metavar="KIND", help="parallelism | optimization | microbatch | heatmap | kernels")
    what.add_argument("--findings", action="store_true",
                      help="what the runs show, in sentences with their numbers: micro batch, overlap, recomputation "
                           "and layout, each between members alike but for that one thing, and the plans against "
                           "the measurements")
    report.add_argument("--metric", metavar="M", help="the summary figure to plot (a column of `campaign summary`)")
    report.add_argument("--normalize", action="store_true", help="optimization: divide by each model's best")
    report.add_argument("--out", metavar="FILE", help="write an SVG or PNG image instead (needs the plot extra)")
    report.add_argument("--predicted", action="store_true",
                        help="draw it from the plans (the speed model), before any run: parallelism, optimization, "
                             "microbatch")
    report.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: one entry per member, its keys and the figure's values (default: text)")
    compare = actions.add_parser(
        "compare", help="two campaigns side by side: each model's best fitting layout in each, predicted and measured",
        description="For every model both campaigns train, each campaign's best member by --metric, with its GPUs, "
                    "tokens/s, tokens/s per GPU, energy per token and power: predicted rows from the plans (before "
                    "any run), measured rows from the members' completed runs (once a campaign has run).")
    compare.add_argument("first", metavar="A", help="a campaign's name or file (its ratio is 1)")
    compare.add_argument("second", metavar="B", help="the campaign set beside it")
    compare.add_argument("--metric", metavar="M", default="tokens_per_s",
                         help="what makes a member the best: tokens_per_s (the default), tokens_per_s_per_gpu, "
                              "energy_per_token_j (the lowest) or efficiency_samples_per_s_mj")
    compare.add_argument("--variant", choices=spec.VARIANTS,
                         help="pick among members of this optimization variant only (default: any)")
    compare.add_argument("--format", choices=COMPARE_FORMATS, default="table", help="default: table")
    delete = actions.add_parser("delete", help="delete a campaign's record (its runs stay)")
    delete.add_argument("name", metavar="NAME", help=RECORDED)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    return {"list": _list, "keys": _keys, "show": _show, "plan": _plan, "run": _start, "status": _status,
            "cancel": _cancel, "summary": _summary, "report": _report, "compare": _compare,
            "delete": _delete}[args.action](args)


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)   # pipes: 160 unless said


# --------------------------------------------------------------------------------------------
def _list(args) -> int:
    from rich.table import Table
    from rich.text import Text

    files = spec.campaigns()
    try:
        recorded, unreadable = state.recorded(), None
    except UserError as exc:           # a damaged .campaigns costs only the records: the files are listed
        recorded, unreadable = [], exc
    rows = []
    for name in sorted(set(files) | set(recorded)):
        row: dict = {"campaign": name, "members": None, "status": "not run", "by_status": {},
                     "progress": "not run" if unreadable is None else "-"}
        try:
            campaign = spec.Campaign.load(name) if name in files else None
            row["members"] = len(campaign.members()) if campaign else None
            row["description"] = campaign.description if campaign else "(its file is gone)"
        except UserError as exc:
            row["description"] = f"invalid: {exc}"
        if name in recorded:
            try:
                record = queue.refresh(state.Record.load(name))
                row.update(status=record.data.get("status"), by_status=record.counts(),
                           progress=record.progress().split(": ", 1)[1])
            except UserError as exc:
                row.update(status="damaged", progress=f"damaged: {exc}")
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        if unreadable is not None:
            raise unreadable
        return 0
    table = Table(box=None, header_style="bold")
    for column in ("campaign", "members", "progress", "description"):
        table.add_column(column, overflow="fold")
    for row in rows:
        cells = (row["campaign"], "-" if row["members"] is None else str(row["members"]), row["progress"],
                 row["description"])
        table.add_row(*map(Text, cells))   # plain text, never markup (a '[/]' in a file is no markup error)
    _console().print(table)
    if unreadable is not None:
        raise unreadable
    return 0


def _keys(args) -> int:
    width = max(len(k) for k in spec.HELP)
    for key, text in spec.HELP.items():
        print(f"{key:<{width}}  {text}")
    print("\nAn axis or a layout key is any experiment field, as --set names it (charllm-tui fields).")
    return 0


def _show(args) -> int:
    campaign = spec.Campaign.load(args.name)
    members = campaign.members()
    print(f"# campaign {campaign.name!r} ({campaign.source}): {plural(len(members), 'member')}")
    with open(campaign.source) as fh:
        print(fh.read(), end="")
    for m in members:
        if m.command is not None:    # (a command campaign's members: what each runs, its values filled in)
            print(f"# member {m.index + 1} ({m.experiment.name}, {m.layout_label}) runs: {m.command.line}")
    return 0


def _plan(args) -> int:
    campaign = spec.Campaign.load(args.name)
    plans = campaign.plan()
    varying = campaign.varying
    if args.json:
        print(json.dumps([{"member": p.member.index + 1, "name": p.member.experiment.name, "base": p.member.base,
                           "layout": p.member.layout_label,
                           **({"command": p.member.command.line} if p.member.command else {}),
                           "varied": {k: v for k, v in p.member.varied.items() if k in varying},
                           "verdict": p.verdict, "reason": p.reason, "peak_bytes": p.peak_bytes,
                           "allocator_bytes": p.allocator_bytes} for p in plans], indent=2))
        return 0
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", title=f"{campaign.name}: {spec.describe(plans)}",
                  title_justify="left")
    commands = campaign.command is not None
    for column in ("#", "member", "layout", "varied", "verdict", "why", *(["runs"] if commands else [])):
        table.add_column(column, overflow="fold", no_wrap=column in ("#", "verdict"))
    for p in plans:
        varied = " ".join(f"{k}={one_line(v)}" for k, v in p.member.varied.items() if k in varying)
        table.add_row(*map(Text, (str(p.member.index + 1), p.member.experiment.name, p.member.layout_label,
                                  varied)), Text(p.verdict, PLAN_STYLE.get(p.verdict, "red")),
                      Text(p.reason), *([Text(p.member.command.line)] if p.member.command else []))
    _console().print(table)
    return 0


PLAN_STYLE = {**VERDICT_STYLE, spec.LAYOUT_UNKNOWN: "yellow"}   # (a command member not planned: run all the same)


def one_line(value) -> str:
    """A value as one line: a string as written unless it holds a line break or another control
    character (then escaped, as Python writes it), anything else as JSON."""
    if isinstance(value, str):
        return value if value.isprintable() else repr(value)[1:-1]
    return json.dumps(value)


def _start(args) -> int:
    campaign = spec.Campaign.load(args.name)
    target = get_target(args.target or campaign.target or "local", args.target_file)
    try:
        record = queue.start(campaign, target, max_parallel=args.max_parallel, include_oom=args.include_oom,
                             resume=args.resume)
    except queue.Refused as exc:                   # one line per reason
        print(f"charllm-tui: error: {one_error_line(exc.head)}", file=sys.stderr)
        for reason in exc.reasons:
            print(f"  {one_error_line(reason)}", file=sys.stderr)
        return 2
    print(f"{queued_line(record, target.name)}; its supervisor runs the queue "
          f"(log: {state.directory(campaign.name) / 'supervisor.log'})", flush=True)
    for m in record.members:
        if m["status"] in (state.SKIPPED, state.INVALID):
            print(f"  {m['name']}: {m['status']}: {m['reason']}")
    if args.detach:
        record = queue.wait_handed_over(campaign.name)
        print(f"campaign {campaign.name}: handed over ({record.progress()})" if record.data.get("handed_over_ns")
              else f"campaign {campaign.name}: its supervisor ended before taking the queue over "
                   f"({record.data.get('failure') or record.progress()})")
        return 0
    return _follow(campaign.name)


def queued_line(record: state.Record, target: str) -> str:
    """What a started campaign says (here and on the workbench's Campaign screen)."""
    return (
        f"campaign {record.name}: {record.counts().get(state.QUEUED, 0):,} of "
        f"{plural(len(record.members), 'member')} queued on {target}, at most {record.data['max_parallel']} at once"
    )


def _follow(name: str) -> int:
    """Show progress until the campaign ends; Ctrl-C leaves it running."""
    from rich.progress import BarColumn, Progress, TextColumn

    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      transient=False) as progress:
            task = progress.add_task(name, total=None)
            while True:
                record = queue.refresh(state.Record.load(name))
                done = sum(1 for m in record.members if m["status"] in state.DONE)
                progress.update(task, completed=done, total=len(record.members),
                                description=record.progress())
                if record.data.get("status") in FINAL_STATUSES:
                    break
                time.sleep(1.0)
    except KeyboardInterrupt:
        print(f"\ncampaign {name}: still running (charllm-tui campaign status {name}; cancel: campaign cancel {name})")
        return 0
    bad = [m for m in record.members if m["status"] in ("failed", "cancelled", "unknown", state.REFUSED, *state.LOST)]
    for m in record.members:
        ran = state.ran_line(m)
        if m in bad:
            print(f"  {m['name']}: {m['status']}: {m.get('failure') or '-'}" + (f"; {ran}" if ran else ""))
        elif ran:     # (a command campaign's member says what it ran)
            print(f"  {m['name']}: {m['status']}: {ran}")
    print(f"campaign {name}: {record.data['status']} ({record.tally()})")
    return 1 if bad or record.data["status"] != "completed" else 0


def _status(args) -> int:
    record = queue.refresh(state.Record.load(spec.record_name(args.name)))
    if args.json:
        print(json.dumps(record.data, indent=2))
        return 0
    from rich.table import Table
    from rich.text import Text

    print(record.progress())
    table = Table(box=None, header_style="bold")
    for column in ("#", "member", "layout", "status", "run", "started", "note"):
        table.add_column(column, overflow="fold")
    for m in record.members:
        status = state.member_status(record, m)
        note = state.member_note(m, status) or state.ran_line(m)
        cells = (m["index"] + 1, m["name"], m.get("layout") or "", status, m.get("run") or "-",
                 local_time(m.get("started_ns")), note or "")
        table.add_row(*(Text(str(cell)) for cell in cells))
    _console().print(table)
    return 0


def _cancel(args) -> int:
    name = spec.record_name(args.name)
    print(f"campaign {name}: cancelling...", flush=True)
    record = queue.cancel(name)
    print(record.progress())
    return 0


def _summary(args) -> int:
    from charllm.engine.campaign.summary import campaign_summary  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.render import render, write_summary  # deferred: loads polars (start-up time)

    out = paths.output_file(args.out, "--out") if args.out is not None else None
    df = campaign_summary(queue.refresh(state.Record.load(spec.record_name(args.name))))
    if out is not None:
        write_summary(df, out, args.format)
        print(f"wrote {args.out}")
        return 0
    fmt = args.format or "table"
    if fmt == "parquet":
        raise UserError("--format parquet is binary: give --out FILE")
    if fmt in ("table", "markdown"):
        _members_table(df, markdown=fmt == "markdown")
    else:
        print(render(df, fmt), end="")
    return 0


def _members_table(df, markdown: bool) -> None:
    """One row per member, figures with their units; a column the same for every member (or empty
    for all) is said once above the table instead."""
    from rich import box
    from rich.markup import escape
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    from charllm.probes.analysis.render import format_figure, metric_label  # deferred: loads polars (start-up time)

    same = [c for c in df.columns if df[c].n_unique() == 1 and c not in ("member", "name")]
    for c in same:
        value = df[c][0]
        if value is not None:
            print(f"{metric_label(c)}: {format_figure(c, value)}")
    columns = [c for c in df.columns if c not in same and c not in ("run", "verdict")]
    headings = ["#" if c == "member" else c if c in ("name", "status", "layout", "why") else metric_label(c)
                for c in columns]
    cells = [[format_figure(c, row[c]) if row[c] is not None else "-" for c in columns]
             for row in df.iter_rows(named=True)]
    # Names, layouts and figures are never cut: where the table is too wide for the terminal its
    # headings wrap at spaces, and where it still is, each member is said in a block of its own.
    console = _console()
    def width(i: int, folded: bool) -> int:
        """Column i's width: its longest cell (word, for `why`) and heading (word, when `folded`)."""
        words = [w for row in cells for w in (row[i].split() if columns[i] == "why" else [row[i]])]
        return max(map(len, [*words, *(headings[i].split() if folded else [headings[i]])]))

    for folded in (False, True):
        widths = [width(i, folded) for i in range(len(columns))]
        if markdown or sum(widths) + 2 * (len(widths) - 1) <= console.width:
            table = Table(box=box.MARKDOWN if markdown else None, header_style="bold", pad_edge=False)
            for c, heading, w in zip(columns, headings, widths):
                table.add_column("\n".join(textwrap.wrap(heading, w)), no_wrap=c != "why", min_width=w)
            for row in cells:
                table.add_row(*map(Text, row))   # plain text, never markup
            console.print(table)
            return
    for row in cells:
        named = {c: v for c, v in zip(columns, row)}
        console.print(f"[b]{named.get('member', '')}  {escape(named.get('name', ''))}[/b]", highlight=False)
        rest = [f"{h} {v}" for c, h, v in zip(columns, headings, row) if c not in ("member", "name")]
        console.print(Padding(escape(" · ".join(rest)), (0, 0, 0, 3)), highlight=False)


def _report(args) -> int:
    from charllm.engine.campaign.report import entries, figure, predicted_figure  # deferred: loads polars
    from charllm.tui import figures  # deferred: loads polars and plotext (start-up time)

    out = paths.output_file(args.out, "--out") if args.out is not None else None
    if args.findings:
        if args.predicted or out is not None or args.metric or args.normalize:
            raise UserError("--findings: reads the runs, one way (text, or --format json); --predicted, --out, "
                            "--metric and --normalize are for --figure")
        return _findings(spec.record_name(args.name), args.format)
    if args.predicted:
        fig, record = predicted_figure(spec.Campaign.load(args.name), args.figure, args.metric, args.normalize)
    else:
        record = queue.refresh(state.Record.load(spec.record_name(args.name)))
        fig = figure(record, args.figure, args.metric, args.normalize)
    if args.format == "json":
        if fig.kind == "heatmap":
            raise UserError("--format json: for the figures per member (parallelism, optimization, microbatch, "
                            "kernels); the heatmap is per GPU")
        print(json.dumps(entries(record, fig), indent=2))
        return 0
    if out is not None:
        figures.write_image(fig, out)
        print(f"wrote {args.out}")
        return 0

    columns = shutil.get_terminal_size((100, 30)).columns
    print(figures.terminal(fig, width=min(columns, 160)), end="")
    return 0


def _findings(name: str, fmt: str) -> int:
    from charllm.engine.campaign.findings import describe, findings  # deferred: loads polars (start-up time)

    record = queue.refresh(state.Record.load(name))
    found = findings(record)
    print(json.dumps([f.to_dict() for f in found], indent=2) if fmt == "json" else "\n".join(describe(record, found)))
    return 0


def _compare(args) -> int:
    from charllm.engine.campaign.compare import compare  # deferred: loads polars (start-up time)
    from charllm.probes.analysis.render import metric_label, render  # deferred: loads polars (start-up time)

    df = compare(args.first, args.second, args.metric, args.variant)
    if args.format in ("csv", "json"):
        print(render(df, args.format), end="")
        return 0
    def hardware(campaign: str) -> str:
        return ", ".join(sorted(set(df.filter(df["campaign"] == campaign)["hardware"].drop_nulls()))) or "?"

    first, second = df["campaign"][0], df["campaign"][1]
    among = f"{args.variant} member" if args.variant else "member"
    print(f"{first} ({hardware(first)}) against {second} ({hardware(second)}): each model's best {among} by "
          f"{metric_label(args.metric)}; predicted: from the plans, measured: from the completed runs; "
          f"ratio: its {metric_label(args.metric)} over {first}'s")
    # the table a terminal holds; the members' names, hardware and efficiency are in --format json and csv
    _members_table(df.drop("name", "hardware", "efficiency_samples_per_s_mj"), markdown=args.format == "markdown")
    return 0


def _delete(args) -> int:
    name = spec.record_name(args.name)
    lock = state.take_lock(name) if os.path.lexists(state.directory(name)) else None   # no supervisor runs it
    try:
        try:
            record: state.Record | None = queue.refresh(state.Record.load(name))
        except UserError:
            if not os.path.lexists(state.directory(name) / "campaign.json"):
                raise
            record = None                           # damaged: deleting it is how it goes
        if record is not None and record.data.get("status") not in FINAL_STATUSES:
            raise UserError(f"campaign {name!r} is {record.data.get('status')}; cancel it first "
                            f"(charllm-tui campaign cancel {name})")
        state.delete(name)
    finally:
        if lock is not None:
            os.close(lock)
    runs = plural(sum(1 for m in record.members if m.get("run")), "run") if record else "runs"
    print(f"campaign {name}: record deleted (its {runs} stay; charllm-tui runs delete removes a run)")
    return 0
