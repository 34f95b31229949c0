"""Megatron's FLOP count against closed forms, and a run's experiment as the summaries read it."""

from __future__ import annotations

import pytest

from charllm.engine.model.experiment import ModelSpec
from charllm.engine.model.flops import flops_per_iteration, num_floating_point_operations
from charllm.probes.analysis.iterations import read_experiment
from charllm.probes.core.errors import UserError

GPT3 = dict(
    num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200, make_vocab_size_divisible_by=128
)


def test_dense_mha_matches_the_closed_form():
    # Per layer 6·(4h² + hs) + 6·2·4h² = 72h² + 6hs (causal attention counts half the scores),
    # plus the logits 6hV: F = 72·B·s·L·h²·(1 + s/(12h)) + 6·B·s·h·V.
    b, s, L, h, v = 128, 2048, 96, 12288, 51200
    expected = 72 * b * s * L * h * h * (1 + s / (12 * h)) + 6 * b * s * h * v
    assert num_floating_point_operations(ModelSpec(**GPT3), b, s) == pytest.approx(expected, rel=1e-12)


def test_gqa_swiglu_moe_topk():
    # Mixtral-like: GQA 8 groups, SwiGLU, 8 experts top-2, every layer MoE.
    m = {"num_layers": 1, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
         "ffn_hidden_size": 14336, "swiglu": True, "num_moe_experts": 8, "moe_router_topk": 2,
         "vocab_size": 32000, "make_vocab_size_divisible_by": 128}
    b, s, h, f, kv = 1, 4096, 4096, 14336, 128 * 8
    attn = 6 * (h * (h + 2 * kv) + h * s + h * h)
    mlp = 6 * h * f * 2 * 3                                # top-2 experts, 3 GEMMs (SwiGLU)
    logits = 6 * h * 32000
    assert num_floating_point_operations(ModelSpec(**m), b, s) == pytest.approx(b * s * (attn + mlp + logits))


def test_vocab_padding_depends_on_tp():
    m = dict(GPT3, vocab_size=50257)
    assert num_floating_point_operations(ModelSpec(**m), 1, 8, tp=8) > num_floating_point_operations(
        ModelSpec(**m), 1, 8, tp=1
    )


def test_mla_counts():
    m = {"num_layers": 1, "hidden_size": 1024, "num_attention_heads": 8, "multi_latent_attention": True,
         "q_lora_rank": None, "kv_lora_rank": 64, "qk_head_dim": 32, "qk_pos_emb_head_dim": 16,
         "v_head_dim": 32, "vocab_size": 128, "make_vocab_size_divisible_by": 128, "ffn_hidden_size": 2048}
    s, h, n = 16, 1024, 8
    attn = 6 * (h * n * 48 + 64 * (h + n * 64 + 1) + h * 16 + n * 32 * h + s * n * 48 / 2 + s * n * 32 / 2)
    expected = s * (6 * h * 2048 * 2 + attn + 6 * h * 128)
    assert num_floating_point_operations(ModelSpec(**m), 1, s) == pytest.approx(expected)


def test_read_experiment_resolves_a_shipped_preset(tmp_path):
    path = tmp_path / "experiment.toml"
    path.write_text('model = "tiny-dense"\nhardware = "cpu"\n[cluster]\nnodes = 1\ngpus_per_node = 2\n'
                    "[training]\nglobal_batch_size = 8\n")
    exp = read_experiment(path).experiment
    assert exp.model.hidden_size == 64 and exp.seq_length == 32
    assert exp.hardware.bf16_tflops == 0.5 and exp.world_size == 2
    assert flops_per_iteration(exp) == num_floating_point_operations(exp.model, 8, 32)
    assert read_experiment(tmp_path / "missing.toml") is None


def test_bad_toml_is_a_user_error(tmp_path):
    path = tmp_path / "experiment.toml"
    path.write_text("[model\n")
    with pytest.raises(UserError, match="invalid TOML"):
        read_experiment(path)
