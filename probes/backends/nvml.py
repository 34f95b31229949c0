"""NVIDIA GPUs through NVML (nvidia-ml-py, module `pynvml`).

Per GPU per tick: one batched `nvmlDeviceGetFieldValues` (instant/average/memory power, total
energy, memory temperature, PCIe byte counters, NVLink throughput over all links), then GPU
temperature, SM/memory clocks, clocks-event (throttle) reasons, utilization, memory and the
enforced power limit. NVML has no field id for the GPU die temperature, hence the extra call.
The violation-time counters (power, thermal, sync boost) only grow and are read once a second;
the ticks between repeat the last reading.

Where the device supports GPM (GPU Performance Monitoring: Hopper and newer), one GPM sample at
least every 100 ms (NVML asks for that much between the two samples a metric is computed from)
gives SM activity, SM occupancy, tensor-core activity, DRAM bandwidth, and NVLink and PCIe
bandwidth; the ticks until the next one repeat its values, as they cover those ticks. PCIe
bandwidth then comes from GPM, not from the byte counters. A device without GPM has these null,
found out once (`nvmlGpmQueryDeviceSupport`).

`processes()` lists what runs on each GPU: NVML's compute and graphics processes with the memory
each holds, its SM share from the process-utilization samples since the last call, and its name
(NVML's, else the host's) and user.
"""

from __future__ import annotations

import time
from functools import partial

import psutil
import pynvml

from charllm.probes.backends.base import Backend, BackendUnavailable, Device, GpuProcess

UINT_MAX = 0xFFFFFFFF  # scopeId meaning "all NVLink links"

# (column, fieldId, scopeId, scale to the column's unit)
FIELDS: tuple[tuple[str, int, int, float], ...] = (
    ("power_w", pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU, 1e-3),      # mW
    ("power_avg_w", pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_POWER_SCOPE_GPU, 1e-3),
    ("mem_power_w", pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_MEMORY, 1e-3),
    ("energy_j", pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0, 1e-3),                      # mJ
    ("temp_mem_c", pynvml.NVML_FI_DEV_MEMORY_TEMP, 0, 1.0),
    ("pcie_tx_bytes", pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0, 1.0),    # counters -> rates below
    ("pcie_rx_bytes", pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0, 1.0),
    ("nvlink_tx_bytes", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX, 1024.0),    # KiB
    ("nvlink_rx_bytes", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX, 1024.0),
)
_INT_COLUMNS = {"nvlink_tx_bytes", "nvlink_rx_bytes"}
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
# GPM metrics: (column, metric id, scale to the column's unit). Percentages are 0-100; bandwidths MiB/s.
MIB = 1024.0 * 1024.0
GPM_METRICS: tuple[tuple[str, int, float], ...] = (
    ("sm_active_pct", pynvml.NVML_GPM_METRIC_SM_UTIL, 1.0),
    ("sm_occupancy_pct", pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, 1.0),
    ("tensor_active_pct", pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, 1.0),
    ("dram_bw_util_pct", pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, 1.0),
    ("nvlink_tx_bytes_s", pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, MIB),
    ("nvlink_rx_bytes_s", pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, MIB),
    ("pcie_tx_bytes_s", pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, MIB),
    ("pcie_rx_bytes_s", pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, MIB),
)
GPM_COLUMNS = tuple(column for column, _, _ in GPM_METRICS)
GPM_MIN_INTERVAL_S = 0.1    # "greater than 100ms due to the internal sample refresh rate" (NVML API reference)
VIOLATION_EVERY_S = 1.0     # cumulative counters: a second's resolution is plenty, and 3 calls a GPU saved a tick
# Violation-time counters: (column, perf policy), each nanoseconds of held-down clocks since driver load.
VIOLATIONS: tuple[tuple[str, int], ...] = (
    ("violation_power_ns", pynvml.NVML_PERF_POLICY_POWER),
    ("violation_thermal_ns", pynvml.NVML_PERF_POLICY_THERMAL),
    ("violation_sync_boost_ns", pynvml.NVML_PERF_POLICY_SYNC_BOOST),
)

# Answers that mean "this device will never report it".
NOT_SUPPORTED_CODES = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                       pynvml.NVML_ERROR_NO_PERMISSION}
NOT_SUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound,
                 pynvml.NVMLError_NoPermission)


class NvmlBackend(Backend):
    name = "nvml"
    metrics = ("power_w", "power_avg_w", "mem_power_w", "energy_j", "temp_gpu_c", "temp_mem_c",
               "sm_clock_mhz", "mem_clock_mhz", "util_gpu_pct", "util_mem_pct", "mem_used_bytes",
               "mem_total_bytes", "power_limit_w", "throttle_reasons", "pcie_tx_bytes_s",
               "pcie_rx_bytes_s", "nvlink_tx_bytes", "nvlink_rx_bytes",
               "sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_bw_util_pct",
               "nvlink_tx_bytes_s", "nvlink_rx_bytes_s",
               "violation_power_ns", "violation_thermal_ns", "violation_sync_boost_ns")

    def __init__(self) -> None:
        super().__init__()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise BackendUnavailable(f"nvmlInit failed: {exc} ({type(exc).__name__})") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            for i in range(count):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                self._devices.append(Device(f"gpu{i}", _text(pynvml.nvmlDeviceGetUUID(handle)),
                                            _text(pynvml.nvmlDeviceGetName(handle)), handle))
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise BackendUnavailable(f"NVML device query failed ({type(exc).__name__})") from None
        if not self._devices:
            pynvml.nvmlShutdown()
            raise BackendUnavailable("NVML found no GPUs")
        # Per device: the field requests still worth making, and the last PCIe counters for rates.
        self._fields = {d.label: list(FIELDS) for d in self._devices}
        self._pcie_prev: dict[str, tuple[float, int, int]] = {}
        self._throttle_fn = {d.label: pynvml.nvmlDeviceGetCurrentClocksEventReasons for d in self._devices}
        self._utilization_seen_us: dict[str, int] = {}   # per device: the newest process sample read
        self._gpm = {d.label: Gpm.open(d) for d in self._devices}
        self._violations: dict[str, tuple[float, dict]] = {}   # per device: when read, the readings
        for dev, gpm in zip(self._devices, self._gpm.values()):
            if gpm is None:
                dev.unsupported.update(c for c in GPM_COLUMNS if not c.startswith("pcie_"))
            else:   # PCIe bandwidth from GPM: the byte counters are not asked for
                self._fields[dev.label] = [f for f in FIELDS if not f[0].startswith("pcie_")]

    def close(self) -> None:
        for gpm in self._gpm.values():
            if gpm is not None:
                gpm.free()
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

    def sample(self) -> list[dict]:
        return [self._sample_device(d) for d in self._devices]

    def _sample_device(self, dev: Device) -> dict:
        row = self._row(dev)
        h = dev.handle
        self._read_fields(dev, row)
        read = self._read
        read(
            dev,
            row,
            ("temp_gpu_c",),
            lambda: (float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),),
            NOT_SUPPORTED,
            (pynvml.NVMLError,),
        )
        read(dev, row, ("sm_clock_mhz",), lambda: (float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),),
             NOT_SUPPORTED, (pynvml.NVMLError,))
        read(dev, row, ("mem_clock_mhz",), lambda: (float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),),
             NOT_SUPPORTED, (pynvml.NVMLError,))
        read(dev, row, ("throttle_reasons",), lambda: (self._throttle(dev),), NOT_SUPPORTED, (pynvml.NVMLError,))

        def util():
            u = pynvml.nvmlDeviceGetUtilizationRates(h)
            return float(u.gpu), float(u.memory)

        def memory():
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
            return int(m.used), int(m.total)

        read(dev, row, ("util_gpu_pct", "util_mem_pct"), util, NOT_SUPPORTED, (pynvml.NVMLError,))
        read(dev, row, ("mem_used_bytes", "mem_total_bytes"), memory, NOT_SUPPORTED, (pynvml.NVMLError,))
        read(dev, row, ("power_limit_w",), lambda: (pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,),
             NOT_SUPPORTED, (pynvml.NVMLError,))
        self._read_violations(dev, row)
        gpm = self._gpm[dev.label]
        if gpm is not None:
            read(dev, row, GPM_COLUMNS, gpm.read, NOT_SUPPORTED, (pynvml.NVMLError,))
        row["errors"] = dev.errors
        return row

    def _read_violations(self, dev: Device, row: dict) -> None:
        """The violation-time counters: read once every VIOLATION_EVERY_S, else the last reading."""
        now = time.monotonic()
        read_at, last = self._violations.get(dev.label, (-VIOLATION_EVERY_S, {}))
        if now - read_at < VIOLATION_EVERY_S:
            row.update(last)
            return
        got: dict = {}
        for column, policy in VIOLATIONS:
            self._read(dev, got, (column,),
                       partial(_violation_time, dev.handle, policy),
                       NOT_SUPPORTED, (pynvml.NVMLError,))
        self._violations[dev.label] = (now, got)
        row.update(got)

    def processes(self) -> list[GpuProcess]:
        out = []
        for dev in self._devices:
            if "processes" in dev.unsupported:
                continue
            held: dict[int, int | None] = {}      # pid -> bytes (a process may be both compute and graphics)
            try:
                for listing in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                                pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                    for proc in listing(dev.handle):
                        held.setdefault(int(proc.pid), proc.usedGpuMemory)   # None: the driver does not say
            except NOT_SUPPORTED:
                dev.unsupported.add("processes")
                continue
            except pynvml.NVMLError:
                dev.errors += 1
                continue
            sm = self._process_sm(dev) if held else {}
            out += [GpuProcess(dev.label, pid, *_process_owner(pid), used, sm.get(pid)) for pid, used in held.items()]
        return out

    def _process_sm(self, dev: Device) -> dict[int, float]:
        """pid -> SM share (%) of its newest utilization sample since the previous call."""
        if "process_sm" in dev.unsupported:
            return {}
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(dev.handle, self._utilization_seen_us.get(dev.label, 0))
        except NOT_SUPPORTED:
            dev.unsupported.add("process_sm")
            return {}
        except pynvml.NVMLError:      # NotFound: no sample since the last call; others are transient
            return {}
        newest: dict[int, tuple[int, float]] = {}
        for sample in samples:
            if sample.timeStamp >= newest.get(sample.pid, (-1, 0.0))[0]:
                newest[sample.pid] = (sample.timeStamp, float(sample.smUtil))
        if samples:
            self._utilization_seen_us[dev.label] = max(sample.timeStamp for sample in samples)
        return {pid: sm for pid, (_, sm) in newest.items()}

    def _throttle(self, dev: Device) -> int:
        """Clocks-event reasons; drivers older than the rename only know the Throttle name."""
        try:
            return int(self._throttle_fn[dev.label](dev.handle))
        except pynvml.NVMLError_FunctionNotFound:
            if self._throttle_fn[dev.label] is pynvml.nvmlDeviceGetCurrentClocksThrottleReasons:
                raise
            self._throttle_fn[dev.label] = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
            return int(self._throttle_fn[dev.label](dev.handle))

    def _read_fields(self, dev: Device, row: dict) -> None:
        fields = self._fields[dev.label]
        if not fields:
            return
        try:
            values = pynvml.nvmlDeviceGetFieldValues(dev.handle, [(f[1], f[2]) for f in fields])
        except NOT_SUPPORTED:
            dev.unsupported.update(f[0] for f in fields)
            fields.clear()
            return
        except pynvml.NVMLError:
            dev.errors += 1
            return
        now = time.monotonic()
        keep, counters, failed = [], {}, False
        for spec, value in zip(fields, values):
            column, _fid, _scope, scale = spec
            if value.nvmlReturn in NOT_SUPPORTED_CODES:
                dev.unsupported.add(column)
                continue
            keep.append(spec)
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                failed = True
                continue
            raw = getattr(value.value, _VALUE_MEMBER.get(value.valueType, "ullVal"))
            if column.startswith("pcie_"):
                counters[column] = int(raw)
            elif column in _INT_COLUMNS:
                row[column] = int(raw * scale)
            else:
                row[column] = float(raw) * scale
        dev.errors += failed
        self._fields[dev.label] = keep
        self._pcie_rates(dev, row, now, counters)

    def _pcie_rates(self, dev: Device, row: dict, now: float, counters: dict) -> None:
        """Bytes/s from the cumulative PCIe counters (cheaper than nvmlDeviceGetPcieThroughput's 20 ms)."""
        for column in ("pcie_tx_bytes", "pcie_rx_bytes"):
            if column in dev.unsupported:
                dev.unsupported.add(column + "_s")
        if len(counters) != 2:
            return
        prev = self._pcie_prev.get(dev.label)
        self._pcie_prev[dev.label] = (now, counters["pcie_tx_bytes"], counters["pcie_rx_bytes"])
        if prev and now > prev[0]:
            dt = now - prev[0]
            row["pcie_tx_bytes_s"] = max(0, counters["pcie_tx_bytes"] - prev[1]) / dt
            row["pcie_rx_bytes_s"] = max(0, counters["pcie_rx_bytes"] - prev[2]) / dt


class Gpm:
    """One device's GPM samples: two buffers, the older and the newer, and the metrics between them."""

    def __init__(self, dev: Device, samples: list) -> None:
        self.dev, self.samples = dev, samples
        self.taken_at = time.monotonic()
        self.values: tuple[float | None, ...] = (None,) * len(GPM_METRICS)
        # One request, filled in once: each read swaps its two samples (the struct is 20 KiB)
        self.request = pynvml.c_nvmlGpmMetricsGet_t()
        self.request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        self.request.numMetrics = len(GPM_METRICS)

    @classmethod
    def open(cls, dev: Device) -> "Gpm | None":
        """GPM for `dev` with its first sample taken; None where the device (or driver) has no GPM."""
        try:
            if not pynvml.nvmlGpmQueryDeviceSupport(dev.handle).isSupportedDevice:
                return None
            samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        except pynvml.NVMLError:   # a driver without GPM answers FunctionNotFound or NotSupported
            return None
        gpm = cls(dev, samples)
        try:
            pynvml.nvmlGpmSampleGet(dev.handle, samples[0])
        except pynvml.NVMLError:
            gpm.free()
            return None
        return gpm

    def read(self) -> tuple[float | None, ...]:
        """The metrics over the interval since the last GPM sample, once it is GPM_MIN_INTERVAL_S
        old; until then the last interval's (None before the first)."""
        now = time.monotonic()
        if now - self.taken_at < GPM_MIN_INTERVAL_S:
            return self.values
        older, newer = self.samples
        pynvml.nvmlGpmSampleGet(self.dev.handle, newer)
        self.samples, self.taken_at = [newer, older], now
        request = self.request
        request.sample1, request.sample2 = older, newer
        for i, (_, metric, _) in enumerate(GPM_METRICS):   # NVML writes each result over its entry
            request.metrics[i].metricId = metric
        pynvml.nvmlGpmMetricsGet(request)
        values = []
        for (column, _, scale), metric in zip(GPM_METRICS, request.metrics):
            if metric.nvmlReturn in NOT_SUPPORTED_CODES:
                self.dev.unsupported.add(column)   # one metric this device lacks (a PCIe-only board's NVLink)
            values.append(metric.value * scale if metric.nvmlReturn == pynvml.NVML_SUCCESS else None)
        self.values = tuple(values)
        return self.values

    def free(self) -> None:
        for sample in self.samples:
            try:
                pynvml.nvmlGpmSampleFree(sample)
            except pynvml.NVMLError:
                pass
        self.samples = []


def _process_owner(pid: int) -> tuple[str, str]:
    """(name, user) of a process: NVML's name, else the host's; "" where neither can be read (a
    process of another container, or one that has just exited)."""
    try:
        name = _text(pynvml.nvmlSystemGetProcessName(pid)).rpartition("/")[2]
    except pynvml.NVMLError:
        name = ""
    user = ""
    try:
        proc = psutil.Process(pid)
        name = name or proc.name()
        user = proc.username()
    except (psutil.Error, KeyError):        # KeyError: a uid with no name on this host
        pass
    return name, user


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _violation_time(handle, policy: int) -> tuple[int]:
    """The time (ns) the device spent held back by `policy` (an NVML_PERF_POLICY_*)."""
    return (int(pynvml.nvmlDeviceGetViolationStatus(handle, policy).violationTime),)
