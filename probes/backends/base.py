"""The backend interface: one abstract `Backend` over all devices of one kind on a node.

Modelled on Zeus's `zeus/device/gpu/common.py` (one abstract device class, one subclass per
vendor), but shaped for a sampler: a backend owns all its devices and `sample()` returns one
row per device, keyed by the column names of `probes.store.schema.TELEMETRY_SCHEMA`.

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

from charllm.probes.core.errors import UserError

MAX_HZ = 100.0          # NVML power counters update at 10-50 Hz; faster gains nothing
DEFAULT_HZ = 20.0       # the rate unless asked otherwise (probe --hz, an experiment's telemetry.hz)


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


@dataclass(frozen=True)
class GpuProcess:
    """A process on a device, as the vendor library lists it (what nvitop shows per GPU)."""

    device: str                         # the device's label: "gpu0"
    pid: int
    name: str                           # its executable, "" where it cannot be read
    user: str                           # "" where it cannot be read (another container's process)
    used_bytes: int | None              # device memory it holds; None where the driver does not say
    sm_pct: float | None                # its share of the SMs in the last sample period; None: not reported


class BackendUnavailable(Exception):
    """The backend cannot run on this machine; the message says why (used by `auto`)."""


class Backend(abc.ABC):
    """All devices of one kind on this node."""

    name: str = ""                      # the `backend` column
    simulated: bool = False
    metrics: tuple[str, ...] = ()       # the metrics this backend can report at best
    max_hz: float | None = None         # sample at most this often (None: every tick)
    max_hz_why: str = ""                # why, said when a faster rate is asked for
    reason: str = ""                    # why this backend was chosen (`auto` says what it tried)

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

    def processes(self) -> list[GpuProcess]:
        """The processes on each device now; [] where the library lists none or cannot list them."""
        return []

    def close(self) -> None:  # optional hook
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
