"""Which hardware preset a node is: its GPUs' names, compute capability and memory against each
preset's device_names, compute_capability and usable_bytes (shipped presets and the user's own in
<config>/hardware/, which wins over a shipped one of its name)."""

from __future__ import annotations

import fnmatch

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Hardware
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import gib

# A node's GPUs are a hardware preset when their name matches one of its device_names, their compute
# capability is its compute_capability (where both are known), and their memory is its usable_bytes
# within MEMORY_TOLERANCE (an A100 80GB from a 40GB that reports the same name pattern).
MEMORY_TOLERANCE = 0.05


def match_hardware(devices: list[dict]) -> tuple[str | None, str]:
    """(hardware preset, why) for the node's devices as `runtime.describe` lists them; the preset is
    None for a GPU no preset matches, and the reason then asks for --hardware."""

    if not devices:
        return "cpu", "no GPU: training runs on the CPU"
    names = sorted({d["name"] for d in devices})
    if len(names) > 1:
        return None, f"mixed GPUs ({', '.join(names)}): say which preset with --hardware NAME"
    name, total = devices[0]["name"], min(d["total_bytes"] for d in devices)
    capability = devices[0].get("capability")
    found = [hw.name for hw in hardware_presets() if is_device(hw, name, capability, total)]
    if len(found) == 1:
        return found[0], f"{len(devices)} x {name}, {gib(total)}"
    seen = f"unknown GPU {name!r} with {gib(total)}" if not found else \
        f"{name!r} with {gib(total)} matches several hardware presets ({', '.join(found)})"
    return None, (f"{seen}: pass --hardware NAME (`charllm-tui presets list hardware`, or add one with this "
                  "name in device_names to <config>/hardware/)")


def hardware_presets():
    """Every hardware preset, the user's and the shipped ones (a user's file over a shipped one of its name)."""
    for name in catalog.entries("hardware"):
        try:
            yield Hardware.load(name)
        except UserError:   # a damaged preset of the user's says so where it is used, not in every doctor
            continue


def is_device(hardware, name: str, capability: str | None, total_bytes: int) -> bool:
    """Whether a device of this name, compute capability and memory (as torch reports them) is `hardware`."""
    if not any(fnmatch.fnmatchcase(name.lower(), pattern.lower()) for pattern in hardware.device_names):
        return False
    if hardware.compute_capability and capability and hardware.compute_capability != capability:
        return False
    expected = hardware.usable_bytes or hardware.memory_bytes
    return not expected or abs(total_bytes - expected) <= MEMORY_TOLERANCE * expected


def check_hardware(hardware, devices: list[dict]) -> None:
    """--hardware must be what this node is: a GPU preset on a node without GPUs (or the CPU preset
    on a GPU node) would file this node's software under hardware it is not."""
    if (hardware.vendor == "cpu") != (not devices):
        has = f"{plural(len(devices), 'GPU')} ({devices[0]['name']})" if devices else "no GPU"
        raise UserError(f"--hardware {hardware.name!r}: a {hardware.vendor} preset, and this node has {has}")
