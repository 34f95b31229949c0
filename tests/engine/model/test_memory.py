"""The memory model, formula by formula, against numbers computed by hand in each test.

Notation as in Korthikanti et al. 2022: s sequence, b micro batch, h hidden, a heads, t TP size,
L layers, V padded vocabulary; activations in bf16 (2 bytes per element).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from charllm.engine.model.experiment import Cluster, Experiment, Hardware, ModelSpec, Parallel, Training
from charllm.engine.model.memory import (
    BASE_WORKSPACE_BYTES,
    GEMM_WORKSPACE_BYTES,
    _Shapes,
    count_parameters,
    estimate,
    split_layers,
)

S, B, H, A, FFN, L, V = 1024, 2, 512, 8, 2048, 4, 50304
GIB = 1 << 30


def gpt(*, tp=1, pp=1, vp=None, cp=1, sp=False, dp=1, mbs=B, gbs=None, dist_opt=False, dropout=0.1,
        backend="unfused", recompute=None, method=None, recompute_layers=None, expandable_segments=True,
        cpu_offloading_num_layers=0, fine_grained_activation_offloading=False, offload_modules=None,
        **model) -> Experiment:
    """A GPT-3-style model (LayerNorm, biases, GELU 4h MLP, learned positions, tied embeddings)."""
    spec = dict(num_layers=L, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=A, seq_length=S,
                max_position_embeddings=S, vocab_size=50257, hidden_dropout=dropout, attention_dropout=dropout)
    spec.update(model)
    world = tp * pp * cp * dp
    return Experiment(
        model=ModelSpec(**spec),
        hardware=Hardware(name="test-80g", vendor="nvidia", usable_bytes=80 * GIB, memory_bytes=80 * GIB,
                          outside_allocator_bytes=2 * GIB),
        cluster=Cluster(nodes=1, gpus_per_node=world),
        parallel=Parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp, sequence_parallel=sp,
                          use_distributed_optimizer=dist_opt),
        training=Training(micro_batch_size=mbs, global_batch_size=gbs or mbs * dp, attention_backend=backend,
                          recompute_granularity=recompute, recompute_method=method,
                          recompute_num_layers=recompute_layers, expandable_segments=expandable_segments,
                          cpu_offloading_num_layers=cpu_offloading_num_layers,
                          fine_grained_activation_offloading=fine_grained_activation_offloading,
                          offload_modules=offload_modules),
    )


def layer_params(h=H, ffn=FFN) -> int:
    """GPT layer: QKV 3h^2+3h, proj h^2+h, fc1 h*ffn+ffn, fc2 ffn*h+h, two LayerNorms 4h."""
    return 4 * h * h + 2 * h * ffn + 9 * h + ffn


# -- weights ----------------------------------------------------------------------------------
def test_parameter_count_of_a_small_gpt_matches_the_explicit_formula():
    m = gpt().model
    assert count_parameters(m) == V * H + S * H + L * layer_params() + 2 * H   # + final LayerNorm


def test_gqa_swiglu_rmsnorm_untied_parameter_count():
    m = gpt(num_query_groups=2, swiglu=True, normalization="RMSNorm", untie_embeddings_and_output_weights=True,
            position_embedding_type="rope", add_bias_linear=False).model
    d = H // A
    per_layer = H * (A + 2 * 2) * d + A * d * H + 3 * H * FFN + 2 * H      # QKV, proj, fc1 (gated) + fc2, norms
    assert count_parameters(m) == 2 * V * H + L * per_layer + H


def test_weights_on_one_rank_split_by_tp_and_pp_with_the_output_copy_on_the_last_stage():
    r = estimate(gpt(tp=2, pp=2))
    v2 = 50432                                     # 50257 padded to a multiple of 128 x TP
    column, row = 3 * H * H + 3 * H + H * FFN + FFN, H * H + FFN * H   # split by TP (column biases too)
    replicated = 4 * H + 2 * H                      # LayerNorms and the row-parallel biases
    layer = (column + row) // 2 + replicated
    first = 2 * layer + v2 * H // 2 + S * H
    last = 2 * layer + 2 * H + v2 * H // 2          # final norm + its own copy of the tied embedding
    assert [s.weights for s in r.stages] == [2 * first, 2 * last]


def test_tied_embedding_is_counted_once_without_pipeline_parallelism():
    r = estimate(gpt())
    assert r.stages[0].weights == 2 * count_parameters(gpt().model)


# -- gradients and optimizer ------------------------------------------------------------------
def test_gradients_are_fp32_main_grads_unless_reduced_in_bf16():
    exp = gpt()
    n = count_parameters(exp.model)
    assert estimate(exp).stages[0].gradients == 4 * n
    exp.training.grad_reduce_in_bf16 = True
    assert estimate(exp).stages[0].gradients == 2 * n


def test_adam_state_is_12_bytes_per_parameter_sharded_by_the_distributed_optimizer():
    n = count_parameters(gpt().model)
    assert estimate(gpt(dp=4)).stages[0].optimizer == 12 * n
    assert estimate(gpt(dp=4, dist_opt=True)).stages[0].optimizer == 12 * n // 4
    # context-parallel ranks hold the same weights, so they share the optimizer shard too
    assert estimate(gpt(dp=2, cp=2, dist_opt=True)).stages[0].optimizer == 12 * n // 4


def test_expert_optimizer_state_shards_over_the_expert_data_parallel_group():
    exp = gpt(dp=8, dist_opt=True, num_moe_experts=8, moe_router_topk=2, add_bias_linear=False)
    exp.parallel.expert_model_parallel_size = 4
    experts_per_rank = 2 * (2 * H * FFN)            # 8 experts / EP4, fc1 + fc2 without bias
    dense = count_parameters(exp.model) - L * 8 * (2 * H * FFN)
    expected = 12 * dense / 8 + 12 * L * experts_per_rank / 2    # DP 8, expert DP = 8 / EP4 = 2
    assert estimate(exp).stages[0].optimizer == int(expected)


# -- activations per layer --------------------------------------------------------------------
def test_unfused_attention_layer_is_34sbh_plus_5as2b():
    act = _Shapes(gpt()).layer(False)
    assert act.saved == 34 * S * B * H + 5 * A * S * S * B


def test_tensor_parallel_without_sp_keeps_10sbh_unsharded():
    t = 4
    act = _Shapes(gpt(tp=t)).layer(False)
    assert act.saved == pytest.approx(S * B * H * (10 + 24 / t + 5 * A * S / (H * t)))


def test_sequence_parallel_divides_everything_by_tp():
    t = 4
    act = _Shapes(gpt(tp=t, sp=True)).layer(False)
    assert act.saved == pytest.approx(S * B * H * (34 / t + 5 * A * S / (H * t)))


def test_flash_attention_keeps_no_scores_only_the_fp32_logsumexp():
    act = _Shapes(gpt(backend="flash")).layer(False)
    assert act.saved == 34 * S * B * H + 4 * A * S * B


def test_no_dropout_means_no_masks():
    act = _Shapes(gpt(dropout=0.0)).layer(False)
    # without dropout: no 2 sbh masks, and the scores are saved once (no mask, no dropout output)
    assert act.saved == 32 * S * B * H + 2 * A * S * S * B


def test_selective_recompute_drops_the_attention_scores():
    act = _Shapes(gpt(recompute="selective")).layer(False)
    assert act.saved == 34 * S * B * H


def test_gqa_and_swiglu_shapes():
    g, ffn = 2, 1344
    act = _Shapes(gpt(num_query_groups=g, swiglu=True, ffn_hidden_size=ffn, backend="flash", dropout=0.0)).layer(False)
    d = H // A
    attention = 2 * S * B * H * 2 + 2 * S * B * (A + 2 * g) * d + 2 * S * B * A * d + 4 * A * S * B
    mlp = 2 * S * B * H * 2 + 2 * S * B * 2 * ffn + 2 * S * B * ffn       # fc1 output is 2 x ffn wide
    assert act.saved == attention + mlp


def test_context_parallel_halves_the_sequence_and_keeps_the_ring_copies():
    full = _Shapes(gpt(backend="flash")).layer(False).saved
    cp2 = _Shapes(gpt(cp=2, backend="flash")).layer(False).saved
    qkv = 3 * 2 * (S // 2) * B * H                  # Q, K, V of the local half sequence
    assert cp2 == pytest.approx(full / 2 + qkv)


# -- whole stages -----------------------------------------------------------------------------
def test_full_recompute_keeps_only_each_layers_input():
    exp = gpt(recompute="full", method="uniform", recompute_layers=1, dropout=0.0)
    last = estimate(exp).stages[0]
    embedding, final_norm = 8 * S * B, 4 * S * B * H
    assert last.activations == L * 2 * S * B * H + embedding + final_norm


def test_last_stage_holds_bf16_logits_and_the_fp32_copy_the_loss_keeps():
    exp = gpt(dropout=0.0)
    stage = estimate(exp).stages[0]
    logits = S * B * V * (2 + 4)
    assert stage.other == BASE_WORKSPACE_BYTES + GEMM_WORKSPACE_BYTES + logits
    exp.training.cross_entropy_loss_fusion = True                   # one more fp32 copy
    assert estimate(exp).stages[0].other == stage.other + 4 * S * B * V


def test_1f1b_in_flight_microbatches_are_min_of_pp_minus_rank_and_microbatches():
    assert [s.in_flight for s in estimate(gpt(pp=4, gbs=2 * B)).stages] == [2, 2, 2, 1]
    assert [s.in_flight for s in estimate(gpt(pp=4, gbs=8 * B)).stages] == [4, 3, 2, 1]


def test_interleaved_schedule_holds_the_warmup_chunks():
    # Megatron: (PP - r - 1) * 2 + (VP - 1) * PP warm-up chunk steps, plus the current one
    exp = gpt(pp=4, vp=2, num_layers=8, gbs=8 * B)
    assert [s.in_flight for s in estimate(exp).stages] == [11, 9, 7, 5]
    first = estimate(exp).stages[0]
    assert first.activations == pytest.approx(11 * first.chunks[1].activation_bytes, rel=0.01)


def test_interleaved_micro_batch_groups_set_the_warmup_and_the_chunk_order():
    """microbatch_group_size_per_vp_stage (megatron-core schedules.py, core_v0.16.1): the warm-up is
    (PP - r - 1) * 2 + (VP - 1) * group chunk steps (get_pp_rank_microbatches), and the forward steps
    run `group` micro-batches on chunk 0, then on chunk 1, ... (get_schedule_table)."""
    from charllm.engine.model.memory import stage_terms

    exp = gpt(pp=4, vp=3, num_layers=12, gbs=8 * B)                 # 8 micro-batches, the group unset: PP
    assert [s.in_flight for s in estimate(exp).stages] == [15, 13, 11, 9]
    exp.parallel.microbatch_group_size_per_vp_stage = 8
    assert [s.in_flight for s in estimate(exp).stages] == [23, 21, 19, 17]

    # Megatron-LM's tunable_overlap test: PP 4, VP 3, 5 micro-batches in one group of 5. The last stage runs
    # 5 steps of chunk 0, 5 of chunk 1, then 5 of chunk 2 (with the loss), and holds 11 at once (10 warm-up
    # steps and the current one): the most at a step of chunk 2, 5 + 5 + 1 or 1 + 5 + 5 of them
    exp = gpt(pp=4, vp=3, num_layers=12, gbs=5 * B)
    exp.parallel.microbatch_group_size_per_vp_stage = 5
    last = stage_terms(exp)[-1]
    chunk = [c.activation_bytes for c in last.chunks]
    assert chunk[2] > chunk[0] == chunk[1]                             # the last chunk holds the final norm
    assert last.in_flight == 11
    assert last.held_max == last.held_loss == pytest.approx(chunk[0] + 5 * chunk[1] + 5 * chunk[2], abs=3)
    exp.parallel.microbatch_group_size_per_vp_stage = None             # Megatron's default: groups of PP (4)
    assert stage_terms(exp)[-1].in_flight == 9


def test_the_interleaved_warmup_and_chunk_order_are_megatron_cores_own():
    """memory's schedule against the installed megatron-core's get_pp_rank_microbatches and get_schedule_table,
    for every rank, VP, micro-batch count and group the interleaved schedule accepts (whole groups: a shorter
    last group is planned as a whole one)."""
    pytest.importorskip("torch")
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from types import SimpleNamespace

    from charllm.engine.model.memory import _in_flight_units

    for pp in (2, 3, 4):
        for vp in (2, 3):
            for m in range(pp, 3 * pp + 1):
                for group in range(pp, m + 1):
                    if 0 < m % group < pp:
                        continue                        # Megatron refuses it (engine.model.validate too)
                    for r in range(pp):
                        p2p = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: r),
                                              virtual_pipeline_model_parallel_size=vp)
                        total, _, warmup, _ = schedules.get_pp_rank_microbatches(m, vp, group, p2p_communicator=p2p)
                        assert _in_flight_units(r, pp, vp, m, group) == min(warmup + 1, total), (pp, vp, m, group, r)
                    if m % group == 0:
                        chunks = [c for _, c in schedules.get_schedule_table(m, vp, group)]
                        assert chunks == [(k % (group * vp)) // group for k in range(m * vp)], (pp, vp, m, group)


def test_uneven_pipeline_split():
    exp = gpt(pp=4, num_layers=12)
    exp.parallel.decoder_first_pipeline_num_layers = 2
    exp.parallel.decoder_last_pipeline_num_layers = 2
    assert [len(c[0].layers) for c in split_layers(exp)] == [2, 4, 4, 2]


def test_pipeline_layout_string():
    exp = gpt(pp=2, vp=2, num_layers=6)
    exp.parallel.pipeline_model_parallel_layout = "Et|(tt|)*2tL"
    chunks = split_layers(exp)
    assert [[len(c.layers) for c in stage] for stage in chunks] == [[1, 2], [2, 1]]
    assert chunks[0][0].embedding and chunks[1][1].loss


def test_verdict_arithmetic_outside_memory_and_the_allocator_reserve():
    r = estimate(gpt())
    stage = r.stages[0]
    assert r.budget.outside_allocator_bytes == 2 * GIB and r.budget.allocator_bytes == 78 * GIB
    # expandable segments (the default): the allocator reserves 3% of the churn beyond its peak
    assert stage.churn_bytes == stage.total_bytes - stage.static_bytes - stage.workspace > 0
    assert stage.reserve_bytes == int(0.03 * stage.churn_bytes)
    assert stage.headroom_bytes == 78 * GIB - stage.total_bytes - stage.reserve_bytes
    assert stage.verdict == r.verdict == "fits" and r.fits
    allocator, peak, verdict = r.explain()
    assert "usable 80.00 GiB (hardware preset) - 2.00 GiB outside it" in allocator and "= 78.00 GiB" in allocator
    assert f"allocated peak {stage.total_bytes / GIB:.2f} GiB + reserved beyond it" in peak
    assert "3% of" in peak and "expandable segments; assumed" in peak
    assert verdict == f"fits: {stage.headroom_bytes / GIB:.2f} GiB to spare"


def _with_room(exp: Experiment, allocator_bytes: int) -> Experiment:
    exp.hardware.usable_bytes = allocator_bytes + exp.hardware.outside_allocator_bytes
    return exp


def test_three_verdicts_fits_tight_does_not_fit():
    """tight: within the plan's measured error (PEAK_MARGIN) of the limit, either side, or the
    allocated peak fits and the allocator's reserve beyond it does not."""
    from charllm.engine.model.memory import PEAK_MARGIN

    probe = estimate(gpt(expandable_segments=False)).stages[0]
    total, reserve = probe.total_bytes, probe.reserve_bytes
    error = math.ceil(total * PEAK_MARGIN)
    assert reserve == int(0.15 * probe.churn_bytes) > 0          # fixed segments reserve more
    for room, expected, exit_word in ((total + error + reserve + 1, "fits", "to spare"),
                                      (total + error + reserve - 1, "tight", "within the plan's error"),
                                      (total + reserve // 2, "tight", "less than the"),
                                      (total - error + 1, "tight", "over, within the plan's error"),
                                      (total - error - 1, "does not fit", "alone is")):
        r = estimate(_with_room(gpt(expandable_segments=False), room))
        assert r.verdict == expected and r.fits == (expected == "fits")
        assert exit_word in r.explain()[-1]
        assert r.to_dict()["verdict"] == expected


def test_a_calibrated_reserve_replaces_the_assumed_one_for_the_same_allocator_setting():
    from charllm.engine.model import calibration

    exp = gpt()
    calibration.save({"hardware": exp.hardware.name, "node": "n7", "date": "2026-11-20",
                      "stack": {"cuda": True, "capability": [9, 0], "extensions": ["transformer_engine"]},
                      "memory": {"usable_bytes": 80 * GIB, "outside_allocator_bytes": 2 * GIB, "devices": 8,
                                 "reserve_fraction": 0.07, "expandable_segments": True}})
    r = estimate(exp)
    assert r.budget.reserve_fraction == 0.07 and r.budget.reserve_source == "measured: calibrated on n7, 2026-11-20"
    assert r.stages[0].reserve_bytes == int(0.07 * r.stages[0].churn_bytes)
    other = estimate(gpt(expandable_segments=False))              # measured with the other setting: not used
    assert other.budget.reserve_fraction == 0.15 and other.budget.reserve_source == "assumed"


def test_a_plan_of_55_gib_fits_an_80_gb_h100():
    """The flat 30% margin judged 55.6 GiB on one H100 as not fitting; the allocator model does not."""
    exp = gpt()
    exp.hardware = Hardware.load("h100-sxm-80gb")
    r = estimate(exp)
    churn = 0.55 * 55.6 * GIB                                      # a plan at 55.6 GiB, half of it churn
    assert 55.6 * GIB + r.budget.reserve(churn) < r.budget.allocator_bytes


def test_to_dict_shape():
    d = estimate(gpt(pp=2)).to_dict()
    assert {"verdict", "fits", "usable_bytes", "peak_bytes", "peak_stage", "stages", "outside_allocator_bytes",
            "allocator_bytes", "reserve_bytes", "reserve_fraction", "arithmetic", "ignored_args", "warnings"} <= set(d)
    stage = d["stages"][1]
    assert stage["pp_rank"] == 1
    assert stage["static_bytes"] == sum(stage["breakdown"][k] for k in ("weights", "gradients", "optimizer"))
    assert stage["total_bytes"] == stage["static_bytes"] + stage["breakdown"]["activations"] \
        + stage["breakdown"]["other"]
    assert d["peak_bytes"] == max(s["total_bytes"] for s in d["stages"])


# -- the weight formula against the real megatron-core models the workload builds -------------
@pytest.fixture(scope="module")
def megatron_world():
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
        try:
            yield torch
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def _variant(name: str, **changes) -> ModelSpec:
    return dataclasses.replace(ModelSpec.load(name), **changes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_class", ["GPTModel", "HybridModel"])
@pytest.mark.parametrize("model", [
    ModelSpec.load("tiny-dense"),
    ModelSpec.load("tiny-moe"),
    _variant("tiny-dense", swiglu=True, num_query_groups=2, normalization="RMSNorm", add_bias_linear=False,
             untie_embeddings_and_output_weights=True, position_embedding_type="rope", qk_layernorm=True),
    _variant("tiny-moe", moe_shared_expert_intermediate_size=96, moe_layer_freq=[0, 1, 1, 1], swiglu=True),
], ids=["tiny-dense", "tiny-moe", "tiny-gqa-swiglu-rms-untied", "tiny-moe-shared-pattern"])
def test_parameter_count_matches_the_megatron_core_model_the_workload_builds(megatron_world, model, model_class):
    """GPTModel, and HybridModel where megatron-core prefers it, as engine.workload.model_builder
    builds them for the workload (megatron-core's local layers on this CPU)."""
    from megatron.core.transformer import TransformerConfig

    from charllm.engine.model import runtime
    from charllm.engine.workload import model_builder
    from charllm.engine.workload.train import transformer_settings

    if model_class == "HybridModel" and not model_builder.hybrid_preferred():
        pytest.skip("this megatron-core does not prefer HybridModel; the workload builds GPTModel")
    exp = dataclasses.replace(Experiment.load("tiny-local").apply(["gpus_per_node=1"]), model=model)
    impl = runtime.resolve(exp, runtime.detect())
    builder = model_builder.ModelBuilder(model_class, "under test")
    settings = transformer_settings(exp, impl) | {"use_cpu_initialization": True}
    config = TransformerConfig(**builder.config_settings(exp, settings))
    built = builder.build(exp, config, impl, pre_process=True, post_process=True, vp_stage=None)
    assert type(built).__name__ == model_class
    assert sum(p.numel() for p in built.parameters()) == count_parameters(model)


def test_precision_aware_optimizer_dtypes_and_host_offload():
    exp = gpt()
    n = count_parameters(exp.model)
    t = exp.training
    t.use_precision_aware_optimizer = True
    t.main_grads_dtype, t.main_params_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype = "bf16", "fp16", "bf16", "fp8"
    stage = estimate(exp).stages[0]
    assert (stage.gradients, stage.optimizer) == (2 * n, (2 + 2 + 1) * n)
    t.optimizer_cpu_offload = True
    report = estimate(exp)
    assert report.stages[0].optimizer == 0 and any("offloaded" in w for w in report.warnings)


def test_the_mtp_stage_holds_its_own_embedding_copy():
    """megatron-core builds the embedding on the stage that runs the MTP layers too; with PP = 1
    that stage is the first one and the copy is the same module."""
    from charllm.engine.model.memory import embedding_params

    plain, mtp = estimate(gpt(pp=2)), estimate(gpt(pp=2, mtp_num_layers=1))
    one_mtp_layer = estimate(gpt(mtp_num_layers=1)).stages[0].weights - estimate(gpt()).stages[0].weights
    added = mtp.stages[1].weights - plain.stages[1].weights
    assert added - one_mtp_layer == embedding_params(gpt().model) * 2      # bf16 weights
    assert mtp.stages[0].weights == plain.stages[0].weights                 # the first stage is unchanged


def test_layer_offloading_keeps_the_other_layers_activations_on_the_gpu():
    """cpu_offloading_num_layers = k: k of the n layers' saved activations wait on the host."""
    n = gpt().model.num_layers
    on_gpu, offloaded = estimate(gpt()).stages[0], estimate(gpt(cpu_offloading_num_layers=1)).stages[0]
    layers = _Shapes(gpt()).layer(False).saved * n
    assert on_gpu.activations - offloaded.activations == pytest.approx(layers / n, abs=2)


@pytest.mark.parametrize("module", ["attn_norm", "core_attn", "mlp_norm"])
def test_fine_grained_offloading_removes_exactly_the_modules_inputs(module):
    """What each of offload_modules saves for backward leaves the GPU in every layer: attn_norm and
    mlp_norm each the residual stream (2 bytes x s x b x h in bf16), core_attn (flash) Q, K, V and its
    fp32 log-sum-exp. In backward two layers' worth come back at once (the chunk that runs next keeps its
    last layer, and the groups of the layer before are reloaded ahead)."""
    plain = _Shapes(gpt(backend="flash")).layer(False)
    off = _Shapes(gpt(backend="flash", fine_grained_activation_offloading=True, offload_modules=[module])).layer(False)
    sbh = S * B * H
    expected = {"attn_norm": 2 * sbh, "mlp_norm": 2 * sbh, "core_attn": 3 * 2 * sbh + 4 * A * S * B}[module]
    assert plain.saved - off.saved == pytest.approx(expected)
    assert off.transient - plain.transient == pytest.approx(2 * expected)


def test_fine_grained_offloading_of_core_attention_takes_the_unfused_softmax_too():
    """Unfused attention keeps its s x s softmax output for backward inside core attention's offloading
    context, so offloading core_attn takes it to the host as well (the first dev-set case with
    offloading planned +80% before)."""
    plain = _Shapes(gpt(dropout=0.0)).layer(False)
    off = _Shapes(gpt(dropout=0.0, fine_grained_activation_offloading=True, offload_modules=["core_attn"])).layer(False)
    assert plain.saved - off.saved == pytest.approx(3 * 2 * S * B * H + 2 * A * S * S * B)


def test_unfused_softmax_in_fp32_keeps_an_fp32_copy_without_the_fused_kernel():
    """megatron-core's FusedScaleMaskSoftmax: with its CUDA kernel the scores stay bf16; without it
    attention_softmax_in_fp32 upcasts them, and softmax keeps its fp32 output for backward."""
    from charllm.engine.model.runtime import Implementation

    exp = gpt(dropout=0.0)
    exp.training.bf16, exp.training.attention_softmax_in_fp32 = True, True
    fused = Implementation("local", "megatron-unfused", ("masked_softmax_fusion",), "cuda")
    plain = Implementation("local", "megatron-unfused", (), "cuda")
    scores = A * S * S * B                                       # one s x s score tensor of every head
    assert _Shapes(exp, plain).layer(False).saved - _Shapes(exp, fused).layer(False).saved == 4 * scores
    exp.training.attention_softmax_in_fp32 = False
    assert _Shapes(exp, plain).layer(False).saved == _Shapes(exp, fused).layer(False).saved


def test_moe_routing_probabilities_cost_what_megatron_keeps_for_them():
    """megatron-core multiplies the routing probabilities into the expert activation: inside the fused
    weighted SwiGLU when bias_activation_fusion is on (nothing extra kept), else as a multiply that
    keeps the activation's output (one bf16 tensor of routed tokens x moe_ffn). Unpermute keeps no
    copy of the expert output; the fp32 probabilities are 4 bytes per routed token."""
    from charllm.engine.model.runtime import Implementation

    exp = gpt(dropout=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=1024, swiglu=True)
    exp.training.bf16 = True
    fused = Implementation("transformer_engine", "te-flash", ("bias_activation_fusion",), "cuda")
    plain = Implementation("transformer_engine", "te-flash", (), "cuda")
    routed = S * B * 2                                        # tokens x top-k, EP 1: no imbalance factor
    kept_output = _Shapes(exp, plain).layer(True).saved - _Shapes(exp, fused).layer(True).saved
    assert kept_output == 2 * routed * 1024
    dense = _Shapes(exp, fused).layer(False).saved
    moe = _Shapes(exp, fused).layer(True).saved
    router = 4 * S * B * 4 * 2                                # fp32 logits and probabilities over 4 experts
    # the MoE block instead of the dense MLP: fc1 input, fc1 output (gate and up), fc2 input, probabilities
    dense_mlp = 2 * S * B * FFN * 2 + 2 * S * B * FFN
    assert moe - dense == pytest.approx(router + 2 * routed * H + 2 * routed * 1024 * 2 + 2 * routed * 1024
                                        + 4 * routed - dense_mlp)


def test_busiest_rank_routing_excess_averages_over_the_micro_batches_held():
    """Dropless MoE with EP > 1: one micro-batch is planned with the busiest rank's routed tokens
    (MOE_DROPLESS_IMBALANCE x the mean); n micro-batches held at once carry n x the mean plus
    sqrt(n) x that excess, since the excess is a fluctuation of the routing that averages out."""
    from charllm.engine.model.memory import stage_terms

    def held(pp, ep):
        exp = gpt(pp=pp, dp=2, dropout=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=1024,
                  gbs=B * 2 * 8)
        exp.parallel.expert_model_parallel_size = ep
        return exp, stage_terms(exp)[0]

    exp, first = held(pp=4, ep=2)                 # stage 0 of 4 holds 4 micro-batches of its one layer
    assert first.in_flight == 4
    busiest = _Shapes(exp).layer(True).saved
    mean = _Shapes(exp, imbalance=False).layer(True).saved
    assert busiest > mean and first.chunks[0].activation_bytes == pytest.approx(busiest + 8 * S * B, abs=1)
    excess = busiest - mean
    embedding = 8 * S * B                          # token ids on the first stage
    assert first.held_max == pytest.approx(4 * (mean + embedding) + 2 * excess, rel=1e-9)
    # EP 1: every rank sees every token, no excess to average
    exp1, first1 = held(pp=4, ep=1)
    assert first1.held_max == pytest.approx(4 * (_Shapes(exp1).layer(True).saved + embedding), rel=1e-9)


def test_deepep_buffers_of_the_flex_dispatcher_sit_outside_the_allocator():
    """DeepEP v1.2.1 sizes (csrc/config.hpp, deep_ep/buffer.py) for hidden 7168 over 16 EP ranks:
    10 channels (20 SMs), 8 NVLink peers, 2 RDMA ranks, 288 tokens per channel and peer over
    NVLink, 128 over RDMA; a token is 2 x 7168 hidden bytes + 8 metadata + 128 x (8 + 4 + 4)."""
    from charllm.engine.model.memory import budget, dispatcher_buffer_bytes

    exp = gpt(dp=16, hidden_size=7168, num_attention_heads=56, num_moe_experts=64, moe_router_topk=8,
              moe_ffn_hidden_size=2048)
    exp.parallel.expert_model_parallel_size = 16
    token = 2 * 7168 + 8 + 128 * 16
    nvl = 10 * 8 * ((2 * 2 + 3) * 4 + 288 * token)
    rdma = 10 * 2 * ((8 * 2 + 2) * 2 * 4 + 128 * (token + 16) * 2)
    assert exp.training.moe_token_dispatcher_type != "flex" and dispatcher_buffer_bytes(exp) == 0
    exp.training.moe_token_dispatcher_type = "flex"
    assert dispatcher_buffer_bytes(exp) == -(-nvl // 128) * 128 + -(-rdma // 128) * 128
    room = budget(exp)
    assert room.allocator_bytes == room.usable_bytes - room.outside_allocator_bytes - dispatcher_buffer_bytes(exp)
    assert "DeepEP buffers" in estimate(exp).explain()[0]
    exp.parallel.expert_model_parallel_size = 8            # one node: NVLink only, 256 tokens
    assert dispatcher_buffer_bytes(exp) == -(-(10 * 8 * (5 * 4 + 256 * token)) // 128) * 128
    exp.training.moe_flex_dispatcher_backend = "hybridep"     # its own buffers: not modelled, and said so
    assert dispatcher_buffer_bytes(exp) == 0
    assert any("HybridEP" in w for w in estimate(exp).warnings)


def test_muon_keeps_one_momentum_for_matrices_and_adam_state_for_the_embeddings():
    """megatron-core's Muon (optimizer/emerging_optimizers.py) updates the matrices with one fp32
    momentum buffer beside the fp32 master copy (8 bytes) and routes the embeddings and the output
    layer to Adam (12 bytes)."""
    from charllm.engine.model.memory import embedding_params, stage_terms

    adam, muon = gpt(), gpt()
    muon.training.optimizer = "muon"
    st = stage_terms(adam)[0]
    assert st.embedding_params == embedding_params(adam.model)           # tied: one matrix for both
    matrices = st.dense_params - st.embedding_params
    saved = estimate(adam).stages[0].optimizer - estimate(muon).stages[0].optimizer
    assert saved == pytest.approx(4 * matrices, abs=1)


@pytest.mark.parametrize("version, strategy, kept", [
    ("0.19.0", "optim_grads_params", True),
    ("0.18.0", "optim_grads_params", True),
    ("0.16.1", "optim_grads_params", False),      # the step's reset freed every gathered bucket
    ("0.19.0", "optim_grads", False),             # weights not sharded: nothing is gathered
])
def test_megatron_fsdp_keeps_the_gathered_embeddings_and_output_layer_between_iterations(version, strategy, kept):
    """Megatron-FSDP's FSDP units are the transformer layers; the embeddings and the output layer
    share a bucket of their own that, from core_v0.18.0 on, stays all-gathered (bf16, unsharded)
    beside their shards between iterations (AllGatherPipeline.reset(preserve_non_fsdp_units=True))."""
    from charllm.engine.model.memory import stage_terms

    exp = gpt(dp=4, dist_opt=True, untie_embeddings_and_output_weights=True)
    exp.parallel.use_megatron_fsdp, exp.parallel.data_parallel_sharding_strategy = True, strategy
    st = stage_terms(exp)[0]
    stage = estimate(exp, megatron_version=version).stages[0]
    shards = 2 * st.dense_params / (4 if strategy == "optim_grads_params" else 1)
    assert stage.weights == pytest.approx(shards + (2 * st.embedding_params if kept else 0), abs=1)
    assert st.embedding_params == 2 * 50304 * H + S * H      # untied input and output embeddings + positions


@pytest.mark.parametrize("param_gather, cached", [(False, 2), (True, 0)])
def test_fp8_on_bf16_weights_keeps_an_fp8_copy_and_its_transpose(param_gather, cached):
    """FP8 compute on BF16 weights: Transformer Engine casts each linear weight once per step and keeps
    the FP8 copy and its transpose (2 bytes a parameter) for the later micro-batches and the backward.
    With fp8_param_gather the weights are FP8 themselves (data + transpose: the 2 bytes BF16 had)."""
    from charllm.engine.model.memory import stage_terms

    plain = gpt()
    fp8 = gpt()
    fp8.hardware.fp8, fp8.training.fp8, fp8.training.fp8_param_gather = True, "hybrid", param_gather
    st = stage_terms(plain)[0]
    extra = estimate(fp8).stages[0].weights - estimate(plain).stages[0].weights
    assert extra == pytest.approx(cached * (st.dense_params - st.embedding_params), abs=1)


def test_fp8_flash_attention_keeps_its_output_beside_the_projections_fp8_input():
    """A flash-type attention kernel keeps its BF16 output O for backward. Without FP8 the output
    projection keeps the same tensor as its input; with FP8 it keeps an FP8 copy, so O is counted
    once more: offloading core_attn moves Q, K, V, the log-sum-exp and O."""
    def layer(**training):
        exp = gpt(backend="flash", dropout=0.0, **training)
        exp.hardware.fp8, exp.training.fp8 = True, "hybrid"
        return _Shapes(exp).layer(False)

    off = layer(fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    assert layer().saved - off.saved == pytest.approx(4 * 2 * S * B * H + 4 * A * S * B)


@pytest.mark.parametrize("scope, captured", [(None, {"attn", "mlp"}), (["attn"], {"attn"}), (["mlp"], {"mlp"})])
def test_te_cuda_graphs_count_their_parts_while_captured_and_the_rest_while_replayed(scope, captured):
    """Transformer Engine's CUDA graphs keep what their layers save in the graphs' private pool: the
    allocator counts it while the graphs are captured (in schedule order) and not when they replay.
    So the captured parts (cuda_graph_scope: whole layers when unset) and the rest peak apart."""
    from charllm.engine.model.memory import activation_terms

    plain, graphed = gpt(backend="flash"), gpt(backend="flash")
    graphed.training.cuda_graph_impl, graphed.training.cuda_graph_scope = "transformer_engine", scope
    layer = _Shapes(plain).layer(False)
    terms = activation_terms(graphed, {})
    assert terms.capture.saved[False] == pytest.approx(sum(layer.parts[p][0] for p in captured))
    assert terms.capture.saved[False] + terms.saved[False] == pytest.approx(layer.saved)
    assert terms.capture.loss_extra == 0 and terms.loss_extra == activation_terms(plain, {}).loss_extra
    # Megatron-LM's default 3 eager steps before the capture hold every part, as without graphs
    assert estimate(graphed).peak_bytes >= estimate(plain).peak_bytes
    graphed.training.cuda_graph_warmup_steps = 0
    assert estimate(graphed).peak_bytes < estimate(plain).peak_bytes


@pytest.mark.parametrize("scope, mask", [(None, True), (["attn"], True), (["mlp"], False)])
def test_te_cuda_graphs_keep_static_inputs_per_graphed_layer_and_micro_batch_in_flight(scope, mask):
    """Megatron-LM's TECudaGraphHelper gives every graphed layer static inputs per micro-batch: BF16
    hidden states (s x b x h) and, where the graph holds the attention, a boolean b x s x s causal mask;
    a micro-batch's buffers go to a later one once its backward is done, so a stage keeps those of its
    micro-batches in flight (2 on stage 0 of 2, 1 on the last). Transformer Engine keeps one gradient
    buffer of the graphs' outputs and the last backward's input gradient (both s x b x h, BF16).
    Without CUDA graphs none of it."""
    def run(impl: str):
        exp = gpt(backend="flash", pp=2, gbs=4 * B)
        exp.training.cuda_graph_impl, exp.training.cuda_graph_scope = impl, scope
        return estimate(exp).stages

    plain, graphed = run("none"), run("transformer_engine")
    per_layer = 2 * S * B * H + (B * S * S if mask else 0)
    fixed = 2 * (2 * S * B * H)
    for stage, in_flight in zip(range(2), (2, 1)):
        layers = L // 2
        assert graphed[stage].steady_bytes - plain[stage].steady_bytes == \
            pytest.approx(in_flight * layers * per_layer + fixed, abs=2)
        assert graphed[stage].workspace - plain[stage].workspace == \
            graphed[stage].steady_bytes - plain[stage].steady_bytes


def test_every_verdict_has_its_style_beside_it():
    from charllm.engine.model import memory

    assert tuple(memory.VERDICT_STYLE) == memory.VERDICTS


def test_mla_normalises_its_latents_inside_the_up_projections():
    """MLA's qk_layernorm normalises the Q and KV latents inside the up-projections (TE
    LayerNormColumnParallelLinear, q_layernorm/kv_layernorm IdentityOp), whose inputs are counted
    already: no per-head Q/K norm inputs as in standard attention."""
    def saved(mla: bool, qk_layernorm: bool) -> float:
        extra = dict(multi_latent_attention=True, q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64,
                     qk_pos_emb_head_dim=32, v_head_dim=64) if mla else {}
        return _Shapes(gpt(backend="flash", qk_layernorm=qk_layernorm, **extra)).layer(False).saved

    assert saved(True, True) == saved(True, False)
    assert saved(False, True) - saved(False, False) == pytest.approx(2 * 2 * S * B * H)
