"""Each summary statistic against a signal with a known analytic answer."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from charllm.engine.model.experiment import ModelSpec
from charllm.engine.model.flops import num_floating_point_operations
from charllm.probes.analysis.summary import cached_summary, summarize
from charllm.probes.core.errors import UserError
from charllm.probes.store.schema import THROTTLE_BITS
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run, tiny_experiment

T = np.round(np.arange(0, 101) * 0.1, 10)             # 10 s at 10 Hz, both ends sampled
SQUARE = np.where(np.floor(T + 1e-9) % 2 == 0, 100.0, 300.0)  # 100 W / 300 W, 1 s each


def one(df: pl.DataFrame, col: str):
    assert df.height == 1, df
    return df[col][0]


@pytest.fixture
def square_run(tmp_path):
    return make_run(tmp_path, [gpu_frame(T, power_w=SQUARE, power_limit_w=250.0)])


def test_square_wave_power_energy_and_excursions(square_run):
    s = summarize(square_run, "all")
    assert one(s, "power_mean_w") == pytest.approx(200.0)        # 50 s·100 W + 50 s·300 W over 10 s
    assert one(s, "power_peak_w") == 300.0
    assert one(s, "power_p99_w") == 300.0
    assert one(s, "energy_j") == pytest.approx(2000.0)           # trapezoid: ramps cancel pairwise
    assert one(s, "energy_source") == "trapezoid"
    assert one(s, "duration_s") == pytest.approx(10.0)
    # five 1 s plateaus at 300 W: 100 W above the mean, 50 W above the 250 W limit
    assert one(s, "spikes_over_mean_count") == 5
    assert one(s, "spikes_over_mean_max_excess_w") == pytest.approx(100.0)
    assert one(s, "spikes_over_mean_avg_excess_w") == pytest.approx(100.0)
    assert one(s, "time_over_mean_s") == pytest.approx(5.0)
    assert one(s, "spikes_over_limit_count") == 5
    assert one(s, "spikes_over_limit_max_excess_w") == pytest.approx(50.0)
    assert one(s, "time_over_limit_s") == pytest.approx(5.0)
    assert one(s, "power_max_rise_w_per_s") == pytest.approx(200.0)
    assert one(s, "simulated") is True


@pytest.mark.parametrize("seed", range(4))
def test_largest_rise_within_a_second_matches_its_definition(tmp_path, seed):
    """The skipping of blocks that cannot hold it (`_max_rise`) never changes the answer:
    GPUs with jittered and uneven sampling, gaps longer than a second, missing power, steps,
    a flat GPU and one with no power at all, against the definition sample by sample."""
    rng = np.random.default_rng(seed)
    frames, expected = [], {}
    for g, hz in enumerate((20, 7, 50, 3, 20, 20)):
        t = np.cumsum(rng.uniform(0.2, 1.8, int(30 * hz)) / hz)
        t[len(t) // 2:] += 2.5                                     # a gap of more than a second
        power = np.where((t % 6) < 3, 600.0, 350.0) + rng.normal(0, 20 if g != 4 else 0, t.size)
        power = np.round(power, 3)
        if g == 2:
            power[rng.random(t.size) < 0.2] = np.nan               # missing readings
        if g == 5:
            power[:] = np.nan                                      # a GPU that reports no power
        frames.append(gpu_frame(t, device=f"gpu{g}", power_w=power).with_columns(pl.col("power_w").fill_nan(None)))
        t_ns = np.round(t * 1e9).astype(np.int64)
        rises = [power[i] - np.nanmin(power[(t_ns > t_ns[i] - 10**9) & (t_ns <= t_ns[i])])
                 for i in range(t.size) if not np.isnan(power[i])]
        expected[f"gpu{g}"] = max(rises) if rises else None
    run = make_run(tmp_path, frames)
    got = dict(summarize(run, "all").select("device", "power_max_rise_w_per_s").iter_rows())
    for device, rise in expected.items():
        assert got[device] == (None if rise is None else pytest.approx(rise, abs=1e-9)), device


@pytest.mark.parametrize("seed", range(3))
def test_spikes_match_their_definition(tmp_path, seed):
    """Spikes over the run's mean power and over each GPU's (changing, partly unknown) power
    limit, against a sample-by-sample count of runs above the threshold."""
    rng = np.random.default_rng(seed)
    frames, powers = [], {}
    for g in range(4):
        t = np.cumsum(rng.uniform(0.02, 0.08, 400))
        power = np.round(300 + 150 * np.sin(t * (g + 1)) + rng.normal(0, 30, t.size), 3)
        limit = np.where(t < t[-1] / 2, 380.0, 420.0)
        limit[rng.random(t.size) < 0.1] = np.nan
        if g == 3:
            power[rng.random(t.size) < 0.15] = np.nan
        frames.append(gpu_frame(t, device=f"gpu{g}", power_w=power, power_limit_w=limit)
                      .with_columns(pl.col("power_w", "power_limit_w").fill_nan(None)))
        powers[f"gpu{g}"] = (t, power, limit)
    s = summarize(make_run(tmp_path, frames), "all")
    mean = s["power_mean_w"].mean()
    for row in s.iter_rows(named=True):
        t, power, limit = powers[row["device"]]
        for name, threshold in (("mean", np.full(t.size, mean)), ("limit", limit)):
            excess = power - threshold
            above = np.nan_to_num(excess, nan=-1.0) > 0
            spikes, size = [], None
            for i in range(t.size):
                if above[i]:
                    size = excess[i] if size is None else max(size, excess[i])
                if size is not None and (not above[i] or i == t.size - 1):
                    spikes.append(size)
                    size = None
            time_over = sum(t[i + 1] - t[i] for i in range(t.size - 1) if above[i])
            assert row[f"spikes_over_{name}_count"] == len(spikes), (row["device"], name)
            assert row[f"time_over_{name}_s"] == pytest.approx(time_over, abs=1e-6)
            assert row[f"spikes_over_{name}_max_excess_w"] == pytest.approx(max(spikes))
            assert row[f"spikes_over_{name}_avg_excess_w"] == pytest.approx(np.mean(spikes))


def test_energy_counter_preferred_and_wrap_falls_back_to_interval(tmp_path):
    # 200 W constant; the counter restarts from 0 at t = 5 s (a wrap or driver reload).
    counter = 200.0 * T
    counter[T >= 5.0] -= 1000.0 + 7.0
    run = make_run(tmp_path, [gpu_frame(T, power_w=200.0, energy_j=counter)])
    s = summarize(run, "all")
    assert one(s, "energy_source") == "counter+trapezoid"   # one interval came from power
    # 49 counter deltas (980 J) + the wrapped interval from power (20 J) + 50 deltas (1000 J)
    assert one(s, "energy_j") == pytest.approx(2000.0)


def test_counter_energy_differs_from_power_when_power_is_instantaneous(tmp_path):
    # The counter knows the truth (250 W) even when the sampled power misses it.
    run = make_run(tmp_path, [gpu_frame(T, power_w=100.0, energy_j=250.0 * T)])
    s = summarize(run, "all")
    assert one(s, "energy_j") == pytest.approx(2500.0)
    assert one(s, "power_mean_w") == pytest.approx(100.0)


def test_nvlink_counter_wraps_at_32_and_64_bits(tmp_path):
    step = 1_000_000_000                                   # bytes per 0.1 s
    c32 = (np.arange(T.size, dtype=np.int64) * step + 3 * 2**31) % 2**32   # wraps several times
    c64 = (np.arange(T.size, dtype=np.uint64) * np.uint64(step) + np.uint64(2**64 - 5 * step))
    run = make_run(tmp_path, [gpu_frame(T, power_w=1.0, nvlink_tx_bytes=c32,
                                        nvlink_rx_bytes=c64.view(np.int64))])
    s = summarize(run, "all")
    assert one(s, "nvlink_tx_bytes") == pytest.approx(100 * step)
    assert one(s, "nvlink_rx_bytes") == pytest.approx(100 * step)


def test_pcie_bytes_integrate_the_rate(tmp_path):
    run = make_run(tmp_path, [gpu_frame(T, power_w=1.0, pcie_tx_bytes_s=2e9, pcie_rx_bytes_s=1e9)])
    s = summarize(run, "all")
    assert one(s, "pcie_tx_bytes") == pytest.approx(20e9)
    assert one(s, "pcie_rx_bytes") == pytest.approx(10e9)


def test_temperature_above_threshold_for_known_time(tmp_path):
    temp = np.where(T < 3.0, 90.0, 60.0)                 # 3 s above an 85 °C limit
    hw = '[hardware]\nbf16_tflops = 989.0\ntemp_limit_c = 85.0\nmax_sm_clock_mhz = 1980.0\n'
    run = make_run(tmp_path, [gpu_frame(T, power_w=1.0, temp_gpu_c=temp, temp_mem_c=70.0)], experiment=hw)
    s = summarize(run, "all")
    assert one(s, "time_above_temp_limit_s") == pytest.approx(3.0)
    assert one(s, "temp_gpu_mean_c") == pytest.approx(0.3 * 90 + 0.7 * 60)
    assert one(s, "temp_gpu_peak_c") == 90.0
    assert one(s, "temp_mem_mean_c") == pytest.approx(70.0)
    assert one(s, "temp_limit_c") == 85.0


def test_clock_and_throttle_fractions(tmp_path):
    # 0–2 s: power cap (0x4) at 1500 MHz; 2–6 s: none at 1980 MHz; 6–10 s: thermal (0x20|0x40) at 1200.
    bits = np.select([T < 2, T < 6], [0x4, 0x0], 0x20 | 0x40)
    clock = np.select([T < 2, T < 6], [1500.0, 1980.0], 1200.0)
    hw = '[hardware]\nmax_sm_clock_mhz = 1980.0\n'
    run = make_run(tmp_path, [gpu_frame(T, power_w=1.0, throttle_reasons=bits, sm_clock_mhz=clock)], experiment=hw)
    s = summarize(run, "all")
    assert one(s, "throttle_sw_power_cap_frac") == pytest.approx(0.2)
    assert one(s, "throttle_sw_thermal_frac") == pytest.approx(0.4)
    assert one(s, "throttle_hw_thermal_frac") == pytest.approx(0.4)
    assert one(s, "throttle_perf_frac") == pytest.approx(0.6)
    assert one(s, "throttle_gpu_idle_frac") == 0.0
    assert set(f"throttle_{n}_frac" for n in THROTTLE_BITS) <= set(s.columns)
    assert one(s, "below_max_clock_frac") == pytest.approx(0.6)
    assert one(s, "sm_clock_min_mhz") == 1200.0
    assert one(s, "sm_clock_mean_mhz") == pytest.approx(0.2 * 1500 + 0.4 * 1980 + 0.4 * 1200)


def test_utilization_time_weighted_with_uneven_sampling(tmp_path):
    t = np.array([0.0, 1.0, 4.0])                        # 1 s at 100 %, 3 s at 0 %
    run = make_run(tmp_path, [gpu_frame(t, power_w=1.0, util_gpu_pct=[100.0, 0.0, 50.0])], chunks=1)
    assert one(summarize(run, "all"), "util_gpu_mean_pct") == pytest.approx(25.0)


TINY = tiny_experiment("tiny", bf16_tflops=0.5, gpus_per_node=2, extra_hardware="temp_limit_c = 90.0\n")


def test_iteration_log_gives_tokens_per_s_mfu_and_energy_per_token(tmp_path):
    # 2 warm-up + 8 steady iterations of 1 s each, back to back from t = 0; 8 samples of 32 tokens.
    rows = iteration_rows(np.arange(10.0), 1.0, warmup=2, samples=8)
    frames = [gpu_frame(np.round(np.arange(0, 101) * 0.1, 10), device=d, power_w=100.0) for d in ("gpu0", "gpu1")]
    run = make_run(tmp_path, frames, experiment=TINY, iterations=rows)
    s = summarize(run, "steady", by="run")
    assert one(s, "window") == "steady"
    assert one(s, "window_start_s") == pytest.approx(2.0)
    assert one(s, "iterations") == 8
    assert one(s, "iter_time_mean_s") == pytest.approx(1.0)
    assert one(s, "iter_time_p99_s") == pytest.approx(1.0)
    assert one(s, "samples_per_s") == pytest.approx(8.0)
    assert one(s, "tokens_per_s") == pytest.approx(8 * 32)
    flops = num_floating_point_operations(
        ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024), 8, 32)
    assert one(s, "tflops_per_gpu") == pytest.approx(flops / 1.0 / 2 / 1e12)
    assert one(s, "mfu_pct") == pytest.approx(100 * flops / 2 / 1e12 / 0.5)
    assert one(s, "energy_j") == pytest.approx(2 * 100.0 * 8)          # 2 GPUs · 100 W · 8 s
    assert one(s, "energy_per_iteration_j") == pytest.approx(200.0)
    assert one(s, "energy_per_token_j") == pytest.approx(1600.0 / (8 * 8 * 32))
    assert one(s, "efficiency_samples_per_s_mj") == pytest.approx(8.0 / 200e-6)
    assert one(s, "temp_limit_c") == 90.0


@pytest.mark.parametrize("precision, tf32, peak", [
    ("bf16 = true", None, 0.5),          # the hardware's BF16 peak
    ("bf16 = false", False, 0.25),       # fp32: the FP32 peak
    ("bf16 = false", True, 2.0),         # fp32 with TF32 allowed: the TF32 peak
    ("fp8 = 'e4m3'", None, None),        # no FP8 peak given: not applicable, said in the notes
])
def test_mfu_is_against_the_peak_of_the_precision_that_ran(tmp_path, precision, tf32, peak):
    experiment = tiny_experiment("p", bf16_tflops=0.5, extra_hardware="fp32_tflops = 0.25\ntf32_tflops = 2.0\n")
    experiment = experiment.replace("[training]\n", f"[training]\n{precision}\n")
    rows = iteration_rows(np.arange(4.0), 1.0, warmup=0, samples=8)
    if tf32 is not None:   # the workload's start record says whether fp32 matmuls could use TF32
        rows[0]["runtime"] = {"tf32": tf32}
    run = make_run(tmp_path, [gpu_frame(np.round(np.arange(0, 41) * 0.1, 10), power_w=100.0)],
                   experiment=experiment, iterations=rows)
    s = summarize(run, "all", by="run")
    tflops = one(s, "tflops_per_gpu")
    assert tflops > 0
    if peak is None:
        assert one(s, "mfu_pct") is None
        assert any("MFU not applicable" in note and "fp8" in note for note in one(s, "notes").split("; "))
    else:
        assert one(s, "mfu_pct") == pytest.approx(100 * tflops / peak)


def test_steady_without_log_falls_back_to_all_with_a_note(square_run):
    s = summarize(square_run, "steady")
    assert one(s, "window") == "all"
    assert "no iteration log" in one(s, "notes")
    assert one(s, "iterations") is None


def test_time_range_window(square_run):
    s = summarize(square_run, (1.0, 3.0))                 # one 300 W and one 100 W second
    assert one(s, "window") == "1:3"
    assert one(s, "power_mean_w") == pytest.approx(200.0)
    assert one(s, "duration_s") == pytest.approx(2.0)


def test_spread_across_gpus_and_node_rows(tmp_path):
    frames = [gpu_frame(T, node=n, device=d, power_w=p, temp_gpu_c=c)
              for n, d, p, c in [("n0", "gpu0", 300.0, 70.0), ("n0", "gpu1", 200.0, 60.0),
                                 ("n1", "gpu0", 100.0, 80.0), ("n1", "gpu1", 150.0, 50.0)]]
    run = make_run(tmp_path, frames)
    r = summarize(run, "all", by="run")
    assert one(r, "gpus") == 4
    assert one(r, "hottest_gpu") == "n1/gpu0" and one(r, "coolest_gpu") == "n1/gpu1"
    assert one(r, "temp_gpu_spread_c") == pytest.approx(30.0)
    assert one(r, "highest_power_gpu") == "n0/gpu0" and one(r, "lowest_power_gpu") == "n1/gpu0"
    assert one(r, "power_spread_w") == pytest.approx(200.0)
    assert one(r, "power_mean_w") == pytest.approx(187.5)             # mean of per-GPU means
    assert one(r, "power_peak_w") == 300.0
    assert one(r, "energy_j") == pytest.approx(7500.0)
    nodes = summarize(run, "all", by="node")
    assert nodes["node"].to_list() == ["n0", "n1"]
    assert nodes["energy_j"].to_list() == pytest.approx([5000.0, 2500.0])
    assert nodes["hottest_gpu"].to_list() == ["n0/gpu0", "n1/gpu0"]
    assert summarize(run, "all", by="gpu").height == 4


def test_missing_metrics_are_null_not_zero(square_run):
    s = summarize(square_run, "all")
    for col in ("temp_gpu_mean_c", "time_above_temp_limit_s", "sm_clock_mean_mhz", "throttle_perf_frac",
                "nvlink_tx_bytes", "pcie_tx_bytes", "util_gpu_mean_pct", "mem_used_peak_bytes"):
        assert one(s, col) is None, col


def test_host_rows_are_not_gpus(tmp_path):
    host = gpu_frame(T, device="host", cpu_util_pct=50.0)
    run = make_run(tmp_path, [gpu_frame(T, power_w=10.0), host])
    assert summarize(run, "all")["device"].to_list() == ["gpu0"]


@pytest.mark.parametrize("window, message", [
    ((20.0, 30.0), "no telemetry samples"),
    ((3.0, 1.0), "need 0 <= start < end"),
    ("bogus", "expected steady, all or START:END"),
])
def test_bad_windows_are_user_errors(square_run, window, message):
    with pytest.raises(UserError, match=message):
        summarize(square_run, window)


def test_single_sample_run_is_a_user_error(tmp_path):
    run = make_run(tmp_path, [gpu_frame([0.0], power_w=100.0)], chunks=1)
    with pytest.raises(UserError, match="only one sample per device"):
        summarize(run, "all")


def test_run_without_telemetry_is_a_user_error(tmp_path):
    run = make_run(tmp_path, [gpu_frame(T, power_w=1.0)])
    for f in run.telemetry_files():
        f.unlink()
    with pytest.raises(UserError, match="no telemetry under"):
        summarize(run)


def test_host_only_run_has_host_statistics(tmp_path):
    # A CPU run: host rows only. RAPL counter at 10 W that wraps once (that interval is left out).
    rapl = 10.0 * T
    rapl[T >= 5.0] -= 40.0
    net = (np.arange(T.size, dtype=np.int64) * 1000 + 2**32 - 5000) % 2**32
    host = gpu_frame(T, device="host", cpu_util_pct=np.where(T < 5, 100.0, 0.0), temp_cpu_c=70.0,
                     cpu_energy_j=rapl, net_tx_bytes=net, host_mem_used_bytes=2**30)
    rows = iteration_rows(np.arange(10.0), 1.0, warmup=2)
    run = make_run(tmp_path, [host], experiment=TINY, iterations=rows)
    with pytest.raises(UserError, match="no accelerator telemetry"):
        summarize(run, "all", by="gpu")
    s = summarize(run, "all", by="run")
    assert one(s, "cpu_util_mean_pct") == pytest.approx(50.0)
    assert one(s, "cpu_energy_j") == pytest.approx(100.0 - 1.0)   # 99 intervals of 1 J, one wrapped
    assert one(s, "net_tx_bytes") == pytest.approx(100 * 1000)
    assert one(s, "temp_cpu_peak_c") == 70.0 and one(s, "host_mem_used_peak_bytes") == 2**30
    assert one(s, "simulated") is True and "power_mean_w" not in s.columns
    assert "host statistics only" in one(s, "notes")
    steady = summarize(run, "steady", by="node")
    assert steady["node"].to_list() == ["n0"] and one(steady, "samples_per_s") == pytest.approx(8.0)
    assert summarize(run, "steady", by="auto").equals(steady)   # the CLI's default for a CPU run


def test_auto_means_per_gpu_when_the_run_has_gpus(square_run):
    assert summarize(square_run, "all", by="auto").equals(summarize(square_run, "all", by="gpu"))


def test_bad_by_is_a_user_error(square_run):
    with pytest.raises(UserError, match="by = 'rack'"):
        summarize(square_run, "all", by="rack")


def test_finished_runs_are_cached_and_refreshed_when_files_change(square_run):
    first = summarize(square_run, "all")
    cache = square_run.path / "summaries" / "gpu-all.parquet"
    assert cache.is_file()
    assert summarize(square_run, "all").equals(first)
    marked = first.with_columns(pl.col("samples") + 1_000_000)   # the same columns, other values
    marked.write_parquet(cache)                          # prove the second read comes from the cache
    assert one(summarize(square_run, "all"), "samples") == one(first, "samples") + 1_000_000
    first.select(pl.exclude("notes"), notes=pl.lit(5)).write_parquet(cache)   # a column of another type
    assert summarize(square_run, "all").equals(first), "a kept file of another shape is made again"
    # new data (chunks replaced, as the recorder does: by rename) invalidates the cache
    for f in square_run.telemetry_files():
        f.unlink()
    make_run(square_run.path.parent, [gpu_frame(T, power_w=SQUARE * 2, power_limit_w=250.0)])
    assert one(summarize(square_run, "all"), "power_mean_w") == pytest.approx(400.0)


def test_one_pass_keeps_every_level(square_run, monkeypatch):
    import charllm.probes.analysis.summary as summary

    passes = []
    real = summary._summarize
    monkeypatch.setattr(summary, "_summarize", lambda *a: passes.append(a[2]) or real(*a))
    by_run = summarize(square_run, "all", by="run")
    assert passes == [summary.BY]
    by_gpu, by_node = summarize(square_run, "all", by="gpu"), summarize(square_run, "all", by="node")
    assert passes == [summary.BY]                        # both from the first pass's cache
    assert one(by_run, "power_mean_w") == one(by_gpu, "power_mean_w") == one(by_node, "power_mean_w")
    square_run.update_manifest(status="running")         # a running run: the one level asked for
    summarize(square_run, "all", by="run")
    assert passes == [summary.BY, ("run",)]


def test_running_runs_are_not_cached(square_run):
    square_run.update_manifest(status="running")
    summarize(square_run, "all")
    assert not (square_run.path / "summaries").exists()
    assert cached_summary(square_run, "all") is None


def test_cached_summary_reads_only_a_kept_summary_of_unchanged_files(square_run):
    assert cached_summary(square_run, "all", by="run") is None          # never summarized: not computed here
    assert not (square_run.path / "summaries").exists()
    first = summarize(square_run, "all", by="run")
    assert cached_summary(square_run, "all", by="run").equals(first)
    assert cached_summary(square_run, "steady", by="run") is None       # another window is another summary
    for f in square_run.telemetry_files():                              # new data: the kept one is stale
        f.unlink()
    make_run(square_run.path.parent, [gpu_frame(T, power_w=SQUARE * 2, power_limit_w=250.0)])
    assert cached_summary(square_run, "all", by="run") is None


def _recording(rng: np.random.Generator) -> pl.DataFrame:
    """Two nodes of three GPUs and a host, 20 Hz for 30 s, as a sampler writes them: each tick's
    devices in turn. Noisy power, a wrapping NVLink counter, a metric with gaps, throttle bits."""
    t = np.arange(600) / 20
    frames = []
    for node in ("n0", "n1"):
        for g in range(3):
            power = 300 + 200 * (np.floor(t / 3) % 2) + rng.normal(0, 30, t.size)
            temp = np.where(rng.random(t.size) < 0.1, np.nan, 60 + 25 * t / 30 + g)
            link = (np.cumsum(rng.integers(0, 2**28, t.size)) + 2**32 - 2**30) % 2**32
            frames.append(gpu_frame(
                t, node=node, device=f"gpu{g}", power_w=power, power_limit_w=450.0, temp_gpu_c=temp,
                energy_j=np.cumsum(power) / 20, sm_clock_mhz=np.where(power > 450, 1500.0, 1980.0),
                throttle_reasons=np.where(power > 450, THROTTLE_BITS["sw_power_cap"], 0), nvlink_tx_bytes=link,
            ).with_columns(pl.col("temp_gpu_c").fill_nan(None)))
        frames.append(gpu_frame(t[::2], node=node, device="host", cpu_util_pct=rng.uniform(0, 100, t.size // 2)))
    return pl.concat(frames).sort("ts_ns", maintain_order=True)


def test_summaries_do_not_depend_on_how_the_recording_is_laid_out(tmp_path):
    """Devices interleaved in 1-s chunks, compacted files grouped by device, one file per node:
    the same samples give the same statistics (device and time order are rebuilt, never assumed).
    Equal to the last bits that float summation order allows: polars' sums vary there with the
    memory layout of equal inputs."""
    from charllm.probes.store.recorder import ChunkWriter

    data = _recording(np.random.default_rng(3))
    layouts = {"one file per node": make_run(tmp_path / "a", [data], chunks=1)}
    for name, every in (("1-s chunks", None), ("compacted every 7 s", 7)):
        run = make_run(tmp_path / name.replace(" ", "-"), [data.head(1)], chunks=1)
        for f in run.telemetry_files():
            f.unlink()
        for (node,), part in data.group_by(["node"], maintain_order=True):
            writer = ChunkWriter(run.node_telemetry_dir(node), compact_every=every)
            second = (part["ts_ns"] - part["ts_ns"].min()) // 10**9
            for _, chunk in part.group_by(second, maintain_order=True):
                writer.write(chunk)
            writer.close()
        layouts[name] = run
    assert any(f.suffix == ".parquet" for f in layouts["compacted every 7 s"].telemetry_files())
    for by, window in (("gpu", "all"), ("node", "all"), ("run", "all"), ("gpu", (5.0, 20.0))):
        first, *others = (summarize(run, window, by=by) for run in layouts.values())
        assert first.height == {"gpu": 6, "node": 2, "run": 1}[by]
        for other in others:
            assert_frame_equal(first, other, rel_tol=1e-12, abs_tol=0)


def test_utilization_counters_and_violation_time_where_measured_null_where_not(tmp_path):
    """A Hopper GPU with GPM beside one without: the counters' time-weighted means on the first,
    nulls (never zeros) on the second; violation time is the counter's growth as a share of the window."""
    hopper = gpu_frame(T, device="gpu0", power_w=100.0, sm_active_pct=np.where(T < 5, 80.0, 40.0),
                       sm_occupancy_pct=30.0, tensor_active_pct=50.0, dram_bw_util_pct=20.0,
                       nvlink_tx_bytes_s=np.where(T < 5, 2e9, 1e9), nvlink_rx_bytes_s=1e9,
                       violation_power_ns=(T * 0.25 * 1e9).astype(np.int64), violation_thermal_ns=0,
                       violation_sync_boost_ns=10**12)
    ampere = gpu_frame(T, device="gpu1", power_w=100.0, violation_power_ns=0)
    s = summarize(make_run(tmp_path, [hopper, ampere]), "all").sort("device")
    gpm, other = s.row(0, named=True), s.row(1, named=True)
    assert gpm["sm_active_mean_pct"] == pytest.approx(60.0) and gpm["sm_occupancy_mean_pct"] == pytest.approx(30.0)
    assert gpm["tensor_active_mean_pct"] == pytest.approx(50.0) and gpm["dram_bw_util_mean_pct"] == pytest.approx(20.0)
    assert gpm["nvlink_tx_mean_bytes_s"] == pytest.approx(1.5e9) and gpm["nvlink_tx_peak_bytes_s"] == 2e9
    assert gpm["violation_power_frac"] == pytest.approx(0.25) and gpm["violation_thermal_frac"] == 0.0
    assert gpm["violation_sync_boost_frac"] == 0.0                  # a constant counter: none in the window
    for col in ("sm_active_mean_pct", "sm_occupancy_mean_pct", "tensor_active_mean_pct", "dram_bw_util_mean_pct",
                "nvlink_tx_mean_bytes_s", "nvlink_tx_peak_bytes_s", "violation_thermal_frac"):
        assert other[col] is None, col
    assert other["violation_power_frac"] == 0.0
    run_row = summarize(make_run(tmp_path, [hopper, ampere], run_id="run-b"), "all", by="run")
    assert one(run_row, "sm_active_mean_pct") == pytest.approx(60.0)     # the GPUs that measured it
    assert one(run_row, "nvlink_tx_peak_bytes_s") == 2e9


def test_host_iowait_and_busiest_core(tmp_path):
    cores = [[100.0, 0.0, 0.0, 0.0] if t < 5 else [25.0, 25.0, 25.0, 25.0] for t in T]
    host = gpu_frame(T, device="host", cpu_util_pct=25.0, cpu_iowait_pct=np.where(T < 5, 10.0, 0.0),
                     cpu_core_util_pct=cores)
    s = summarize(make_run(tmp_path, [host]), "all", by="run")
    assert one(s, "cpu_util_mean_pct") == pytest.approx(25.0)
    assert one(s, "cpu_iowait_mean_pct") == pytest.approx(5.0)
    assert one(s, "cpu_core_busiest_mean_pct") == pytest.approx(62.5)   # one core full, then all at a quarter
