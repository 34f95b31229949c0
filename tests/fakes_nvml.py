"""A fake NVML behind the real `pynvml` module.

Only the C library is faked: the functions our backend calls are replaced on the real module
(monkeypatch, which refuses a name the real module lacks), take the real functions' parameters, and
answer with pynvml's own return types (c_nvmlFieldValue_t arrays, c_nvmlUtilization_t, c_nvmlMemory_t,
the process lists' friendly objects, c_nvmlProcessUtilizationSample_t, c_nvmlViolationTime_t,
c_nvmlGpmSupport_t, GPM sample buffers and a filled-in c_nvmlGpmMetricsGet_t), constants and exception
classes (NVMLError(code) maps to NVMLError_NotSupported etc. exactly as the real binding does).

GPM as the driver does it: a sample buffer is allocated (nvmlGpmSampleAlloc), filled from a device
(nvmlGpmSampleGet), and nvmlGpmMetricsGet computes each requested metric from two buffers of the
same device, each with its own nvmlReturn. The fake records the interval between the two samples of
every computation (`gpm_intervals`), and answers the GPU's `gpm_values` for it.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import pynvml


@dataclass
class FakeProcess:
    pid: int
    name: str = "python"
    used_bytes: int | None = 40 * 2**30      # None: the driver does not say (pynvml gives None)
    sm_util: int | None = 90                 # None: no utilization sample for it
    graphics: bool = False


@dataclass
class FakeGpu:
    index: int
    uuid: str = ""
    name: str = "NVIDIA H100 80GB HBM3"
    power_mw: int = 650_000
    power_avg_mw: int = 640_000
    mem_power_mw: int = 80_000
    energy_mj: int = 123_456_789
    temp_c: int = 71
    mem_temp_c: int = 78
    sm_clock_mhz: int = 1755
    mem_clock_mhz: int = 2619
    throttle: int = pynvml.nvmlClocksEventReasonSwPowerCap
    util_gpu: int = 98
    util_mem: int = 41
    mem_used: int = 60 * 2**30
    mem_total: int = 80 * 2**30
    power_limit_mw: int = 700_000
    pcie_tx_bytes: int = 10_000
    pcie_rx_bytes: int = 20_000
    nvlink_tx_kib: int = 1_000
    nvlink_rx_kib: int = 2_000
    old_driver: bool = False                                 # no nvmlDeviceGetCurrentClocksEventReasons
    unsupported_fields: set = field(default_factory=set)     # {(fieldId, scopeId)}
    unsupported_calls: set = field(default_factory=set)      # {"nvmlDeviceGetTemperature", ...}
    failures: dict = field(default_factory=dict)             # {"nvmlDeviceGetClockInfo": n} transient errors
    field_failures: dict = field(default_factory=dict)       # {(fieldId, scopeId): n} per-field transient errors
    processes: list = field(default_factory=list)            # FakeProcess
    utilization_us: int | None = None    # the driver's newest process sample (µs); None: it samples all the time
    gpm: bool = False                    # GPM supported (Hopper and newer); a driver without GPM: gpm_driver False
    gpm_driver: bool = True
    gpm_values: dict = field(default_factory=lambda: {
        pynvml.NVML_GPM_METRIC_SM_UTIL: 62.5, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 31.25,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 44.0, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 55.5,
        pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 1024.0, pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 2048.0,
        pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 16.0, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 32.0})
    gpm_unsupported: set = field(default_factory=set)       # metric ids this device answers NOT_SUPPORTED for
    violation_ns: dict = field(default_factory=lambda: {     # perf policy -> cumulative violation time
        pynvml.NVML_PERF_POLICY_POWER: 5_000_000_000, pynvml.NVML_PERF_POLICY_THERMAL: 0,
        pynvml.NVML_PERF_POLICY_SYNC_BOOST: 0})


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu] | None = None, init_error: int | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(0)]
        for gpu in self.gpus:
            gpu.uuid = gpu.uuid or f"GPU-fake-{gpu.index:04d}"
        self.init_error = init_error
        self.calls: dict[str, int] = {}
        self.field_requests: list[list[tuple[int, int]]] = []
        self.gpm_samples: dict[int, tuple[FakeGpu, float] | None] = {}   # buffer address -> (device, when filled)
        self.gpm_buffers: list = []       # keeps the buffers' memory alive while allocated
        self.gpm_intervals: list[float] = []

    # -- installing ------------------------------------------------------------------------
    def install(self, monkeypatch) -> "FakeNvml":
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetFieldValues",
                     "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
                     "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
                     "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                     "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPcieThroughput",
                     "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                     "nvmlDeviceGetProcessUtilization", "nvmlSystemGetProcessName",
                     "nvmlDeviceGetViolationStatus", "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc",
                     "nvmlGpmSampleFree", "nvmlGpmSampleGet", "nvmlGpmMetricsGet"):
            monkeypatch.setattr(pynvml, name, self._counted(name, getattr(self, name)))
        return self

    def _counted(self, name, fn):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)
        return call

    def _check(self, gpu: FakeGpu, name: str) -> None:
        """Raise as the real binding does when the driver answers an error code."""
        if name in gpu.unsupported_calls:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gpu.failures.get(name, 0) > 0:
            gpu.failures[name] -= 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    # -- the NVML API ----------------------------------------------------------------------
    def nvmlInit(self):
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        # NVML takes "GPU-<uuid>" for a whole GPU and "MIG-<uuid>" for a MIG instance, nothing else.
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, gpu):
        return gpu.uuid  # pynvml's @convertStrBytes gives str on Python 3

    def nvmlDeviceGetName(self, gpu):
        return gpu.name

    def nvmlDeviceGetFieldValues(self, gpu, field_ids):
        requests = [f if isinstance(f, tuple) else (f, 0) for f in field_ids]
        self.field_requests.append(requests)
        values = (pynvml.c_nvmlFieldValue_t * len(requests))()
        for value, (fid, scope) in zip(values, requests):
            value.fieldId, value.scopeId = fid, scope
            if (fid, scope) in gpu.unsupported_fields:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            if gpu.field_failures.get((fid, scope), 0) > 0:
                gpu.field_failures[(fid, scope)] -= 1
                value.nvmlReturn = pynvml.NVML_ERROR_TIMEOUT
                continue
            value.nvmlReturn = pynvml.NVML_SUCCESS
            kind, number = self._field(gpu, fid, scope)
            value.valueType = kind
            member = {pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
                      pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal"}[kind]
            setattr(value.value, member, number)
        return values

    def _field(self, gpu: FakeGpu, fid: int, scope: int):
        uint, ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        if fid == pynvml.NVML_FI_DEV_POWER_INSTANT:
            return uint, gpu.mem_power_mw if scope == pynvml.NVML_POWER_SCOPE_MEMORY else gpu.power_mw
        if fid == pynvml.NVML_FI_DEV_POWER_AVERAGE:
            return uint, gpu.power_avg_mw
        if fid == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return ull, gpu.energy_mj
        if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return uint, gpu.mem_temp_c
        if fid == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
            return ull, gpu.pcie_tx_bytes
        if fid == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
            return ull, gpu.pcie_rx_bytes
        # NVLink throughput: the sum over links only with scopeId UINT_MAX, else link `scope` alone.
        links = 18 if scope == 0xFFFFFFFF else 1
        if fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
            return ull, gpu.nvlink_tx_kib * links
        if fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
            return ull, gpu.nvlink_rx_kib * links
        raise AssertionError(f"unexpected field id {fid}")

    def nvmlDeviceGetTemperature(self, gpu, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        self._check(gpu, "nvmlDeviceGetTemperature")
        return gpu.temp_c

    def nvmlDeviceGetClockInfo(self, gpu, kind):
        self._check(gpu, "nvmlDeviceGetClockInfo")
        return {pynvml.NVML_CLOCK_SM: gpu.sm_clock_mhz, pynvml.NVML_CLOCK_MEM: gpu.mem_clock_mhz}[kind]

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu):
        if gpu.old_driver:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        self._check(gpu, "nvmlDeviceGetCurrentClocksEventReasons")
        return gpu.throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu):
        self._check(gpu, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return gpu.throttle

    def nvmlDeviceGetUtilizationRates(self, gpu):
        self._check(gpu, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_mem)

    def nvmlDeviceGetMemoryInfo(self, gpu, version=None):
        self._check(gpu, "nvmlDeviceGetMemoryInfo")
        return pynvml.c_nvmlMemory_t(total=gpu.mem_total, free=gpu.mem_total - gpu.mem_used, used=gpu.mem_used)

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu):
        self._check(gpu, "nvmlDeviceGetEnforcedPowerLimit")
        return gpu.power_limit_mw

    def nvmlDeviceGetPcieThroughput(self, gpu, counter):
        self._check(gpu, "nvmlDeviceGetPcieThroughput")
        return 0

    # Processes: pynvml returns friendly objects made from c_nvmlProcessInfo_t, usedGpuMemory None
    # where the driver answers NVML_VALUE_NOT_AVAILABLE.
    def _processes(self, handle, name: str, graphics: bool):
        self._check(handle, name)
        out = []
        for proc in handle.processes:
            if proc.graphics != graphics:
                continue
            used = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if proc.used_bytes is None else proc.used_bytes
            obj = pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_t(pid=proc.pid, usedGpuMemory=used))
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self._processes(handle, "nvmlDeviceGetComputeRunningProcesses", graphics=False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return self._processes(handle, "nvmlDeviceGetGraphicsRunningProcesses", graphics=True)

    def nvmlDeviceGetProcessUtilization(self, handle, timeStamp):  # pynvml's parameter name
        """Samples newer than timeStamp; NVML_ERROR_NOT_FOUND when there are none, as the driver answers."""
        self._check(handle, "nvmlDeviceGetProcessUtilization")
        newest = handle.utilization_us if handle.utilization_us is not None else time.time_ns() // 1000
        samples = [pynvml.c_nvmlProcessUtilizationSample_t(pid=p.pid, timeStamp=newest,
                                                            smUtil=p.sm_util, memUtil=0, encUtil=0, decUtil=0)
                   for p in handle.processes if p.sm_util is not None and newest > timeStamp]
        if not samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    def nvmlDeviceGetViolationStatus(self, gpu, perfPolicyType):  # pynvml's parameter name
        self._check(gpu, "nvmlDeviceGetViolationStatus")
        if perfPolicyType not in gpu.violation_ns:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlViolationTime_t(referenceTime=time.time_ns() // 1000,
                                            violationTime=gpu.violation_ns[perfPolicyType])

    # -- GPM -----------------------------------------------------------------------------------
    def _gpm_driver(self, gpu: FakeGpu | None = None) -> None:
        if gpu is not None and not gpu.gpm_driver or not all(g.gpm_driver for g in self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlGpmQueryDeviceSupport(self, gpu):
        self._gpm_driver(gpu)
        self._check(gpu, "nvmlGpmQueryDeviceSupport")
        return pynvml.c_nvmlGpmSupport_t(version=pynvml.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(gpu.gpm))

    def nvmlGpmSampleAlloc(self):
        self._gpm_driver()
        buffer = pynvml.struct_c_nvmlGpmSample_t()
        self.gpm_buffers.append(buffer)
        self.gpm_samples[ctypes.addressof(buffer)] = None
        return ctypes.pointer(buffer)   # a c_nvmlGpmSample_t, as nvmlGpmSampleAlloc fills it in

    def _buffer(self, sample) -> int:
        address = ctypes.addressof(sample.contents) if sample else 0
        if address not in self.gpm_samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return address

    def nvmlGpmSampleFree(self, gpmSample):  # pynvml's parameter name
        del self.gpm_samples[self._buffer(gpmSample)]

    def nvmlGpmSampleGet(self, gpu, gpmSample):  # pynvml's parameter name
        self._check(gpu, "nvmlGpmSampleGet")
        if not gpu.gpm:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.gpm_samples[self._buffer(gpmSample)] = (gpu, time.monotonic())
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet):  # pynvml's parameter name
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self.gpm_samples[self._buffer(metricsGet.sample1)]
        second = self.gpm_samples[self._buffer(metricsGet.sample2)]
        if first is None or second is None or first[0] is not second[0] \
                or not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = first[0]
        self.gpm_intervals.append(second[1] - first[1])
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]   # a view into the caller's struct
            if metric.metricId in gpu.gpm_unsupported or metric.metricId not in gpu.gpm_values:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, gpu.gpm_values[metric.metricId]
        return metricsGet

    def nvmlSystemGetProcessName(self, pid):
        for gpu in self.gpus:
            for proc in gpu.processes:
                if proc.pid == pid:
                    return proc.name
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


def real_nvml_present() -> bool:
    """Whether the real NVML initialises here (a GPU machine)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True
