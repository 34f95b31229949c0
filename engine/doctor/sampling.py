"""What the probe sees on a node, and how fast the real sampler achieves its rates there."""

from __future__ import annotations

import math
import statistics

from charllm.probes.backends import inventory

SAMPLING_HZ = (20.0, 100.0)
SAMPLE_SECONDS = 2.0


def telemetry_check(backends, reason: str) -> dict:
    return {"backend": ", ".join(b.name for b in backends), "reason": reason, "devices": inventory(backends)}


def sampling_check(backends, hz: float, seconds: float, node: str) -> dict:
    """Run the real sampler for `seconds` at `hz`; per device, rows per second and the spacing of
    its rows (a backend slower than `hz`, like the host's, is asked every n-th tick: `target_hz`)."""
    from charllm.probes.sampler import Sampler  # deferred: loads polars (start-up time)

    rows: list[dict] = []
    sampler = Sampler(backends, hz=hz, node=node, on_sample=rows.extend)
    sampler.run(seconds)
    stamps: dict[tuple, list[int]] = {}
    for row in rows:
        stamps.setdefault((row["backend"], row["device"]), []).append(row["mono_ns"])
    devices = []
    for backend in backends:
        for dev in backend.devices():
            times = sorted(stamps.get((backend.name, dev.label), []))
            gaps = sorted((b - a) / 1e6 for a, b in zip(times, times[1:], strict=False))
            devices.append({
                "device": dev.label, "backend": backend.name, "target_hz": sampler.backend_hz(backend),
                "rows": len(times), "achieved_hz": len(times) / seconds,
                "interval_ms": {"median": statistics.median(gaps), "p99": gaps[math.ceil(0.99 * len(gaps)) - 1],
                                "max": gaps[-1]} if gaps else None,
            })
    return {"hz": hz, "seconds": seconds, "ticks": sampler.ticks, "missed_deadlines": sampler.missed_deadlines,
            "devices": devices}
