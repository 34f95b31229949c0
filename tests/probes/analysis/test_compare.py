"""compare: metrics side by side, % change from the baseline, direction-aware flags, experiment diff."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from charllm.probes.analysis import baselines
from charllm.probes.analysis.compare import compare, direction, render
from charllm.probes.analysis.render import format_figure
from charllm.probes.core.errors import UserError
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run, tiny_experiment
from charllm.tui.cli import main

T = np.round(np.arange(0, 101) * 0.1, 10)


def _run(root, run_id, power, temp, iter_s, mbs=1):
    rows = iteration_rows(np.arange(0, 10, iter_s), iter_s, warmup=1)
    return make_run(root, [gpu_frame(T, power_w=power, temp_gpu_c=temp)], run_id=run_id,
                    experiment=tiny_experiment(run_id, micro_batch_size=mbs), iterations=rows)


@pytest.fixture
def runs(charllm_dirs):
    root = charllm_dirs["runs"]
    a = _run(root, "20261121-000001-a", 200.0, 60.0, 1.0)
    b = _run(root, "20261121-000002-b", 260.0, 61.0, 0.5, mbs=4)   # 30 % more power, 2x faster
    return a, b


def _row(result, metric, ref):
    rows = result.table.filter((result.table["metric"] == metric) & (result.table["ref"] == ref))
    assert rows.height == 1, (metric, ref)
    return rows.row(0, named=True)


def test_direction_aware_flags(runs):
    a, b = runs
    r = compare([a.id, b.id])
    assert r.baseline == a.id
    p = _row(r, "power_mean_w", b.id)
    assert p["value"] == pytest.approx(260.0) and p["delta"] == pytest.approx(60.0)
    assert p["delta_pct"] == pytest.approx(30.0) and p["flag"] == "worse"
    s = _row(r, "samples_per_s", b.id)
    assert s["delta_pct"] == pytest.approx(100.0) and s["flag"] == "better"
    it = _row(r, "iter_time_mean_s", b.id)
    assert it["delta_pct"] == pytest.approx(-50.0) and it["flag"] == "better"
    t = _row(r, "temp_gpu_mean_c", b.id)
    assert t["delta_pct"] == pytest.approx(100 / 60) and t["flag"] is None   # under 5 %
    assert _row(r, "power_mean_w", a.id)["flag"] is None                     # the baseline itself
    assert r.experiment_diff["field"].to_list() == ["training.micro_batch_size"]
    assert r.experiment_diff[b.id].to_list() == ["4"]


def test_threshold_and_named_baseline(runs):
    a, b = runs
    r = compare([a.id, b.id], baseline=b.id, threshold_pct=40)
    assert r.baseline == b.id
    assert _row(r, "power_mean_w", a.id)["flag"] is None               # -23 % is within 40 %
    assert _row(r, "samples_per_s", a.id)["delta_pct"] == pytest.approx(-50.0)
    assert _row(r, "samples_per_s", a.id)["flag"] == "worse"
    at_edge = compare([a.id, b.id], baseline=b.id, threshold_pct=50)   # "beyond" is strictly more
    assert _row(at_edge, "samples_per_s", a.id)["flag"] is None


def test_against_a_saved_baseline(runs):
    a, b = runs
    baselines.save(a, "ref")
    r = compare([b.id], baseline="ref")
    assert r.labels == ["baseline:ref", b.id]
    assert _row(r, "power_mean_w", b.id)["delta_pct"] == pytest.approx(30.0)


def test_renderings(runs):
    a, b = runs
    r = compare([a.id, b.id])
    table = render(r, "table")
    assert table.index("Experiment differences") < table.index("Metrics")
    assert "+30.0% worse" in table
    md = render(r, "markdown")
    assert "| metric" in md and "## Metrics" in md
    data = json.loads(render(r, "json"))
    assert data["baseline"] == a.id and data["experiment_diff"][0]["field"] == "training.micro_batch_size"
    assert render(r, "csv").splitlines()[0] == "metric,ref,value,baseline_value,delta,delta_pct,better,flag"


def test_the_table_formats_figures_with_units_in_reading_order(runs):
    a, b = runs
    r = compare([a.id, b.id])
    wide = r.wide()
    metrics = wide["metric"].to_list()
    # The window first, then throughput and efficiency, then the GPUs' power and heat; bookkeeping last.
    assert metrics[0] == "window" and wide.row(0)[2:4] == ("steady", "steady")
    assert metrics.index("samples_per_s") < metrics.index("energy_j") < metrics.index("power_mean_w") \
        < metrics.index("temp_gpu_mean_c") < metrics.index("duration_s")
    figures = dict(zip(metrics, wide[a.id]))
    assert figures["power_mean_w"] == "200.0 W" and figures["temp_gpu_mean_c"] == "60.00 °C"
    assert figures["iter_time_mean_s"] == "1.000 s" and figures["iterations"] == "9"
    assert figures["energy_j"] == "1.800 kJ"                                # 200 W over the 9 steady seconds
    table = render(r, "table")
    assert "200.0 W" in table and "260.0 W" in table and not re.search(r"\de[+-]\d", table)
    # Machine-readable forms keep the raw numbers.
    assert sorted(row["value"] for row in json.loads(render(r, "json"))["metrics"]
                  if row["metric"] == "power_mean_w") == pytest.approx([200.0, 260.0])


def test_format_figure():
    assert format_figure("energy_j", 1.52049e9) == "1.520 GJ"
    assert format_figure("energy_per_token_j", 0.0091864) == "9.186 mJ"
    assert format_figure("tokens_per_s", 3355.4) == "3,355 tokens/s"
    assert format_figure("throttle_perf_frac", 0.25) == "25.00%"
    assert format_figure("mem_used_peak_bytes", 61 * 2**30) == "61.00 GiB"
    assert format_figure("power_max_rise_w_per_s", 479.594) == "479.6 W/s"
    assert format_figure("spikes_over_mean_count", 184.0) == "184"
    assert format_figure("efficiency_samples_per_s_mj", 12295.2) == "12,295 samples/(s·MJ)"
    assert format_figure("power_mean_w", None) == ""


def test_direction_table():
    assert direction("energy_per_token_j") == "lower"
    assert direction("mfu_pct") == "higher"
    assert direction("nvlink_tx_bytes") is None


def test_mismatched_and_bad_refs(runs, charllm_dirs):
    a, _ = runs
    with pytest.raises(UserError, match="at least two"):
        compare([a.id])
    with pytest.raises(UserError, match="neither a run nor a baseline"):
        compare([a.id, "ghost"])
    with pytest.raises(UserError, match="no such baseline"):
        compare([a.id, "baseline:ghost"])
    # a run whose telemetry cannot be summarized is named in the error
    broken = make_run(charllm_dirs["runs"], [gpu_frame([0.0], power_w=1.0)], chunks=1, run_id="broken")
    with pytest.raises(UserError, match="only one sample"):
        compare([a.id, broken.id])


def test_simulated_and_measured_runs_are_noted(runs, charllm_dirs):
    a, _ = runs
    frame = gpu_frame(T, power_w=200.0).with_columns(simulated=False, backend=__import__("polars").lit("nvml"))
    real = make_run(charllm_dirs["runs"], [frame], run_id="real")
    r = compare([a.id, real.id], window="all")
    assert any("simulated and measured" in n for n in r.notes)


def test_cli(runs, capsys):
    a, b = runs
    assert main(["compare", a.id, b.id, "--format", "markdown", "--threshold", "10"]) == 0
    assert "flagged beyond ±10%" in capsys.readouterr().out
    assert main(["compare", a.id]) == 2
    assert capsys.readouterr().err.strip().startswith("charllm-tui: error: compare: give at least two")


def test_figures_against_a_runs_own_mean_are_changes_not_better_or_worse(charllm_dirs):
    """Spikes over a run's own mean power: a burstier run (bursts over a lower mean) once counted
    fewer, and was coloured better."""
    root = charllm_dirs["runs"]
    steady = make_run(root, [gpu_frame(T, power_w=200.0 + 20.0 * np.sin(T * 7), temp_gpu_c=60.0)],
                      run_id="20261121-000003-steady", experiment=tiny_experiment("s"),
                      iterations=iteration_rows(np.arange(0, 10, 1.0), 1.0, warmup=1))
    bursty = make_run(root, [gpu_frame(T, power_w=np.where((T * 10).astype(int) % 10 == 0, 600.0, 150.0),
                                       temp_gpu_c=60.0)],
                      run_id="20261121-000004-bursty", experiment=tiny_experiment("b"),
                      iterations=iteration_rows(np.arange(0, 10, 1.0), 1.0, warmup=1))
    r = compare([steady.id, bursty.id])
    for metric in ("spikes_over_mean_count", "time_over_mean_s", "spikes_over_mean_max_excess_w"):
        row = _row(r, metric, bursty.id)
        assert row["better"] is None and row["flag"] in ("changed", None), (metric, row)
    assert _row(r, "spikes_over_mean_count", bursty.id)["delta"] != 0, "the figures do differ"
    assert direction("spikes_over_mean_count") is None and direction("time_over_limit_s") == "lower"


def test_experiment_diff_leaves_out_a_field_one_lacks_and_another_holds_empty(charllm_dirs):
    """An older run's experiment without hardware.device_names against two with []: no difference
    (Compare listed `hardware.device_names: | [] | []`); a real difference still is one."""
    root = charllm_dirs["runs"]
    runs = [_run(root, "20261121-000001-a", 200.0, 60.0, 1.0), _run(root, "20261121-000002-b", 200.0, 60.0, 1.0),
            _run(root, "20261121-000003-c", 200.0, 60.0, 1.0, mbs=2)]
    for newer in runs[1:]:
        newer.experiment_path.write_text(newer.experiment_path.read_text().replace(
            "[hardware]\n", "[hardware]\ndevice_names = []\n"))
    diff = compare([r.id for r in runs]).experiment_diff
    assert diff["field"].to_list() == ["training.micro_batch_size"]
