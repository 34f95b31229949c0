"""AMD GPUs through AMD SMI (`amdsmi`). Each GCD (an MI250X has two) is one device.

`import amdsmi` without the library prints two lines to stdout and raises KeyError; inside a
running TUI that print would corrupt the screen, so the import runs with file descriptor 1
pointed at /dev/null, and any exception means "unavailable".

What AMD SMI has of NVML's newer counters: violation time from `amdsmi_get_violation_status`
(MI300 and newer) and XGMI link bytes from `amdsmi_get_gpu_metrics_info` (in the NVLink columns).
AMD SMI counts violations as ticks of its firmware's own counter (acc_counter): each interval's
share of violating ticks times the interval's length is added up into nanoseconds since the probe
started, so the columns read as NVML's counters do. It has no SM occupancy, tensor-core activity,
DRAM bandwidth or sync-boost counter: those stay null.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

from charllm.probes.backends.base import Backend, BackendUnavailable, Device
from charllm.probes.store.schema import THROTTLE_BITS

# amdsmi_get_violation_status() "active_*" flags onto the NVML reason bits.
VIOLATION_BITS = {
    "active_ppt_pwr": THROTTLE_BITS["sw_power_cap"],      # package power tracking (PVIOL)
    "active_socket_thrm": THROTTLE_BITS["sw_thermal"],    # socket thermal (TVIOL)
    "active_prochot_thrm": THROTTLE_BITS["hw_thermal"],
    "active_hbm_thrm": THROTTLE_BITS["hw_thermal"],
    "active_vr_thrm": THROTTLE_BITS["hw_slowdown"],
}
# The accumulated violation counters that stand for NVML's power and thermal violation time.
VIOLATION_COUNTERS = (("violation_power_ns", "acc_ppt_pwr"), ("violation_thermal_ns", "acc_socket_thrm"))
XGMI_KIB = 1024   # gpu_metrics' xgmi_*_data_acc count kilobytes (amdgpu's kgd_pp_interface.h)


@contextlib.contextmanager
def _stdout_silenced():
    """Silence stdout at both levels: fd 1 (C code) and sys.stdout (Python prints; a TUI or
    pytest may have replaced it with an object that does not write to fd 1)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            with contextlib.redirect_stdout(io.StringIO()):
                yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def import_amdsmi():
    """The amdsmi module, or BackendUnavailable with the reason."""
    try:
        with _stdout_silenced():
            return importlib.import_module("amdsmi")
    except KeyError as exc:  # the wrapper's lookup of the library it failed to load
        raise BackendUnavailable(f"{exc.args[0] if exc.args else 'libamd_smi.so'} not found") from None
    except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
        raise BackendUnavailable(f"import failed ({type(exc).__name__}: {exc})") from None


class AmdSmiBackend(Backend):
    name = "amdsmi"
    metrics = ("power_w", "power_avg_w", "energy_j", "temp_gpu_c", "temp_hotspot_c", "temp_mem_c",
               "sm_clock_mhz", "mem_clock_mhz", "util_gpu_pct", "util_mem_pct", "mem_used_bytes",
               "mem_total_bytes", "power_limit_w", "throttle_reasons", "violation_power_ns",
               "violation_thermal_ns", "nvlink_tx_bytes", "nvlink_rx_bytes")

    def __init__(self) -> None:
        super().__init__()
        smi = self._smi = import_amdsmi()
        try:
            smi.amdsmi_init()
        except Exception as exc:  # noqa: BLE001
            raise BackendUnavailable(f"amdsmi_init failed ({type(exc).__name__}: {exc})") from None
        try:
            for i, handle in enumerate(smi.amdsmi_get_processor_handles()):
                uuid = smi.amdsmi_get_gpu_device_uuid(handle)
                name = smi.amdsmi_get_gpu_asic_info(handle).get("market_name", "AMD GPU")
                self._devices.append(Device(f"gcd{i}", uuid, name, handle))
        except smi.AmdSmiException as exc:
            self.close()
            raise BackendUnavailable(f"device query failed ({exc})") from None
        if not self._devices:
            self.close()
            raise BackendUnavailable("AMD SMI found no GPUs")
        codes = {
            getattr(smi.amdsmi_wrapper, n) for n in ("AMDSMI_STATUS_NOT_SUPPORTED", "AMDSMI_STATUS_NOT_YET_IMPLEMENTED")
        }
        self._not_supported_codes = codes
        self._violations = {d.label: Violations() for d in self._devices}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._smi.amdsmi_shut_down()

    def sample(self) -> list[dict]:
        return [self._sample_device(d) for d in self._devices]

    def _call(self, dev: Device, row: dict, metrics: tuple[str, ...], fn) -> None:
        """Like Backend._read, telling NotSupported apart by the library's status code."""
        if all(m in dev.unsupported for m in metrics):
            return
        try:
            values = fn()
        except self._smi.AmdSmiLibraryException as exc:
            if exc.err_code in self._not_supported_codes:
                dev.unsupported.update(metrics)
            else:
                dev.errors += 1
            return
        except self._smi.AmdSmiException:
            dev.errors += 1
            return
        for metric, value in zip(metrics, values):
            if value is None and metric not in dev.unsupported:
                dev.unsupported.add(metric)  # the library answered "N/A": this device lacks it
            row[metric] = value

    def _sample_device(self, dev: Device) -> dict:
        smi, h, row = self._smi, dev.handle, self._row(dev)
        current = smi.AmdSmiTemperatureMetric.CURRENT

        def power():
            info = smi.amdsmi_get_power_info(h)
            return _num(info.get("current_socket_power")), _num(info.get("average_socket_power"))

        def energy():
            e = smi.amdsmi_get_energy_count(h)
            return (e["energy_accumulator"] * e["counter_resolution"] * 1e-6,)  # µJ -> J

        def temp(sensor):
            return lambda: (_num(smi.amdsmi_get_temp_metric(h, sensor, current)),)

        def clock(kind):
            return lambda: (_num(smi.amdsmi_get_clock_info(h, kind).get("clk")),)

        def activity():
            a = smi.amdsmi_get_gpu_activity(h)
            return _num(a.get("gfx_activity")), _num(a.get("umc_activity"))

        def vram():
            v = smi.amdsmi_get_gpu_vram_usage(h)
            return _mib(v.get("vram_used")), _mib(v.get("vram_total"))

        def cap():
            c = _num(smi.amdsmi_get_power_cap_info(h).get("power_cap"))
            return (None if c is None else c * 1e-6,)  # µW -> W

        def throttle():
            status = smi.amdsmi_get_violation_status(h)
            bits = 0
            for key, bit in VIOLATION_BITS.items():
                if status.get(key) is True:
                    bits |= bit
            return (bits, *self._violations[dev.label].add(status))

        def xgmi():
            m = smi.amdsmi_get_gpu_metrics_info(h)
            return tuple(_link_bytes(m.get(key)) for key in ("xgmi_write_data_acc", "xgmi_read_data_acc"))

        call = self._call
        call(dev, row, ("power_w", "power_avg_w"), power)
        call(dev, row, ("energy_j",), energy)
        call(dev, row, ("temp_gpu_c",), temp(smi.AmdSmiTemperatureType.EDGE))
        call(dev, row, ("temp_hotspot_c",), temp(smi.AmdSmiTemperatureType.HOTSPOT))
        call(dev, row, ("temp_mem_c",), temp(smi.AmdSmiTemperatureType.VRAM))
        call(dev, row, ("sm_clock_mhz",), clock(smi.AmdSmiClkType.GFX))
        call(dev, row, ("mem_clock_mhz",), clock(smi.AmdSmiClkType.MEM))
        call(dev, row, ("util_gpu_pct", "util_mem_pct"), activity)
        call(dev, row, ("mem_used_bytes", "mem_total_bytes"), vram)
        call(dev, row, ("power_limit_w",), cap)
        call(dev, row, ("throttle_reasons", "violation_power_ns", "violation_thermal_ns"), throttle)
        call(dev, row, ("nvlink_tx_bytes", "nvlink_rx_bytes"), xgmi)
        row["errors"] = dev.errors
        return row


class Violations:
    """One GCD's violation time, in nanoseconds since the first reading, from AMD SMI's counters."""

    def __init__(self) -> None:
        self.last: dict | None = None
        self.totals = {column: 0 for column, _ in VIOLATION_COUNTERS}

    def add(self, status: dict) -> tuple[int | None, ...]:
        """The totals after this reading; None for a counter the GCD does not have ("N/A")."""
        now = {
            key: status.get(key) for key in ("reference_timestamp", "acc_counter", *(k for _, k in VIOLATION_COUNTERS))
        }
        if not all(isinstance(now[key], int) for key in ("reference_timestamp", "acc_counter")):
            return (None,) * len(VIOLATION_COUNTERS)
        last, self.last = self.last, now
        out: list[int | None] = []
        for column, key in VIOLATION_COUNTERS:
            if not isinstance(now[key], int):
                out.append(None)
                continue
            if last is not None and isinstance(last.get(key), int):
                ticks = now["acc_counter"] - last["acc_counter"]
                elapsed_ns = (now["reference_timestamp"] - last["reference_timestamp"]) * 1000   # µs
                if ticks > 0 and elapsed_ns > 0:   # a reset counter starts over: that interval is left out
                    self.totals[column] += round(elapsed_ns * min(1.0, max(0, now[key] - last[key]) / ticks))
            out.append(self.totals[column])
        return tuple(out)


def _link_bytes(links) -> int | None:
    """All XGMI links' accumulated kilobytes as bytes; None where the GCD reports none."""
    if not isinstance(links, list):
        return None
    known = [v for v in links if isinstance(v, int) and not isinstance(v, bool)]
    return sum(known) * XGMI_KIB if known else None


def _num(value) -> float | None:
    """amdsmi reports a missing value as the string "N/A"."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mib(value) -> int | None:
    return int(value) * 1024 * 1024 if isinstance(value, int) else None
