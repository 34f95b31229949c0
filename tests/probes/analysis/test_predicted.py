"""Predicted against measured (probes.analysis.predicted) and the power model fitted to recorded runs
(probes.analysis.power_fit), on run directories as the probe and the launcher write them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from charllm.engine.model import calibration, power, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.sweep import base_experiment
from charllm.probes.analysis import power_fit, predicted
from charllm.probes.analysis.summary import keep_summaries
from charllm.probes.core.errors import UserError
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run, tiny_experiment
from charllm.tui.cli import main

T = np.round(np.arange(0, 201) * 0.1, 10)          # 20 s at 10 Hz


def layout(tp: int):
    """Llama-3 8B on 8 H100s with tensor parallelism `tp` (the rest data parallel)."""
    exp = base_experiment("llama3-8b", "h100-sxm-80gb", 1, 8, 16)
    exp.parallel.tensor_model_parallel_size, exp.parallel.sequence_parallel = tp, tp > 1
    return exp


def recorded(root, run_id: str, exp, step_s: float, power_w: float, *, simulated: bool = False):
    """A finished run of `exp`: 8 GPUs drawing `power_w`, steps of `step_s`, telemetry real or simulated."""
    starts = np.arange(0, 19, step_s)
    frames = [gpu_frame(T, device=f"gpu{i}", power_w=power_w, energy_j=power_w * T, simulated=simulated,
                        backend="sim" if simulated else "nvml", iteration=np.searchsorted(starts, T, side="right"))
              for i in range(8)]
    rows = iteration_rows(starts, step_s, warmup=2, samples=exp.training.global_batch_size,
                          tokens=exp.training.global_batch_size * exp.seq_length)
    return make_run(root, frames, run_id=run_id, experiment=exp.to_toml(), iterations=rows,
                    manifest={"id": run_id, "status": "completed", "kind": "train"})


def test_predicted_against_measured_gives_the_plan_the_run_and_the_error(charllm_dirs):
    exp = layout(2)
    run = recorded(charllm_dirs["runs"], "20261121-000000-tp2", exp, 1.0, 500.0)
    table = predicted.predicted_vs_measured(run)
    by = {r["metric"]: r for r in table.iter_rows(named=True)}
    plan = speed.estimate(exp)
    assert by["step time"]["predicted"] == pytest.approx(plan.step_s)
    assert by["step time"]["measured"] == pytest.approx(1.0, rel=1e-3)
    assert by["step time"]["error_pct"] == pytest.approx(100 * (plan.step_s / by["step time"]["measured"] - 1))
    assert by["power per GPU"]["predicted"] == pytest.approx(plan.power_w)
    assert by["power per GPU"]["measured"] == pytest.approx(500.0)
    assert {"tokens/s", "MFU", "energy per token"} <= set(by)
    assert table["source"][0] == speed.describe(exp)
    text = predicted.render(table)
    assert text.startswith("predicted (the plan) against measured") and "step time" in text and "(speed: " in text


def test_a_simulated_run_says_so_and_a_run_without_an_experiment_has_no_plan(charllm_dirs):
    run = recorded(charllm_dirs["runs"], "20261121-000000-sim", layout(1), 1.0, 500.0, simulated=True)
    assert predicted.predicted_vs_measured(run)["source"][0].endswith("; simulated telemetry")
    bare = make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=100.0)], run_id="20261121-000000-bare")
    with pytest.raises(UserError, match="no experiment.toml"):
        predicted.predicted_vs_measured(bare)
    lacking = make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=100.0)], run_id="20261121-000000-lacking",
                       experiment=tiny_experiment("lacking"), iterations=iteration_rows(np.arange(0, 19, 1.0), 1.0))
    assert predicted.predicted_vs_measured(lacking).height == 0       # its hardware gives no bandwidths


def test_summarize_ends_with_the_plan_against_the_run(charllm_dirs, capsys):
    recorded(charllm_dirs["runs"], "20261121-000000-tp2", layout(2), 1.0, 500.0)
    assert main(["summarize", "tp2", "--by", "run"]) == 0
    out = capsys.readouterr().out
    assert "predicted (the plan) against measured" in out and "power per GPU" in out and "500 W" in out


def test_finished_real_runs_calibrate_their_hardware_power(charllm_dirs):
    light, heavy = layout(8), layout(1)          # TP8 waits on its collectives: less of the board busy
    times = [speed.step_times(e, speed.layouts_of(e)) for e in (light, heavy)]
    u = [float(speed.utilization(np, t)[0]) for t in times]
    assert u[0] < u[1] - 0.05
    idle, top = 90.0, 680.0                       # what the boards "really" draw
    for run_id, exp, share in (("20261121-000000-light", light, u[0]), ("20261121-010000-heavy", heavy, u[1])):
        run = recorded(charllm_dirs["runs"], run_id, exp, 1.0, idle + (top - idle) * share)
        keep_summaries(run)                       # what finishes a run: it refits the hardware's power
    fit = calibration.load_power("h100-sxm-80gb")
    assert (
        fit["runs"] == 2
        and fit["idle_w"] == pytest.approx(idle, abs=0.2)
        and fit["max_w"] == pytest.approx(top, abs=0.2)
    )
    plan = speed.estimate(heavy)
    assert plan.power_source == ("calibrated from 2 recorded runs of h100-sxm-80gb: 20261121-000000-light, "
                                 "20261121-010000-heavy"), "a plan names the runs its power came from"
    assert plan.power_w == pytest.approx(idle + (top - idle) * u[1], abs=0.5)
    # a simulated run, or one of other hardware, does not count
    recorded(charllm_dirs["runs"], "20261121-020000-sim", heavy, 1.0, 50.0, simulated=True)
    assert len(power_fit.power_points("h100-sxm-80gb")) == 2


def test_one_run_fits_full_load_and_keeps_the_presets_idle(charllm_dirs):
    exp = layout(1)
    share = float(speed.utilization(np, speed.step_times(exp, speed.layouts_of(exp)))[0])
    run = recorded(charllm_dirs["runs"], "20261121-000000-one", exp, 1.0, 75.0 + 500.0 * share)
    assert power_fit.refit_for(run) is None                   # no kept summary yet: nothing to fit
    keep_summaries(run)
    fit = calibration.load_power("h100-sxm-80gb")
    assert fit["runs"] == 1 and fit["idle_w"] == 75.0 and fit["max_w"] == pytest.approx(575.0, abs=0.5)
    assert "idle 75 W from the preset" in fit["how"]


def test_a_refit_takes_only_completed_plausible_runs_and_doctor_show_lists_it(charllm_dirs, capsys):
    """Issue 39: an import silently refitted H200 power to idle 393 W from 9 runs, crashes among them."""
    light, heavy = layout(8), layout(1)
    u = [float(speed.utilization(np, speed.step_times(e, speed.layouts_of(e)))[0]) for e in (light, heavy)]
    idle, top = 90.0, 680.0
    for run_id, exp, share in (("20261121-000000-light", light, u[0]), ("20261121-010000-heavy", heavy, u[1])):
        keep_summaries(recorded(charllm_dirs["runs"], run_id, exp, 1.0, idle + (top - idle) * share))
    hot = recorded(charllm_dirs["runs"], "20261121-020000-hot", heavy, 1.0, 800.0)      # > 110 % of 700 W
    crashed = recorded(charllm_dirs["runs"], "20261121-030000-crash", heavy, 1.0, 150.0)
    crashed.update_manifest(status="failed", failure="crashed or OOM")
    for run in (hot, crashed):
        keep_summaries(run)
    fit = calibration.load_power("h100-sxm-80gb")
    assert [p["run"] for p in fit["points"]] == ["20261121-000000-light", "20261121-010000-heavy"]
    assert fit["idle_w"] == pytest.approx(idle, abs=0.2) and fit["max_w"] == pytest.approx(top, abs=0.2)
    assert fit["left_out"] == [{"run": "20261121-020000-hot", "power_w": 800.0, "why": "above 110% of the 700 W limit"}]
    assert main(["doctor", "--show"]) == 0
    out = capsys.readouterr().out
    assert ("power model of h100-sxm-80gb: idle 90 W, full load 680 W (idle and full load fitted), fitted from 2 "
            "recorded runs: 20261121-000000-light, 20261121-010000-heavy") in out, out
    assert "left out: 20261121-020000-hot (800.0 W, above 110% of the 700 W limit)" in out
    assert main(["doctor", "--show", "h100", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["calibrations"] == [] and [f["hardware"] for f in shown["power_models"]] == ["h100-sxm-80gb"]
    assert shown["power_models"][0]["left_out"] == fit["left_out"] and len(shown["power_models"][0]["points"]) == 2
    assert main(["doctor", "--drop-power", "h100"]) == 0 and "power model of h100-sxm-80gb dropped" in \
        capsys.readouterr().out
    assert calibration.load_power("h100-sxm-80gb") is None and speed.estimate(heavy).power_source == "assumed"
    assert main(["doctor", "--drop-power", "h100"]) == 2
    assert "no power model is fitted for h100-sxm-80gb" in capsys.readouterr().err


@pytest.mark.parametrize("idle, full, fits", [(90.0, 680.0, True), (30.0, 680.0, False), (450.0, 680.0, False),
                                              (90.0, 780.0, False), (300.0, 200.0, False)])
def test_a_fit_outside_a_boards_plausible_range_is_never_saved(idle, full, fits):
    assert power_fit.plausible(idle, full, 700.0) == fits       # idle 35-420 W, full load up to 770 W


def test_runs_that_imply_an_implausible_idle_leave_the_model_as_it_was(charllm_dirs):
    light, heavy = layout(8), layout(1)
    u = [float(speed.utilization(np, speed.step_times(e, speed.layouts_of(e)))[0]) for e in (light, heavy)]
    idle, top = 500.0, 690.0                                # idle at 71 % of the limit: not a board's
    for run_id, exp, share in (("20261121-000000-light", light, u[0]), ("20261121-010000-heavy", heavy, u[1])):
        keep_summaries(recorded(charllm_dirs["runs"], run_id, exp, 1.0, idle + (top - idle) * share))
    assert calibration.load_power("h100-sxm-80gb") is None
    assert speed.estimate(heavy).power_source == "assumed"


def test_the_kept_h200_run_shows_the_limiters_figures_beside_its_own(charllm_dirs, capsys):
    """The one run kept whole (tests/data/gpu_runs/), copied: the power limiter's mean, p99, peak, share at
    the limit and SM clock, and the thermal model's temperatures, beside the steady window's; each kind with
    the source it rests on (one run)."""
    kept = Path(__file__).parents[2] / "data" / "gpu_runs" / "runs" / "20261126-045153-m1-llama1b-mbs1"
    run = shutil.copytree(kept, charllm_dirs["runs"] / kept.name)
    table = predicted.predicted_vs_measured(run)
    by = {r["metric"]: r for r in table.iter_rows(named=True)}
    got = power.predict(Experiment.load(str(run / "experiment.toml")))
    assert by["power per GPU, limiter"]["predicted"] == pytest.approx(got.mean_w)
    assert by["power per GPU, limiter"]["measured"] == pytest.approx(627.3, abs=0.1)
    assert by["power p99"]["measured"] == pytest.approx(795.2, abs=0.1) and abs(by["power p99"]["error_pct"]) < 8
    assert by["at the power limit"]["predicted"] == pytest.approx(100 * got.limit_share)
    assert by["at the power limit"]["measured"] == pytest.approx(100.0)
    assert by["SM clock"]["measured"] == pytest.approx(1886.4, abs=0.1) and abs(by["SM clock"]["error_pct"]) < 3
    assert by["GPU temperature peak"]["measured"] == 50.0
    assert by["GPU temperature peak"]["predicted"] == pytest.approx(got.temp_peak_c)
    plan = speed.estimate(Experiment.load(str(run / "experiment.toml")))
    assert by["power per GPU"]["predicted"] == pytest.approx(plan.power_w)   # the speed model's, without the limiter
    assert by["power peak"]["source"].startswith("power limit: calibrated on 1 run")
    assert by["GPU temperature"]["source"].startswith("temperature: assumed")
    assert main(["summarize", kept.name, "--by", "run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^power p99 +\d+ W +795 W +[+-][\d.]+%$", out, re.M)
    assert re.search(r"^GPU temperature peak +[\d.]+ °C +50.0 °C", out, re.M)
    assert "(power limit: calibrated on 1 run" in out and "(temperature: assumed" in out
