"""NVML and AMD SMI backends against fakes behind the real pynvml / amdsmi modules."""

from __future__ import annotations

import pynvml
import pytest

from charllm.probes.backends import open_backend, open_backends
from charllm.probes.backends.base import BackendUnavailable
from charllm.probes.core.errors import UserError
from charllm.probes.store.schema import THROTTLE_BITS
from fakes_amdsmi import FakeAmdSmi, FakeGcd, load_real_amdsmi, real_amdsmi_present, unload_amdsmi
from fakes_nvml import FakeGpu, FakeNvml, FakeProcess, real_nvml_present

UINT_MAX = 0xFFFFFFFF


# -- NVML ---------------------------------------------------------------------------------------
def test_nvml_reads_every_metric_in_schema_units(monkeypatch):
    FakeNvml([FakeGpu(0), FakeGpu(1, temp_c=80)]).install(monkeypatch)
    backend = open_backend("nvml")
    rows = backend.sample()
    assert [r["device"] for r in rows] == ["gpu0", "gpu1"]
    row = rows[0]
    assert row["uuid"] == "GPU-fake-0000" and row["backend"] == "nvml" and row["simulated"] is False
    assert row["power_w"] == pytest.approx(650.0) and row["power_avg_w"] == pytest.approx(640.0)
    assert row["mem_power_w"] == pytest.approx(80.0)
    assert row["energy_j"] == pytest.approx(123_456.789)
    assert row["temp_gpu_c"] == 71 and row["temp_mem_c"] == 78 and rows[1]["temp_gpu_c"] == 80
    assert row["sm_clock_mhz"] == 1755 and row["mem_clock_mhz"] == 2619
    assert row["throttle_reasons"] == THROTTLE_BITS["sw_power_cap"]
    assert row["util_gpu_pct"] == 98 and row["util_mem_pct"] == 41
    assert row["mem_used_bytes"] == 60 * 2**30 and row["mem_total_bytes"] == 80 * 2**30
    assert row["power_limit_w"] == pytest.approx(700.0)
    assert row["errors"] == 0


def test_nvml_one_batched_field_call_per_gpu_with_nvlink_over_all_links(monkeypatch):
    fake = FakeNvml([FakeGpu(0), FakeGpu(1)]).install(monkeypatch)
    row = open_backend("nvml").sample()[0]
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2
    requested = set(fake.field_requests[0])
    assert (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX) in requested
    assert (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX) in requested
    assert (pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_MEMORY) in requested
    # 18 links x 1000 KiB: the sum over all links, in bytes
    assert row["nvlink_tx_bytes"] == 18 * 1000 * 1024 and row["nvlink_rx_bytes"] == 18 * 2000 * 1024


def test_nvml_pcie_rates_come_from_counter_deltas(monkeypatch):
    gpu = FakeGpu(0)
    FakeNvml([gpu]).install(monkeypatch)
    backend = open_backend("nvml")
    assert backend.sample()[0].get("pcie_tx_bytes_s") is None  # a rate needs two readings
    gpu.pcie_tx_bytes += 5_000_000
    row = backend.sample()[0]
    assert row["pcie_tx_bytes_s"] > 0 and row["pcie_rx_bytes_s"] == 0


def test_nvml_unsupported_metrics_are_null_and_asked_once(monkeypatch):
    gpu = FakeGpu(0, unsupported_fields={(pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_MEMORY)},
                  unsupported_calls={"nvmlDeviceGetTemperature"})
    fake = FakeNvml([gpu]).install(monkeypatch)
    backend = open_backend("nvml")
    rows = [backend.sample()[0] for _ in range(3)]
    assert all(r.get("mem_power_w") is None and r.get("temp_gpu_c") is None for r in rows)
    assert all(r["power_w"] == pytest.approx(650.0) for r in rows)
    assert fake.calls["nvmlDeviceGetTemperature"] == 1
    later = set(fake.field_requests[-1])
    assert (pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_MEMORY) not in later
    assert (pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU) in later
    supported = backend.supported_metrics(backend.devices()[0])
    assert "mem_power_w" not in supported and "temp_gpu_c" not in supported and "power_w" in supported
    assert rows[-1]["errors"] == 0  # NotSupported is not an error


def test_nvml_transient_errors_are_counted_not_fatal(monkeypatch):
    gpu = FakeGpu(0, failures={"nvmlDeviceGetClockInfo": 1},
                  field_failures={(pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0): 1})
    FakeNvml([gpu]).install(monkeypatch)
    backend = open_backend("nvml")
    first, second = backend.sample()[0], backend.sample()[0]
    assert first.get("sm_clock_mhz") is None and first.get("energy_j") is None
    assert first["power_w"] == pytest.approx(650.0)
    assert first["errors"] == 2
    assert second["sm_clock_mhz"] == 1755 and second["energy_j"] == pytest.approx(123_456.789)
    assert second["errors"] == 2  # cumulative


def test_nvml_old_driver_falls_back_to_throttle_reasons_name(monkeypatch):
    gpu = FakeGpu(0, old_driver=True, throttle=pynvml.nvmlClocksThrottleReasonSwThermalSlowdown)
    fake = FakeNvml([gpu]).install(monkeypatch)
    backend = open_backend("nvml")
    rows = [backend.sample()[0] for _ in range(2)]
    assert [r["throttle_reasons"] for r in rows] == [THROTTLE_BITS["sw_thermal"]] * 2
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # the new name is tried once
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2
    assert rows[-1]["errors"] == 0


def test_nvml_lists_each_gpus_processes_with_memory_sm_share_name_and_user(monkeypatch):
    import getpass
    import os

    gpu0 = FakeGpu(0, processes=[FakeProcess(4242, "pretrain_gpt.py", 60 * 2**30, 97),
                                 FakeProcess(os.getpid(), "", None, None, graphics=True)], utilization_us=1_000_000)
    gpu1 = FakeGpu(1, processes=[])
    fake = FakeNvml([gpu0, gpu1]).install(monkeypatch)
    backend = open_backend("nvml")
    procs = {p.pid: p for p in backend.processes()}
    assert sorted(procs) == sorted([4242, os.getpid()]) and {p.device for p in procs.values()} == {"gpu0"}
    trainer, this = procs[4242], procs[os.getpid()]
    assert (trainer.name, trainer.used_bytes, trainer.sm_pct) == ("pretrain_gpt.py", 60 * 2**30, 97.0)
    # NVML knows no name for it: the host's is used, with its user; the driver gives no memory figure
    assert this.name.startswith("python") and this.user == getpass.getuser() and this.used_bytes is None
    assert this.sm_pct is None
    assert fake.calls["nvmlDeviceGetProcessUtilization"] == 1            # gpu1 has nothing to ask about
    # No utilization sample since the last call (the driver answers NOT_FOUND): no share, no error.
    again = {p.pid: p for p in backend.processes()}
    assert again[4242].sm_pct is None and backend.devices()[0].errors == 0
    gpu0.utilization_us += 500_000
    assert {p.pid: p for p in backend.processes()}[4242].sm_pct == 97.0


def test_nvml_processes_unsupported_are_asked_once_and_errors_counted(monkeypatch):
    gpu0 = FakeGpu(0, processes=[FakeProcess(1)], unsupported_calls={"nvmlDeviceGetComputeRunningProcesses"})
    gpu1 = FakeGpu(1, processes=[FakeProcess(2)], failures={"nvmlDeviceGetComputeRunningProcesses": 1})
    fake = FakeNvml([gpu0, gpu1]).install(monkeypatch)
    backend = open_backend("nvml")
    assert backend.processes() == []                       # gpu0: not supported; gpu1: a transient error
    assert backend.devices()[1].errors == 1
    assert [p.pid for p in backend.processes()] == [2]
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 3     # gpu0 once, gpu1 twice


def test_backends_without_a_process_list_give_none():
    assert open_backend("host").processes() == []


def test_nvml_without_library_or_gpus_is_unavailable(monkeypatch):
    FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    with pytest.raises(UserError, match="NVMLError_DriverNotLoaded"):
        open_backend("nvml")
    FakeNvml(gpus=[]).install(monkeypatch)
    with pytest.raises(UserError, match="found no GPUs"):
        open_backend("nvml")


def test_auto_prefers_nvml_and_samples_host_beside_it(monkeypatch):
    FakeNvml([FakeGpu(0), FakeGpu(1)]).install(monkeypatch)
    backends, reason = open_backends("auto")
    assert [b.name for b in backends] == ["nvml", "host"]
    assert reason == "nvml: 2 devices found"


def test_auto_on_this_machine_uses_host_and_says_why():
    if real_nvml_present() or real_amdsmi_present():
        pytest.skip("this machine has a GPU library; the no-GPU path cannot be checked here")
    backends, reason = open_backends("auto")
    assert [b.name for b in backends] == ["host"]
    assert reason.startswith("nvml: nvmlInit failed")
    assert "NVMLError_LibraryNotFound" in reason
    assert "amdsmi: libamd_smi.so not found" in reason and reason.endswith("using host only")


# -- AMD SMI ------------------------------------------------------------------------------------
@pytest.fixture
def real_amdsmi(monkeypatch):
    smi = load_real_amdsmi(monkeypatch)
    yield smi
    unload_amdsmi()


def test_amdsmi_import_without_library_prints_nothing(capfd):
    from charllm.probes.backends.amdsmi import import_amdsmi

    if real_amdsmi_present():
        pytest.skip("libamd_smi.so is installed here")
    capfd.readouterr()
    with pytest.raises(BackendUnavailable, match="libamd_smi.so not found"):
        import_amdsmi()
    out = capfd.readouterr()
    assert out.out == ""  # the library's own prints went to /dev/null


def test_amdsmi_each_gcd_is_a_device_with_metrics_in_schema_units(monkeypatch, real_amdsmi):
    FakeAmdSmi(real_amdsmi).install(monkeypatch)
    backend = open_backend("amdsmi")
    rows = backend.sample()
    assert [(r["device"], r["uuid"]) for r in rows] == [("gcd0", "gcd-uuid-0"), ("gcd1", "gcd-uuid-1")]
    row = rows[0]
    assert row["backend"] == "amdsmi" and row["simulated"] is False
    assert row["power_w"] == 480 and row["power_avg_w"] == 470
    assert row["energy_j"] == pytest.approx(1_000_000 * 15.259e-6)
    assert (row["temp_gpu_c"], row["temp_hotspot_c"], row["temp_mem_c"]) == (55, 71, 62)
    assert row["sm_clock_mhz"] == 1700 and row["mem_clock_mhz"] == 1600
    assert row["util_gpu_pct"] == 93 and row["util_mem_pct"] == 40
    assert row["mem_used_bytes"] == 50_000 * 2**20 and row["mem_total_bytes"] == 65_520 * 2**20
    assert row["power_limit_w"] == pytest.approx(500.0)
    assert row["throttle_reasons"] == THROTTLE_BITS["sw_power_cap"]
    assert row["errors"] == 0


def test_amdsmi_violations_map_onto_throttle_bits(monkeypatch, real_amdsmi):
    gcd = FakeGcd("u0", violations={"active_ppt_pwr": False, "active_socket_thrm": True,
                                    "active_prochot_thrm": True, "active_hbm_thrm": "N/A", "active_vr_thrm": False})
    FakeAmdSmi(real_amdsmi, [gcd]).install(monkeypatch)
    row = open_backend("amdsmi").sample()[0]
    assert row["throttle_reasons"] == THROTTLE_BITS["sw_thermal"] | THROTTLE_BITS["hw_thermal"]


def test_amdsmi_not_supported_and_na_are_null_and_asked_once(monkeypatch, real_amdsmi):
    gcd = FakeGcd("u0", average_socket_power="N/A", temps={"EDGE": 50, "HOTSPOT": 60},
                  not_supported={"amdsmi_get_violation_status"})
    fake = FakeAmdSmi(real_amdsmi, [gcd]).install(monkeypatch)
    backend = open_backend("amdsmi")
    rows = [backend.sample()[0] for _ in range(3)]
    assert all(r.get("power_avg_w") is None and r.get("temp_mem_c") is None for r in rows)
    assert all(r.get("throttle_reasons") is None for r in rows)
    assert rows[-1]["power_w"] == 480 and rows[-1]["errors"] == 0
    assert fake.calls["amdsmi_get_violation_status"] == 1
    assert fake.calls["amdsmi_get_temp_metric"] == 3 + 3 + 1  # VRAM asked once
    supported = backend.supported_metrics(backend.devices()[0])
    assert {"power_avg_w", "temp_mem_c", "throttle_reasons"}.isdisjoint(supported)


def test_amdsmi_transient_errors_are_counted(monkeypatch, real_amdsmi):
    gcd = FakeGcd("u0", failures={"amdsmi_get_power_info": 2})
    FakeAmdSmi(real_amdsmi, [gcd]).install(monkeypatch)
    backend = open_backend("amdsmi")
    rows = [backend.sample()[0] for _ in range(3)]
    assert [r.get("power_w") for r in rows] == [None, None, 480]
    assert [r["errors"] for r in rows] == [1, 2, 2]


def test_amdsmi_init_failure_is_unavailable_and_auto_moves_on(monkeypatch, real_amdsmi):
    FakeAmdSmi(real_amdsmi, init_error=True).install(monkeypatch)
    with pytest.raises(UserError, match="amdsmi_init failed"):
        open_backend("amdsmi")
    FakeAmdSmi(real_amdsmi).install(monkeypatch)
    if real_nvml_present():
        pytest.skip("NVML is present here, auto would pick it")
    backends, reason = open_backends("auto")
    assert [b.name for b in backends] == ["amdsmi", "host"]
    assert reason.endswith("amdsmi: 2 devices found")


# -- utilization counters (GPM), violation time, XGMI ------------------------------------------
GPM_COLUMNS = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_bw_util_pct",
               "nvlink_tx_bytes_s", "nvlink_rx_bytes_s")


def test_nvml_gpm_metrics_from_two_samples_at_least_100_ms_apart(monkeypatch):
    import time

    fake = FakeNvml([FakeGpu(0, gpm=True)]).install(monkeypatch)
    backend = open_backend("nvml")
    first = backend.sample()[0]
    assert all(first.get(c) is None for c in GPM_COLUMNS)        # a metric needs two samples
    time.sleep(0.11)
    row = backend.sample()[0]
    assert row["sm_active_pct"] == 62.5 and row["sm_occupancy_pct"] == 31.25
    assert row["tensor_active_pct"] == 44.0 and row["dram_bw_util_pct"] == 55.5
    assert row["nvlink_tx_bytes_s"] == 1024 * 2**20 and row["nvlink_rx_bytes_s"] == 2048 * 2**20   # MiB/s
    assert row["pcie_tx_bytes_s"] == 16 * 2**20 and row["pcie_rx_bytes_s"] == 32 * 2**20           # GPM's, ...
    assert all((f, s) for f, s in fake.field_requests[-1]
               if f not in (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES))
    assert not {pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES} & {
        f for f, _ in fake.field_requests[-1]
    }  # ... not the counters'
    again = backend.sample()[0]                                    # within 100 ms: the interval's values stand
    assert again["sm_active_pct"] == 62.5 and fake.calls["nvmlGpmMetricsGet"] == 1
    assert all(interval >= 0.1 for interval in fake.gpm_intervals)
    backend.close()
    assert fake.gpm_samples == {}                                   # both buffers freed


def test_nvml_without_gpm_has_the_metrics_null_and_unsupported_never_zero(monkeypatch):
    import time

    pre_hopper = FakeGpu(0, name="NVIDIA A100-SXM4-80GB")           # GPM: not supported on this device
    old_driver = FakeGpu(1, gpm=True, gpm_driver=False)             # a driver without the GPM functions
    fake = FakeNvml([pre_hopper]).install(monkeypatch)
    backend = open_backend("nvml")
    rows = [backend.sample()[0] for _ in range(2)]
    time.sleep(0.11)
    rows.append(backend.sample()[0])
    assert all(r.get(c) is None for r in rows for c in GPM_COLUMNS)
    assert rows[-1]["errors"] == 0 and rows[-1]["pcie_tx_bytes_s"] is not None   # PCIe from the counters
    supported = backend.supported_metrics(backend.devices()[0])
    assert set(GPM_COLUMNS).isdisjoint(supported) and "pcie_tx_bytes_s" in supported
    assert "nvmlGpmSampleGet" not in fake.calls and "nvmlGpmMetricsGet" not in fake.calls
    FakeNvml([old_driver]).install(monkeypatch)
    backend = open_backend("nvml")
    assert set(GPM_COLUMNS).isdisjoint(backend.supported_metrics(backend.devices()[0]))


def test_nvml_gpm_metric_a_device_lacks_is_unsupported_alone(monkeypatch):
    import time

    pcie_board = FakeGpu(0, gpm=True, gpm_unsupported={pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
                                                       pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC})
    FakeNvml([pcie_board]).install(monkeypatch)
    backend = open_backend("nvml")
    backend.sample()
    time.sleep(0.11)
    row = backend.sample()[0]
    assert row["sm_active_pct"] == 62.5 and row.get("nvlink_tx_bytes_s") is None
    supported = backend.supported_metrics(backend.devices()[0])
    assert "nvlink_tx_bytes_s" not in supported and "sm_active_pct" in supported


def test_nvml_violation_time_counters_per_policy_read_once_a_second(monkeypatch):
    from charllm.probes.backends import nvml

    gpu = FakeGpu(0, violation_ns={pynvml.NVML_PERF_POLICY_POWER: 7_000_000_000,
                                   pynvml.NVML_PERF_POLICY_THERMAL: 250_000_000})   # no sync boost counter
    fake = FakeNvml([gpu]).install(monkeypatch)
    backend = open_backend("nvml")
    rows = [backend.sample()[0] for _ in range(2)]
    assert rows[0]["violation_power_ns"] == 7_000_000_000 and rows[0]["violation_thermal_ns"] == 250_000_000
    assert all(r.get("violation_sync_boost_ns") is None for r in rows) and rows[-1]["errors"] == 0
    assert fake.calls["nvmlDeviceGetViolationStatus"] == 3               # the second tick repeats the first's
    assert rows[1]["violation_power_ns"] == 7_000_000_000
    gpu.violation_ns[pynvml.NVML_PERF_POLICY_POWER] += 10**9
    monkeypatch.setattr(nvml, "VIOLATION_EVERY_S", 0.0)                  # a second later
    assert backend.sample()[0]["violation_power_ns"] == 8_000_000_000
    assert fake.calls["nvmlDeviceGetViolationStatus"] == 3 + 2           # sync boost is not asked again


def test_amdsmi_violation_time_from_the_firmware_counters_and_xgmi_bytes(monkeypatch, real_amdsmi):
    gcd = FakeGcd("u0")
    FakeAmdSmi(real_amdsmi, [gcd]).install(monkeypatch)
    backend = open_backend("amdsmi")
    first = backend.sample()[0]
    assert first["violation_power_ns"] == 0 and first["violation_thermal_ns"] == 0   # counted from the first reading
    assert first["nvlink_tx_bytes"] == 3000 * 1024 and first["nvlink_rx_bytes"] == 7000 * 1024   # two links, KB
    # 0.5 s later: 200 firmware ticks, 50 of them violating the power limit, none thermal
    gcd.reference_us += 500_000
    gcd.acc_counter += 200
    gcd.acc_ppt_pwr += 50
    row = backend.sample()[0]
    assert row["violation_power_ns"] == 125_000_000 and row["violation_thermal_ns"] == 0
    assert row.get("violation_sync_boost_ns") is None and "violation_sync_boost_ns" not in backend.metrics
    assert row["errors"] == 0


def test_amdsmi_without_violation_counters_or_links_has_them_null(monkeypatch, real_amdsmi):
    mi200 = FakeGcd("u0", acc_counter="N/A", acc_ppt_pwr="N/A", acc_socket_thrm="N/A", xgmi_read_kb=["N/A"] * 8,
                    xgmi_write_kb=["N/A"] * 8)
    FakeAmdSmi(real_amdsmi, [mi200]).install(monkeypatch)
    backend = open_backend("amdsmi")
    rows = [backend.sample()[0] for _ in range(2)]
    assert rows[-1]["throttle_reasons"] == THROTTLE_BITS["sw_power_cap"]   # the flags still read
    for column in ("violation_power_ns", "violation_thermal_ns", "nvlink_tx_bytes", "nvlink_rx_bytes"):
        assert all(r.get(column) is None for r in rows)
        assert column not in backend.supported_metrics(backend.devices()[0])
