"""Megatron-LM command lines: the memory_dev cases import with the layout their README states, exports
import back to the same experiment, and unmodelled flags are listed, never fatal."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from charllm.engine.model import calibration, catalog, runtime
from charllm.engine.model.experiment import Experiment, Hardware, ModelSpec
from charllm.engine.model.megatron import (
    MLA_DEFAULTS,
    ROUND_TRIP_NORMALIZED,
    export_environment,
    export_megatron_args,
    format_layer_pattern,
    format_megatron_args,
    import_megatron_args,
    model_config_tokens,
    parse_layer_pattern,
    parse_pipeline_layout,
)
from charllm.probes.core.errors import UserError

# The shipped memory development set (tests/data/memory_dev: Megatron-LM's CI cases, rebuilt by
# tools/build_memory_dev.py).
DEV = Path(__file__).resolve().parents[2] / "data" / "memory_dev" / "memory_dev.json"
CASES = json.loads(DEV.read_text())

# A flag's value as the command line says it, or Megatron's default (arguments.py, core_v0.16.1).
LAYOUT_FLAGS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                "--context-parallel-size": 1, "--expert-model-parallel-size": 1, "--micro-batch-size": 1,
                "--seq-length": None}
LAYOUT_SWITCHES = ("--sequence-parallel", "--use-distributed-optimizer")


def _said(tokens: list[str]) -> dict:
    """The layout the command line states, read from its tokens alone (not through the importer)."""
    value = {flag: int(tokens[tokens.index(flag) + 1]) if flag in tokens else default
             for flag, default in LAYOUT_FLAGS.items()}
    said = {**value, **{switch: switch in tokens for switch in LAYOUT_SWITCHES}}
    # Megatron turns sequence parallelism off at TP 1 (validate_args, arguments.py, core_v0.16.1).
    said["--sequence-parallel"] &= said["--tensor-model-parallel-size"] > 1
    return said


def _read(exp: Experiment) -> dict:
    p, t = exp.parallel, exp.training
    return {"--tensor-model-parallel-size": p.tensor_model_parallel_size,
            "--pipeline-model-parallel-size": p.pipeline_model_parallel_size,
            "--context-parallel-size": p.context_parallel_size,
            "--expert-model-parallel-size": p.expert_model_parallel_size,
            "--micro-batch-size": t.micro_batch_size, "--seq-length": exp.seq_length,
            "--sequence-parallel": p.sequence_parallel, "--use-distributed-optimizer": p.use_distributed_optimizer}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_memory_dev_case_imports_with_the_stated_layout(case):
    result = import_megatron_args(case["megatron_args"], world_size=case["world_size"], hardware=case["hardware"])
    tokens = shlex.split(case["megatron_args"])
    said = _said(tokens)
    if said["--seq-length"] is None:           # Megatron takes it from --encoder-seq-length then
        said["--seq-length"] = _read(result.experiment)["--seq-length"]
    assert _read(result.experiment) == said
    assert result.experiment.world_size == case["world_size"]
    assert result.experiment.hardware.name == "h100-sxm-80gb"
    assert not result.warnings or all("world size" not in w for w in result.warnings)
    # Logging and checkpoint flags are listed as ignored, exactly as written.
    if "--log-interval" in tokens:
        assert f"--log-interval {tokens[tokens.index('--log-interval') + 1]}" in result.ignored


def test_memory_dev_shapes_follow_megatron_defaults():
    by_name = {c["name"]: c for c in CASES}
    mla = import_megatron_args(by_name["gpt3_mcore_te_tp2_pp2_mla"]["megatron_args"], world_size=8,
                               hardware="h100-sxm-80gb").experiment.model
    assert (mla.multi_latent_attention, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim,
            mla.qk_pos_emb_head_dim, mla.v_head_dim) == (True, 192, 64, 16, 8, 16)
    last = import_megatron_args(by_name["moe_gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph"]["megatron_args"],
                                world_size=8, hardware="h100-sxm-80gb").experiment
    assert last.model.moe_layer_freq == [0] * 4 + [1] * 9
    assert last.model.mtp_num_layers == 1
    assert last.parallel.pipeline_model_parallel_layout == "Et|(tt|)*6mL"
    assert (last.training.fp8, last.training.fp8_recipe, last.training.bf16) == ("hybrid", "blockwise", True)
    assert last.model.padded_vocab_size(4) == 50688  # as the case notes state
    swiglu = import_megatron_args(by_name["gpt3_mcore_te_tp1_pp4_resume_torch_dist_swiglu"]["megatron_args"],
                                  world_size=8, hardware="h100-sxm-80gb").experiment.model
    assert swiglu.swiglu and swiglu.ffn_hidden_size == int((4 * 512 * 2 / 3) / 64) * 64 == 1344
    assert last.training.cuda_graph_impl == "transformer_engine"
    assert last.training.attention_softmax_in_fp32           # --attention-softmax-in-fp32 is in the case
    fsdp = import_megatron_args(by_name["gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor"]["megatron_args"],
                                world_size=8, hardware="h100-sxm-80gb").experiment.parallel
    assert fsdp.use_megatron_fsdp and fsdp.data_parallel_sharding_strategy == "optim_grads_params"


def test_defaults_are_megatrons_not_ours():
    exp = import_megatron_args("--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 128 "
                               "--micro-batch-size 1", world_size=1, hardware="cpu").experiment
    m = exp.model
    assert (m.hidden_dropout, m.attention_dropout, m.add_bias_linear) == (0.1, 0.1, True)
    assert m.ffn_hidden_size == 4096 and m.max_position_embeddings == 128
    assert exp.training.bf16 is False and exp.training.fp16 is False    # fp32 without --bf16/--fp16
    assert exp.training.global_batch_size == 1                          # micro batch x DP
    swiglu = import_megatron_args("--num-layers 2 --hidden-size 1000 --num-attention-heads 8 --seq-length 128 "
                                  "--swiglu --micro-batch-size 1", world_size=1, hardware="cpu").experiment
    assert swiglu.model.ffn_hidden_size == 2624                         # int(4000*2/3/64)*64
    mla = import_megatron_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
                               "--multi-latent-attention --micro-batch-size 1", world_size=1,
                               hardware="cpu").experiment.model
    assert {k: getattr(mla, k) for k in MLA_DEFAULTS} == MLA_DEFAULTS   # kv_lora_rank 32, no q compression


BASE = "--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 "


def test_launch_script_syntax():
    script = """torchrun --nnodes 2 --nproc_per_node 4 pretrain_gpt.py \\
        --num-layers=8 --hidden-size 256 \\
        --num-attention-heads 8 --seq-length 512   # a comment
        --micro-batch-size 1 --global-batch-size 16 --bf16 \\
        --group-query-attention --num-query-groups 2 \\
        --tensor-model-parallel-size 2 --sequence-parallel --no-sequence-parallel \\
        --recompute-granularity full --recompute-method block --recompute-num-layers 2 \\
        --lr-decay-style cosine --no-rope-fusion --eval-iters 10 --use-checkpoint-args
    """
    result = import_megatron_args(script, hardware="cpu")
    exp = result.experiment
    assert (exp.cluster.nodes, exp.cluster.gpus_per_node, exp.world_size) == (2, 4, 8)
    assert exp.model.num_layers == 8 and exp.model.num_query_groups == 2 and exp.training.bf16
    assert exp.parallel.tensor_model_parallel_size == 2 and exp.parallel.sequence_parallel is False
    assert (exp.training.recompute_granularity, exp.training.recompute_method,
            exp.training.recompute_num_layers) == ("full", "block", 2)
    assert result.ignored == ["--lr-decay-style cosine", "--no-rope-fusion", "--use-checkpoint-args"]
    assert any(line.startswith("--eval-iters 10:") for line in result.no_effect)
    assert "world size 8 = 2 nodes x 4, from the torchrun prefix" in result.warnings
    elastic = import_megatron_args("torchrun --nnodes 1:4 --nproc-per-node=8 pretrain_gpt.py " + BASE, hardware="cpu")
    assert any("no world size given" in w for w in elastic.warnings)   # an elastic node range says nothing


@pytest.mark.parametrize("flag, vp", [
    ("--num-layers-per-virtual-pipeline-stage 1", 2),     # 8 layers / PP4 = 2 per rank, 1 per virtual stage
    ("--num-virtual-stages-per-pipeline-rank 2", 2),
    ("--num-virtual-stages-per-pipeline-rank 1", None),   # Megatron: 1 virtual stage means no interleaving
    ("--pipeline-model-parallel-layout 'Et|(t|)*6tL'", 2),
])
def test_virtual_pipeline_flags(flag, vp):
    exp = import_megatron_args(BASE + "--pipeline-model-parallel-size 4 " + flag, world_size=4,
                               hardware="cpu").experiment
    assert exp.parallel.virtual_pipeline_model_parallel_size == vp


def test_the_micro_batch_group_of_the_interleaved_schedule_imports_and_exports():
    """--microbatch-group-size-per-virtual-pipeline-stage (megatron-core ModelParallelConfig, core_v0.16.1 and
    core_v0.19.0): read into its field, written back only where set (unset, Megatron takes PP)."""
    line = BASE + "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
    imported = import_megatron_args(line + "--microbatch-group-size-per-virtual-pipeline-stage 5",
                                    world_size=4, hardware="cpu")
    assert imported.experiment.parallel.microbatch_group_size_per_vp_stage == 5 and not imported.ignored
    tokens = export_megatron_args(imported.experiment)
    at = tokens.index("--microbatch-group-size-per-virtual-pipeline-stage")
    assert tokens[at + 1] == "5"
    plain = import_megatron_args(line, world_size=4, hardware="cpu").experiment
    assert plain.parallel.microbatch_group_size_per_vp_stage is None
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in export_megatron_args(plain)


def test_two_virtual_pipeline_flags_are_refused():
    with pytest.raises(UserError, match="cannot be combined"):
        import_megatron_args(BASE + "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
                             "--num-layers-per-virtual-pipeline-stage 1", world_size=4, hardware="cpu")


def test_memory_flags_without_a_single_field():
    exp = import_megatron_args(BASE + "--apply-query-key-layer-scaling --enable-cuda-graph --use-precision-aware-"
                               "optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --main-grads-dtype bf16 "
                               "--optimizer-cpu-offload --fp8-param-gather", world_size=1, hardware="cpu").experiment
    t = exp.training
    assert t.attention_softmax_in_fp32 and t.cuda_graph_impl == "local" and t.fp8_param_gather
    assert (t.use_precision_aware_optimizer, t.exp_avg_dtype, t.exp_avg_sq_dtype, t.main_grads_dtype,
            t.main_params_dtype, t.optimizer_cpu_offload) == (True, "bf16", "bf16", "bf16", "fp32", True)


def test_gqa_needs_its_switch_and_fsdp_flags():
    result = import_megatron_args(BASE + "--num-query-groups 2 --use-megatron-fsdp "
                                  "--data-parallel-sharding-strategy optim_grads_params "
                                  "--expert-tensor-parallel-size 1", world_size=8, hardware="cpu")
    assert result.experiment.model.num_query_groups is None
    assert any("--group-query-attention" in w for w in result.warnings)
    assert result.experiment.parallel.use_megatron_fsdp
    assert result.experiment.parallel.data_parallel_sharding_strategy == "optim_grads_params"
    assert result.experiment.parallel.expert_tensor_parallel_size == 1


def test_without_world_size_nothing_is_inferred_silently():
    result = import_megatron_args(BASE + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
                                  hardware="cpu")
    assert result.experiment.world_size == 4
    assert any("no world size given" in w for w in result.warnings)
    explicit = import_megatron_args(BASE + "--world-size 16", hardware="cpu").experiment
    assert (explicit.world_size, explicit.cluster.nodes, explicit.cluster.gpus_per_node) == (16, 2, 8)
    small = import_megatron_args(BASE, world_size=4, gpus_per_node=2, hardware="cpu").experiment
    assert (small.cluster.nodes, small.cluster.gpus_per_node) == (2, 2)
    default_hw = import_megatron_args(BASE, world_size=1)
    assert default_hw.experiment.hardware.name == "h100-sxm-80gb"
    assert any("no hardware given" in w for w in default_hw.warnings)


@pytest.mark.parametrize("args, message", [
    (BASE + "--tensor-model-parallel-size two", "--tensor-model-parallel-size = 'two': expected an integer"),
    (BASE + "--hidden-dropout nan", "--hidden-dropout = 'nan': expected a number"),
    (BASE + "--pipeline-model-parallel-size $PP", "--pipeline-model-parallel-size = '$PP': expected an integer "
                                                   "(a shell variable: give the expanded command line"),
    (BASE + "--bf16 yes", "--bf16 = 'yes': this flag takes no value"),
    (BASE + "--moe-layer-freq '__import__(\"os\")'", "--moe-layer-freq"),
    (BASE + "--micro-batch-size", "--micro-batch-size: expected one value, got nothing"),
    ("--hidden-size 8 --num-attention-heads 2 --seq-length 8", "--num-layers is required"),
    (BASE + "--pipeline-model-parallel-layout 'Etx|L'", "unknown layer letter"),
    (BASE + "--seq-length '1", "cannot split"),
])
def test_bad_values_are_one_line_user_errors(args, message):
    with pytest.raises(UserError, match=None) as info:
        import_megatron_args(args, world_size=8, hardware="cpu")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_world_size_must_be_whole_nodes():
    with pytest.raises(UserError, match="world_size = 12: not a whole number of nodes of 8"):
        import_megatron_args(BASE, world_size=12, hardware="cpu")


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("4", 4), ("([0]*3+[1]*58)", [0] * 3 + [1] * 58), ("[1,0]*2", [1, 0, 1, 0]),
    ("([1]*3+[0]*1)*3", ([1] * 3 + [0]) * 3), ("2*[1]", [1, 1]),
])
def test_layer_pattern_is_evaluated_safely(text, value):
    assert parse_layer_pattern(text) == value


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "[1]*10**9", "[[1]]", "[1]+2", "x", "[1.5]"])
def test_layer_pattern_rejects_anything_else(text):
    with pytest.raises(ValueError):
        parse_layer_pattern(text)


@given(st.lists(st.integers(0, 1), min_size=1, max_size=80) | st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_layer_pattern_formats_back(pattern):
    assert parse_layer_pattern(format_layer_pattern(pattern)) == pattern


def test_pipeline_layout_parse():
    assert [len(s) for s in parse_pipeline_layout("Et|(tt|)*6mL")] == [2] + [2] * 6 + [2]
    assert parse_pipeline_layout("Ettt|(tt|)*2,m|L")[-2:] == [["m"], ["L"]]


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------
def _megatron_resolved(exp: Experiment) -> Experiment:
    """`exp` with the values Megatron resolves (engine.model.megatron.ROUND_TRIP_NORMALIZED) resolved."""
    out = exp.copy()
    m, p = out.model, out.parallel
    m.ffn_hidden_size = exp.model.ffn
    m.max_position_embeddings = exp.model.max_position_embeddings or exp.model.seq_length
    m.seq_length, out.training.seq_length = exp.seq_length, None
    if p.virtual_pipeline_model_parallel_size == 1:
        p.virtual_pipeline_model_parallel_size = None
    if p.tensor_model_parallel_size == 1:
        p.sequence_parallel = False
    if not m.multi_latent_attention:
        for name in MLA_DEFAULTS:
            setattr(m, name, getattr(ModelSpec, name))
    # "auto" has no Megatron flag: it leaves as what it becomes on the planned node's software.
    out.training.transformer_impl = runtime.transformer_impl(exp, calibration.for_planning(exp.hardware))
    if out.training.transformer_impl == "local" and out.training.attention_backend in ("auto", "flash", "fused"):
        out.training.attention_backend = "unfused"   # Megatron's local spec has only its unfused attention
    return out


def _round_trip(exp: Experiment) -> Experiment:
    # the environment export names goes before the script, as in the line it prints
    env = [f"{name}={value}" for name, value in export_environment(exp).items()]
    back = import_megatron_args([*env, "pretrain_gpt.py", *export_megatron_args(exp)], world_size=exp.world_size,
                                gpus_per_node=exp.cluster.gpus_per_node, hardware=exp.hardware).experiment
    # What a command line does not carry: names, telemetry, our iteration-marker setting.
    back.name, back.description, back.model.name, back.model.description = \
        exp.name, exp.description, exp.model.name, exp.model.description
    back.telemetry = dataclasses.replace(exp.telemetry)
    back.training.warmup_iters = exp.training.warmup_iters
    return back


def _shipped_experiments() -> list[str]:
    return list(catalog.entries("experiments"))


@pytest.mark.parametrize("name", _shipped_experiments())
def test_every_shipped_experiment_round_trips(name):
    exp = Experiment.load(name)
    assert _round_trip(exp) == _megatron_resolved(exp)


def test_a_command_line_is_named_after_the_model_preset_it_describes():
    """Megatron's own command for an experiment's layout names its model as the experiment does (so
    `campaign compare` finds the model both ran); a network no preset has stays "megatron"."""
    for name in ("tiny-local", "ppt-h100-llama3-70b-1-01000", "ppt-h100-mixtral-8x22b-1-00000"):
        exp = Experiment.load(name)
        back = import_megatron_args(export_megatron_args(exp), world_size=exp.world_size,
                                    gpus_per_node=exp.cluster.gpus_per_node, hardware=exp.hardware)
        assert back.experiment.model.name == exp.model.name, name
        assert back.experiment.model.description == ModelSpec.load(exp.model.name).description
        assert f"model: the flags give the architecture of model preset {exp.model.name}" in back.warnings
    exp = Experiment.load("tiny-local")
    exp.model.num_layers += 1   # a layer more: another network
    back = import_megatron_args(export_megatron_args(exp), world_size=1, gpus_per_node=1, hardware="cpu")
    assert back.experiment.model.name == "megatron" and not any(w.startswith("model:") for w in back.warnings)


def test_a_model_preset_saved_since_the_last_import_is_recognised(charllm_dirs):
    """The presets' architectures are read once per set of files: one saved afterwards is read too."""
    exp = Experiment.load("tiny-local")
    line = export_megatron_args(exp)
    assert import_megatron_args(line, world_size=2, gpus_per_node=2, hardware="cpu").experiment.model.name == \
        "tiny-dense"
    folder = charllm_dirs["config"] / "models"
    folder.mkdir(parents=True)
    (folder / "a-tiny-copy.toml").write_text(catalog.find("models", "tiny-dense").read_text())
    assert import_megatron_args(line, world_size=2, gpus_per_node=2, hardware="cpu").experiment.model.name == \
        "a-tiny-copy"     # (the first in name order with that architecture)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_imported_cases_are_a_fixed_point(case):
    first = import_megatron_args(case["megatron_args"], world_size=8, hardware="h100-sxm-80gb").experiment
    tokens = export_megatron_args(first)
    again = import_megatron_args(tokens, world_size=8, hardware="h100-sxm-80gb")
    assert again.experiment == first and again.ignored == []
    # And through the printed form (shell quoting, continuations).
    assert import_megatron_args(format_megatron_args(tokens), world_size=8,
                                hardware="h100-sxm-80gb").experiment == first


def experiments() -> st.SearchStrategy[Experiment]:
    """Random experiments over the fields a Megatron command line carries (valid or not)."""
    small = st.integers(1, 8)

    @st.composite
    def build(draw):
        exp = Experiment(name="fuzz")
        m, p, t = exp.model, exp.parallel, exp.training
        m.num_layers, m.hidden_size, m.num_attention_heads = (
            draw(small),
            draw(st.sampled_from([64, 128, 512])),
            draw(small),
        )
        m.ffn_hidden_size = draw(st.none() | st.integers(1, 4096))
        m.num_query_groups = draw(st.none() | small)
        m.kv_channels = draw(st.none() | small)
        m.seq_length = draw(st.integers(1, 4096))
        m.max_position_embeddings = draw(st.none() | st.integers(1, 8192))
        m.vocab_size = draw(st.integers(1, 200_000))
        m.make_vocab_size_divisible_by = draw(st.sampled_from([1, 64, 128]))
        m.swiglu, m.squared_relu, m.untie_embeddings_and_output_weights = (
            draw(st.booleans()),
            draw(st.booleans()),
            draw(st.booleans()),
        )
        m.add_bias_linear, m.add_qkv_bias, m.qk_layernorm = (
            draw(st.booleans()),
            draw(st.booleans()),
            draw(st.booleans()),
        )
        m.position_embedding_type = draw(st.sampled_from(["learned_absolute", "rope", "none"]))
        m.normalization = draw(st.sampled_from(["LayerNorm", "RMSNorm"]))
        m.hidden_dropout = draw(st.sampled_from([0.0, 0.1, 0.25]))
        m.attention_dropout = draw(st.floats(0, 1, allow_nan=False))
        m.num_moe_experts = draw(st.none() | small)
        m.moe_router_topk = draw(small)
        m.moe_ffn_hidden_size = draw(st.none() | small)
        m.moe_shared_expert_intermediate_size = draw(st.none() | small)
        m.moe_layer_freq = draw(st.integers(1, 4) | st.lists(st.integers(0, 1), min_size=1, max_size=8))
        m.multi_latent_attention = draw(st.booleans())
        m.q_lora_rank = draw(st.none() | small)
        m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = (draw(small) for _ in range(4))
        m.mtp_num_layers = draw(st.none() | st.integers(1, 2))
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = draw(small), draw(small)
        p.virtual_pipeline_model_parallel_size = draw(st.none() | small)
        p.microbatch_group_size_per_vp_stage = draw(st.none() | small)
        p.context_parallel_size, p.expert_model_parallel_size = draw(small), draw(small)
        p.expert_tensor_parallel_size = draw(st.none() | small)
        p.sequence_parallel, p.use_distributed_optimizer = draw(st.booleans()), draw(st.booleans())
        p.num_distributed_optimizer_instances = draw(st.integers(1, 2))
        p.use_megatron_fsdp = draw(st.booleans())
        p.data_parallel_sharding_strategy = draw(st.sampled_from(["no_shard", "optim", "optim_grads_params"]))
        p.decoder_first_pipeline_num_layers = draw(st.none() | small)
        p.account_for_loss_in_pipeline_split = draw(st.booleans())
        t.micro_batch_size, t.global_batch_size = draw(small), draw(st.integers(1, 512))
        t.seq_length = draw(st.none() | st.integers(1, 4096))
        t.bf16, t.fp16 = draw(st.booleans()), draw(st.booleans())
        t.fp8 = draw(st.sampled_from([None, "e4m3", "hybrid"]))
        t.fp8_recipe = draw(st.sampled_from(["delayed", "tensorwise", "blockwise"]))
        t.recompute_granularity = draw(st.sampled_from([None, "full", "selective"]))
        t.recompute_method = draw(st.sampled_from([None, "uniform", "block"]))
        t.recompute_num_layers = draw(st.none() | small)
        t.recompute_modules = draw(st.none() | st.lists(st.sampled_from(["core_attn", "mlp", "moe_act"]), max_size=3))
        t.overlap_grad_reduce, t.overlap_param_gather, t.tp_comm_overlap = (draw(st.booleans()) for _ in range(3))
        t.attention_backend = draw(st.sampled_from(["auto", "flash", "unfused"]))
        t.transformer_impl = draw(st.sampled_from(["transformer_engine", "local"]))
        t.moe_expert_capacity_factor = draw(st.none() | st.sampled_from([1.0, 1.5]))
        t.moe_aux_loss_coeff = draw(st.sampled_from([0.0, 0.01]))
        t.lr = draw(st.floats(1e-6, 1.0))
        t.fp8_param_gather, t.attention_softmax_in_fp32 = draw(st.booleans()), draw(st.booleans())
        t.cuda_graph_impl = draw(st.sampled_from(["none", "local", "transformer_engine"]))
        t.use_precision_aware_optimizer, t.optimizer_cpu_offload = draw(st.booleans()), draw(st.booleans())
        t.main_grads_dtype = draw(st.sampled_from(["fp32", "bf16"]))
        t.exp_avg_dtype = draw(st.sampled_from(["fp32", "bf16", "fp8"]))
        t.data_path = draw(st.none() | st.sampled_from(["/data/x_text_document", "0.5 /a 0.5 /b"]))
        exp.cluster.gpus_per_node = draw(st.sampled_from([1, 2, 8]))
        exp.cluster.nodes = draw(st.integers(1, 4))
        exp.hardware = Hardware.load(draw(st.sampled_from(["cpu", "h100-sxm-80gb"])))
        return exp

    return build()


@given(experiments())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_experiments_round_trip(exp):
    back = _round_trip(exp)
    assert back == _megatron_resolved(exp)
    # Only the documented fields change on the way (engine.model.megatron.ROUND_TRIP_NORMALIZED).
    changed = {f"{section}.{f.name}" for section in ("model", "parallel", "training")
               for f in dataclasses.fields(getattr(exp, section))
               if getattr(getattr(exp, section), f.name) != getattr(getattr(back, section), f.name)}
    assert changed <= set(ROUND_TRIP_NORMALIZED)


FSDP_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
            "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
            "--vocab-size 128256 --swiglu --untie-embeddings-and-output-weights --normalization RMSNorm "
            "--position-embedding-type rope --disable-bias-linear --micro-batch-size 1 --global-batch-size 128 "
            "--bf16 --use-megatron-fsdp --ckpt-format fsdp_dtensor --recompute-granularity full "
            "--recompute-method uniform --recompute-num-layers 1")


@pytest.mark.parametrize("version, strategy", [("0.16.1", "no_shard"), ("0.17.1", "no_shard"),
                                               ("0.18.0", "optim_grads_params"), ("0.19.0", "optim_grads_params")])
def test_a_default_that_changed_between_releases_follows_the_users_release(version, strategy):
    """megatron-core 0.18 made Megatron-FSDP shard optimizer, gradients and parameters by default."""
    imported = import_megatron_args(FSDP_70B, world_size=32, hardware="h200-141gb", version=version)
    assert imported.experiment.parallel.data_parallel_sharding_strategy == strategy
    assert any(f"the default of megatron-core {version} (given)" in w for w in imported.warnings)


def test_the_installed_release_is_the_default():
    from charllm.engine.model.megatron import installed_version, megatron_version

    release, source = megatron_version()
    assert (release, source) == ((installed_version(), "installed") if installed_version()
                                 else ("0.19.0", "the newest supported; megatron-core is not installed here"))
    with pytest.raises(UserError, match="megatron_version = 'latest': expected a release"):
        import_megatron_args(FSDP_70B, world_size=32, version="latest")


def test_fsdp_70b_on_32_h200s_plans_sharded_on_current_megatron():
    """The issue's case: 76 GiB planned as no_shard; about 40 GiB measured on megatron-core 0.19."""
    from charllm.engine.model.memory import estimate

    old = estimate(import_megatron_args(FSDP_70B, world_size=32, hardware="h200-141gb", version="0.16.1").experiment)
    new = estimate(import_megatron_args(FSDP_70B, world_size=32, hardware="h200-141gb", version="0.19.0").experiment)
    assert new.peak_bytes < 0.6 * old.peak_bytes


def test_export_always_says_the_sharding_strategy_of_megatron_fsdp():
    exp = Experiment.load("tiny-local").apply(["use_megatron_fsdp=true", "data_parallel_sharding_strategy=no_shard"])
    flags = export_megatron_args(exp)
    assert flags[flags.index("--data-parallel-sharding-strategy") + 1] == "no_shard"
    assert "--data-parallel-sharding-strategy" not in export_megatron_args(Experiment.load("tiny-local"))


def test_activation_offloading_flags_import():
    tiny = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 16 --bf16 ")
    layer = import_megatron_args(tiny + "--cpu-offloading-num-layers 2", world_size=8).experiment.training
    assert layer.cpu_offloading_num_layers == 2
    fine = import_megatron_args(tiny + "--fine-grained-activation-offloading --offload-modules core_attn attn_proj",
                                world_size=8)
    t = fine.experiment.training
    assert t.fine_grained_activation_offloading and t.offload_modules == ["core_attn", "attn_proj"]
    assert not fine.ignored


def test_a_megatron_lm_checkout_on_the_path_is_the_release_that_counts(tmp_path):
    """pretrain_gpt.py runs from a Megatron-LM checkout on PYTHONPATH, which shadows the installed
    megatron-core: its package_info.py says the release (read, not imported: no torch)."""
    import os
    import subprocess
    import sys

    core = tmp_path / "Megatron-LM" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\nPRE_RELEASE = ''\n")
    code = ("import sys; from charllm.engine.model.megatron import installed_version; "
            "print(installed_version(), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "Megatron-LM")})
    assert done.stdout.split() == ["0.19.1", "False"], done.stderr


@pytest.mark.parametrize("sets, env", [
    (["tensor_model_parallel_size=2"], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    (["tensor_model_parallel_size=2", "use_torch_fsdp2=true"], {}),        # FSDP refuses a single connection
    (["fine_grained_activation_offloading=true", "offload_modules=['core_attn']"], {"NVTE_CPU_OFFLOAD_V1": "1"}),
    (["deterministic_mode=true"], {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
])
def test_the_exported_environment_is_what_megatron_asks_for(sets, env):
    exp = Experiment.load("tiny-local").apply(["expandable_segments=false", *sets])
    assert export_environment(exp) == env


# --------------------------------------------------------------------------------------------
# Exports that start and imports of whole launch lines (tests/engine/model/test_megatron_lm.py checks the same
# rules against Megatron-LM's own code where a mirror is at hand)
# --------------------------------------------------------------------------------------------
def _flag(tokens: list[str], flag: str) -> str | None:
    return tokens[tokens.index(flag) + 1] if flag in tokens else None


@pytest.mark.parametrize("version, vocab_flag", [("0.16.1", 50256), ("0.17.1", 50256), ("0.18.0", 50257),
                                                 ("0.19.0", 50257)])
def test_export_names_a_tokenizer_whose_vocabulary_is_the_models(version, vocab_flag):
    """pretrain_gpt.py builds a tokenizer first (none: NotImplementedError in 0.16.1, ValueError in 0.19).
    NullTokenizer counts its end-of-document token on top of --vocab-size up to 0.17.1 (null_tokenizer.py)."""
    exp = Experiment.load("ppt-h100-gpt3-175b-1-00000")
    tokens = export_megatron_args(exp, version)
    assert _flag(tokens, "--tokenizer-type") == "NullTokenizer"
    assert int(_flag(tokens, "--vocab-size")) == vocab_flag == exp.model.vocab_size - (version < "0.18")
    back = import_megatron_args(tokens, world_size=exp.world_size, hardware=exp.hardware, version=version)
    assert back.experiment.model.vocab_size == exp.model.vocab_size


def test_export_writes_what_megatron_asserts_for_fsdp():
    """validate_args: Megatron-FSDP only with --ckpt-format fsdp_dtensor; torch FSDP2 not with gradient
    accumulation fusion (on by default) and only with untied embeddings (charllm's validate says so)."""
    from charllm.engine.model.validate import validate as problems

    tiny = Experiment.load("tiny-local")
    mfsdp = export_megatron_args(tiny.copy().apply(["use_megatron_fsdp=true"]))
    assert _flag(mfsdp, "--ckpt-format") == "fsdp_dtensor"
    fsdp2 = tiny.copy().apply(["use_torch_fsdp2=true", "model.untie_embeddings_and_output_weights=true"])
    assert "--no-gradient-accumulation-fusion" in export_megatron_args(fsdp2)
    assert "--ckpt-format" not in export_megatron_args(fsdp2)            # torch_dist, the default, is allowed
    tied = [str(p) for p in problems(tiny.copy().apply(["use_torch_fsdp2=true"]))]
    assert any(p.startswith("untie_embeddings_and_output_weights = False: use_torch_fsdp2 needs untied") for p in tied)


@pytest.mark.parametrize("backend", ["auto", "unfused", "local"])
def test_export_never_writes_local_attention(backend):
    """`--attention-backend local` makes validate_args demand `--spec local`, which pretrain_gpt.py cannot
    load; Megatron's local layers have one attention whatever the backend, so none is written."""
    exp = Experiment.load("tiny-local").apply([f"attention_backend={backend}", "transformer_impl=local"])
    tokens = export_megatron_args(exp)
    assert _flag(tokens, "--transformer-impl") == "local" and "--attention-backend" not in tokens
    assert "--spec" not in tokens


def test_the_launch_script_runs_and_imports_back(tmp_path):
    import subprocess

    from charllm.engine.model.megatron import export_script

    exp = Experiment.load("ppt-h100-llama3-70b-1-01000")
    script = export_script(exp, "0.16.1")
    path = tmp_path / "train.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in script       # TP 8
    # A dry run with pretrain_gpt.py replaced by a script that prints its arguments and environment.
    (tmp_path / "pretrain_gpt.py").write_text("import os, sys; print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'], "
                                              "os.environ['NODE_RANK'], len(sys.argv))\n")
    fake_torchrun = tmp_path / "bin" / "torchrun"
    fake_torchrun.parent.mkdir()
    fake_torchrun.write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift 2; done\n'
                             'exec python3 "$@"\n')
    fake_torchrun.chmod(0o755)
    import os

    done = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake_torchrun.parent}:{os.environ['PATH']}",
                               "MEGATRON_LM": str(tmp_path), "NODE_RANK": "3", "MASTER_ADDR": "n0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "3", str(len(export_megatron_args(exp, "0.16.1")) + 1)]
    # The script is a launch line import reads whole: world size from torchrun, environment, flags.
    back = import_megatron_args(script, hardware=exp.hardware, version="0.16.1")
    assert back.experiment.world_size == 64 and back.experiment.parallel == exp.parallel
    assert back.experiment.training.expandable_segments and not back.ignored


def test_export_cli_writes_an_executable_script(tmp_path, capsys):
    from infra_cli import run

    out = tmp_path / "train.sh"
    code, _, err = run(capsys, "export", "megatron", "tiny-tp2", "--script", "--megatron-version", "0.19.0",
                       "--out", str(out))
    assert code == 0 and out.stat().st_mode & 0o111
    assert "flags for megatron-core 0.19.0 (given)" in out.read_text()
    assert "--vocab-size 1024" in out.read_text()


LAUNCH = """
# from a launch script
export NVTE_FLASH_ATTN=0
NCCL_DEBUG=WARN PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NVTE_FUSED_ATTN=0 \\
torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK pretrain_gpt.py \\
    --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 \\
    --micro-batch-size 2 --global-batch-size 64 --train-samples 6400 --bf16 \\
    --tokenizer-type NullTokenizer --vocab-size 32000 --apply-layernorm-1p --ckpt-format torch_dist \\
    --num-experts 8 --moe-token-dispatcher-type flex --moe-enable-deepep --moe-router-dtype fp32
"""


def test_a_whole_launch_line_imports():
    imported = import_megatron_args(LAUNCH, hardware="h100-sxm-80gb", version="0.19.0")
    exp = imported.experiment
    assert (exp.cluster.nodes, exp.cluster.gpus_per_node) == (2, 8)      # from torchrun, no --world-size
    assert exp.training.train_iters == 100                                # 6400 samples / 64 per batch
    assert exp.training.expandable_segments
    assert exp.training.attention_backend == "unfused"                    # NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=0
    assert exp.model.vocab_size == 32000                                  # 0.19's NullTokenizer: --vocab-size
    assert import_megatron_args(LAUNCH, hardware="h100-sxm-80gb", version="0.16.1").experiment.model.vocab_size == 32001
    t = exp.training
    assert (t.moe_token_dispatcher_type, t.moe_flex_dispatcher_backend, t.moe_router_dtype) == (
        "flex",
        "deepep",
        "fp32",
    )
    assert not imported.ignored
    said = " | ".join(imported.no_effect)
    assert "--apply-layernorm-1p: LayerNorm keeps its weight as w - 1" in said and "NCCL_DEBUG=WARN" in said
    assert "--ckpt-format torch_dist" in said


@pytest.mark.parametrize(
    "line, message",
    [
        (
            LAUNCH.replace("--train-samples 6400", "--train-samples 6400 --train-iters 5"),
            "--train-iters and --train-samples cannot be combined",
        ),
        (
            LAUNCH.replace("--train-samples 6400", "--train-samples 10"),
            "--train-samples = 10: fewer than one global batch",
        ),
        (
            LAUNCH.replace("--moe-token-dispatcher-type flex", ""),
            "--moe-enable-deepep: needs --moe-token-dispatcher-type flex",
        ),
    ],
)
def test_launch_lines_megatron_would_refuse_say_why(line, message):
    with pytest.raises(UserError, match=message):
        import_megatron_args(line, hardware="h100-sxm-80gb")


MODEL_CONFIG = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
  NVTE_ALLOW_NONDETERMINISTIC_ALGO: 0
TEST_TYPE: regular
MODEL_ARGS:
  --num-layers: 12
  --hidden-size: 512
  --num-attention-heads: 8
  --seq-length: 1024
  --max-position-embeddings: 1024
  --tensor-model-parallel-size: 2
  --sequence-parallel: true
  --use-distributed-optimizer: true
  --untie-embeddings-and-output-weights: false
  --micro-batch-size: 4
  --global-batch-size: 32
  --recompute-granularity: selective
  --recompute-modules: "[core_attn mlp]"
  --moe-layer-freq: ([0]*1+[1]*11)
  --step-batch-size-schedule: "0:384 200B:768"
  --min-lr: 1.0e-5
  --data-path: ${DATA_PATH}/text_document
  --log-interval: 1
  --bf16: true
"""


def test_a_functional_test_model_config_imports():
    """Megatron-LM's functional tests keep a launch as model_config.yaml (ENV_VARS, MODEL_ARGS), read by
    tests/functional_tests/shell_test_utils/_run_training.sh: `true` is the bare flag, `[a b]` two
    words, any other value one word as written."""
    words = model_config_tokens(MODEL_CONFIG)
    assert words[words.index("--recompute-modules") + 1:][:2] == ["core_attn", "mlp"]
    assert words[words.index("--step-batch-size-schedule") + 1] == "0:384 200B:768"
    assert words[words.index("--min-lr") + 1] == "1.0e-5"                # as written, not 1e-05
    assert words[words.index("--moe-layer-freq") + 1] == "([0]*1+[1]*11)"
    imported = import_megatron_args(MODEL_CONFIG, world_size=8, hardware="h100-sxm-80gb")
    exp = imported.experiment
    p, t = exp.parallel, exp.training
    assert (p.tensor_model_parallel_size, p.sequence_parallel, p.use_distributed_optimizer) == (2, True, True)
    assert not exp.model.untie_embeddings_and_output_weights             # `false`: the flag is left out
    assert t.recompute_modules == ["core_attn", "mlp"] and t.bf16
    assert t.data_path == "${DATA_PATH}/text_document"
    assert imported.ignored == ["--step-batch-size-schedule 0:384 200B:768", "--min-lr 1.0e-5", "--log-interval 1"]
    assert any(n.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1") for n in imported.no_effect)
    with pytest.raises(UserError, match="model_config.yaml: ENV_VARS must be a mapping"):
        import_megatron_args("ENV_VARS: [1]\nMODEL_ARGS: {--num-layers: 2}\n", world_size=1)


def test_a_launch_script_with_a_model_args_array_is_read_as_shell():
    """NVIDIA's example scripts keep their flags in a bash array named MODEL_ARGS: that is a shell
    script, not a model_config.yaml, so its words are read (and its variables named), never parsed as YAML."""
    script = ("PRETRAIN_SCRIPT_PATH=pretrain_gpt.py\nNUM_LAYERS=2\nMASTER_ADDR=${MASTER_ADDR:-localhost}\n"
              "MODEL_ARGS=(\n    --num-layers $NUM_LAYERS\n)\n[ -f $PRETRAIN_SCRIPT_PATH ] || echo 'Error: not found'\n"
              "torchrun $PRETRAIN_SCRIPT_PATH ${MODEL_ARGS[@]}\n")
    assert model_config_tokens(script) is None
    with pytest.raises(UserError) as refused:
        import_megatron_args(script, world_size=1)
    assert "$NUM_LAYERS" in str(refused.value) and "YAML" not in str(refused.value)


def test_plan_takes_the_world_size_from_the_launch_line(capsys):
    from infra_cli import one_error_line, run

    code, out, _ = run(capsys, "plan", "--megatron-args", LAUNCH, "--hardware", "h100-sxm-80gb", "--json")
    warnings = json.loads(out)["warnings"]
    assert "world size 16 = 2 nodes x 8, from the torchrun prefix" in warnings
    assert any(w.startswith("no memory effect: --apply-layernorm-1p") for w in warnings)
    bare = LAUNCH.split("pretrain_gpt.py", 1)[1]
    code, _, err = run(capsys, "plan", "--megatron-args", bare, "--hardware", "h100-sxm-80gb")
    assert code == 2 and one_error_line(err) == (
        "charllm-tui: error: plan --megatron-args: --world-size is required unless the line starts with "
        "torchrun --nnodes N --nproc-per-node G")


@pytest.mark.parametrize("experiment, base", [("ppt-h100-llama3-70b-1-01000", 500000),
                                              ("ppt-h200-mixtral-8x7b-1-01000", 1000000)])
def test_export_gives_the_models_rotary_base(experiment, base):
    """Llama 3's RoPE theta is 500000 and Mixtral's 1e6 (their config.json rope_theta); Megatron's
    --rotary-base defaults to 10000, so the flag must be written, and it imports back."""
    args = export_megatron_args(Experiment.load(experiment))
    assert args[args.index("--rotary-base") + 1] == str(base)
    assert import_megatron_args(args, world_size=64, hardware="h100-sxm-80gb").experiment.model.rotary_base == base


def test_the_default_rotary_base_is_megatrons_and_not_written():
    exp = Experiment.load("tiny-local")
    exp.model.position_embedding_type = "rope"
    assert exp.model.rotary_base == 10000 and "--rotary-base" not in export_megatron_args(exp)
    assert import_megatron_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                 "--seq-length", "32", "--max-position-embeddings", "32"],
                                world_size=1, hardware="cpu").experiment.model.rotary_base == 10000


def test_the_model_section_follows_the_fields_metadata():
    """Megatron's defaults are metadata (`megatron_default`), a flag that means something only with another
    setting is written only then (`only_with`), and the sizes a reader wants are always said (`said`)."""
    from charllm.engine.model.experiment import Training, megatron_default

    assert megatron_default(Training, "bf16") is False and megatron_default(ModelSpec, "kv_lora_rank") == 32
    exp = Experiment.load("tiny-local").apply(["position_embedding_type=learned_absolute", "rotary_base=500000",
                                                "multi_latent_attention=false", "hidden_dropout=0.1"])
    flags = export_megatron_args(exp)
    assert "--rotary-base" not in flags and "--kv-lora-rank" not in flags and "--hidden-dropout" not in flags
    assert flags[:2] == ["--num-layers", str(exp.model.num_layers)]
    flags = export_megatron_args(exp.apply(["position_embedding_type=rope", "multi_latent_attention=true"]))
    assert flags[flags.index("--rotary-base") + 1] == "500000"
    assert flags[flags.index("--kv-lora-rank") + 1] == str(exp.model.kv_lora_rank)   # said with MLA


def test_a_flag_of_many_numbers_with_a_word_among_them_is_one_user_error():
    """`--rampup-batch-size 16 ([0]*2) 1000`: the value that is not a number is named, not a traceback."""
    with pytest.raises(UserError, match=r"--rampup-batch-size = '\(\[0\]\*2\)': expected an integer"):
        import_megatron_args("--num-layers 2 --rampup-batch-size 16 ([0]*2) 1000", world_size=8)


def test_a_batch_ramp_up_is_read_counted_as_megatron_counts_it_and_written_back():
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 100 --micro-batch-size 1 --global-batch-size 64 --rampup-batch-size 16 16 1000 "
            "--train-samples 5000")
    exp = import_megatron_args(line, world_size=8).experiment
    assert exp.training.rampup_batch_size == [16, 16, 1000]
    # update_train_iters: a third of the 1000 samples per increment; 21 steps of 16 pass 333, 11 of 32 pass 667,
    # 7 of 48 pass 1000 (1024 consumed), then (5000 - 1024) // 64 steps of the global batch
    assert exp.batch_ramp() == [(16, 21), (32, 11), (48, 7)]
    assert exp.training.train_iters == 39 + (5000 - 1024) // 64
    words = export_megatron_args(exp)
    assert "--train-iters" not in words and words[words.index("--train-samples") + 1] == "4992"
    assert import_megatron_args(words, world_size=8).experiment.training == exp.training
