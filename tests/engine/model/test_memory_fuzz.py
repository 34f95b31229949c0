"""Random experiments: every valid one gets a sane estimate; `plan` never shows a traceback."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from charllm.engine.model.experiment import Cluster, Experiment, Hardware, ModelSpec, Parallel, Training
from charllm.engine.model.memory import estimate
from charllm.engine.model.validate import validate
from charllm.tui.cli import main

powers = st.sampled_from([1, 2, 4, 8])


@st.composite
def experiments(draw) -> Experiment:
    heads = draw(st.sampled_from([4, 8, 16]))
    layers = draw(st.sampled_from([2, 4, 6, 8, 12]))
    moe = draw(st.booleans())
    mla = draw(st.booleans())
    mtp = draw(st.sampled_from([None, 1])) if moe else None
    model = ModelSpec(
        num_layers=layers, hidden_size=heads * draw(st.sampled_from([16, 32, 64])), num_attention_heads=heads,
        num_query_groups=None if mla else draw(st.sampled_from([None, heads, heads // 2, heads // 4])),
        ffn_hidden_size=draw(st.sampled_from([None, 256, 512])), seq_length=draw(st.sampled_from([64, 256, 1024])),
        vocab_size=draw(st.sampled_from([1000, 32000, 50257])), swiglu=draw(st.booleans()),
        untie_embeddings_and_output_weights=draw(st.booleans()),
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])), add_bias_linear=not moe,
        hidden_dropout=draw(st.sampled_from([0.0, 0.1])), attention_dropout=draw(st.sampled_from([0.0, 0.1])),
        num_moe_experts=draw(st.sampled_from([4, 8])) if moe else None, moe_router_topk=2,
        moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 128])) if moe else None,
        multi_latent_attention=mla, q_lora_rank=draw(st.sampled_from([None, 64])) if mla else None,
        kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
        mtp_num_layers=mtp, position_embedding_type="rope" if (mla or mtp) else "learned_absolute")
    tp, pp, cp, dp = draw(powers), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2])), draw(powers)
    mbs = draw(st.sampled_from([1, 2, 4]))
    recompute = draw(st.sampled_from([None, "selective", "full"]))
    return Experiment(
        model=model,
        hardware=Hardware(name="h", usable_bytes=80 << 30, memory_bytes=80 << 30, outside_allocator_bytes=2 << 30),
        cluster=Cluster(nodes=1, gpus_per_node=tp * pp * cp * dp),
        parallel=Parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=draw(st.sampled_from([None, 2])) if pp > 1 else None,
                          context_parallel_size=cp, sequence_parallel=tp > 1,
                          expert_model_parallel_size=draw(st.sampled_from([1, 2])) if moe else 1,
                          use_distributed_optimizer=draw(st.booleans())),
        training=Training(micro_batch_size=mbs, global_batch_size=mbs * dp * draw(st.sampled_from([1, 3, 8])),
                          recompute_granularity=recompute, recompute_method="uniform" if recompute == "full" else None,
                          recompute_num_layers=1 if recompute == "full" else None,
                          attention_backend=draw(st.sampled_from(["auto", "flash", "unfused"])),
                          cross_entropy_loss_fusion=draw(st.booleans())),
    )


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(experiments())
def test_valid_experiments_get_a_sane_estimate(exp):
    if validate(exp):
        return
    report = estimate(exp)
    assert len(report.stages) == exp.parallel.pipeline_model_parallel_size
    for stage in report.stages:
        assert all(v >= 0 for v in stage.breakdown.values())
        assert stage.weights > 0 and stage.total_bytes > stage.static_bytes
        assert len(stage.chunks) == exp.virtual_stages
    assert report.peak_bytes == max(s.total_bytes for s in report.stages)
    assert sum(len(c.layers) for s in report.stages for c in s.chunks) == exp.model.num_layers


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                            "global_batch_size", "recompute_granularity", "num_layers", "hidden_size",
                            "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout"]),
       value=st.one_of(st.integers(-3, 64), st.sampled_from(["full", "x", "none", "Et|tL", "(t|)*3", ""])))
def test_plan_with_random_overrides_never_shows_a_traceback(capsys, key, value):
    code = main(["plan", "tiny-local", "--json", "--set", f"{key}={value}"])
    _, err = capsys.readouterr()
    assert code in (0, 1, 2)
    assert "Traceback" not in err
    if code == 2:
        assert err.startswith("charllm-tui: error: ") and len(err.strip().splitlines()) == 1
