"""`charllm-tui presets list [models|hardware|experiments] [--json]` and `presets show NAME [--kind K] [--json]`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment, Hardware, ModelSpec, _drop_none
from charllm.engine.model.validate import validate, value_problems
from charllm.probes.core.errors import UserError, did_you_mean_preset, plural
from charllm.probes.core.formatting import GIB

KINDS = ("models", "hardware", "experiments")
SINGULAR = {"models": "model", "hardware": "hardware", "experiments": "experiment"}
KIND_ALIASES = {"model": "models", "experiment": "experiments"}


def register(sub, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help,
                       description="Presets ship with charllm-tui (presets/) or live in your config dir "
                                   "(<config>/{models,hardware,experiments}/*.toml); a user preset with a "
                                   "shipped preset's name takes its place.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="every preset of one kind or of all kinds")
    listing.add_argument("kind", nargs="?", choices=[*KINDS, *KIND_ALIASES], help="models, hardware or experiments")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show = actions.add_parser("show", help="one preset, fully resolved")
    show.add_argument("name", metavar="NAME")
    show.add_argument(
        "--kind", choices=[*KINDS, *KIND_ALIASES], help="which kind NAME is (default: the only kind that has it)"
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    p.set_defaults(func=run, action=None, kind=None, json=False)


def run(args: argparse.Namespace) -> int:
    kind = KIND_ALIASES.get(args.kind, args.kind)
    if args.action == "show":
        return _show(args.name, kind, args.json)
    return _list(kind, args.json)


# --------------------------------------------------------------------------------------------
def _entries(kinds) -> list[dict]:
    """One row per preset: kind, name, source, file, description and a one-line summary (or the error
    that makes the file unreadable: a broken user preset must not hide the others)."""
    rows = []
    for kind in kinds:
        for name, path in catalog.entries(kind).items():
            row = {"kind": kind, "name": name, "source": "user" if catalog.is_user(kind, name) else "shipped",
                   "path": str(path)}
            try:
                obj = _load(kind, name)
                row["description"] = obj.description
                row["summary"] = _summary(kind, obj)
            except UserError as exc:
                row["description"] = ""
                row["summary"] = f"invalid: {exc}"
            rows.append(row)
    return rows


def _load(kind: str, name: str) -> ModelSpec | Hardware | Experiment:
    loaders: dict[str, Callable[[str], ModelSpec | Hardware | Experiment]] = {
        "models": ModelSpec.load, "hardware": Hardware.load, "experiments": Experiment.load}
    return loaders[kind](name)


def _summary(kind: str, obj) -> str:
    if kind == "models":
        m = obj
        parts = [f"{m.num_layers} layers", f"hidden {m.hidden_size}", f"{m.num_attention_heads} heads"]
        if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
            parts.append(f"{m.num_query_groups} groups")
        if m.multi_latent_attention:
            parts.append("MLA")
        if m.is_moe:
            parts.append(f"{m.num_moe_experts} experts top-{m.moe_router_topk}")
        return ", ".join(parts)
    if kind == "hardware":
        h = obj
        gib = h.usable_bytes / GIB
        fp8 = f", FP8 {h.fp8_tflops:g}" if h.fp8 and h.fp8_tflops else ""
        return f"{gib:.1f} GiB usable, BF16 {h.bf16_tflops:g} TFLOP/s{fp8}, {h.tdp_w:g} W"

    e = obj
    if value_problems(e):
        return f"invalid: {value_problems(e)[0]}"
    return (f"{e.model.name} on {e.world_size} x {e.hardware.name} ({e.cluster.nodes}x{e.cluster.gpus_per_node}), "
            f"{e.layout_label}")


def _list(kind: str | None, as_json: bool) -> int:
    rows = _entries([kind] if kind else KINDS)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Narrower than DESCRIBED_WIDTH (COLUMNS, or the terminal's) the descriptions (a few lines each)
    # are left out, so that a list stays about two lines a preset.
    console = Console()
    described = console.width >= DESCRIBED_WIDTH
    for k in [kind] if kind else KINDS:
        listed = [r for r in rows if r["kind"] == k]
        table = Table(title=k, title_justify="left", box=None, header_style="bold")
        # A name is what one types next: it never wraps; summary and description give way.
        table.add_column("name", no_wrap=True, min_width=max((len(r["name"]) for r in listed), default=4))
        table.add_column("source", no_wrap=True)
        for column in ("summary", "description") if described else ("summary",):
            table.add_column(column, overflow="fold")
        for row in listed:
            source = "[cyan]user[/]" if row["source"] == "user" else "shipped"
            summary = f"[red]{escape(row['summary'])}[/]" if row["summary"].startswith("invalid:") \
                else escape(row["summary"])
            table.add_row(row["name"], source, summary, *([escape(row["description"])] if described else []))
        console.print(table)
    if not described:
        console.print(f"[dim]descriptions: presets show NAME, --json, or {DESCRIBED_WIDTH}+ columns[/]",
                      highlight=False)
    return 0


DESCRIBED_WIDTH = 120


# --------------------------------------------------------------------------------------------
def _find_kind(name: str) -> str:
    kinds = [k for k in KINDS if catalog.resolve(k, name) in catalog.entries(k)]
    if len(kinds) == 1:
        return kinds[0]
    if kinds:
        raise UserError(f"preset {name!r} is a {' and a '.join(SINGULAR[k] for k in kinds)} preset; "
                        f"pass --kind {'|'.join(kinds)}")
    every = [n for k in KINDS for n in (*catalog.entries(k), *catalog.ALIASES.get(k, {}))]
    hint = did_you_mean_preset(name, every, "; see `charllm-tui presets list`")
    raise UserError(f"preset {name!r}: no such model, hardware or experiment preset{hint}")


def _show(name: str, kind: str | None, as_json: bool) -> int:
    import tomli_w

    kind = kind or _find_kind(name)
    name = catalog.resolve(kind, name)          # an alias shows its preset
    path = catalog.find(kind, name)
    obj = _load(kind, name)
    source = "user" if catalog.is_user(kind, name) else "shipped"
    data = obj.to_dict() if isinstance(obj, Experiment) else _drop_none(dataclasses.asdict(obj))
    extra: dict[str, Any] = {}
    if isinstance(obj, Experiment):
        derived = None if value_problems(obj) else {  # derived sizes divide by the layout's sizes
            "world_size": obj.world_size, "data_parallel_size": obj.data_parallel_size,
            "expert_data_parallel_size": obj.expert_data_parallel_size,
            "num_microbatches": obj.num_microbatches, "seq_length": obj.seq_length}
        extra = {"derived": derived, "problems": [str(p) for p in validate(obj)]}
    if as_json:
        print(json.dumps({"kind": kind, "name": name, "source": source, "path": str(path),
                          "data": data, **extra}, indent=2))
        return 0
    print(f"# {SINGULAR[kind]} preset {name!r} ({source}: {path})")
    if extra.get("derived"):
        d = extra["derived"]
        print(
            f"# world size {d['world_size']}, data parallel {d['data_parallel_size']}, "
            f"{plural(d['num_microbatches'], 'micro-batch', 'micro-batches')} per iteration, sequence {d['seq_length']}"
        )
    for problem in extra.get("problems", []):
        print(f"# invalid: {problem}")
    print(tomli_w.dumps(data), end="")
    return 0
