"""The host backend on this machine (for real) and the simulated GPUs."""

from __future__ import annotations

import json

import psutil
import pytest

from charllm.probes.backends import open_backend
from charllm.probes.backends.host import HostBackend
from charllm.probes.backends.sim import SimBackend, SimHardware
from charllm.probes.core.errors import UserError
from charllm.probes.store.schema import HOST_METRICS, THROTTLE_BITS, THROTTLE_PERF_MASK


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# -- host ---------------------------------------------------------------------------------------
def test_host_reads_this_machine():
    import time

    backend = open_backend("host")
    [first] = backend.sample()
    assert first.get("cpu_util_pct") is None or 0 <= first["cpu_util_pct"] <= 100   # the same clock tick: unknown
    time.sleep(0.05)
    [row] = backend.sample()
    assert row["device"] == "host" and row["backend"] == "host" and row["uuid"].startswith("host-")
    assert set(row) - {"device", "uuid", "backend", "simulated", "errors"} <= set(HOST_METRICS)
    vm = psutil.virtual_memory()
    assert row["host_mem_total_bytes"] == vm.total
    assert 0 < row["host_mem_used_bytes"] < vm.total
    assert 0.0 <= row["cpu_util_pct"] <= 100.0 and 0.0 <= row["cpu_iowait_pct"] <= 100.0
    cores = row["cpu_core_util_pct"]
    assert len(cores) == psutil.cpu_count() and all(c is None or 0.0 <= c <= 100.0 for c in cores)
    assert row["net_rx_bytes"] >= 0 and row["net_tx_bytes"] >= 0
    assert row["errors"] == 0
    supported = backend.supported_metrics(backend.devices()[0])
    for metric in supported:
        assert metric in row, f"{metric} claimed supported but not read"
    if not psutil.sensors_temperatures():
        assert "temp_cpu_c" not in supported and row.get("temp_cpu_c") is None


def test_host_per_core_use_and_iowait_count_as_psutil_does(monkeypatch):
    """Each core's use and the iowait share from the kernel's per-core times (psutil's own tuples)."""
    times = type(psutil.cpu_times())
    fields = times._fields

    def cpu(**kw):
        return times(**{f: float(kw.get(f, 0.0)) for f in fields})

    readings = iter([
        [cpu(user=100, idle=100), cpu(user=100, idle=100)],
        # core 0: 1 s busy, 1 s idle; core 1: 0.5 s user (0.25 s of it guest, which the kernel counts in
        # user time too), 0.5 s iowait, 1 s idle
        [cpu(user=101, idle=101), cpu(user=100.5, idle=101, iowait=0.5, guest=0.25)],
    ])
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: next(readings) if percpu else cpu())
    backend = HostBackend(powercap_root="/nonexistent", infiniband_root="/nonexistent")
    [row] = backend.sample()
    assert row["cpu_core_util_pct"] == [50.0, 25.0]
    assert row["cpu_util_pct"] == 37.5 and row["cpu_iowait_pct"] == 12.5   # 0.5 s of 4 s


def _zone(root, name, label, energy, max_range):
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(label + "\n")
    (zone / "energy_uj").write_text(f"{energy}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range}\n")
    return zone


def test_host_rapl_energy_is_cumulative_across_counter_wrap(tmp_path):
    pkg = _zone(tmp_path, "intel-rapl:0", "package-0", 999_000_000, 1_000_000_000)
    dram = _zone(tmp_path, "intel-rapl:0:0", "dram", 5_000_000, 1_000_000_000)
    _zone(tmp_path, "intel-rapl:0:1", "core", 1, 1_000_000_000)  # inside the package: not added
    backend = HostBackend(powercap_root=str(tmp_path), infiniband_root=str(tmp_path / "none"))
    assert backend.sample()[0]["cpu_energy_j"] == 0.0
    (pkg / "energy_uj").write_text("2000000\n")  # wrapped: +1 J to the top, +2 J after
    (dram / "energy_uj").write_text("6500000\n")
    row = backend.sample()[0]
    assert row["cpu_energy_j"] == pytest.approx(3.0)
    assert row["dram_energy_j"] == pytest.approx(1.5)


def test_host_infiniband_counters_are_summed_in_bytes(tmp_path):
    for dev, port, tx, rx in (("mlx5_0", "1", 100, 200), ("mlx5_1", "1", 1000, 2000)):
        counters = tmp_path / dev / "ports" / port / "counters"
        counters.mkdir(parents=True)
        (counters / "port_xmit_data").write_text(f"{tx}\n")
        (counters / "port_rcv_data").write_text(f"{rx}\n")
    backend = HostBackend(powercap_root=str(tmp_path / "none"), infiniband_root=str(tmp_path))
    row = backend.sample()[0]
    assert row["ib_tx_bytes"] == 4 * 1100 and row["ib_rx_bytes"] == 4 * 2200  # 4-byte words
    assert row.get("cpu_energy_j") is None


# -- sim ----------------------------------------------------------------------------------------
def _run(backend: SimBackend, clock: FakeClock, seconds: float, dt: float = 0.05) -> list[list[dict]]:
    ticks = []
    for _ in range(int(seconds / dt)):
        clock.advance(dt)
        ticks.append(backend.sample())
    return ticks


def test_sim_is_deterministic_for_a_seed_and_clock():
    a_clock, b_clock, c_clock = FakeClock(), FakeClock(), FakeClock()
    a = _run(SimBackend(gpus=4, profile="bursty", seed=7, clock=a_clock), a_clock, 30)
    b = _run(SimBackend(gpus=4, profile="bursty", seed=7, clock=b_clock), b_clock, 30)
    c = _run(SimBackend(gpus=4, profile="bursty", seed=8, clock=c_clock), c_clock, 30)
    assert a == b
    assert a != c


def test_sim_rows_are_labelled_and_plausible_when_not_driven_hard():
    clock = FakeClock()
    sim = SimBackend(gpus=8, profile="steady", clock=clock)
    last = _run(sim, clock, 120)[-1]
    assert len(last) == 8 and {r["device"] for r in last} == {f"gpu{i}" for i in range(8)}
    assert all(r["backend"] == "sim" and r["simulated"] is True for r in last)
    for row in last:
        assert row["throttle_reasons"] & THROTTLE_PERF_MASK == 0
        assert row["sm_clock_mhz"] == 1980
        assert 400 < row["power_w"] < 700
        assert 40 < row["temp_gpu_c"] < 85 - 5
        assert row["energy_j"] > 120 * 400
    assert len({round(r["temp_gpu_c"], 3) for r in last}) > 1  # boards differ in cooling


def test_sim_power_cap_throttles_clock_and_sets_sw_power_cap():
    clock = FakeClock()
    sim = SimBackend(gpus=2, profile="steady", clock=clock, power_limit_w=400, intensity=1.0)
    last = _run(sim, clock, 10)[-1]
    for row in last:
        assert row["throttle_reasons"] & THROTTLE_BITS["sw_power_cap"]
        assert row["sm_clock_mhz"] < 1980 * 0.85
        assert row["power_w"] == pytest.approx(400, rel=0.03)
        assert row["power_limit_w"] == 400


def test_sim_thermal_throttling_when_cooling_cannot_keep_up():
    clock = FakeClock()
    sim = SimBackend(gpus=2, profile="steady", clock=clock, ambient_c=65.0, intensity=1.1, tau_s=10.0)
    ticks = _run(sim, clock, 120)
    first, last = ticks[0][0], ticks[-1][0]
    assert first["throttle_reasons"] & (THROTTLE_BITS["sw_thermal"] | THROTTLE_BITS["hw_thermal"]) == 0
    assert last["throttle_reasons"] & THROTTLE_BITS["sw_thermal"]
    assert last["sm_clock_mhz"] < 0.8 * first["sm_clock_mhz"]
    # the governor holds the die a few degrees around the limit instead of running away
    assert 80 < last["temp_gpu_c"] < 85 + 8


def test_sim_hw_thermal_when_cooling_fails():
    clock = FakeClock()
    sim = SimBackend(gpus=1, profile="steady", clock=clock, ambient_c=95.0, tau_s=5.0)
    last = _run(sim, clock, 60)[-1][0]
    assert last["throttle_reasons"] & THROTTLE_BITS["hw_thermal"]
    assert last["throttle_reasons"] & THROTTLE_BITS["sw_thermal"]
    assert last["sm_clock_mhz"] <= 0.3 * 1980 + 15


def test_sim_bursty_profile_alternates_compute_and_bubbles():
    clock = FakeClock()
    utils = [r[0]["util_gpu_pct"] for r in _run(SimBackend(gpus=1, profile="bursty", clock=clock), clock, 9)]
    assert max(utils) >= 95 and min(utils) <= 30
    assert 0.5 < sum(u > 90 for u in utils) / len(utils) < 0.8


def test_sim_follows_an_iteration_timeline(tmp_path):
    log = tmp_path / "iterations.jsonl"
    t0 = 1_700_000_000_000_000_000
    events = [{"event": "start"}] + [
        {"event": "iteration", "iteration": i + 1, "start_ns": t0 + i * 2_000_000_000,
         "end_ns": t0 + i * 2_000_000_000 + 1_000_000_000} for i in range(3)]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    clock = FakeClock()
    sim = SimBackend(gpus=1, profile=f"iterations:{log}", clock=clock)
    utils = [r[0]["util_gpu_pct"] for r in _run(sim, clock, 5.0, dt=0.25)]
    # busy during [0,1) [2,3) [4,5) s, idle between (sampled at 0.25, 0.5, ...)
    assert utils[1] > 90 and utils[5] < 20 and utils[9] > 90


def test_sim_bad_arguments_are_user_errors():
    with pytest.raises(UserError, match="sim profile = 'wavy'"):
        SimBackend(profile="wavy")
    with pytest.raises(UserError, match="sim gpus = 0"):
        SimBackend(gpus=0)
    with pytest.raises(UserError, match="sim hardware = 'cpu'"):
        SimBackend(hardware="cpu")  # a CPU preset has no TDP or clock to simulate


def test_sim_hardware_comes_from_the_catalog():
    hw = SimHardware.from_preset("h100-sxm-80gb")
    assert hw.tdp_w == 700 and hw.max_sm_clock_mhz == 1980


def test_a_short_bursty_run_throttles_in_its_bursts_and_a_steady_one_does_not():
    """The paper's effect: bursts of dense compute draw past the power limit and are clocked down;
    the same GPUs running steadily are not (it once never throttled in a short bursty run)."""
    shares = {}
    for profile in ("steady", "bursty"):
        clock = FakeClock()
        rows = [r for tick in _run(SimBackend(gpus=2, profile=profile, clock=clock), clock, 20) for r in tick]
        capped = [r for r in rows if r["throttle_reasons"] & THROTTLE_BITS["sw_power_cap"]]
        shares[profile] = len(capped) / len(rows)
        assert all(r["util_gpu_pct"] >= 90 and r["sm_clock_mhz"] < 1980 for r in capped), "only bursts, clocked down"
        assert all(r["power_w"] <= r["power_limit_w"] * 1.03 for r in rows)
    assert shares["steady"] == 0 and shares["bursty"] > 0.3, shares


def test_sim_hardware_limits_are_the_presets(tmp_path, monkeypatch):
    # No second copy of hardware numbers: the temperature limit is the preset's (85 °C for the H100, once
    # 87 here), a user's file of the same name wins as everywhere, and an unknown name is the catalog's error.
    assert SimBackend(gpus=1).hw.temp_limit_c == 85.0
    monkeypatch.setenv("CHARLLM_CONFIG_DIR", str(tmp_path))
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "h100-sxm-80gb.toml").write_text(
        'tdp_w = 500.0\nmax_sm_clock_mhz = 1500.0\ntemp_limit_c = 80.0\nmemory_bytes = 1024\nnode_link_gbs = 100.0\n')
    hw = SimBackend(gpus=1).hw
    assert (hw.tdp_w, hw.max_sm_clock_mhz, hw.temp_limit_c, hw.memory_bytes, hw.nvlink_bytes_s) == \
        (500.0, 1500.0, 80.0, 1024, 100e9)
    assert SimHardware.from_preset("h100").tdp_w == 500.0      # its short name: the same preset, the user's
    with pytest.raises(UserError, match="sim hardware 'h100-sxn': no such preset; did you mean 'h100-sxm'"):
        SimHardware.from_preset("h100-sxn")
