"""`charllm-tui fields [PATTERN] [--json]`: every field an experiment file or --set takes, from the
fields' own metadata (engine.model.experiment.setting)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from charllm.engine.model import experiment
from charllm.engine.model.experiment import SECTIONS
from charllm.probes.core.errors import UserError, did_you_mean
from charllm.probes.core.formatting import number
from charllm.tui.commands import add_command

EPILOG = """\
Defaults are charllm's own; a model or hardware preset gives its fields their own values.

examples:
  charllm-tui fields recompute
  charllm-tui fields parallel. --json
"""


def register(sub, name: str, help: str) -> None:
    p = add_command(sub, name, help,
                    "The fields of an experiment (what a TOML file and --set KEY=VALUE take),\n"
                    "each with its default, the values it takes, the pretrain_gpt.py flag that\n"
                    "sets it and what it means.",
                    EPILOG)
    p.add_argument("pattern", nargs="?", metavar="PATTERN",
                   help="only fields whose section.name contains this (e.g. recompute, parallel.)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def rows() -> list[dict]:
    """One row per field, in section and field order."""
    out = []
    for section, kind in SECTIONS.items():
        for f in dataclasses.fields(kind):
            facts = experiment.facts(kind, f.name)
            out.append({"key": experiment.set_key(section, f.name), "section": section, "name": f.name,
                        "default": getattr(kind(), f.name), "takes": experiment.expected(kind, f.name),
                        "choices": facts["choices"], "minimum": facts["minimum"], "above": facts["above"],
                        "maximum": facts["maximum"],
                        "flag": experiment.megatron_flag(kind, f.name), "help": facts["help"]})
    return out


def run(args: argparse.Namespace) -> int:
    every = found = rows()
    if args.pattern is not None:
        pattern = args.pattern.lower()
        found = [r for r in every if pattern in f"{r['section']}.{r['name']}".lower()]
        if not found:
            raise UserError(f"fields: no field matches {args.pattern!r}"
                            f"{did_you_mean(args.pattern, [r['key'] for r in every])}")
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for i, r in enumerate(found):
        if i == 0 or r["section"] != found[i - 1]["section"]:
            print(f"{chr(10) if i else ''}[{r['section']}]")
        print(f"{r['key']} = {_value(r['default'])}  ({_takes(r)})" + (f"  {r['flag']}" if r["flag"] else ""))
        print(f"    {r['help']}")
    return 0


def _takes(row: dict) -> str:
    """The values a field takes, in words."""
    if row["choices"] is not None:
        options = ", ".join("none" if c is None else c for c in row["choices"])   # as validate lists them
        return f"a list of {options}" if row["takes"].startswith("a list") else f"one of {options}"
    low, above, high = row["minimum"], row["above"], row["maximum"]
    bounds = [f"above {number(above)}"] if above is not None else []
    if low is not None and high is not None:
        bounds.append(f"{number(low)} to {number(high)}")
    else:
        bounds += [f"at least {number(low)}"] if low is not None else []
        bounds += [f"at most {number(high)}"] if high is not None else []
    return ", ".join([row["takes"], *bounds])


def _value(value) -> str:
    """A default as a TOML file writes it; none for unset."""
    if value is None:
        return "none"
    return json.dumps(value) if isinstance(value, (bool, str, list)) else str(value)
