"""`charllm-tui plan` and `charllm-tui sweep` as a user runs them: output, JSON shape, exit codes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import polars as pl
import pytest

from charllm.engine.model.experiment import Experiment
from charllm.tui.cli import main
from infra_cli import one_error_line, run

MEGATRON = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16 --bf16 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
            "--use-distributed-optimizer --vocab-size 50257 --log-interval 1 --weight-decay 0.1")


# -- plan -------------------------------------------------------------------------------------
def test_plan_prints_a_per_stage_table(capsys):
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000")
    assert code == 0
    for word in ("weights", "grads", "optim", "acts", "other", "total", "reserve", "headroom", "verdict",
                 "outside it", "allocated peak", "reserved beyond it"):
        assert word in out
    assert out.rstrip().splitlines()[-1].startswith("fits: ")
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]) == 4


def test_plan_json_shape(capsys):
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000", "--json")
    assert code == 0
    d = json.loads(out)
    assert isinstance(d["fits"], bool) and isinstance(d["usable_bytes"], int)
    assert isinstance(d["peak_bytes"], int) and 0 <= d["peak_stage"] < 4
    assert d["ignored_args"] == [] and isinstance(d["warnings"], list)
    assert [s["pp_rank"] for s in d["stages"]] == [0, 1, 2, 3]
    for s in d["stages"]:
        assert set(s["breakdown"]) == {"weights", "gradients", "optimizer", "activations", "other"}
        assert s["static_bytes"] == s["breakdown"]["weights"] + s["breakdown"]["gradients"] \
            + s["breakdown"]["optimizer"]
        assert s["total_bytes"] == s["static_bytes"] + s["activation_bytes"] + s["breakdown"]["other"]
        assert isinstance(s["fits"], bool) and isinstance(s["headroom_bytes"], int)


def test_plan_set_changes_the_estimate_and_exit_1_when_it_does_not_fit(capsys):
    _, base, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000", "--json")
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000", "--json",
                       "--set", "micro_batch_size=8", "--set", "use_distributed_optimizer=false")
    assert code == 1
    assert json.loads(out)["fits"] is False
    assert json.loads(out)["peak_bytes"] > json.loads(base)["peak_bytes"]


def test_plan_megatron_args(capsys):
    code, out, _ = run(capsys, "plan", "--megatron-args", MEGATRON, "--world-size", "8",
                       "--hardware", "h100-sxm-80gb", "--json")
    assert code == 0
    d = json.loads(out)
    assert len(d["stages"]) == 2
    assert "--log-interval" in " ".join(d["ignored_args"]) and "--weight-decay" in " ".join(d["ignored_args"])


def test_plan_a_model_on_a_cluster_as_sweep_takes_it(capsys):
    """--model, --hardware (its short name), --nodes, --gpus-per-node and --global-batch-size, with the
    layout in --set: the same plan as the preset that says the same, and --world-size is nodes of 8."""
    layout = ["--set", "tensor_model_parallel_size=8", "--set", "pipeline_model_parallel_size=4",
              "--set", "sequence_parallel=true", "--set", "use_distributed_optimizer=true"]
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--hardware", "h100", "--nodes", "8",
                       "--gpus-per-node", "8", "--global-batch-size", "128", *layout, "--json")
    assert code == 0
    by_model = json.loads(out)
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000", "--json")
    preset = json.loads(out)
    assert by_model["peak_bytes"] == preset["peak_bytes"] and by_model["speed"] == preset["speed"]
    assert [s["total_bytes"] for s in by_model["stages"]] == [s["total_bytes"] for s in preset["stages"]]
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--hardware", "h100-sxm-80gb", "--world-size", "64",
                       "--global-batch-size", "128", *layout, "--json")
    assert code == 0 and json.loads(out)["peak_bytes"] == preset["peak_bytes"]
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--hardware", "h200", "--nodes", "8",
                       "--gpus-per-node", "8", "--global-batch-size", "128", *layout)
    assert code == 0 and out.startswith("plan: llama3-70b on 64 x h200-141gb (TP8 PP4 DP2 SP dist-opt)")


@pytest.mark.parametrize("argv, needle", [
    (["plan", "tiny-local", "--set", "tensor_model_parallel_size=3"], "tensor"),
    (["plan", "no-such-experiment"], "no-such-experiment"),
    (["plan", "tiny-local", "--set", "tensor_model_paralel_size=2"], "did you mean"),
    (["plan"], "say what to plan: an EXPERIMENT_OR_PRESET, --model NAME"),
    (["plan", "tiny-local", "--megatron-args", MEGATRON], "not EXPERIMENT_OR_PRESET and --megatron-args"),
    (["plan", "llama3-70b"], "plan 'llama3-70b': a model preset, not an experiment; plan it on a cluster with "
                             "--model llama3-70b --hardware NAME --nodes N --gpus-per-node G --global-batch-size B"),
    (["plan", "--world-size", "64", "--hardware", "h100"], "say what to plan"),
    (["plan", "--model", "llama3-70b", "--hardware", "h100", "--nodes", "8", "--gpus-per-node", "8"],
     "plan --model: give --global-batch-size too"),
    (["plan", "--model", "llama3-70b", "--hardware", "h100", "--nodes", "8", "--world-size", "64",
      "--global-batch-size", "8"], "give --nodes or --world-size, not both"),
    (["plan", "--model", "llama3-70b", "--hardware", "h100", "--world-size", "12", "--global-batch-size", "8"],
     "world_size = 12: not a whole number of nodes of 8 devices"),
    (["plan", "--model", "llama3-70b", "--hardware", "h100", "--world-size", "0", "--global-batch-size", "8"],
     "--world-size = 0: must be a positive integer"),
    (["plan", "--megatron-args", MEGATRON, "--hardware", "h100", "--nodes", "2"], "--nodes goes with --model"),
    (["plan", "--megatron-args", MEGATRON, "--world-size", "8"], "--hardware"),
    (["plan", "--megatron-args", MEGATRON, "--world-size", "8", "--hardware", "h99"], "h99"),
    (["plan", "--megatron-args", "--num-layers x", "--world-size", "8", "--hardware", "h100-sxm-80gb"], "x"),
    (["plan", "--megatron-args", MEGATRON, "--world-size", "3", "--hardware", "h100-sxm-80gb"], "3"),
    (["plan", "tiny-local", "--world-size", "4"], "plan tiny-local: --world-size goes with --model or --megatron-args; "
                                                  "for an experiment, --set nodes=2 (nodes of 2 devices"),
    (["plan", "tiny-local", "--hardware", "h100"], "for an experiment, --set hardware=h100"),
    (["plan", "tiny-local", "--nodes", "2"], "plan tiny-local: --nodes goes with --model; for an experiment, "
                                             "--set nodes=2"),
    (["plan", "tiny-local", "--megatron-version", "0.16.1"], "--megatron-version goes with --megatron-args"),
    (["plan", "--megatron-args", "", "--world-size", "8", "--hardware", "h100-sxm-80gb"],
     "--megatron-args = '': no arguments in it"),
    (["plan", "--megatron-args", "# only a comment\n", "--hardware", "h100-sxm-80gb"], "no arguments in it"),
])
def test_plan_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in one_error_line(err)


def test_plan_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "0 every stage fits, 1 some stage does not fit, 3 tight, 2 bad input" in out


# -- sweep ------------------------------------------------------------------------------------
SWEEP = ["sweep", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--nodes", "1", "--gpus-per-node", "8",
         "--global-batch-size", "64"]


def test_sweep_table(capsys):
    code, out, _ = run(capsys, *SWEEP, "--top", "5")
    assert code == 0
    assert "rank" in out and "headroom" in out and "layouts" in out
    body = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(body) == 5 and body[0].split()[0] == "1"


def test_sweep_fits_only_counts_what_was_swept_and_what_fits_alike(capsys):
    code, out, _ = run(capsys, *SWEEP, "--top", "3")
    everything = out.splitlines()[0]
    code, out, _ = run(capsys, *SWEEP, "--top", "3", "--fits-only")
    assert code == 0
    title = out.splitlines()[0]
    counts = re.search(r"([\d,]+) layouts, ([\d,]+) fit, only those listed", title)
    assert counts, title
    swept, fit = (int(c.replace(",", "")) for c in counts.groups())
    assert swept > fit > 0 and f"{swept:,} layouts, {fit:,} fit" in everything


def test_sweep_json_rows(capsys):
    code, out, _ = run(capsys, *SWEEP, "--json", "--fits-only")
    assert code == 0
    rows = json.loads(out)
    assert rows and all(r["fits"] for r in rows)
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "data_parallel_size", "micro_batch_size",
            "recompute", "use_distributed_optimizer", "sequence_parallel", "peak_bytes", "fits",
            "headroom_bytes", "rank"} <= set(rows[0])


def test_sweep_parquet(capsys, tmp_path):
    target = tmp_path / "out" / "layouts.parquet"
    code, _, err = run(capsys, *SWEEP, "--parquet", str(target))
    assert code == 2 and "does not exist (create it first)" in one_error_line(err)
    assert not (tmp_path / "out").exists(), "a missing directory is never created silently"
    (tmp_path / "out").mkdir()
    code, _, err = run(capsys, *SWEEP, "--parquet", str(target))
    assert code == 0 and "wrote" in err
    df = pl.read_parquet(target)
    assert df.height > 0 and df["rank"][0] == 1
    assert not list(tmp_path.glob("out/.*.tmp"))


def test_sweep_set_and_recompute_change_every_layout(capsys):
    _, out, _ = run(capsys, *SWEEP, "--json")
    base = {tuple(r[k] for k in KEYS): r["peak_bytes"] for r in json.loads(out)}
    code, out, _ = run(capsys, *SWEEP, "--json", "--recompute", "none", "--set", "seq_length=4096",
                       "--set", "attention_backend=unfused")
    assert code == 0
    rows = json.loads(out)
    assert rows and {r["recompute"] for r in rows} == {"none"}
    # a shorter sequence than llama3-8b's 8192 but unfused attention (s x s scores): every peak changes
    assert all(r["peak_bytes"] != base[tuple(r[k] for k in KEYS)] for r in rows)
    first = rows[0]
    from charllm.engine.model.memory import estimate
    from charllm.engine.model.sweep import base_experiment, layout_to_experiment

    exp = layout_to_experiment(base_experiment("llama3-8b", "h100-sxm-80gb", 1, 8, 64, training={
        "seq_length": 4096, "attention_backend": "unfused"}), first)
    assert exp.seq_length == 4096 and estimate(exp).peak_bytes == first["peak_bytes"]


KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "micro_batch_size", "recompute", "use_distributed_optimizer")


@pytest.mark.parametrize("extra, needle", [
    (["--nodes", "0"], "--nodes = 0"),
    (["--top", "-1"], "--top = -1"),
    (["--model", "nope"], "nope"),
    (["--hardware", "nope"], "nope"),
    (["--set", "tensor_model_parallel_size=2"], "the sweep varies tensor_model_parallel_size"),
    (["--set", "recompute_granularity=full"], "the sweep varies recompute_granularity"),
    (["--set", "seq_lenght=4096"], "did you mean 'seq_length'"),
    (["--set", "hidden_size=1024"], "only training and parallel options"),
    (["--set", "seq_length=-8"], "seq_length = -8: must be at least 1"),
    (["--set", "seq_length"], "expected key=value"),
    (["--recompute", "sometimes"], "recompute = 'sometimes'"),
    (["--hardware", "a100-80gb", "--set", "fp8=e4m3"], "no valid layout: fp8 = 'e4m3': hardware a100-80gb has no FP8"),
    (["--seq-length", "16384"], "no valid layout: seq_length = 16384: must not exceed max_position_embeddings"),
    (["--recompute", "full", "--set", "cuda_graph_impl=local"], "cuda_graph_impl"),
    (["--distributed-optimizer", "maybe"], "--distributed-optimizer = 'maybe': expected one of on, off"),
    (["ppt-h100-llama3-70b-1-01000"], "sweep: --model goes with --model, not with an experiment"),
])
def test_sweep_bad_input_is_one_line_and_exit_2(capsys, extra, needle):
    code, out, err = run(capsys, *SWEEP, *extra)
    assert code == 2 and out == ""
    assert needle in one_error_line(err)


def test_sweep_json_and_parquet_are_exclusive(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*SWEEP, "--json", "--parquet", str(tmp_path / "x.parquet")])
    assert exc.value.code == 2
    assert not (tmp_path / "x.parquet").exists()


def test_sweep_help_explains_the_ranking(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "ranking" in out and "bubble" in out and "recompute" in out


def test_a_set_that_breaks_another_field_names_it_and_a_value_that_works(capsys):
    """The README's example: PP 8 leaves 10 layers per stage, below the preset's recompute count."""
    name = "ppt-h100-llama3-70b-1-01000"
    code, _, err = run(capsys, "plan", name, "--set", "pipeline_model_parallel_size=8", "--json")
    assert code == 2 and one_error_line(err).endswith("recompute_num_layers=10 works")
    code, out, _ = run(capsys, "plan", name, "--set", "pipeline_model_parallel_size=8",
                       "--set", "recompute_num_layers=10", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "fits"


def test_plan_exit_status_follows_the_verdict(capsys, tmp_path):
    """0 fits, 3 tight, 1 does not fit: the same plan on CPU "devices" sized around its peak."""
    from charllm.engine.model.memory import PEAK_MARGIN
    from charllm.probes.core import paths

    code, out, _ = run(capsys, "plan", "tiny-local", "--json")
    report = json.loads(out)
    worst = next(s for s in report["stages"] if s["pp_rank"] == report["verdict_stage"])
    assert worst["reserve_bytes"] > 0
    (paths.config_dir() / "hardware").mkdir(parents=True, exist_ok=True)
    cpu = (Path(__file__).parents[2] / "presets" / "hardware" / "cpu.toml").read_text()
    total, reserve = worst["total_bytes"], worst["reserve_bytes"]
    error = math.ceil(total * PEAK_MARGIN)   # the plan's measured error: within it of the limit is tight
    for room, expected, status in ((total + error + reserve + 1, "fits", 0),
                                   (total + reserve // 2, "tight", 3),
                                   (total - error - 1, "does not fit", 1)):
        name = f"cpu-{expected.replace(' ', '-')}"
        (paths.config_dir() / "hardware" / f"{name}.toml").write_text(
            cpu.replace("usable_bytes = 4294967296", f"usable_bytes = {room}"))
        experiment = tmp_path / f"{name}.toml"
        experiment.write_text((Path(__file__).parents[2] / "presets" / "experiments" / "tiny-local.toml")
                              .read_text().replace('hardware = "cpu"', f'hardware = "{name}"'))
        code, out, _ = run(capsys, "plan", str(experiment), "--json")
        assert (code, json.loads(out)["verdict"]) == (status, expected)


def test_sweep_of_an_experiment_keeps_its_settings(capsys):
    code, out, _ = run(capsys, "sweep", "ppt-h100-llama3-70b-1-01000", "--set", "attention_backend=unfused", "--json")
    assert code == 0
    rows = json.loads(out)
    assert {r["recompute"] for r in rows} == {"full"} and {r["use_distributed_optimizer"] for r in rows} == {True}
    from charllm.engine.model.memory import estimate
    from charllm.engine.model.sweep import layout_to_experiment

    composed = Experiment.load("ppt-h100-llama3-70b-1-01000").apply(["attention_backend=unfused"])
    for row in [r for r in rows if r["fits"]][:20]:
        assert estimate(layout_to_experiment(composed, row)).peak_bytes == row["peak_bytes"]


def test_a_paper_preset_that_does_not_fit_says_how_the_paper_ran_it(capsys):
    """GPT-3 175B at TP2 PP32 without recomputation needs ~90 GiB of an 80 GiB H100: the plan says the
    paper ran all four variants, marking those that ran out of memory, and names the recompute preset."""
    code, out, _ = run(capsys, "plan", "ppt-h100-gpt3-175b-1-00000")
    assert code == 1
    said = " ".join(out.split())
    assert "the paper ran all four variants of this layout" in said and "out of memory OOM" in said
    assert "with recomputation: ppt-h100-gpt3-175b-1-01000" in said
    code, out, _ = run(capsys, "plan", "ppt-h200-gpt3-175b-4-00000")        # TP1 PP32 on H200s
    said = " ".join(out.split())
    assert code == 1 and "parallelism sweep ran this layout with recomputation (ppt-h200-gpt3-175b-4-01000)" in said
    code, out, _ = run(capsys, "plan", "tiny-local")                   # fits: nothing more said
    assert code == 0 and "CPU processes" not in out


# -- speed ------------------------------------------------------------------------------------
def test_plan_shows_the_step_time_throughput_and_power_with_their_sources(capsys):
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000")
    assert code == 0
    assert re.search(r"^step [\d.]+ s · [\d,]+ tokens/s · [\d.]+ samples/s · MFU [\d.]+% \(bf16\)$", out, re.M)
    assert re.search(r"^of the step: compute \d+% · exposed communication \d+% · pipeline bubble \d+% · "
                     r"host-bound \d+% · optimizer and fixed \d+%$", out, re.M)
    assert "parameters 70.6B · per stage " in out and "PFLOP per iteration" in out
    assert re.search(r"^power \d+ W per device \(no limiter\) · [\d.]+ J/token", out, re.M)
    assert "speed: GEMMs at 72% of the bf16 peak (assumed) · power: idle 75 W to 700 W (assumed)" in out
    assert re.search(r"^at the 700 W limit \d+% of the step · power mean \d+ W, p99 \d+ W, peak \d+ W "
                     r"\(NVML, 50 Hz\) · SM clock \d+ MHz$", out, re.M)
    assert re.search(r"^with the limit: step [\d.]+ s \(\+[\d.]+%\) · [\d.]+ J/token$", out, re.M)
    assert "power limit: calibrated on 1 run, 20261126-045153-m1-llama1b-mbs1 (H200)" in out
    assert re.search(r"^GPU temperature \d+ °C once the steps repeat, peak \d+ °C over 11 steps$", out, re.M)
    assert "temperature: assumed, fitted to 1 short run" in out


def test_plan_json_carries_the_speed_figures(capsys):
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000", "--json")
    fast = json.loads(out)["speed"]
    assert code == 0 and fast["step_s"] > 0 and fast["tokens_per_s"] > 0 and 0 < fast["mfu"] < 1
    assert len(fast["params_per_stage"]) == len(fast["params_per_device"]) == 4
    assert sum(fast["shares"].values()) == pytest.approx(1.0)
    assert fast["source"] == {"step_time": "assumed", "power": "assumed"}
    limited = json.loads(out)["power_limit"]
    assert limited["limit_w"] == 700 and limited["peak_w"] >= limited["p99_w"] >= limited["mean_w"] > 75
    assert 0 <= limited["limit_share"] <= 1 and limited["step_s"] >= fast["step_s"]
    assert limited["source"].startswith("calibrated on 1 run")
    assert 30 < limited["temp_steady_c"] <= limited["temp_peak_c"] < 100
    assert limited["temp_source"].startswith("assumed")
    code, out, _ = run(capsys, "plan", "ppt-h100-llama3-70b-1-00000", "--set", "hardware.mem_bandwidth_gbs=0",
                       "--json")
    assert json.loads(out)["speed"] == {"unknown": "no step time: hardware 'h100-sxm-80gb' gives no "
                                                   "mem_bandwidth_gbs (0: unknown)"}
    assert json.loads(out)["power_limit"] is None


def test_sweep_ranks_fitting_layouts_by_tokens_per_second_and_sorts_by_any_column(capsys):
    args = ("sweep", "--model", "llama3-8b", "--hardware", "h100-sxm-80gb", "--nodes", "1", "--gpus-per-node", "8",
            "--global-batch-size", "64", "--fits-only", "--json")
    code, out, _ = run(capsys, *args)
    rows = json.loads(out)
    assert code == 0 and rows and [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows),
                                                                              reverse=True)
    code, out, _ = run(capsys, *args, "--sort", "energy_per_token_j")
    energy = [r["energy_per_token_j"] for r in json.loads(out)]
    assert energy == sorted(energy)
    code, out, _ = run(capsys, *args, "--sort=-mfu")                     # - reverses: the lowest MFU first
    mfu = [r["mfu"] for r in json.loads(out)]
    assert mfu == sorted(mfu)
    code, _, err = run(capsys, *args, "--sort", "tokens_per_sec")
    assert code == 2 and one_error_line(err).startswith("charllm-tui: error: --sort = 'tokens_per_sec': not a column")
    assert "did you mean 'tokens_per_s'" in err
