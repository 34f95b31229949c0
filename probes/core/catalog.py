"""The catalog: where the presets of models, hardware and experiments are, shipped and the user's.
`ModelSpec.load`, `Hardware.load` and `Experiment.load` build them (through `charllm.engine.model.catalog`,
which is this module); the simulator reads its hardware here too, so there is one lookup.

Shipped: `presets/{models,hardware,experiments}/*.toml` (package `charllm.presets`).
User's:  `<config_dir>/{models,hardware,experiments}/*.toml` (same format); a user file with the
same name as a shipped one takes precedence.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, did_you_mean_preset

KINDS = ("models", "hardware", "experiments")
SINGULAR = {"models": "model", "hardware": "hardware", "experiments": "experiment"}

# Short names of the shipped hardware presets, as people say them: a bare chip is its SXM board (what
# HGX/DGX nodes hold), its other boards add theirs. Every lookup takes them (--hardware, --set
# hardware=..., `hardware = ...` in a file), and a preset of that very name (yours) comes first; the
# resolved preset keeps its own name (calibrations are filed under it).
ALIASES = {"hardware": {
    "a100": "a100-80gb", "a100-sxm": "a100-80gb", "a100-pcie": "a100-pcie-80gb",
    "h100": "h100-sxm-80gb", "h100-sxm": "h100-sxm-80gb", "h100-pcie": "h100-pcie-80gb", "h100-nvl": "h100-nvl-94gb",
    "h200": "h200-141gb", "h200-sxm": "h200-141gb", "h200-nvl": "h200-nvl-141gb",
}}


def _shipped(kind: str) -> dict[str, Path]:
    root = resources.files("charllm.presets") / kind
    out = {}
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.endswith(".toml"):
                out[entry.name[:-5]] = Path(str(entry))
    return out


def _user(kind: str) -> dict[str, Path]:
    root = paths.config_dir() / kind
    return {p.stem: p for p in root.glob("*.toml")} if root.is_dir() else {}


def entries(kind: str) -> dict[str, Path]:
    """name -> file for one kind, user files over shipped ones, sorted by name."""
    merged = {**_shipped(kind), **_user(kind)}
    return dict(sorted(merged.items()))


PRESET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_user_preset(kind: str, name: str) -> Path:
    """Where a preset of the user's named `name` goes: a plain file name that no shipped preset
    has (the user's file would hide the shipped one everywhere)."""
    singular = SINGULAR[kind]
    if not PRESET_NAME.match(name or ""):
        raise UserError(f"{singular} preset name {name!r}: use letters, digits, '.', '_' and '-' "
                        "(at most 128, not starting with '.' or '-')")
    if name in _shipped(kind):
        raise UserError(f"{singular} preset name {name!r}: a shipped preset has that name, and yours would "
                        "hide it; choose another name")
    return paths.config_dir() / kind / f"{name}.toml"


def is_user(kind: str, name: str) -> bool:
    return name in _user(kind)


def resolve(kind: str, name: str) -> str:
    """The preset `name` stands for: itself, or what its alias names (ALIASES)."""
    table = entries(kind)
    return name if name in table else ALIASES.get(kind, {}).get(name, name)


def find(kind: str, name: str) -> Path:
    table = entries(kind)
    if (resolved := resolve(kind, name)) in table:
        return table[resolved]
    raise UserError(f"{SINGULAR[kind]} {name!r}: no such preset{suggestion(kind, name)}")


def suggestion(kind: str, name: str) -> str:
    """What to say after `no such preset`: the presets of this kind it is closest to (edit distance,
    ALIASES included), or the other kind it names (a model where an experiment is wanted), and
    where the list is."""
    if hint := did_you_mean_preset(str(name), [*entries(kind), *ALIASES.get(kind, {})]):
        return hint
    for other in KINDS:
        if other != kind and resolve(other, name) in entries(other):
            return f"; {name!r} is a {SINGULAR[other]} preset (`charllm-tui presets list {kind}` lists the {kind})"
    return f"; see `charllm-tui presets list {kind}`"


def read(kind: str, name: str) -> dict:
    """A preset's table, named as its file unless it says otherwise (an alias gives the preset's name)."""
    resolved = resolve(kind, name)
    data = paths.read_toml(find(kind, resolved), "preset")
    data.setdefault("name", resolved)
    return data
