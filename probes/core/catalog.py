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
from charllm.probes.core.errors import UserError, did_you_mean

KINDS = ("models", "hardware", "experiments")


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
    singular = {"models": "model", "hardware": "hardware", "experiments": "experiment"}[kind]
    if not PRESET_NAME.match(name or ""):
        raise UserError(f"{singular} preset name {name!r}: use letters, digits, '.', '_' and '-' "
                        "(at most 128, not starting with '.' or '-')")
    if name in _shipped(kind):
        raise UserError(f"{singular} preset name {name!r}: a shipped preset has that name, and yours would "
                        "hide it; choose another name")
    return paths.config_dir() / kind / f"{name}.toml"


def is_user(kind: str, name: str) -> bool:
    return name in _user(kind)


def find(kind: str, name: str) -> Path:
    table = entries(kind)
    if name in table:
        return table[name]
    singular = {"models": "model", "hardware": "hardware", "experiments": "experiment"}[kind]
    hint = did_you_mean(name, table, f"; see `charllm-tui presets list {kind}`", cutoff=0.5)
    raise UserError(f"{singular} {name!r}: no such preset{hint}")


def read(kind: str, name: str) -> dict:
    """A preset's table, named `name` unless it says otherwise."""
    data = paths.read_toml(find(kind, name), "preset")
    data.setdefault("name", name)
    return data
