"""Every experiment field, changed one at a time: the values tests try for each field.

`variants(exp)` yields (section, field, value) for every field of every section, each value other
than the field's current one. Where a field's type and metadata do not say which other value makes
sense (an unset size, a per-layer list, a string), `CHANGES` gives it; every other field gets the
other choices, the other switch position, or a doubled (or halved, where at the maximum) number.
`changed` sets one field, with only the fields `NEEDS` says it cannot go without (an FP16 loss scale
needs FP16, which needs BF16 off).
"""

from __future__ import annotations

import dataclasses

from charllm.engine.model.experiment import SECTIONS, Experiment, choices, facts, field_options

# Values to try for fields whose type alone does not say which other value is sensible (sized for
# the tiny presets: 4 layers, hidden 64, 4 heads, sequence 32).
CHANGES = {
    "name": ["changed"],
    "description": ["changed"],
    "num_query_groups": [2],
    "kv_channels": [32],
    "ffn_hidden_size": [128],
    "max_position_embeddings": [64],
    "moe_ffn_hidden_size": [64],
    "moe_shared_expert_intermediate_size": [64],
    "moe_layer_freq": [2, [0, 1, 1, 1]],
    "num_moe_experts": [8],
    "q_lora_rank": [32],
    "kv_lora_rank": [32],
    "qk_head_dim": [32],
    "qk_pos_emb_head_dim": [16],
    "v_head_dim": [32],
    "mtp_num_layers": [2],
    "seq_length": [16],
    "virtual_pipeline_model_parallel_size": [2],
    "microbatch_group_size_per_vp_stage": [4],
    "expert_tensor_parallel_size": [1],
    "decoder_first_pipeline_num_layers": [1],
    "decoder_last_pipeline_num_layers": [1],
    "pipeline_model_parallel_layout": ["Et|tttmL"],
    "num_distributed_optimizer_instances": [2],
    "loss_scale": [1024.0],
    "moe_expert_capacity_factor": [1.0],
    "recompute_num_layers": [2],
    "cpu_offloading_num_layers": [1],
    "wgrad_deferral_limit": [2],
    "cuda_graph_warmup_steps": [0],              # only none against some changes what is held
    "rampup_batch_size": [[4, 4, 100]],          # the tiny presets' global batch 8, micro batch x DP 4
    "data_path": ["/data/x"],
    "compute_capability": ["8.0"],
    "make_vocab_size_divisible_by": [100],
    "expert_model_parallel_size": [1, 4],
    "attention_dropout": [0.1, 0.0],
    "hidden_dropout": [0.1, 0.0],
    "interconnect": ["changed"],
    "backend": ["sim"],
    "nodes": [2],
    "gpus_per_node": [8],
    "fp8_tflops": [1000.0],
    "tf32_tflops": [400.0],
    "fp32_tflops": [60.0],
    "device_names": [["NVIDIA Changed*"]],
    "profile_steps": [[2]],
}

# What a field needs set with it to be valid, or to be read at all (Megatron ignores it otherwise).
NEEDS = {
    "fp16": {"bf16": False}, "loss_scale": {"fp16": True, "bf16": False},
    "initial_loss_scale": {"fp16": True, "bf16": False},
    **{name: {"multi_latent_attention": True}
       for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")},
    "use_torch_fsdp2": {"untie_embeddings_and_output_weights": True},
    "data_parallel_sharding_strategy": {"use_megatron_fsdp": True},
    "overlap_param_gather": {"overlap_grad_reduce": True},
    **{name: {"use_precision_aware_optimizer": True}
       for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
                    "optimizer_cpu_offload")},
    "fine_grained_activation_offloading": {"offload_modules": ["core_attn"]},
    "offload_modules": {"fine_grained_activation_offloading": True},
    "recompute_modules": {"recompute_granularity": "selective"},
    "recompute_method": {"recompute_granularity": "full", "recompute_num_layers": 2},
    "recompute_num_layers": {"recompute_granularity": "full", "recompute_method": "uniform"},
    "moe_pad_expert_input_to_capacity": {"moe_expert_capacity_factor": 1.5},
    "fp8_recipe": {"fp8": "e4m3"},
    "moe_flex_dispatcher_backend": {"moe_token_dispatcher_type": "flex"},
    "overlap_moe_expert_parallel_comm": {"moe_token_dispatcher_type": "alltoall", "bf16": True},
    "wgrad_deferral_limit": {"defer_embedding_wgrad_compute": True},
    "cuda_graph_scope": {"cuda_graph_impl": "transformer_engine"},
    "cuda_graph_warmup_steps": {"cuda_graph_impl": "transformer_engine"},
}


def values_for(exp: Experiment, section: str, name: str) -> list:
    """Values other than the current one for one field."""
    kind = SECTIONS[section]
    current = getattr(getattr(exp, section), name)
    options = field_options(kind, name)
    listed = choices(kind, name)
    if name in CHANGES:
        out = list(CHANGES[name])
    elif listed is not None and any(getattr(o, "__origin__", None) is list for o in options):
        out = [[item] for item in listed]                     # a list field: each allowed item alone
    elif listed is not None:
        out = list(listed)
    elif bool in options:
        out = [not current]
    elif current is None:
        raise AssertionError(f"{section}.{name}: unset by default; give it a value in CHANGES")
    else:
        stated = facts(kind, name)
        maximum = stated["maximum"]
        out = [current / 2 if maximum is not None and current * 2 > maximum else current * 2]
        if isinstance(current, int):
            out = [int(v) for v in out]
    return [v for v in out if v != current]


def variants(exp: Experiment, sections=tuple(SECTIONS)):
    """(section, field, value) for every field of `sections`, each value other than `exp`'s."""
    for section in sections:
        for f in dataclasses.fields(SECTIONS[section]):
            for value in values_for(exp, section, f.name):
                yield section, f.name, value


def needed(exp: Experiment, name: str) -> Experiment:
    """A copy of `exp` with what field `name` `NEEDS` (the field itself unchanged)."""
    out = exp.copy()
    for other, value in NEEDS.get(name, {}).items():
        out.set(other, value)
    return out


def changed(exp: Experiment, section: str, name: str, value) -> Experiment:
    """A copy of `exp` with one field set, and what it `NEEDS`."""
    out = needed(exp, name)
    setattr(getattr(out, section), name, value)
    return out
