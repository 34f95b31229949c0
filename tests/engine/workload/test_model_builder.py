"""Which megatron-core class the workload builds, and the layer pattern HybridModel gets.

That both classes train the same model is checked by real runs (test_workload.py) and by the
parameter count against engine.model.memory (tests/engine/model/test_memory.py)."""

from __future__ import annotations

from importlib import metadata

import pytest
from packaging.version import Version

from charllm.engine.model.experiment import Experiment
from charllm.engine.workload import model_builder


def tiny(*assignments: str) -> Experiment:
    return Experiment.load("tiny-local").apply(["gpus_per_node=8", *assignments])


def test_hybrid_model_is_preferred_from_megatron_core_0_19():
    # megatron-core 0.19.0 deprecates GPTModel (gpt_model.py: "GPTModel IS DEPRECATED"); 0.18 has
    # HybridModel but no such preference, 0.16.1 has neither.
    pytest.importorskip("megatron.core")
    installed = Version(metadata.version("megatron-core"))
    assert model_builder.hybrid_preferred() == (installed >= Version("0.19"))
    assert model_builder.choose(tiny()).name == ("HybridModel" if installed >= Version("0.19") else "GPTModel")


def test_without_the_preference_the_builder_is_gpt_model(monkeypatch):
    monkeypatch.setattr(model_builder, "PREFERENCE_MODULE", "megatron.core.no_such_module")
    builder = model_builder.choose(tiny())
    assert (builder.name, builder.describe(tiny())["hybrid_layer_pattern"]) == ("GPTModel", None)


def test_layer_cpu_offloading_stays_on_gpt_model(monkeypatch):
    # HybridStack has no Transformer Engine CPU-offload context (megatron-core 0.19.2), so the
    # layers would silently stay on the GPU.
    monkeypatch.setattr(model_builder, "hybrid_preferred", lambda: True)
    assert model_builder.choose(tiny()).name == "HybridModel"
    builder = model_builder.choose(tiny("cpu_offloading_num_layers=1"))
    assert builder.name == "GPTModel" and "cpu_offloading_num_layers" in builder.reason


@pytest.mark.parametrize("assignments, pattern", [
    ([], "*-*-*-*-"),
    (["model=tiny-moe"], "*E*E*E*E"),
    (["model=tiny-moe", "moe_layer_freq=2"], "*E*-*E*-"),
    (["pipeline_model_parallel_size=2"], "*-*-|*-*-"),
    # chunk c = virtual stage x PP + pipeline rank, as Megatron's select_pipeline_segment reads them
    (["pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2"], "*-|*-|*-|*-"),
    (["pipeline_model_parallel_size=2", "decoder_first_pipeline_num_layers=1"], "*-|*-*-*-"),
    (["num_layers=5", "pipeline_model_parallel_size=2", "pipeline_model_parallel_layout=Ettt|ttL"],
     "*-*-*-|*-*-"),
    (["num_layers=3", "pipeline_model_parallel_size=2", "account_for_embedding_in_pipeline_split=true"],
     "*-|*-*-"),
], ids=["dense", "moe", "moe-every-2nd", "pp2", "pp2-vp2", "pp2-first-1", "layout", "embedding-counted"])
def test_each_gpt_layer_is_attention_then_its_mlp_with_the_chunks_between_pipes(assignments, pattern):
    assert model_builder.hybrid_pattern(tiny(*assignments)) == pattern


def test_hybrid_config_counts_two_layers_per_gpt_layer_and_leaves_the_split_to_the_pattern():
    exp = tiny("pipeline_model_parallel_size=2", "decoder_first_pipeline_num_layers=1",
               "recompute_granularity=full", "recompute_method=block", "recompute_num_layers=1")
    settings = {"num_layers": 4, "num_layers_in_first_pipeline_stage": 1, "recompute_num_layers": 1,
                "moe_layer_freq": [0, 1, 1, 1], "hidden_size": 64}
    hybrid = model_builder.ModelBuilder("HybridModel", "").config_settings(exp, settings)
    assert hybrid["num_layers"] == 8 and hybrid["recompute_num_layers"] == 2 and hybrid["is_hybrid_model"]
    assert hybrid["num_layers_in_first_pipeline_stage"] is None and hybrid["moe_layer_freq"] == 1
    assert hybrid["hidden_size"] == 64
    assert model_builder.ModelBuilder("GPTModel", "").config_settings(exp, settings) == settings


@pytest.mark.timeout(300)
def test_the_built_model_rotates_with_the_models_rotary_base(tmp_path):
    """Llama 3 trains with RoPE theta 500000: the model the workload builds uses it (megatron-core's
    rotary embedding: inv_freq[i] = base ** (-2i / dim)), not megatron-core's default 10000."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from charllm.engine.model import runtime
    from charllm.engine.workload.train import transformer_settings

    exp = tiny("gpus_per_node=1", "position_embedding_type=rope", "rotary_base=500000")
    impl = runtime.resolve(exp, runtime.detect())
    builder = model_builder.ModelBuilder("GPTModel", "under test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    try:
        config = TransformerConfig(**builder.config_settings(exp, transformer_settings(exp, impl)
                                                             | {"use_cpu_initialization": True}))
        model = builder.build(exp, config, impl, pre_process=True, post_process=True, vp_stage=None)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    inv_freq = model.rotary_pos_emb.inv_freq
    dim = 2 * inv_freq.numel()
    assert float(inv_freq[1]) ** (-dim / 2) == pytest.approx(500000, rel=1e-3)
