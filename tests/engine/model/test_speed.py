"""The step-time and power model (engine.model.speed): its figures follow from its step time, each
modelled cost moves the step the way Megatron's would, and calibrations replace what was assumed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from charllm.engine.model import calibration, speed
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import flops_per_iteration
from charllm.engine.model.memory import count_parameters
from charllm.engine.model.sweep import base_experiment


def llama8b(**settings) -> Experiment:
    """Llama-3 8B on 2 x 8 H100s, TP2 PP2 (DP4), as a composed experiment."""
    exp = base_experiment("llama3-8b", "h100-sxm-80gb", 2, 8, 64)
    exp.parallel.tensor_model_parallel_size = exp.parallel.pipeline_model_parallel_size = 2
    exp.parallel.sequence_parallel = True
    for key, value in settings.items():
        exp.set(key, value)
    return exp


def test_figures_follow_from_the_step_time():
    exp = llama8b()
    got = speed.estimate(exp)
    tokens = exp.training.global_batch_size * exp.seq_length
    assert got.tokens_per_s == pytest.approx(tokens / got.step_s)
    assert got.flops_per_iteration == flops_per_iteration(exp)
    assert got.flops_full_attention == flops_per_iteration(exp, causal=False) > got.flops_per_iteration
    assert got.mfu == pytest.approx(got.flops_per_iteration / got.step_s / exp.world_size / 989.4e12)
    assert sum(got.shares.values()) == pytest.approx(1.0)
    assert all(0 <= share <= 1 for share in got.shares.values())
    assert got.params_total == count_parameters(exp.model)
    assert sum(got.params_per_stage) == got.params_total            # untied: no stage holds a copy
    assert len(got.params_per_device) == 2 and max(got.params_per_device) < got.params_total / 2
    assert exp.hardware.idle_w < got.power_w < exp.hardware.tdp_w
    assert got.energy_per_token_j == pytest.approx(got.power_w * exp.world_size * got.step_s / tokens)
    assert got.rates_source == "assumed" and got.power_source == "assumed"


@pytest.mark.parametrize("change, slower", [
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, True),
    ({"recompute_granularity": "selective"}, True),
    ({"attention_backend": "unfused"}, True),
    ({"fp8": "hybrid"}, False),
    ({"overlap_grad_reduce": True}, False),
    ({"tp_comm_overlap": True}, False),
])
def test_each_cost_moves_the_step_as_megatron_would(change, slower):
    plain, changed = speed.estimate(llama8b()).step_s, speed.estimate(llama8b(**change)).step_s
    assert (changed > plain) if slower else (changed < plain), (change, plain, changed)


def test_the_pipeline_bubble_shrinks_with_micro_batches_and_interleaving():
    few, many = speed.estimate(llama8b(global_batch_size=16)), speed.estimate(llama8b(global_batch_size=256))
    assert many.shares["bubble"] < few.shares["bubble"]
    interleaved = speed.estimate(llama8b(global_batch_size=16, virtual_pipeline_model_parallel_size=4))
    assert interleaved.shares["bubble"] < few.shares["bubble"]


def test_host_bound_time_is_not_a_pipeline_bubble():
    """A small model at PP 1 waits on the host that launches its kernels: that is the host-bound share;
    a pipeline without stages has no bubble. A large pipelined model has a bubble and no host wait."""
    small = speed.estimate(Experiment.load("tiny-local"))
    assert small.shares["bubble"] == 0 and small.shares["host"] > 0.1
    large = speed.estimate(llama8b(global_batch_size=16))
    assert large.shares["bubble"] > 0.01 and large.shares["host"] == 0
    for got in (small, large):
        assert sum(got.shares.values()) == pytest.approx(1)
        assert set(got.shares) == set(speed.SHARES)


def test_tensor_parallelism_across_nodes_is_slower_than_within_one():
    within = llama8b(tensor_model_parallel_size=4)
    across = llama8b(tensor_model_parallel_size=4)
    across.cluster.nodes, across.cluster.gpus_per_node = 8, 2            # the same 16 GPUs, 2 per node
    inside, outside = speed.estimate(within), speed.estimate(across)
    assert outside.shares["communication"] > inside.shares["communication"]
    assert outside.step_s > inside.step_s


def test_offloading_costs_what_the_host_link_cannot_hide():
    exp = llama8b(fine_grained_activation_offloading=True, offload_modules=["core_attn", "qkv_linear"])
    hidden = speed.estimate(exp).step_s                  # the transfers fit beside each layer's compute
    assert hidden == pytest.approx(speed.estimate(llama8b()).step_s)
    exp.hardware.host_link_gbs /= 4
    assert speed.estimate(exp).step_s > 1.5 * hidden


def test_a_node_calibration_replaces_the_assumed_gemm_efficiency():
    exp = llama8b()
    assumed = speed.estimate(exp)
    calibration.save({"hardware": exp.hardware.name, "node": "gpu7", "date": "2026-08-30",
                      "stack": {"cuda": True, "capability": [9, 0], "extensions": ["transformer_engine"]},
                      "speed": {"matmul_efficiency": 0.85}})
    calibrated = speed.estimate(exp)
    assert calibrated.rates_source == "calibrated on gpu7, 2026-08-30"
    assert calibrated.step_s < assumed.step_s
    assert "85% of the bf16 peak (calibrated on gpu7, 2026-08-30)" in speed.describe(exp)


def test_the_efficiency_a_measured_step_implies_gives_back_that_step():
    exp = llama8b()
    predicted = speed.estimate(exp).step_s
    found = speed.calibrated_efficiency(exp, predicted * 1.2)
    assert found is not None and found < exp.hardware.matmul_efficiency
    exp.hardware.matmul_efficiency = found
    assert speed.estimate(exp).step_s == pytest.approx(predicted * 1.2, rel=1e-3)
    assert speed.calibrated_efficiency(exp, predicted / 100) is None        # faster than any efficiency allows


def test_power_comes_from_the_recorded_runs_fit_where_there_is_one():
    exp = llama8b()
    calibration.save_power(exp.hardware.name, {"idle_w": 100.0, "max_w": 650.0, "runs": 3})
    got = speed.estimate(exp)
    assert got.power_source == "calibrated from 3 recorded runs of h100-sxm-80gb"
    assert 100 < got.power_w < 650
    assert "idle 100 W to 650 W (calibrated from 3 recorded runs" in speed.describe(exp)


def test_no_power_without_a_board_limit_and_no_mfu_without_a_peak():
    exp = Experiment.load("tiny-local")
    got = speed.estimate(exp)
    assert got.power_w is None and got.energy_per_token_j is None and got.power_source is None
    exp.hardware = dataclasses.replace(exp.hardware, fp32_tflops=None)
    assert speed.estimate(exp).mfu is None


def test_a_damaged_power_calibration_is_no_calibration(capsys):
    exp = llama8b()
    calibration.power_path(exp.hardware.name).parent.mkdir(parents=True, exist_ok=True)
    calibration.power_path(exp.hardware.name).write_text('{"idle_w": 900, "max_w": 100, "runs": 1}')
    assert speed.estimate(exp).power_source == "assumed"
    assert "not a usable power calibration" in capsys.readouterr().err


def test_hardware_without_a_figure_the_model_needs_gets_no_step_time():
    exp = llama8b()
    exp.hardware.mem_bandwidth_gbs = 0.0
    assert speed.estimate(exp) is None and speed.missing(exp) == ["mem_bandwidth_gbs"]
    assert speed.unknown(exp) == "no step time: hardware 'h100-sxm-80gb' gives no mem_bandwidth_gbs (0: unknown)"
    exp.hardware.network_gbs = 0.0                        # two nodes: the network is needed too
    assert speed.missing(exp) == ["mem_bandwidth_gbs", "network_gbs"]
    from charllm.engine.model.sweep import sweep  # beside the estimate it mirrors

    df = sweep(exp)
    assert df.height > 0 and df["tokens_per_s"].null_count() == df.height and df["step_s"].null_count() == df.height


def mixtral(**settings) -> Experiment:
    """Mixtral 8x7B with 16 experts on 2 x 8 H100s, EP 16 (across both nodes), the all-to-all dispatcher."""
    exp = base_experiment("mixtral-8x7b", "h100-sxm-80gb", 2, 8, 64)
    exp.model.num_moe_experts = 16          # EP 16 spans both nodes
    exp.parallel.expert_model_parallel_size = 16
    exp.training.moe_token_dispatcher_type = "alltoall"
    exp.training.recompute_granularity = "full"
    exp.training.recompute_method, exp.training.recompute_num_layers = "uniform", 1
    for key, value in settings.items():
        exp.set(key, value)
    return exp


def test_the_flex_dispatcher_sends_a_token_once_per_rank_and_node():
    """DeepEP and HybridEP send a token once to each rank (and node) its experts are on; the all-to-all
    dispatcher once per (token, expert) pair, so across two nodes its exchange is the longer one."""
    alltoall, flex = speed.estimate(mixtral()), speed.estimate(mixtral(moe_token_dispatcher_type="flex"))
    assert flex.step_s < alltoall.step_s
    assert flex.shares["communication"] < alltoall.shares["communication"]
    one = dict(token_bytes=1e8, topk=8, size=16, stride=1, r=speed.rates(mixtral(), "bf16"))
    assert float(speed._all_to_all(np, **one, per_rank=True)) < float(speed._all_to_all(np, **one)) / 3


def test_the_a2a_overlap_hides_expert_parallel_exchanges_behind_the_other_micro_batch():
    plain = speed.estimate(mixtral(recompute_granularity=None, recompute_method=None, recompute_num_layers=None))
    overlapped = speed.estimate(mixtral(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                                        overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    assert overlapped.step_s < plain.step_s
    assert overlapped.shares["communication"] < plain.shares["communication"]


def test_forced_load_balancing_plans_the_experts_of_the_mean_rank():
    free, balanced = speed.estimate(mixtral()), speed.estimate(mixtral(moe_router_force_load_balancing=True))
    assert balanced.step_s < free.step_s


def test_a_gemm_that_leaves_a_wave_half_empty_runs_slower_per_flop():
    r = speed.rates(llama8b(), "bf16")
    assert r.sms == 132
    full = float(speed._gemm(np, 128.0 * 132, 8192, 256, r.matmul_flops, r.matmul, r, 2))   # one whole wave
    past = float(speed._gemm(np, 128.0 * 133, 8192, 256, r.matmul_flops, r.matmul, r, 2))   # one tile more
    assert past / full > 1.25                  # the extra tile costs a wave of its own (a third of one)
    assert float(speed._waves(np, 128.0 * 132, 256, 1, 132)) == 1.0
    assert float(speed._waves(np, 128.0 * 132, 256, 1, 0)) == 1.0       # SM count unknown: not counted


def test_fp8_gemms_run_at_their_recipes_share_of_the_bf16_efficiency():
    exp = llama8b(fp8="hybrid")
    fp8, bf16 = speed.rates(exp, "fp8"), speed.rates(exp, "bf16")
    assert fp8.matmul == pytest.approx(bf16.matmul * speed.FP8_MATMUL_SHARE[exp.training.fp8_recipe])
    assert fp8.matmul * fp8.matmul_flops == pytest.approx(0.52 * 1978.9e12, rel=0.01)   # about half the FP8 peak


def test_deterministic_mode_costs_a_transformer_engine_layer_more_host_time():
    tiny = base_experiment("tiny-dense", "h100-sxm-80gb", 1, 1, 8)
    tiny.training.transformer_impl = "transformer_engine"
    plain, deterministic = speed.estimate(tiny), speed.estimate(dataclasses.replace(
        tiny, training=dataclasses.replace(tiny.training, deterministic_mode=True)))
    assert plain.shares["host"] > 0.5                       # a tiny model's step is the host's
    assert deterministic.step_s > plain.step_s


def test_a_large_model_at_tp8_pp1_is_not_host_bound():
    exp = base_experiment("llama3-70b", "h100-sxm-80gb", 8, 8, 128)
    exp.parallel.tensor_model_parallel_size = 8
    exp.parallel.sequence_parallel = True
    exp.training.recompute_granularity, exp.training.recompute_method = "full", "uniform"
    exp.training.recompute_num_layers = 1
    assert speed.estimate(exp).shares["host"] == 0.0


def test_tp_communication_overlap_shortens_the_step_of_gpt3_at_tp8_pp4():
    """The CharLLM-PPT GPT-3 175B presets on 4 x 8 H200s: with TP overlap (11000) Megatron hides the TP
    collectives that the recompute-only variant (01000) waits for."""
    overlapped, plain = (speed.estimate(Experiment.load(f"ppt-h200-gpt3-175b-3-{v}")) for v in ("11000", "01000"))
    assert overlapped.step_s < 0.95 * plain.step_s
    assert overlapped.shares["communication"] < plain.shares["communication"]


def test_a_batch_ramp_up_plans_its_early_steps_and_leaves_the_steady_one():
    steady = speed.estimate(llama8b(global_batch_size=128))
    ramped = speed.estimate(llama8b(global_batch_size=128, rampup_batch_size=[32, 32, 3000]))
    assert ramped.step_s == steady.step_s
    assert [batch for batch, _, _ in ramped.ramp] == [32, 64, 96]
    times = [seconds for _, _, seconds in ramped.ramp]
    assert times == sorted(times) and times[-1] < steady.step_s
    assert any("batch ramp-up" in note for note in ramped.notes)
