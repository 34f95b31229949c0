"""A fake AMD SMI library behind the real `amdsmi` package.

The real package cannot import without libamd_smi.so, so `load_real_amdsmi` lets it load
against a stub shared library (every C symbol a no-op): the Python package — its enums
(AmdSmiTemperatureType, AmdSmiClkType, ...), status codes and exception classes — is the real
one. `FakeAmdSmi.install` then replaces the high-level functions our backend calls with fakes
returning the same dict shapes (and "N/A" strings) the real ones do.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
from dataclasses import dataclass, field

from charllm.probes.backends.amdsmi import import_amdsmi
from charllm.probes.backends.base import BackendUnavailable


class _StubFunction:
    def __init__(self, name: str) -> None:
        self.__name__ = name
        self.argtypes = None
        self.restype = None

    def __call__(self, *args):
        return 0


class _StubLibrary:
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        fn = _StubFunction(name)
        setattr(self, name, fn)
        return fn


def load_real_amdsmi(monkeypatch):
    """Import the real amdsmi package against a stub libamd_smi.so (pair with unload_amdsmi)."""
    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if "amd_smi" in str(name):
            return _StubLibrary()
        return real_cdll(name, *args, **kwargs)

    unload_amdsmi()
    with monkeypatch.context() as patch:
        patch.setattr(ctypes, "CDLL", cdll)
        return importlib.import_module("amdsmi")


def unload_amdsmi() -> None:
    """Forget the stub-loaded package so later imports meet the machine's real situation."""
    for name in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
        del sys.modules[name]


@dataclass
class FakeGcd:
    uuid: str
    market_name: str = "AMD Instinct MI250X"
    current_socket_power: object = 480        # W; "N/A" when the board lacks it
    average_socket_power: object = 470
    energy_accumulator: int = 1_000_000
    counter_resolution: float = 15.259        # µJ per count
    temps: dict = field(default_factory=lambda: {"EDGE": 55, "HOTSPOT": 71, "VRAM": 62})
    gfx_clk: int = 1700
    mem_clk: int = 1600
    gfx_activity: object = 93
    umc_activity: object = 40
    vram_used_mb: int = 50_000
    vram_total_mb: int = 65_520
    power_cap_uw: int = 500_000_000
    violations: dict = field(default_factory=lambda: {"active_ppt_pwr": True, "active_socket_thrm": False,
                                                      "active_prochot_thrm": False, "active_hbm_thrm": False,
                                                      "active_vr_thrm": False})
    # amdsmi_get_violation_status's counters ("N/A" where the GCD lacks one: MI200 and older)
    reference_us: object = 1_000_000                     # CPU timestamp of the reading (µs)
    acc_counter: object = 1000                           # the firmware's violation-tick counter
    acc_ppt_pwr: object = 100                            # PVIOL ticks
    acc_socket_thrm: object = 0                          # TVIOL ticks
    xgmi_write_kb: list = field(default_factory=lambda: [1000, 2000] + ["N/A"] * 6)   # per link, cumulative
    xgmi_read_kb: list = field(default_factory=lambda: [3000, 4000] + ["N/A"] * 6)
    not_supported: set = field(default_factory=set)     # function names answering NOT_SUPPORTED
    failures: dict = field(default_factory=dict)         # function name -> transient errors left


class FakeAmdSmi:
    def __init__(self, smi, gcds: list[FakeGcd] | None = None, init_error: bool = False) -> None:
        self.smi = smi
        self.gcds = gcds if gcds is not None else [FakeGcd("gcd-uuid-0"), FakeGcd("gcd-uuid-1")]
        self.handles = [smi.amdsmi_wrapper.amdsmi_processor_handle(1000 + i) for i in range(len(self.gcds))]
        self.init_error = init_error
        self.calls: dict[str, int] = {}

    def install(self, monkeypatch) -> "FakeAmdSmi":
        for name in ("amdsmi_init", "amdsmi_shut_down", "amdsmi_get_processor_handles", "amdsmi_get_gpu_device_uuid",
                     "amdsmi_get_gpu_asic_info", "amdsmi_get_power_info", "amdsmi_get_energy_count",
                     "amdsmi_get_temp_metric", "amdsmi_get_clock_info", "amdsmi_get_gpu_activity",
                     "amdsmi_get_gpu_vram_usage", "amdsmi_get_power_cap_info", "amdsmi_get_violation_status",
                     "amdsmi_get_gpu_metrics_info"):
            monkeypatch.setattr(self.smi, name, self._counted(name, getattr(self, name)))
        return self

    def _counted(self, name, fn):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)
        return call

    def _gcd(self, handle, name: str) -> FakeGcd:
        if not isinstance(handle, self.smi.amdsmi_wrapper.amdsmi_processor_handle):
            raise self.smi.AmdSmiParameterException(handle, self.smi.amdsmi_wrapper.amdsmi_processor_handle)
        gcd = self.gcds[[h.value for h in self.handles].index(handle.value)]
        status = self.smi.amdsmi_wrapper
        if name in gcd.not_supported:
            raise self.smi.AmdSmiLibraryException(status.AMDSMI_STATUS_NOT_SUPPORTED)
        if gcd.failures.get(name, 0) > 0:
            gcd.failures[name] -= 1
            raise self.smi.AmdSmiLibraryException(status.AMDSMI_STATUS_BUSY)
        return gcd

    def amdsmi_init(self, flag=None):
        if self.init_error:
            raise self.smi.AmdSmiLibraryException(self.smi.amdsmi_wrapper.AMDSMI_STATUS_INIT_ERROR)

    def amdsmi_shut_down(self):
        pass

    def amdsmi_get_processor_handles(self):
        return list(self.handles)

    def amdsmi_get_gpu_device_uuid(self, handle):
        return self._gcd(handle, "amdsmi_get_gpu_device_uuid").uuid

    def amdsmi_get_gpu_asic_info(self, handle):
        return {"market_name": self._gcd(handle, "amdsmi_get_gpu_asic_info").market_name, "vendor_id": 0x1002}

    def amdsmi_get_power_info(self, handle):
        g = self._gcd(handle, "amdsmi_get_power_info")
        return {"socket_power": g.current_socket_power, "current_socket_power": g.current_socket_power,
                "average_socket_power": g.average_socket_power, "gfx_voltage": "N/A", "soc_voltage": "N/A",
                "mem_voltage": "N/A", "power_limit": 500}

    def amdsmi_get_energy_count(self, handle):
        g = self._gcd(handle, "amdsmi_get_energy_count")
        return {"energy_accumulator": g.energy_accumulator, "counter_resolution": g.counter_resolution, "timestamp": 1}

    def amdsmi_get_temp_metric(self, handle, sensor, metric):
        g = self._gcd(handle, "amdsmi_get_temp_metric")
        assert isinstance(sensor, self.smi.AmdSmiTemperatureType)
        assert metric == self.smi.AmdSmiTemperatureMetric.CURRENT
        if sensor.name not in g.temps:
            raise self.smi.AmdSmiLibraryException(self.smi.amdsmi_wrapper.AMDSMI_STATUS_NOT_SUPPORTED)
        return g.temps[sensor.name]

    def amdsmi_get_clock_info(self, handle, kind):
        g = self._gcd(handle, "amdsmi_get_clock_info")
        clk = {self.smi.AmdSmiClkType.GFX: g.gfx_clk, self.smi.AmdSmiClkType.MEM: g.mem_clk}[kind]
        return {"clk": clk, "min_clk": 500, "max_clk": 1700, "clk_locked": False, "clk_deep_sleep": "N/A"}

    def amdsmi_get_gpu_activity(self, handle):
        g = self._gcd(handle, "amdsmi_get_gpu_activity")
        return {"gfx_activity": g.gfx_activity, "umc_activity": g.umc_activity, "mm_activity": "N/A"}

    def amdsmi_get_gpu_vram_usage(self, handle):
        g = self._gcd(handle, "amdsmi_get_gpu_vram_usage")
        return {"vram_total": g.vram_total_mb, "vram_used": g.vram_used_mb}

    def amdsmi_get_power_cap_info(self, handle):
        g = self._gcd(handle, "amdsmi_get_power_cap_info")
        return {"power_cap": g.power_cap_uw, "default_power_cap": g.power_cap_uw, "dpm_cap": 0,
                "min_power_cap": 0, "max_power_cap": g.power_cap_uw}

    def amdsmi_get_violation_status(self, handle):
        g = self._gcd(handle, "amdsmi_get_violation_status")
        return {"reference_timestamp": g.reference_us, "violation_timestamp": 1, "acc_counter": g.acc_counter,
                "acc_prochot_thrm": 0, "acc_ppt_pwr": g.acc_ppt_pwr, "acc_socket_thrm": g.acc_socket_thrm,
                "acc_vr_thrm": 0, "acc_hbm_thrm": 0, "per_ppt_pwr": "N/A", "per_socket_thrm": "N/A", **g.violations}

    def amdsmi_get_gpu_metrics_info(self, handle):
        """The keys of the real dict the backend reads ("N/A" for an absent link), among a few others."""
        g = self._gcd(handle, "amdsmi_get_gpu_metrics_info")
        return {"temperature_edge": g.temps.get("EDGE", "N/A"), "average_gfx_activity": g.gfx_activity,
                "xgmi_link_width": 16, "xgmi_link_speed": 32, "pcie_bandwidth_acc": "N/A",
                "xgmi_read_data_acc": list(g.xgmi_read_kb), "xgmi_write_data_acc": list(g.xgmi_write_kb)}


def real_amdsmi_present() -> bool:
    """Whether the real AMD SMI library loads here (an AMD GPU machine)."""
    try:
        import_amdsmi()
    except BackendUnavailable:
        return False
    return True
