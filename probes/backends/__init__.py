"""Telemetry backends: one interface (`base.Backend`) over NVML, AMD SMI, the host, a simulator
and a replay, one module each; this registry opens them by name.

Each vendor module imports its vendor library, which may be missing or broken on a node, so a
backend's module is imported only when that backend is opened.
"""

from __future__ import annotations

from charllm.probes.backends.base import Backend, BackendUnavailable
from charllm.probes.core.errors import UserError, plural

REPLAY = "replay:"      # replay:RUN replays the telemetry a run recorded


def inventory(backends: list[Backend]) -> list[dict]:
    """Each device with its backend, name, uuid and the metrics it supports (what `probe --list`
    and `doctor` show). One sample first: unsupported metrics are found out on the first read."""
    out = []
    for backend in backends:
        backend.sample()
        for dev in backend.devices():
            out.append({"device": dev.label, "backend": backend.name, "simulated": backend.simulated,
                        "name": dev.name, "uuid": dev.uuid, "metrics": backend.supported_metrics(dev),
                        "not_supported": [m for m in backend.metrics if m in dev.unsupported]})
    return out


def not_supported(backends: list[Backend]) -> str:
    """What the devices cannot report, said once: "gpu0, gpu1: sm_active_pct, ...; host: temp_cpu_c"
    (devices that lack the same metrics share a line); "" when every device reports everything."""
    lacking: dict[tuple[str, ...], list[str]] = {}
    for backend in backends:
        for dev in backend.devices():
            missing = tuple(m for m in backend.metrics if m in dev.unsupported)
            if missing:
                lacking.setdefault(missing, []).append(dev.label)
    return "; ".join(f"{', '.join(devices)}: {' '.join(metrics)}" for metrics, devices in lacking.items())


def open_backend(name: str, **kw) -> Backend:
    """The backend called `name` (one of BACKEND_NAMES); `auto` picks one and sets `.reason`.

    Keyword arguments go to the chosen backend (sim: gpus, profile, seed, clock, ...;
    replay: speed). Raises UserError for an unknown name or a backend that cannot run here.
    """
    if name == "auto":
        return _auto(**kw)
    if name.startswith(REPLAY):
        from charllm.probes.backends.replay import ReplayBackend  # deferred: its vendor library, only once opened

        return ReplayBackend(name.removeprefix(REPLAY), **_only(kw, "speed", "clock"))
    if name not in FACTORIES:
        raise UserError(f"backend = {name!r}: must be one of {', '.join(BACKEND_NAMES)}")
    try:
        return FACTORIES[name](**kw)
    except BackendUnavailable as exc:
        raise UserError(f"backend = {name!r}: unavailable on this machine ({exc})") from None


def open_backends(name: str, **kw) -> tuple[list[Backend], str]:
    """What the sampler runs for `--backend name`: the GPU backend plus the host, and why.

    The host is always sampled beside GPUs (device "host"); a replay already holds the
    recorded host rows, so it runs alone.
    """
    backend = open_backend(name, **kw)
    reason = backend.reason or f"{backend.name}: requested"
    if backend.name == "host" or name.startswith(REPLAY):
        return [backend], reason
    return [backend, _host()], reason


def _only(kw: dict, *names: str) -> dict:
    return {k: v for k, v in kw.items() if k in names}


def _nvml(**_kw) -> Backend:
    from charllm.probes.backends.nvml import NvmlBackend  # deferred: its vendor library, only once opened

    return NvmlBackend()


def _amdsmi(**_kw) -> Backend:
    from charllm.probes.backends.amdsmi import AmdSmiBackend  # deferred: its vendor library, only once opened

    return AmdSmiBackend()


def _host(**_kw) -> Backend:
    from charllm.probes.backends.host import HostBackend  # deferred: its vendor library, only once opened

    return HostBackend()


def _sim(**kw) -> Backend:
    from charllm.probes.backends.sim import SimBackend  # deferred: its vendor library, only once opened

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


FACTORIES = {"nvml": _nvml, "amdsmi": _amdsmi, "host": _host, "sim": _sim}
# What `open_backend` takes (the experiment's telemetry.backend and `probe --backend` say so too).
BACKEND_NAMES = ("auto", *FACTORIES, f"{REPLAY}RUN")
