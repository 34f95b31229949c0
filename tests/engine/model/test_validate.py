"""engine.model.validate: one test per rule; each checks the field, the value and the rule in the message."""

from __future__ import annotations

import pytest

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment, Problem
from charllm.engine.model.sweep import base_experiment
from charllm.engine.model.validate import check, validate
from charllm.probes.core.errors import UserError


def base() -> Experiment:
    """A valid 16-device layout: TP2 PP2 DP4 of a 4-layer MoE-capable model on H100s."""
    exp = Experiment.from_dict({
        "model": {"preset": "tiny-dense", "num_layers": 8, "num_attention_heads": 8, "hidden_size": 128,
                  "ffn_hidden_size": 512, "num_query_groups": 4},
        "hardware": "h100-sxm-80gb",
        "cluster": {"nodes": 2, "gpus_per_node": 8},
        "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                     "sequence_parallel": True},
        "training": {"micro_batch_size": 2, "global_batch_size": 32},
    })
    assert validate(exp) == []
    return exp


def moe(*sets: str) -> list[str]:
    return ["num_moe_experts=8", "moe_router_topk=2", "expert_model_parallel_size=2", *sets]


# (settings applied to the base experiment, the exact message of the expected problem)
RULES = {
    "world size = TP x PP x CP x DP": (
        ["tensor_model_parallel_size=4", "context_parallel_size=3", "seq_length=24", "max_position_embeddings=48"],
        "world_size = 16: must be a multiple of tensor x pipeline x context parallel sizes (4 x 2 x 3 = 24) "
        "for a whole data-parallel size",
    ),
    "heads divisible by TP": (
        ["num_attention_heads=6", "hidden_size=96", "num_query_groups=none", "tensor_model_parallel_size=4"],
        "num_attention_heads = 6: must be divisible by tensor_model_parallel_size (4)",
    ),
    "query groups divisible by TP": (
        ["num_query_groups=2", "tensor_model_parallel_size=4"],
        "num_query_groups = 2: must be divisible by tensor_model_parallel_size (4)",
    ),
    "query groups divide heads": (
        ["num_query_groups=6", "tensor_model_parallel_size=1", "sequence_parallel=false"],
        "num_query_groups = 6: must divide num_attention_heads (8)",
    ),
    "hidden divisible by heads": (
        ["hidden_size=100"],
        "hidden_size = 100: must be divisible by num_attention_heads (8) unless kv_channels is set",
    ),
    "ffn divisible by TP": (
        ["ffn_hidden_size=511"],
        "ffn_hidden_size = 511: must be divisible by tensor_model_parallel_size (2)",
    ),
    "layers divisible by PP x VP": (
        ["pipeline_model_parallel_size=4", "virtual_pipeline_model_parallel_size=4", "nodes=4"],
        "num_layers = 8: must be divisible by pipeline x virtual stages (4 x 4 = 16), or give "
        "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers",
    ),
    "layers counting embedding and loss": (
        ["account_for_embedding_in_pipeline_split=true"],
        "num_layers = 8: must be divisible by pipeline x virtual stages (2 x 1 = 2) (counting embedding/loss "
        "as layers), or give decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers",
    ),
    "uneven split remainder": (
        ["pipeline_model_parallel_size=4", "nodes=4", "decoder_first_pipeline_num_layers=1"],
        "num_layers = 8: after 1 first-stage and 0 last-stage layers, the other 7 must split evenly over "
        "3 middle stages x 1 virtual stages",
    ),
    "uneven split with VP": (
        [
            "pipeline_model_parallel_size=4",
            "nodes=4",
            "virtual_pipeline_model_parallel_size=2",
            "decoder_first_pipeline_num_layers=1",
            "decoder_last_pipeline_num_layers=1",
        ],
        "decoder_first_pipeline_num_layers = 1: must be divisible by virtual_pipeline_model_parallel_size (2)",
    ),
    "uneven split needs PP": (
        ["pipeline_model_parallel_size=1", "decoder_last_pipeline_num_layers=2"],
        "decoder_last_pipeline_num_layers = 2: an uneven pipeline split needs pipeline_model_parallel_size > 1",
    ),
    "VP needs PP > 1": (
        ["pipeline_model_parallel_size=1", "virtual_pipeline_model_parallel_size=2"],
        "virtual_pipeline_model_parallel_size = 2: needs pipeline_model_parallel_size > 1 (the interleaved schedule)",
    ),
    # megatron-core forward_backward_pipelining_with_interleaving (core_v0.16.1, core_v0.19.0): PP <= group <= M
    "micro-batch group within PP and the micro-batches": (
        ["virtual_pipeline_model_parallel_size=2", "microbatch_group_size_per_vp_stage=8"],
        "microbatch_group_size_per_vp_stage = 8: with the interleaved pipeline must be from "
        "pipeline_model_parallel_size (2) to the micro-batches per step (4); microbatch_group_size_per_vp_stage=2 "
        "works",
    ),
    "micro-batch group leaves no short last group": (   # 4 micro-batches in groups of 3: 1 left, PP is 2
        ["virtual_pipeline_model_parallel_size=2", "microbatch_group_size_per_vp_stage=3"],
        "microbatch_group_size_per_vp_stage = 3: the last group of the 4 micro-batches per step has 1: with the "
        "interleaved pipeline it must have at least pipeline_model_parallel_size (2), or none be left over",
    ),
    "interleaved micro-batches a multiple of PP": (   # the group unset is PP
        ["virtual_pipeline_model_parallel_size=2", "global_batch_size=24"],
        "global_batch_size = 24: gives 3 micro-batches per step (over micro_batch_size x data-parallel size = 8); "
        "the interleaved pipeline with microbatch_group_size_per_vp_stage unset needs a multiple of "
        "pipeline_model_parallel_size (2); global_batch_size=32 works",
    ),
    "layout decoder count": (
        ["pipeline_model_parallel_layout='Ett|ttL'"],
        "pipeline_model_parallel_layout = 'Ett|ttL': places 4 decoder layers (t) but num_layers = 8",
    ),
    "layout stage count": (
        ["pipeline_model_parallel_layout='Ettt|ttt|ttL'"],
        "pipeline_model_parallel_layout = 'Ettt|ttt|ttL': its 3 stages must divide over "
        "pipeline_model_parallel_size (2)",
    ),
    "layout gives VP": (  # Megatron takes VP from the layout: 4 stages over PP 2 are VP 2
        ["pipeline_model_parallel_layout='Ettt|ttt|tt|L'"],
        "virtual_pipeline_model_parallel_size = None: the layout gives 2 virtual stages per pipeline rank; "
        "virtual_pipeline_model_parallel_size=2 works",
    ),
    "layout letters": (
        ["pipeline_model_parallel_layout='Etx|L'"],
        "pipeline_model_parallel_layout = 'Etx|L': unknown layer letter(s) 'x'; known: E, t, m, L",
    ),
    "global batch divisible by micro x DP": (
        ["global_batch_size=20"],
        "global_batch_size = 20: must be divisible by micro_batch_size x data-parallel size (2 x 4 = 8); "
        "global_batch_size=16 works",
    ),
    "experts divisible by EP": (
        moe("num_moe_experts=6", "expert_model_parallel_size=4"),
        "num_moe_experts = 6: must be divisible by expert_model_parallel_size (4)",
    ),
    "EP needs MoE": (
        ["expert_model_parallel_size=2"],
        "expert_model_parallel_size = 2: needs a mixture-of-experts model (num_moe_experts)",
    ),
    "top-k within experts": (moe("moe_router_topk=16"), "moe_router_topk = 16: cannot exceed num_moe_experts (8)"),
    "ETP x EP x PP divides world": (
        moe("expert_model_parallel_size=8", "expert_tensor_parallel_size=2"),
        "expert_model_parallel_size = 8: expert tensor x expert x pipeline parallel (2 x 8 x 2 = 32) must divide "
        "the world size (16); ETP x EP must divide the 8 ranks (TP x CP x DP) of a pipeline stage",
    ),
    "expert FFN divisible by ETP": (
        moe("moe_ffn_hidden_size=255"),
        "moe_ffn_hidden_size = 255: must be divisible by expert_tensor_parallel_size (2)",
    ),
    "SP needs TP > 1": (
        ["tensor_model_parallel_size=1"],
        "sequence_parallel = True: needs tensor_model_parallel_size > 1; sequence_parallel=false works",
    ),
    "MoE with TP > 1 needs SP": (
        moe("sequence_parallel=false"),
        "sequence_parallel = False: a mixture-of-experts model with tensor_model_parallel_size > 1 needs "
        "sequence_parallel = true; sequence_parallel=true works",
    ),
    "EP without fp16": (
        moe("fp16=true", "bf16=false"),
        "fp16 = True: expert parallelism does not support fp16 training",
    ),
    "seq divisible by 2 x CP": (
        ["context_parallel_size=2", "nodes=4", "seq_length=30"],
        "seq_length = 30: must be divisible by 2 x context_parallel_size (2 x 2 = 4)",
    ),
    "seq within positions": (
        ["training.seq_length=64"],
        "seq_length = 64: must not exceed max_position_embeddings (32)",
    ),
    "FP8 only with FP8 hardware": (
        ["training.fp8='hybrid'", "hardware.fp8=false", "hardware.name='a100-80gb'"],
        "fp8 = 'hybrid': hardware a100-80gb has no FP8 support",
    ),
    "fp16 and bf16 not both": (["fp16=true", "bf16=true"], "fp16 = True: cannot be combined with bf16 (choose one)"),
    "grouped GEMM needs bf16": (["moe_grouped_gemm=true", "bf16=false"], "moe_grouped_gemm = True: needs bf16 = true"),
    "no recompute method under selective": (
        ["recompute_granularity='selective'", "recompute_method='uniform'"],
        "recompute_method = 'uniform': is not supported with recompute_granularity = 'selective' (only with 'full')",
    ),
    "no recompute layer count under selective": (
        ["recompute_granularity='selective'", "recompute_num_layers=1"],
        "recompute_num_layers = 1: must be unset with recompute_granularity = 'selective' (it applies to 'full')",
    ),
    "full recompute needs a method": (
        ["recompute_granularity='full'", "recompute_num_layers=1"],
        "recompute_method = None: full recompute needs a method: uniform or block",
    ),
    "full recompute needs a layer count": (
        ["recompute_granularity='full'", "recompute_method='uniform'"],
        "recompute_num_layers = None: full recompute needs the number of layers",
    ),
    "recompute layers within a stage": (
        ["recompute_granularity='full'", "recompute_method='block'", "recompute_num_layers=5"],
        "recompute_num_layers = 5: cannot exceed the 4 layers of one pipeline stage (8 layers / 2 model chunks); "
        "recompute_num_layers=4 works",
    ),
    "recompute module names": (
        ["recompute_granularity='selective'", "recompute_modules=['attention']"],
        "recompute_modules = ['attention']: 'attention' is not one of core_attn, moe_act, layernorm, "
        "mla_up_proj, mlp, moe, shared_experts",
    ),
    "param gather needs the distributed optimizer": (
        ["overlap_param_gather=true", "overlap_grad_reduce=true"],
        "overlap_param_gather = True: needs use_distributed_optimizer = true (or use_megatron_fsdp); "
        "use_distributed_optimizer=true works",
    ),
    "param gather needs grad reduce overlap": (
        ["overlap_param_gather=true", "use_distributed_optimizer=true"],
        "overlap_param_gather = True: needs overlap_grad_reduce = true; overlap_grad_reduce=true works",
    ),
    "optimizer instances need the distributed optimizer": (
        ["num_distributed_optimizer_instances=2"],
        "num_distributed_optimizer_instances = 2: applies only with use_distributed_optimizer = true",
    ),
    "muon without distributed optimizer": (
        ["optimizer='muon'", "use_distributed_optimizer=true"],
        "optimizer = 'muon': does not support the distributed optimizer or FSDP",
    ),
    "optimizer dtypes need the precision-aware optimizer": (
        ["exp_avg_dtype='bf16'"],
        "exp_avg_dtype = 'bf16': applies only with use_precision_aware_optimizer = true",
    ),
    "optimizer offload needs the precision-aware optimizer": (
        ["optimizer_cpu_offload=true"],
        "optimizer_cpu_offload = True: needs use_precision_aware_optimizer = true",
    ),
    "FP8 param gather needs the distributed optimizer": (
        ["fp8_param_gather=true"],
        "fp8_param_gather = True: needs use_distributed_optimizer = true (or FSDP); "
        "use_distributed_optimizer=true works",
    ),
    "CUDA graphs without full recompute": (
        [
            "cuda_graph_impl='transformer_engine'",
            "recompute_granularity='full'",
            "recompute_method='block'",
            "recompute_num_layers=1",
        ],
        "cuda_graph_impl = 'transformer_engine': CUDA graphs cannot be combined with full recompute",
    ),
    "enum: optimizer dtypes": (
        ["use_precision_aware_optimizer=true", "main_grads_dtype='fp16'"],
        "main_grads_dtype = 'fp16': must be one of fp32, bf16",
    ),
    "TP comm overlap needs SP": (
        ["tp_comm_overlap=true", "sequence_parallel=false"],
        "tp_comm_overlap = True: needs sequence_parallel = true; sequence_parallel=true works",
    ),
    "sharding strategy needs Megatron-FSDP": (
        ["data_parallel_sharding_strategy='optim_grads_params'"],
        "data_parallel_sharding_strategy = 'optim_grads_params': applies only with use_megatron_fsdp = true",
    ),
    "one FSDP": (
        ["use_megatron_fsdp=true", "use_torch_fsdp2=true"],
        "use_torch_fsdp2 = True: cannot be combined with use_megatron_fsdp",
    ),
    "torch FSDP2 without PP": (
        ["use_torch_fsdp2=true"],
        "pipeline_model_parallel_size = 2: is not supported with use_torch_fsdp2",
    ),
    "sizes positive": (["tensor_model_parallel_size=0"], "tensor_model_parallel_size = 0: must be at least 1"),
    "optional sizes positive": (["num_moe_experts=0"], "num_moe_experts = 0: must be at least 1"),
    "dropout is a probability": (["hidden_dropout=1.5"], "hidden_dropout = 1.5: must be at most 1"),
    "learning rate positive": (["lr=0"], "lr = 0.0: must be greater than 0"),
    "enum: normalization": (
        ["normalization='BatchNorm'"],
        "normalization = 'BatchNorm': must be one of LayerNorm, RMSNorm",
    ),
    "enum: recompute granularity": (
        ["recompute_granularity='partial'"],
        "recompute_granularity = 'partial': must be one of none, full, selective",
    ),
    "enum: attention backend": (
        ["attention_backend='xformers'"],
        "attention_backend = 'xformers': must be one of auto, flash, fused, unfused, local",
    ),
    "enum: dispatcher": (
        ["moe_token_dispatcher_type='a2a'"],
        "moe_token_dispatcher_type = 'a2a': must be one of allgather, alltoall, flex",
    ),
    "enum: fp8 format": (["training.fp8='e5m2'"], "fp8 = 'e5m2': must be one of none, e4m3, hybrid"),
    "enum: telemetry backend": (
        ["telemetry.backend='dcgm'"],
        "backend = 'dcgm': must be one of auto, nvml, amdsmi, host, sim or replay:RUN",
    ),
    "MoE pattern length": (
        moe("moe_layer_freq=[0, 1, 1]"),
        "moe_layer_freq = [0, 1, 1]: a per-layer pattern needs one entry per layer (num_layers = 8), got 3",
    ),
    "MoE pattern values": (
        moe("moe_layer_freq=[0, 1, 2, 1, 1, 1, 1, 1]"),
        "moe_layer_freq = [0, 1, 2, 1, 1, 1, 1, 1]: a per-layer pattern holds only 0 (dense) and 1 (MoE)",
    ),
    "MLA ranks only with MLA": (
        ["q_lora_rank=64"],
        "q_lora_rank = 64: applies only with multi_latent_attention = true",
    ),
    "MLA has no query groups": (
        ["multi_latent_attention=true"],
        "num_query_groups = 4: multi-latent attention has no query groups; leave it unset",
    ),
    "MTP needs rope": (
        ["mtp_num_layers=1"],
        "mtp_num_layers = 1: multi-token prediction needs position_embedding_type rope or none, not learned_absolute",
    ),
    "one MLP activation": (
        ["swiglu=true", "squared_relu=true"],
        "squared_relu = True: cannot be combined with swiglu (one MLP activation)",
    ),
    "layer offloading: fewer layers than the model": (
        ["pipeline_model_parallel_size=1", "cpu_offloading_num_layers=8"],
        "cpu_offloading_num_layers = 8: must be below num_layers (8); cpu_offloading_num_layers=7 works",
    ),
    "layer offloading: no pipeline parallelism": (
        ["cpu_offloading_num_layers=2"],
        "cpu_offloading_num_layers = 2: layer offloading does not support pipeline parallelism; "
        "pipeline_model_parallel_size=1 works",
    ),
    "layer offloading: no recompute": (
        ["pipeline_model_parallel_size=1", "cpu_offloading_num_layers=2", "recompute_granularity=selective"],
        "cpu_offloading_num_layers = 2: layer offloading does not work with activation recompute; "
        "recompute_granularity=none works",
    ),
    "fine-grained offloading needs modules": (
        ["fine_grained_activation_offloading=true"],
        "offload_modules = None: fine-grained offloading needs the modules whose inputs leave the GPU; "
        "offload_modules=['core_attn'] works",
    ),
    "attn_proj offloading needs core_attn": (
        ["fine_grained_activation_offloading=true", "offload_modules=['attn_proj']"],
        "offload_modules = ['attn_proj']: attn_proj needs core_attn too (its input is core attention's output, "
        "which core attention's backward reads)",
    ),
    "offload modules are Megatron's": (
        ["fine_grained_activation_offloading=true", "offload_modules=['mlp']"],
        "offload_modules = ['mlp']: 'mlp' is not one of attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, "
        "expert_fc1, moe_act",
    ),
    "one kind of offloading": (
        [
            "pipeline_model_parallel_size=1",
            "cpu_offloading_num_layers=2",
            "fine_grained_activation_offloading=true",
            "offload_modules=['core_attn']",
        ],
        "fine_grained_activation_offloading = True: cannot be combined with layer offloading "
        "(cpu_offloading_num_layers); cpu_offloading_num_layers=0 works",
    ),
}


@pytest.mark.parametrize("sets, message", RULES.values(), ids=list(RULES))
def test_rule(sets, message):
    exp = base().apply(sets)
    problems = [str(p) for p in validate(exp)]
    assert message in problems, problems


def test_micro_batch_groups_are_checked_only_when_interleaved():
    """Without VP Megatron runs the 1F1B schedule, which never reads the group; a group of 3 over 6
    micro-batches at PP 2 (two whole groups) and a last group of PP or more (5 = 3 + 2) both run."""
    assert validate(base().apply(["microbatch_group_size_per_vp_stage=8", "global_batch_size=24"])) == []
    for gbs in (48, 40):
        exp = base().apply(["virtual_pipeline_model_parallel_size=2", "microbatch_group_size_per_vp_stage=3",
                            f"global_batch_size={gbs}"])
        assert validate(exp) == [], gbs


def test_problem_text_and_check():
    problem = Problem("num_layers", 7, "must be even")
    assert str(problem) == "num_layers = 7: must be even"
    exp = base().apply(["global_batch_size=20", "ffn_hidden_size=511"])
    with pytest.raises(UserError) as info:
        check(exp)
    assert str(info.value) == str(validate(exp)[0])
    check(base())  # a valid experiment passes silently


def test_bad_sizes_stop_before_division_rules():
    exp = base().apply(["pipeline_model_parallel_size=0", "micro_batch_size=0"])
    assert [str(p) for p in validate(exp)] == [
        "pipeline_model_parallel_size = 0: must be at least 1", "micro_batch_size = 0: must be at least 1"]


@pytest.mark.parametrize("name", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                  "context_parallel_size", "expert_model_parallel_size", "micro_batch_size",
                                  "cluster.nodes", "cluster.gpus_per_node"])
@pytest.mark.parametrize("size", [0, -3])
def test_a_size_below_one_is_named_and_the_derived_sizes_stay_defined(name, size):
    """Compose shows world, DP and micro-batches while the user types: a 0 there was a ZeroDivisionError."""
    exp = base().apply([f"{name}={size}"])
    assert exp.data_parallel_size >= 1 and exp.expert_data_parallel_size >= 1 and exp.num_microbatches >= 1
    assert exp.layout_record()["data_parallel_size"] >= 1
    assert [str(p) for p in validate(exp)] == [f"{name.rpartition('.')[2]} = {size}: must be at least 1"]


@pytest.mark.parametrize("name", list(catalog.entries("experiments")))
def test_shipped_experiments_are_valid(name):
    assert validate(Experiment.load(name)) == []


@pytest.mark.parametrize("key, close", [
    ("tensor_parallel_size", "tensor_model_parallel_size"),
    ("parallel.pipeline_parallel_size", "pipeline_model_parallel_size"),
    ("num_experts", "num_moe_experts"),
])
def test_unknown_keys_suggest_the_nearest(key, close):
    with pytest.raises(UserError, match=f"unknown key .*; did you mean '{close}'"):
        base().apply([f"{key}=2"])


def test_unknown_keys_in_toml_suggest_the_nearest(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('model = "tiny-dense"\n[parallel]\ntensor_model_paralel_size = 2\n')
    with pytest.raises(UserError, match="unknown key 'tensor_model_paralel_size'; did you mean "
                                        "'tensor_model_parallel_size'"):
        Experiment.load(path)


def test_what_megatron_ignores_is_accepted_and_listed():
    """Megatron takes recompute settings that do not apply (no granularity, or modules outside
    selective recompute) and ignores them; so do validate and plan, which say so."""
    from charllm.engine.model.memory import estimate
    from charllm.engine.model.validate import ignored

    exp = Experiment.load("tiny-local").apply(["recompute_method='uniform'", "recompute_num_layers=1",
                                                 "recompute_modules=['mlp']"])
    assert validate(exp) == []
    assert ignored(exp) == [
        "recompute_method = 'uniform': ignored without recompute_granularity (as Megatron does)",
        "recompute_num_layers = 1: ignored without recompute_granularity (as Megatron does)",
        "recompute_modules = ['mlp']: ignored without recompute_granularity = 'selective' (as Megatron does)"]
    assert ignored(exp)[1] in estimate(exp).warnings
    assert estimate(exp).peak_bytes == estimate(Experiment.load("tiny-local")).peak_bytes


@pytest.mark.parametrize("sets", [s for s, message in RULES.values() if message.endswith(" works")],
                         ids=[n for n, (_, message) in RULES.items() if message.endswith(" works")])
def test_a_suggested_fix_resolves_its_problem(sets):
    """A rule that names a value that works: applying that value removes the problem."""
    exp = base().apply(sets)
    problem = next(p for p in validate(exp) if p.fix)
    exp.apply([problem.fix])
    assert (problem.field, problem.rule) not in {(p.field, p.rule) for p in validate(exp)}


def test_offload_modules_without_fine_grained_offloading_are_listed_as_ignored():
    from charllm.engine.model.validate import ignored

    exp = base().apply(["offload_modules=['core_attn']"])
    assert validate(exp) == []
    assert ignored(exp) == ["offload_modules = ['core_attn']: ignored without fine_grained_activation_offloading "
                            "(as Megatron does)"]


def test_the_a2a_overlap_needs_what_megatron_requires():
    exp = base_experiment("mixtral-8x7b", "h100-sxm-80gb", 1, 8, 64)
    exp.training.overlap_moe_expert_parallel_comm = True
    exp.training.moe_token_dispatcher_type = "allgather"
    rules = [p.rule for p in validate(exp) if p.field == "overlap_moe_expert_parallel_comm"]
    assert rules == ["needs expert parallelism (expert_model_parallel_size > 1)",
                     "needs the alltoall or flex token dispatcher"]
    exp.parallel.expert_model_parallel_size = 8
    exp.training.moe_token_dispatcher_type = "alltoall"
    assert not [p for p in validate(exp) if p.field == "overlap_moe_expert_parallel_comm"]


def test_deterministic_mode_refuses_the_fused_cross_entropy():
    exp = Experiment.load("tiny-local").apply(["deterministic_mode=true", "cross_entropy_loss_fusion=true"])
    assert [(p.field, p.fix) for p in validate(exp)] == [
        ("cross_entropy_loss_fusion", "cross_entropy_loss_fusion=false")]


def test_a_batch_ramp_up_follows_megatrons_rules():
    exp = Experiment.load("tiny-local").apply(["global_batch_size=64", "rampup_batch_size=[16, 32, 100]"])
    assert [p.rule for p in validate(exp)] == ["its increment (32) must divide global_batch_size - start (48)"]
    exp = exp.apply(["rampup_batch_size=[16, 16, 100]"])
    assert validate(exp) == []
