"""The node itself (device "host"): CPU, memory, RAPL energy, temperatures, InfiniBand, network.

What the CharLLM-PPT artifact scraped from node_exporter, read directly: psutil for CPU, memory,
sensors and NICs; sysfs for RAPL (`/sys/class/powercap/intel-rapl*`, root-only on recent
kernels) and InfiniBand port counters (`/sys/class/infiniband/*/ports/*/counters`).

CPU use comes from one read of every core's times per sample (`CoreTimes`): each core's
utilization, the whole CPU's (their mean) and iowait, counted as psutil counts them.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import psutil

from charllm.probes.backends.base import DEFAULT_HZ, Backend, Device, hostname

POWERCAP = "/sys/class/powercap"
INFINIBAND = "/sys/class/infiniband"
CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "acpitz")


class CoreTimes:
    """Each core's CPU times, read once per sample; utilization and iowait since the last read.

    As psutil.cpu_percent counts on Linux: a core's total time leaves out guest time (already in
    user time), and busy time is the total less idle and iowait. iowait is its share of all cores'
    total time."""

    def __init__(self) -> None:
        self.last = self._read()
        self.values: tuple = (None, None, None)

    @staticmethod
    def _read() -> list[tuple[float, float, float]]:
        """(total, idle, iowait) seconds of each core."""
        out = []
        for t in psutil.cpu_times(percpu=True):
            total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
            out.append((total, t.idle, getattr(t, "iowait", 0.0)))
        return out

    def sample(self) -> tuple[float | None, float | None, list[float | None] | None]:
        """(utilization of all cores, iowait, each core's utilization) in % since the last reading;
        when no time has passed (two calls within one clock tick) the previous figures, Nones
        before there are any (never a 0 that was not measured)."""
        now = self._read()
        if sum(t for t, _, _ in now) <= sum(t for t, _, _ in self.last):
            return self.values
        cores: list[float | None] = []
        spent, waited = 0.0, 0.0
        for (total, idle, iowait), (total0, idle0, iowait0) in zip(now, self.last):
            dt = total - total0
            if dt <= 0:
                cores.append(None)
                continue
            busy = dt - max(0.0, idle - idle0) - max(0.0, iowait - iowait0)
            cores.append(min(100.0, max(0.0, 100.0 * busy / dt)))
            spent += dt
            waited += max(0.0, iowait - iowait0)
        self.last = now
        known = [c for c in cores if c is not None]
        self.values = (sum(known) / len(known), 100.0 * waited / spent, cores)
        return self.values


@dataclass
class RaplZone:
    """One RAPL energy counter, unwrapped into a running total (it wraps at max_energy_range_uj)."""

    path: str
    kind: str            # "cpu" (package) or "dram"
    max_uj: int
    last_uj: int
    total_uj: int = 0

    def read(self) -> int:
        with open(self.path) as fh:
            now = int(fh.read())
        delta = now - self.last_uj
        if delta < 0:
            delta += self.max_uj
        self.last_uj = now
        self.total_uj += delta
        return self.total_uj


def find_rapl_zones(root: str = POWERCAP) -> list[RaplZone]:
    """Readable package and DRAM zones (a package's `core`/`uncore` sub-zones would double count)."""
    zones = []
    for zone in sorted(glob.glob(os.path.join(root, "intel-rapl*"))):
        try:
            with open(os.path.join(zone, "name")) as fh:
                name = fh.read().strip()
            kind = "cpu" if name.startswith("package") else "dram" if name == "dram" else None
            if kind is None:
                continue
            energy = os.path.join(zone, "energy_uj")
            with open(os.path.join(zone, "max_energy_range_uj")) as fh:
                max_uj = int(fh.read())
            with open(energy) as fh:
                first = int(fh.read())
        except (OSError, ValueError):
            continue  # unreadable without root, or not a zone
        zones.append(RaplZone(energy, kind, max_uj, first))
    return zones


def find_ib_counters(root: str = INFINIBAND) -> list[tuple[str, str]]:
    """(port_xmit_data, port_rcv_data) paths of every InfiniBand port."""
    ports = []
    for counters in sorted(glob.glob(os.path.join(root, "*", "ports", "*", "counters"))):
        tx, rx = os.path.join(counters, "port_xmit_data"), os.path.join(counters, "port_rcv_data")
        if os.access(tx, os.R_OK) and os.access(rx, os.R_OK):
            ports.append((tx, rx))
    return ports


class HostBackend(Backend):
    name = "host"
    max_hz = DEFAULT_HZ   # faster costs a core's ~0.6 % per 20 Hz for counters that change slowly
    max_hz_why = "psutil reads /proc and /sys, ~0.3 ms a sample, and host counters change slowly"
    metrics = (
        "cpu_util_pct",
        "cpu_iowait_pct",
        "cpu_core_util_pct",
        "cpu_freq_mhz",
        "host_mem_used_bytes",
        "host_mem_total_bytes",
        "cpu_energy_j",
        "dram_energy_j",
        "temp_cpu_c",
        "ib_tx_bytes",
        "ib_rx_bytes",
        "net_tx_bytes",
        "net_rx_bytes",
    )

    def __init__(self, powercap_root: str = POWERCAP, infiniband_root: str = INFINIBAND) -> None:
        super().__init__()
        node = hostname()
        self.device = Device("host", f"host-{node}", node)
        self._devices.append(self.device)
        self._rapl = find_rapl_zones(powercap_root)
        self._ib = find_ib_counters(infiniband_root)
        kinds = {z.kind for z in self._rapl}
        unsupported = self.device.unsupported
        if "cpu" not in kinds:
            unsupported.add("cpu_energy_j")
        if "dram" not in kinds:
            unsupported.add("dram_energy_j")
        if not self._ib:
            unsupported.update(("ib_tx_bytes", "ib_rx_bytes"))
        if psutil.cpu_freq() is None:
            unsupported.add("cpu_freq_mhz")
        if not hasattr(psutil, "sensors_temperatures") or not psutil.sensors_temperatures():
            unsupported.add("temp_cpu_c")
        if not hasattr(psutil.cpu_times(), "iowait"):   # Linux only
            unsupported.add("cpu_iowait_pct")
        self._cores = CoreTimes()   # the first read only sets the reference point

    def sample(self) -> list[dict]:
        dev, row = self.device, self._row(self.device)
        errors = (OSError, ValueError, RuntimeError)
        read = self._read
        read(dev, row, ("cpu_util_pct", "cpu_iowait_pct", "cpu_core_util_pct"), self._cores.sample, (), errors)
        if "cpu_iowait_pct" in dev.unsupported:
            row.pop("cpu_iowait_pct", None)
        read(dev, row, ("cpu_freq_mhz",), lambda: (psutil.cpu_freq().current,), (), errors)

        def memory():
            vm = psutil.virtual_memory()
            return vm.total - vm.available, vm.total

        read(dev, row, ("host_mem_used_bytes", "host_mem_total_bytes"), memory, (), errors)
        read(dev, row, ("cpu_energy_j", "dram_energy_j"), self._energy, (), errors)
        read(dev, row, ("temp_cpu_c",), lambda: (self._hottest_cpu(),), (), errors)
        read(dev, row, ("ib_tx_bytes", "ib_rx_bytes"), self._infiniband, (), errors)

        def network():
            nics = psutil.net_io_counters(pernic=True)
            up = [c for name, c in nics.items() if name != "lo"]
            return sum(c.bytes_sent for c in up), sum(c.bytes_recv for c in up)

        read(dev, row, ("net_tx_bytes", "net_rx_bytes"), network, (), errors)
        row["errors"] = dev.errors
        return [row]

    def _energy(self) -> tuple[float | None, float | None]:
        totals: dict[str, float | None] = {"cpu": None, "dram": None}
        for zone in self._rapl:
            totals[zone.kind] = (totals[zone.kind] or 0) + zone.read() * 1e-6
        return totals["cpu"], totals["dram"]

    @staticmethod
    def _hottest_cpu() -> float | None:
        sensors = psutil.sensors_temperatures()
        chosen = [s for name in CPU_SENSORS for s in sensors.get(name, [])] or \
                 [s for entries in sensors.values() for s in entries]
        return max((s.current for s in chosen), default=None)

    def _infiniband(self) -> tuple[int, int]:
        tx = rx = 0
        for tx_path, rx_path in self._ib:
            with open(tx_path) as fh:
                tx += int(fh.read()) * 4   # counters count 4-byte words
            with open(rx_path) as fh:
                rx += int(fh.read()) * 4
        return tx, rx
