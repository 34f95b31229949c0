"""The workbench's screens, one module each, and the table that orders them."""

from __future__ import annotations

import importlib

from textual.screen import Screen

# (mode, title, key, module:class) in tab-bar order.
SCREENS: tuple[tuple[str, str, str, str], ...] = (
    ("compose", "Compose", "f2", "compose:ComposeScreen"),
    ("sweep", "Sweep", "f3", "sweep:SweepScreen"),
    ("launch", "Launch", "f4", "launch:LaunchScreen"),
    ("live", "Live", "f5", "live:LiveScreen"),
    ("runs", "Runs", "f6", "runs:RunsScreen"),
    ("compare", "Compare", "f7", "compare:CompareScreen"),
    ("doctor", "Doctor", "f8", "doctor:DoctorScreen"),
    ("campaign", "Campaign", "f9", "campaign:CampaignScreen"),
)


def screen_class(target: str) -> type[Screen]:
    """The class `module:Class` names. A screen's module is imported when its screen is first shown
    (deferred: the first frame does not wait for the other screens' imports; bench_tui measures it)."""
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(f"charllm.tui.screens.{module}"), cls)
