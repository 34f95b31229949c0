"""Simulated GPUs with physically plausible behaviour, for demos and tests (never a fallback).

Model, per GPU and per step of length dt (from an injectable clock):
- load: utilization u(t) from a profile — `steady`, `bursty` (micro-batches: compute bursts,
  communication bubbles, an optimizer step every few micro-batches) or the iteration timeline
  of a recorded run's iterations.jsonl (busy inside iterations, idle between them, looped);
- power: P(f) = idle + (TDP - idle) * intensity * u * (f / f_max)^2 (dynamic power ~ f * V^2,
  with V roughly tracking f over the DVFS range);
- clock governor: the highest clock whose power fits the power limit (sets SwPowerCap when that
  is below f_max); above the temperature limit the clock backs off further (SwThermal), and
  5 °C above it hard (HwThermal);
- temperature: first order, T -> ambient + R * P with time constant tau_s, R chosen so that TDP
  settles 12 °C under the limit at 30 °C ambient.
Deterministic for a given seed and sequence of clock readings. Rows say backend="sim",
simulated=True.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from charllm.probes.backends.base import Backend, Device
from charllm.probes.core import catalog
from charllm.probes.core.errors import UserError
from charllm.probes.core.files import read_bounded
from charllm.probes.store.rundir import resolve_run
from charllm.probes.store.schema import THROTTLE_BITS

PROFILES = ("steady", "bursty", "iterations")


DEFAULT_HARDWARE = "h100-sxm-80gb"


@dataclass(frozen=True)
class SimHardware:
    """What the simulator needs to know about a GPU, read from a hardware preset (`from_preset`)."""

    name: str
    description: str
    tdp_w: float
    idle_w: float
    max_sm_clock_mhz: float
    temp_limit_c: float
    memory_bytes: int
    nvlink_bytes_s: float               # per direction, all links (the preset's node_link_gbs)
    mem_clock_mhz: float = 2619.0       # reported as is; the catalog has no memory clock (H100 HBM3's)

    @classmethod
    def from_preset(cls, name: str) -> "SimHardware":
        """Hardware from the catalog's TOML (the user's file first, then the shipped presets)."""
        try:
            data = catalog.read("hardware", name)
        except UserError as e:
            raise UserError(f"sim {e}") from None

        def positive(key: str) -> float:
            value = data.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise UserError(f"sim hardware = {name!r}: {key} = {value!r}: must be a number above 0 to "
                                "simulate a GPU")
            return value

        tdp = float(positive("tdp_w"))
        idle = data.get("idle_w", 0.0)
        # the preset's idle power, which the power model plans with too; a preset without one (0: not
        # known) idles at a tenth of its board limit
        idle = float(idle) if isinstance(idle, (int, float)) and not isinstance(idle, bool) and 0 < idle < tdp \
            else 0.1 * tdp
        link = data.get("node_link_gbs", 0.0)
        return cls(name=name, description=f"{data.get('description', name)} (simulated)",
                   tdp_w=tdp, idle_w=idle, max_sm_clock_mhz=float(positive("max_sm_clock_mhz")),
                   temp_limit_c=float(positive("temp_limit_c")), memory_bytes=int(positive("memory_bytes")),
                   nvlink_bytes_s=float(link) * 1e9 if isinstance(link, (int, float)) else 0.0)


MAX_TIMELINE_BYTES = 512 * 2**20   # an iteration log of a very long run


def iteration_timeline(path: Path) -> list[tuple[float, float]]:
    """(start_s, end_s) of each iteration in an iterations.jsonl, relative to the first start."""
    spans = []
    try:
        lines = read_bounded(path, MAX_TIMELINE_BYTES, "sim profile").decode(errors="replace").splitlines()
    except OSError as exc:
        raise UserError(f"sim profile: cannot read {path} ({exc.strerror})") from None
    for line in lines:
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(event, dict) or not all(isinstance(event.get(k), int) for k in ("start_ns", "end_ns")):
            continue
        if event.get("event") == "iteration" and event.get("start_ns") and event.get("end_ns"):
            spans.append((event["start_ns"], event["end_ns"]))
    if not spans:
        raise UserError(f"sim profile: {path} has no iteration events with start_ns/end_ns")
    spans = sorted(set(spans))
    t0 = spans[0][0]
    return [((s - t0) / 1e9, (e - t0) / 1e9) for s, e in spans]


# How hard a busy GPU draws, as a share of what would bring it to its power limit at full clocks. A
# steady run's kernels mix compute- and memory-bound phases; a bursty one (large micro-batches
# separated by pipeline bubbles and exchanges) runs dense GEMMs back to back in each burst, and its
# bursts draw past the limit, so the power governor clocks them down (the paper's peak-power
# excursions and throttling, Go et al. MICRO'25: larger micro-batches cause bursty execution).
INTENSITY = {"steady": 0.85, "bursty": 1.15, "iterations": 0.95}


class Load:
    """Utilization (0..1) and communication share over time for one profile."""

    def __init__(self, profile: str, timeline: list[tuple[float, float]] | None = None) -> None:
        if profile not in PROFILES:
            raise UserError(f"sim profile = {profile!r}: must be one of {', '.join(PROFILES)}")
        if profile == "iterations" and not timeline:
            raise UserError("sim profile = 'iterations': needs a run's iterations.jsonl")
        self.profile, self.timeline = profile, timeline
        if timeline:
            self.period = timeline[-1][1] + max(0.05, timeline[-1][1] - timeline[-1][0]) * 0.1

    def at(self, t: float) -> tuple[float, float]:
        if self.profile == "steady":
            return 0.97, 0.1
        if self.profile == "bursty":
            # 8 micro-batches of 0.5 s (0.35 s compute, 0.15 s bubble / exchange), then 0.4 s optimizer step.
            t = t % 4.4
            if t >= 4.0:
                return 0.45, 0.6
            return (0.98, 0.05) if t % 0.5 < 0.35 else (0.25, 0.9)
        t = t % self.period
        inside = any(s <= t < e for s, e in self.timeline or ())
        return (0.97, 0.2) if inside else (0.08, 0.0)


@dataclass
class _GpuState:
    temp_c: float
    resistance: float              # °C per W
    rng: random.Random
    power_avg_w: float = 0.0
    energy_j: float = 0.0
    nvlink_tx: float = 0.0
    nvlink_rx: float = 0.0


class SimBackend(Backend):
    name = "sim"
    simulated = True
    metrics = ("power_w", "power_avg_w", "mem_power_w", "energy_j", "temp_gpu_c", "temp_hotspot_c",
               "temp_mem_c", "sm_clock_mhz", "mem_clock_mhz", "util_gpu_pct", "util_mem_pct",
               "mem_used_bytes", "mem_total_bytes", "power_limit_w", "throttle_reasons",
               "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes", "nvlink_rx_bytes")

    def __init__(self, gpus: int = 8, profile: str = "steady", seed: int = 0,
                 clock: Callable[[], float] = time.monotonic, hardware: str | SimHardware | None = None,
                 iterations: str | Path | None = None, intensity: float | None = None, ambient_c: float = 30.0,
                 power_limit_w: float | None = None, tau_s: float = 15.0) -> None:
        super().__init__()
        if not 1 <= gpus <= 64:
            raise UserError(f"sim gpus = {gpus}: must be between 1 and 64")
        if profile.startswith("iterations:"):
            profile, iterations = "iterations", profile.split(":", 1)[1]
        self.hw = (hardware if isinstance(hardware, SimHardware)
                   else SimHardware.from_preset(hardware or DEFAULT_HARDWARE))
        self.load = Load(profile, iteration_timeline(_iterations_file(iterations)) if iterations else None)
        self.clock, self.ambient_c, self.tau_s = clock, ambient_c, tau_s
        self.intensity = intensity if intensity is not None else INTENSITY[self.load.profile]
        self.power_limit_w = power_limit_w or self.hw.tdp_w
        nominal_r = (self.hw.temp_limit_c - 12.0 - 30.0) / self.hw.tdp_w
        self._state = []
        for i in range(gpus):
            rng = random.Random(seed * 1_000_003 + i)
            self._devices.append(Device(f"gpu{i}", f"SIM-{self.hw.name}-{seed}-{i}", self.hw.description))
            # Boards differ a little in cooling; that spread is part of what the paper measures.
            self._state.append(_GpuState(temp_c=ambient_c + 5.0, resistance=nominal_r * rng.uniform(0.92, 1.08),
                                         rng=rng))
        self._t0 = self._last = clock()

    def sample(self) -> list[dict]:
        now = self.clock()
        dt, self._last = max(0.0, now - self._last), now
        util, comm = self.load.at(now - self._t0)
        return [self._step(dev, st, dt, util, comm) for dev, st in zip(self._devices, self._state)]

    def _power(self, util: float, clock_frac: float) -> float:
        hw = self.hw
        return hw.idle_w + (hw.tdp_w - hw.idle_w) * self.intensity * util * clock_frac ** 2

    def _step(self, dev: Device, st: _GpuState, dt: float, util: float, comm: float) -> dict:
        hw, bits = self.hw, 0
        u = min(1.0, max(0.0, util + st.rng.gauss(0.0, 0.01)))
        # Governor: idle clocks when idle, else the highest clock under the power limit, then heat.
        frac = 1.0
        if u < 0.05:
            frac, bits = 0.3, bits | THROTTLE_BITS["gpu_idle"]
        elif self._power(u, 1.0) > self.power_limit_w:
            dynamic = (hw.tdp_w - hw.idle_w) * self.intensity * u
            frac = math.sqrt(max(0.0, self.power_limit_w - hw.idle_w) / dynamic)
            bits |= THROTTLE_BITS["sw_power_cap"]
        over = st.temp_c - hw.temp_limit_c
        if over >= 0:
            frac *= max(0.5, 1.0 - 0.08 * (over + 1.0))
            bits |= THROTTLE_BITS["sw_thermal"]
            if over >= 5.0:
                frac *= 0.6
                bits |= THROTTLE_BITS["hw_thermal"]
        frac = min(1.0, max(0.3, frac))
        power = self._power(u, frac) * (1.0 + st.rng.gauss(0.0, 0.005))
        # First-order thermal response and the cumulative counters.
        target = self.ambient_c + st.resistance * power
        st.temp_c += (target - st.temp_c) * (1.0 - math.exp(-dt / self.tau_s))
        st.energy_j += power * dt
        st.power_avg_w = (power if st.power_avg_w == 0.0
                          else st.power_avg_w + (power - st.power_avg_w) * (1.0 - math.exp(-dt)))
        link = hw.nvlink_bytes_s * comm * dt
        st.nvlink_tx += link
        st.nvlink_rx += link
        util_mem = 0.55 * u
        row = self._row(dev)
        row.update(
            power_w=power, power_avg_w=st.power_avg_w, mem_power_w=25.0 + 90.0 * util_mem,
            energy_j=st.energy_j, temp_gpu_c=st.temp_c, temp_hotspot_c=st.temp_c + 0.015 * power,
            temp_mem_c=self.ambient_c + 0.8 * (st.temp_c - self.ambient_c) + 4.0,
            sm_clock_mhz=round(hw.max_sm_clock_mhz * frac / 15.0) * 15.0,  # NVIDIA clocks step by 15 MHz
            mem_clock_mhz=hw.mem_clock_mhz, util_gpu_pct=round(100.0 * u), util_mem_pct=round(100.0 * util_mem),
            mem_used_bytes=int(hw.memory_bytes * (0.72 if u >= 0.05 else 0.01)), mem_total_bytes=hw.memory_bytes,
            power_limit_w=self.power_limit_w, throttle_reasons=bits,
            pcie_tx_bytes_s=2e9 * u, pcie_rx_bytes_s=2.5e9 * u,
            nvlink_tx_bytes=int(st.nvlink_tx), nvlink_rx_bytes=int(st.nvlink_rx), errors=dev.errors,
        )
        return row


def _iterations_file(ref: str | Path) -> Path:
    path = Path(ref)
    if path.is_dir():
        return path / "iterations.jsonl"
    if path.is_file():
        return path

    return resolve_run(str(ref)).iterations_path
