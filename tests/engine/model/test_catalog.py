"""The shipped catalog: the required presets exist with their published shapes and figures, and user
presets take precedence over shipped ones."""

from __future__ import annotations

import math
import re

import pytest

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment, Hardware, ModelSpec
from charllm.probes.core.errors import UserError

GIB = 2**30

REQUIRED_MODELS = ["gpt3-175b", "llama3-8b", "llama3-70b", "llama3.1-405b", "mixtral-8x7b", "mixtral-8x22b",
                   "deepseek-v3", "tiny-dense", "tiny-moe"]
REQUIRED_HARDWARE = ["h100-sxm-80gb", "h200-141gb", "a100-80gb", "mi250x", "mi300x", "b200", "cpu"]


def test_required_presets_exist():
    assert set(REQUIRED_MODELS) <= set(catalog.entries("models"))
    assert set(REQUIRED_HARDWARE) <= set(catalog.entries("hardware"))
    assert {"tiny-local", "tiny-tp2", "tiny-pp2", "tiny-moe-ep2"} <= set(catalog.entries("experiments"))


# The CharLLM-PPT shapes, as the issue states them:
# (layers, hidden, ffn, heads, query groups, seq, vocab, experts, top-k)
PPT_SHAPES = {
    "gpt3-175b": (96, 12288, 49152, 96, None, 2048, 50257, None, None),
    "llama3-70b": (80, 8192, 28672, 64, 8, 8192, 128256, None, None),
    "mixtral-8x7b": (32, 4096, 14336, 32, 8, 4096, 32000, 8, 2),
    "mixtral-8x22b": (56, 6144, 16384, 48, 8, 4096, 32000, 8, 2),
}


@pytest.mark.parametrize("name", list(PPT_SHAPES))
def test_charllm_ppt_model_shapes(name):
    m = ModelSpec.load(name)
    topk = m.moe_router_topk if m.is_moe else None
    assert (m.num_layers, m.hidden_size, m.ffn, m.num_attention_heads, m.num_query_groups, m.seq_length,
            m.vocab_size, m.num_moe_experts, topk) == PPT_SHAPES[name]


def _params(m) -> float:
    """Parameter count from the shape (no biases/norms): a check that the presets are the real models."""
    h = m.hidden_size
    if m.multi_latent_attention:
        q = h * m.q_lora_rank + m.q_lora_rank * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * m.num_attention_heads * (
            m.qk_head_dim + m.v_head_dim)
        attn = q + kv + m.num_attention_heads * m.v_head_dim * h
    else:
        kv_heads = m.query_groups
        attn = h * m.head_dim * (m.num_attention_heads + 2 * kv_heads) + m.num_attention_heads * m.head_dim * h
    mats = 3 if m.swiglu else 2
    total = 0.0
    for is_moe in m.moe_layer_pattern():
        if is_moe:
            shared = mats * h * (m.moe_shared_expert_intermediate_size or 0)
            mlp = m.num_moe_experts * mats * h * m.moe_ffn + shared + h * m.num_moe_experts
        else:
            mlp = mats * h * m.ffn
        total += attn + mlp
    embeddings = m.vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1)
    return total + embeddings


@pytest.mark.parametrize("name, billions", [
    ("gpt3-175b", 175), ("llama3-8b", 8.0), ("llama3-70b", 70.6), ("llama3.1-405b", 405.8),
    ("mixtral-8x7b", 46.7), ("mixtral-8x22b", 141), ("deepseek-v3", 671),
])
def test_model_presets_have_the_published_parameter_count(name, billions):
    assert _params(ModelSpec.load(name)) / 1e9 == pytest.approx(billions, rel=0.02)


def test_deepseek_v3_shape():
    m = ModelSpec.load("deepseek-v3")
    assert m.multi_latent_attention and (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
                                         m.v_head_dim) == (1536, 512, 128, 64, 128)
    assert m.moe_layer_pattern() == [False] * 3 + [True] * 58
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size,
            m.moe_shared_expert_intermediate_size) == (256, 8, 2048, 2048)
    assert (m.mtp_num_layers, m.vocab_size, m.hidden_size, m.num_attention_heads, m.ffn) == (
        1,
        129280,
        7168,
        128,
        18432,
    )


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3.1-405b"])
def test_llama_architecture(name):
    m = ModelSpec.load(name)
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.untie_embeddings_and_output_weights,
            m.add_bias_linear) == ("RMSNorm", True, "rope", True, False)


def test_gpt3_architecture():
    m = ModelSpec.load("gpt3-175b")
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.untie_embeddings_and_output_weights) == (
        "LayerNorm", False, "learned_absolute", False)


def test_tiny_moe_trains_on_cpu_settings():
    m = ModelSpec.load("tiny-moe")
    assert (m.num_moe_experts, m.moe_router_topk, m.add_bias_linear) == (4, 2, False)


@pytest.mark.parametrize("name", [h for h in REQUIRED_HARDWARE if h != "cpu"])
def test_hardware_figures_are_consistent(name):
    hw = Hardware.load(name)
    assert hw.vendor in ("nvidia", "amd")
    assert 0 < hw.usable_bytes <= hw.memory_bytes
    assert hw.memory_bytes - hw.usable_bytes < 2 * GIB          # a driver reserve, not a different board
    assert 0 < hw.outside_allocator_bytes < 4 * GIB
    assert hw.bf16_tflops > 0 and hw.mem_bandwidth_gbs > 0 and hw.tdp_w > 0 and hw.max_sm_clock_mhz > 0
    assert hw.fp8 == (hw.fp8_tflops is not None)
    if hw.fp8:
        assert hw.fp8_tflops == pytest.approx(2 * hw.bf16_tflops, rel=0.01)


def test_hardware_known_values():
    h100 = Hardware.load("h100-sxm-80gb")
    assert h100.usable_bytes / GIB == pytest.approx(79.11, abs=0.01)
    assert (h100.bf16_tflops, h100.tdp_w, h100.fp8) == (989.4, 700.0, True)
    assert not Hardware.load("a100-80gb").fp8
    mi250x = Hardware.load("mi250x")
    assert mi250x.devices_per_package == 2 and mi250x.memory_bytes == 64 * GIB
    assert "GCD" in mi250x.description


def test_user_presets_take_precedence(charllm_dirs):
    user = charllm_dirs["config"] / "models"
    user.mkdir(parents=True)
    (user / "llama3-8b.toml").write_text('description = "mine"\nnum_layers = 2\n')
    assert catalog.is_user("models", "llama3-8b")
    assert ModelSpec.load("llama3-8b").num_layers == 2


def test_unknown_preset_suggests_a_name():
    with pytest.raises(UserError, match="model 'mixtral-8x7': no such preset; did you mean 'mixtral-8x7b'"):
        ModelSpec.load("mixtral-8x7")


@pytest.mark.parametrize("kind, name, said", [
    # the cases: a model where an experiment is wanted, a chip's short name
    ("experiments", "llama3-70b", "experiment 'llama3-70b': no such preset; 'llama3-70b' is a model preset"),
    ("models", "h100-sxm-80gb", "model 'h100-sxm-80gb': no such preset; 'h100-sxm-80gb' is a hardware preset"),
    ("hardware", "h10", "hardware 'h10': no such preset; did you mean 'h100'?"),
    ("hardware", "h100-sxn", "did you mean 'h100-sxm'?"),
    ("hardware", "b100", "did you mean 'a100' or 'b200' or 'h100'?"),   # one substitution from each
    ("models", "llama3", "did you mean 'llama3-70b' or 'llama3-8b' or 'llama3.1-405b'?"),   # the family it begins
    ("models", "mixtral-8x7", "did you mean 'mixtral-8x7b'?"),
    ("experiments", "ppt-h100-llama3-70b-1-0100", "did you mean 'ppt-h100-llama3-70b-1-01000'?"),
    ("models", "zzzz", "model 'zzzz': no such preset; see `charllm-tui presets list models`"),
])
def test_an_unknown_name_suggests_names_of_its_own_kind(kind, name, said):
    with pytest.raises(UserError) as exc:
        catalog.find(kind, name)
    assert said in str(exc.value)
    suggested = re.findall(r"'([^']+)'", str(exc.value).partition("did you mean")[2])
    assert all(catalog.resolve(kind, s) in catalog.entries(kind) for s in suggested)   # never another kind's


def test_hardware_short_names_are_the_shipped_presets(charllm_dirs):
    aliases = catalog.ALIASES["hardware"]
    assert {"h100", "h200", "a100"} <= set(aliases)
    for alias, name in aliases.items():
        assert name in catalog.entries("hardware") and alias not in catalog.entries("hardware")
        assert Hardware.load(alias).name == name          # calibrations and runs name the preset itself
    for name in ("b200", "mi250x", "mi300x"):             # already short
        assert Hardware.load(name).name == name
    exp = Experiment.load("tiny-local").apply(["hardware=h200"])
    assert exp.hardware.name == "h200-141gb"
    # a preset of the user's with that very name comes first
    user = charllm_dirs["config"] / "hardware"
    user.mkdir(parents=True)
    (user / "h100.toml").write_text('description = "my h100"\nvendor = "nvidia"\n')
    assert Hardware.load("h100").description == "my h100"


def test_swiglu_ffn_of_presets_is_explicit():
    """Every SwiGLU preset states its FFN size (our default is 4h, not Megatron's 8h/3 rule)."""
    for name in catalog.entries("models"):
        m = ModelSpec.load(name)
        if m.swiglu:
            assert m.ffn_hidden_size is not None, name
            assert math.isfinite(m.ffn)
