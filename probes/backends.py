"""Telemetry backends: one interface over NVML, AMD SMI, the host, a simulator and a replay.

Modelled on Zeus's `zeus/device/gpu/common.py` (one abstract device class, one subclass per
vendor), but shaped for a sampler: a backend owns all its devices and `sample()` returns one
row per device, keyed by the column names of `probes.schema.TELEMETRY_SCHEMA`.

Rules every backend follows:
- A metric a device does not support is found out once (the first NotSupported answer) and is
  null from then on, without asking the library again.
- Any other error from the vendor library is transient: the metric is null for that tick and the
  device's cumulative `errors` count goes up. Sampling never stops because of it.
- The sampler adds `ts_ns`, `mono_ns`, `node`, `iteration` and `missed_deadlines`; a backend may
  set `ts_ns`/`mono_ns`/`iteration` itself (replay does, to keep the recorded spacing).
"""

from __future__ import annotations

import abc
import socket
from dataclasses import dataclass, field
from typing import Callable, Iterable

from charllm.probes.errors import UserError, plural

BACKEND_NAMES = ("auto", "nvml", "amdsmi", "host", "sim", "replay:RUN")
MAX_HZ = 100.0          # NVML power counters update at 10-50 Hz; faster gains nothing


def check_hz(hz: float) -> float:
    """The sampling rate, if a backend can be asked at it (here, not in the sampler, so that
    validating an experiment does not import polars)."""
    if not 0 < hz <= MAX_HZ:
        raise UserError(f"hz = {hz:g}: must be > 0 and at most {MAX_HZ:g} "
                        "(GPU power counters update at 10-50 Hz; faster only costs CPU)")
    return float(hz)


@dataclass
class Device:
    """One sampled device and what it can report."""

    label: str                          # "gpu0", "gcd1", "host"
    uuid: str
    name: str                           # marketing name, e.g. "NVIDIA H100 80GB HBM3"
    handle: object = None               # the vendor library's handle
    unsupported: set[str] = field(default_factory=set)
    errors: int = 0


class BackendUnavailable(Exception):
    """The backend cannot run on this machine; the message says why (used by `auto`)."""


class Backend(abc.ABC):
    """All devices of one kind on this node."""

    name: str = ""                      # the `backend` column
    simulated: bool = False
    metrics: tuple[str, ...] = ()       # the metrics this backend can report at best
    max_hz: float | None = None         # sample at most this often (None: every tick)
    max_hz_why: str = ""                # why, said when a faster rate is asked for

    def __init__(self) -> None:
        self._devices: list[Device] = []

    def devices(self) -> list[Device]:
        return self._devices

    def supported_metrics(self, device: Device) -> list[str]:
        """Metrics not (yet) found unsupported on this device."""
        return [m for m in self.metrics if m not in device.unsupported]

    @abc.abstractmethod
    def sample(self) -> list[dict]:
        """One row per device, with `device`, `uuid`, `backend`, `simulated`, `errors` and metrics."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the vendor library."""

    @property
    def finished(self) -> bool:
        """True when the backend has nothing more to give (only replay ever ends)."""
        return False

    # -- helpers for subclasses -----------------------------------------------------------
    def _row(self, device: Device) -> dict:
        return {"device": device.label, "uuid": device.uuid, "backend": self.name,
                "simulated": self.simulated}

    def _read(self, device: Device, row: dict, metrics: tuple[str, ...], fn: Callable[[], Iterable],
              not_supported: tuple[type[BaseException], ...], errors: tuple[type[BaseException], ...]) -> None:
        """Call `fn` (which returns values for `metrics`, in order) and put them into `row`.

        A `not_supported` exception marks the metrics unsupported for good; an `errors` exception
        counts one transient error. Either way the metrics are null this tick.
        """
        if all(m in device.unsupported for m in metrics):
            return
        try:
            values = fn()
        except not_supported:
            device.unsupported.update(metrics)
            return
        except errors:
            device.errors += 1
            return
        for metric, value in zip(metrics, values):
            row[metric] = value


def hostname() -> str:
    return socket.gethostname().split(".")[0]


def inventory(backends: list[Backend]) -> list[dict]:
    """Each device with its backend, name, uuid and the metrics it supports (what `probe --list`
    and `doctor` show). One sample first: unsupported metrics are found out on the first read."""
    out = []
    for backend in backends:
        backend.sample()
        for dev in backend.devices():
            out.append({"device": dev.label, "backend": backend.name, "simulated": backend.simulated,
                        "name": dev.name, "uuid": dev.uuid, "metrics": backend.supported_metrics(dev)})
    return out


def open_backend(name: str, **kw) -> Backend:
    """The backend called `name` (see BACKEND_NAMES); `auto` picks one and sets `.reason`.

    Keyword arguments go to the chosen backend (sim: gpus, profile, seed, clock, ...;
    replay: speed). Raises UserError for an unknown name or a backend that cannot run here.
    """
    if name == "auto":
        return _auto(**kw)
    if name.startswith("replay:"):
        from charllm.probes.backend_replay import ReplayBackend

        return ReplayBackend(name.split(":", 1)[1], **_only(kw, "speed", "clock"))
    factories = {"nvml": _nvml, "amdsmi": _amdsmi, "host": _host, "sim": _sim}
    if name not in factories:
        raise UserError(f"backend = {name!r}: must be one of {', '.join(BACKEND_NAMES)}")
    try:
        return factories[name](**kw)
    except BackendUnavailable as exc:
        raise UserError(f"backend = {name!r}: unavailable on this machine ({exc})") from None


def open_backends(name: str, **kw) -> tuple[list[Backend], str]:
    """What the sampler runs for `--backend name`: the GPU backend plus the host, and why.

    The host is always sampled beside GPUs (device "host"); a replay already holds the
    recorded host rows, so it runs alone.
    """
    backend = open_backend(name, **kw)
    reason = getattr(backend, "reason", f"{backend.name}: requested")
    if backend.name == "host" or name.startswith("replay:"):
        return [backend], reason
    return [backend, _host()], reason


def _only(kw: dict, *names: str) -> dict:
    return {k: v for k, v in kw.items() if k in names}


def _nvml(**_kw) -> Backend:
    from charllm.probes.backend_nvml import NvmlBackend

    return NvmlBackend()


def _amdsmi(**_kw) -> Backend:
    from charllm.probes.backend_amdsmi import AmdSmiBackend

    return AmdSmiBackend()


def _host(**_kw) -> Backend:
    from charllm.probes.backend_host import HostBackend

    return HostBackend()


def _sim(**kw) -> Backend:
    from charllm.probes.backend_sim import SimBackend

    return SimBackend(**_only(kw, "gpus", "profile", "seed", "clock", "hardware", "iterations",
                              "intensity", "ambient_c", "power_limit_w", "tau_s"))


def _auto(**_kw) -> Backend:
    """NVML if it initialises and finds devices, else AMD SMI, else the host alone."""
    reasons = []
    for label, factory in (("nvml", _nvml), ("amdsmi", _amdsmi)):
        try:
            backend = factory()
        except BackendUnavailable as exc:
            reasons.append(f"{label}: {exc}")
            continue
        backend.reason = "; ".join([*reasons, f"{label}: {plural(len(backend.devices()), 'device')} found"])
        return backend
    backend = _host()
    backend.reason = "; ".join([*reasons, "using host only"])
    return backend
