"""Which megatron-core language model the workload builds: HybridModel where the installed
megatron-core prefers it, GPTModel where it does not.

megatron-core 0.19 deprecates GPTModel for HybridModel (gpt_model.py logs "GPTModel IS DEPRECATED";
Megatron-LM docs/user-guide/hybrid-model-migration.md). HybridModel stacks one layer per symbol of
its `hybrid_layer_pattern`: a GPT layer is two of them, its attention ("*") and then its MLP ("-")
or MoE ("E"), and "|" closes a pipeline chunk. Both halves are built here from the same GPT layer
spec GPTModel would get (Transformer Engine's or megatron-core's local layers, SDPA attention), so
the two classes hold the same parameters and compute the same function.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from charllm.engine.model.memory import split_layers

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment

# The release that deprecates GPTModel ships the GPT-to-Hybrid checkpoint translation with it
# (megatron-core 0.19.0: dist_checkpointing/gpt_checkpoint_interop.py); 0.18 has HybridModel without
# either, 0.16.1 neither.
PREFERENCE_MODULE = "megatron.core.dist_checkpointing.gpt_checkpoint_interop"

ATTENTION, MLP, MOE, PIPE = "*", "-", "E", "|"     # megatron-core hybrid_layer_allocation.Symbols


def hybrid_preferred() -> bool:
    """Whether the installed megatron-core prefers HybridModel to GPTModel."""
    try:
        return importlib.util.find_spec(PREFERENCE_MODULE) is not None
    except ModuleNotFoundError:          # no megatron-core at all
        return False


@dataclass(frozen=True)
class ModelBuilder:
    """Builds one model chunk of an experiment with the chosen megatron-core class."""

    name: str          # "HybridModel" or "GPTModel"
    reason: str        # why this class, for the run log

    @property
    def hybrid(self) -> bool:
        return self.name == "HybridModel"

    def describe(self, exp: Experiment) -> dict:
        """For the run record: which class built the model, why, and HybridModel's layer pattern."""
        return {"class": self.name, "reason": self.reason,
                "hybrid_layer_pattern": hybrid_pattern(exp) if self.hybrid else None}

    def config_settings(self, exp: Experiment, settings: dict) -> dict:
        """TransformerConfig arguments for this class. HybridModel counts its own layers, two per
        GPT layer; its pattern places the MoE layers and the pipeline chunks, so the GPT fields that
        did (moe_layer_freq, the pipeline split and layout) step aside, as Megatron-LM's
        arguments.py requires of --hybrid-layer-pattern."""
        if not self.hybrid:
            return settings
        recompute = settings.get("recompute_num_layers")
        return settings | dict(
            num_layers=2 * exp.model.num_layers,
            # As Megatron-LM's argument_utils.py for a pattern: the output layers' init is then
            # N(0, sigma / sqrt(num_layers)), GPTModel's sigma / sqrt(2 * its layers).
            is_hybrid_model=True,
            moe_layer_freq=1,
            num_layers_in_first_pipeline_stage=None,
            num_layers_in_last_pipeline_stage=None,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False,
            pipeline_model_parallel_layout=None,
            # the same GPT layers recomputed: recompute.py counts the stack's layers
            recompute_num_layers=2 * recompute if recompute else recompute,
        )

    def build(self, exp: Experiment, config, impl, *, pre_process: bool, post_process: bool, vp_stage: int | None):
        m, p = exp.model, exp.parallel
        common = dict(
            config=config,
            vocab_size=m.padded_vocab_size(p.tensor_model_parallel_size),
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_base=m.rotary_base,
            vp_stage=vp_stage,
        )
        if self.hybrid:
            from megatron.core.models.hybrid.hybrid_model import HybridModel  # deferred: absent before 0.18

            return HybridModel(hybrid_stack_spec=hybrid_stack_spec(exp, config, impl),
                               hybrid_layer_pattern=hybrid_pattern(exp), **common)
        from megatron.core.models.gpt import GPTModel

        return GPTModel(transformer_layer_spec=gpt_block_spec(exp, config, impl, vp_stage), **common)


def choose(exp: Experiment) -> ModelBuilder:
    """HybridModel where megatron-core prefers it and it has what the experiment uses, else GPTModel."""
    if not hybrid_preferred():
        return ModelBuilder("GPTModel", "this megatron-core predates HybridModel's preference")
    if exp.training.cpu_offloading_num_layers:
        # TransformerBlock wraps its layers in Transformer Engine's CPU offload context
        # (transformer_block.py); HybridStack has no such context (megatron-core 0.19.2), so the
        # layers would silently stay on the GPU.
        return ModelBuilder("GPTModel", "cpu_offloading_num_layers: HybridModel has no layer CPU offloading")
    return ModelBuilder("HybridModel", "megatron-core deprecates GPTModel for HybridModel")


# --------------------------------------------------------------------------------------------
# GPTModel: Megatron-LM's decoder block spec (gpt_builders.py)
# --------------------------------------------------------------------------------------------
def gpt_block_spec(exp: Experiment, config, impl, vp_stage):
    """Megatron-LM's decoder block spec for this chunk, with SDPA core attention on the local path
    where engine.model.runtime chose it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=impl.transformer == "transformer_engine",
                                      normalization=exp.model.normalization, vp_stage=vp_stage)
    return _with_attention(spec, impl)


def _with_attention(spec, impl):
    if impl.attention.startswith("sdpa"):
        from charllm.engine.workload.attention import with_sdpa  # deferred: loads megatron-core, torch (start-up time)

        spec = with_sdpa(spec, impl.sdpa_kernels)
    return spec


# --------------------------------------------------------------------------------------------
# HybridModel: the GPT stack as a layer pattern
# --------------------------------------------------------------------------------------------
def hybrid_pattern(exp: Experiment) -> str:
    """Each GPT layer as attention then MLP or MoE, the chunks in Megatron's order (chunk c =
    virtual stage v * PP + pipeline rank r, as select_pipeline_segment reads them), "|" between
    chunks: the same layers on every rank as GPTModel's split (engine.model.memory.split_layers)."""
    moe = exp.model.moe_layer_pattern()
    chunks = split_layers(exp)          # chunks[pp_rank][virtual_stage]
    pp, vp = len(chunks), len(chunks[0])
    ordered = [chunks[r][v] for v in range(vp) for r in range(pp)]
    return PIPE.join("".join(ATTENTION + (MOE if moe[i] else MLP) for i in chunk.layers) for chunk in ordered)


class _OneDenseOneMoE:
    """The TransformerConfig as get_gpt_decoder_layer_specs reads it, asked for two GPT layers,
    dense then MoE: it then builds exactly the layer specs GPTModel's block gets."""

    num_layers, moe_layer_freq = 2, [0, 1]

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def hybrid_stack_spec(exp: Experiment, config, impl):
    """A HybridStack spec whose attention, MLP and MoE layers are the halves of the GPT layer
    specs megatron-core builds for GPTModel (gpt_layer_specs.get_gpt_decoder_layer_specs, with
    the same arguments gpt_block_spec gives), and whose final norm is the GPT block's."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    te = impl.transformer == "transformer_engine"
    dense, moe = specs.get_gpt_decoder_layer_specs(_OneDenseOneMoE(config), use_transformer_engine=te,
                                                   normalization=exp.model.normalization)

    def half(layer, module, parts):
        sub = layer.submodules
        return ModuleSpec(module=module, submodules=TransformerLayerSubmodules(
            **{name: getattr(sub, name) for name in parts},
            sharded_state_dict_keys_map=sub.sharded_state_dict_keys_map))

    attention_parts = ("input_layernorm", "self_attention", "self_attn_bda")
    mlp_parts = ("pre_mlp_layernorm", "mlp", "mlp_bda")
    dense = _with_attention(dense, impl)
    submodules = HybridStackSubmodules(attention_layer=half(dense, TransformerLayer, attention_parts),
                                       mlp_layer=half(dense, MLPLayer, mlp_parts))
    if exp.model.is_moe:
        submodules.moe_layer = half(moe, MoETransformerLayer, mlp_parts)
    final_norm = specs.TENorm if te else specs.LNImpl
    return ModuleSpec(module=_hybrid_stack_class(), submodules=submodules, params={"final_norm": final_norm})


@functools.cache
def _hybrid_stack_class():
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    class GPTNormHybridStack(HybridStack):
        """HybridStack with the GPT block's final norm. megatron-core 0.19.2 builds it as TENorm
        whatever the spec (hybrid_block.py:215), which raises without Transformer Engine; the
        local path takes megatron-core's own norm (LNImpl) as GPTModel's block does."""

        def __init__(self, config, submodules, *args, final_norm, post_process=True, post_layer_norm=True,
                     **kwargs):
            super().__init__(config, submodules, *args, post_process=post_process, post_layer_norm=False,
                             **kwargs)
            self.post_layer_norm = post_layer_norm    # forward applies final_norm when set
            if post_process and post_layer_norm:
                self.final_norm = final_norm(config=config, hidden_size=config.hidden_size,
                                             eps=config.layernorm_epsilon)

    return GPTNormHybridStack
