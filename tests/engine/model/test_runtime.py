"""engine.model.runtime: what an experiment becomes on a node's software, what cannot run there, and
the Megatron configs the workload builds from it (checked here against megatron-core itself).

The stacks below stand for nodes this machine is not: an H100 with and without Transformer
Engine. Nothing here needs a GPU: megatron-core's config classes validate on any machine.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest

from charllm.engine.model import calibration, catalog, runtime
from charllm.engine.model.experiment import Experiment, Hardware, Training
from charllm.engine.model.runtime import Stack
from charllm.engine.model.validate import validate
from charllm.engine.workload import model_builder, train
from charllm.probes.store import rundir

CPU = Stack(cuda=False, source="test: a CPU node")
GPU = Stack(cuda=True, capability=(9, 0), source="test: an H100 without TE")
GPU_TE = Stack(cuda=True, capability=(9, 0), extensions=frozenset({"transformer_engine"}),
               source="test: an H100 with TE")


def exp(preset: str = "tiny-local", *assignments: str):
    return Experiment.load(preset).apply(list(assignments))


# --------------------------------------------------------------------------------------------
# What runs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stack, assignments, transformer, attention", [
    (GPU_TE, [], "transformer_engine", "te-auto"),
    (GPU, [], "local", "sdpa"),
    (CPU, [], "local", "sdpa"),
    (GPU_TE, ["attention_backend=flash"], "transformer_engine", "te-flash"),
    (GPU_TE, ["attention_backend=local"], "local", "megatron-unfused"),      # Megatron: --spec local
    (GPU_TE, ["transformer_impl=local"], "local", "sdpa"),
    (GPU, ["attention_backend=unfused"], "local", "megatron-unfused"),
    (GPU, ["attention_backend=flash"], "local", "sdpa-flash"),
    (GPU, ["attention_backend=fused"], "local", "sdpa-fused"),
], ids=["te", "gpu-no-te", "cpu", "te-flash", "te-local-attention", "local-on-te", "unfused", "sdpa-flash",
        "sdpa-fused"])
def test_auto_is_transformer_engine_where_it_imports_else_local_layers_with_sdpa(stack, assignments, transformer,
                                                                                  attention):
    impl = runtime.resolve(exp("tiny-local", *assignments), stack)
    assert (impl.transformer, impl.attention) == (transformer, attention)
    assert impl.unfused_attention == (attention == "megatron-unfused")


def test_sdpa_kernels_follow_the_attention_backend():
    kernels = {backend: runtime.resolve(exp("tiny-local", f"attention_backend={backend}"), GPU).sdpa_kernels
               for backend in ("auto", "flash", "fused")}
    assert kernels == {"auto": None, "flash": ("FLASH_ATTENTION",),
                       "fused": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}


@pytest.mark.parametrize("assignments, stack, fused, not_fused", [
    (["swiglu=true"], GPU, {"bias_activation_fusion", "bias_dropout_fusion"}, {"apply_rope_fusion"}),
    ([], GPU, {"bias_activation_fusion"}, set()),                                       # GeLU with bias
    (["add_bias_linear=false"], GPU, set(), {"bias_activation_fusion"}),               # GeLU without bias
    (["squared_relu=true"], GPU, set(), {"bias_activation_fusion"}),                   # not a fused activation
    (["position_embedding_type=rope"], GPU_TE, {"apply_rope_fusion"}, {"gradient_accumulation_fusion"}),
    (["position_embedding_type=rope"], GPU, set(), {"apply_rope_fusion", "gradient_accumulation_fusion"}),
    ([], dataclasses.replace(GPU, extensions=frozenset({"fused_weight_gradient_mlp_cuda"})),
     {"gradient_accumulation_fusion"}, set()),
    (["cross_entropy_loss_fusion=true"], GPU, {"cross_entropy_loss_fusion"}, set()),
    (["swiglu=true", "cross_entropy_loss_fusion=true"], CPU, set(),
     {"bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion"}),
], ids=["swiglu", "gelu-bias", "gelu-no-bias", "squared-relu", "rope-te", "rope-no-te", "apex-grad-accum", "ce",
        "cpu"])
def test_fusions_are_megatrons_defaults_where_they_can_run(assignments, stack, fused, not_fused):
    """Megatron-LM turns on the bias-activation, bias-dropout, RoPE, softmax and gradient-
    accumulation fusions by default; the pure-PyTorch ones need no Transformer Engine."""
    got = set(runtime.resolve(exp("tiny-local", *assignments), stack).fusions)
    assert fused <= got and not (not_fused & got)


@pytest.mark.train
def test_gpu_configs_of_every_shipped_experiment_are_accepted_by_megatron_core():
    """TransformerConfig, OptimizerConfig and DistributedDataParallelConfig as the workload builds
    them for an H100 without TE, for every shipped experiment (TE-only features switched off, as
    such a node needs): megatron-core raises where it rejects a combination (a fused squared ReLU,
    GeLU fusion without bias, ...)."""
    checked = 0
    for name in catalog.entries("experiments"):
        e = exp(name, "sequence_parallel=false", "tp_comm_overlap=false", "fp8_param_gather=false", "fp8=none",
                "moe_grouped_gemm=false", "moe_token_dispatcher_type=alltoall", "context_parallel_size=1")
        if (e.model.multi_latent_attention or e.model.mtp_num_layers or e.parallel.use_megatron_fsdp
                or e.parallel.use_torch_fsdp2):
            continue   # the workload does not build these yet (runtime.problems says so)
        if validate(e):
            continue   # CP 1 can leave a layout that no longer divides
        assert runtime.problems(e, GPU) == [], name
        impl = runtime.resolve(e, GPU)
        # as the class the workload builds with this megatron-core (HybridModel from 0.19)
        builder = model_builder.choose(e)
        config = train.transformer_config(e, impl, builder)
        if builder.hybrid:   # megatron-core's own reading of the pattern: the config's layers, every chunk
            from megatron.core.models.hybrid import hybrid_layer_allocation as allocation

            pattern = model_builder.hybrid_pattern(e)
            assert allocation.get_hybrid_total_layer_count(pattern) == config.num_layers, name
            assert allocation.get_hybrid_total_pipeline_segment_count(pattern) == \
                e.parallel.pipeline_model_parallel_size * e.virtual_stages, name
        assert config.bias_activation_fusion == ("bias_activation_fusion" in impl.fusions)
        train.optimizer_config(e)
        train.ddp_config(e, e.data_parallel_size)
        checked += 1
    assert checked >= 40


@pytest.mark.train
def test_squared_relu_is_megatrons_own_activation_not_a_lambda():
    from megatron.core.activations import squared_relu

    e = exp("tiny-local", "squared_relu=true")
    config = train.transformer_config(e, runtime.resolve(e, GPU), model_builder.choose(e))
    assert config.activation_func is squared_relu and not config.bias_activation_fusion


@pytest.mark.train
@pytest.mark.parametrize("vp, overlap", [(None, False), (2, True)])
def test_the_interleaved_schedule_overlaps_p2p_and_never_batches_it(vp, overlap):
    """Megatron-LM: --overlap-p2p-communication is on, and batch_p2p_comm = not overlap_p2p_comm;
    batched sends between the same two ranks (PP 2 with VP) would pair activations with gradients.
    Megatron-LM frees sent outputs (deallocate_pipeline_outputs); gloo cannot (see train.py)."""
    e = exp("tiny-pp2", *([f"virtual_pipeline_model_parallel_size={vp}"] if vp else []))
    settings = train.transformer_settings(e, runtime.resolve(e, GPU))
    assert (settings["overlap_p2p_comm"], settings["batch_p2p_comm"]) == (overlap, not overlap)
    assert settings["deallocate_pipeline_outputs"] is True
    assert train.transformer_settings(e, runtime.resolve(e, CPU))["deallocate_pipeline_outputs"] is False


# --------------------------------------------------------------------------------------------
# Every Training field is used or refused
# --------------------------------------------------------------------------------------------
# field: (assignments that make the field matter, the change to it). Compared on the H100 with TE.
ALTERNATIVES = {
    "bf16": ([], ["bf16=true"]),
    "fp16": ([], ["fp16=true"]),
    "loss_scale": (["fp16=true"], ["loss_scale=64.0"]),
    "initial_loss_scale": (["fp16=true"], ["initial_loss_scale=256.0"]),
    "fp8": (["bf16=true", "hardware.fp8=true"], ["fp8=e4m3"]),
    "fp8_recipe": (["bf16=true", "hardware.fp8=true", "fp8=e4m3"], ["fp8_recipe=tensorwise"]),
    "recompute_granularity": ([], ["recompute_granularity=selective"]),
    "recompute_method": (["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=1"],
                         ["recompute_method=block"]),
    "recompute_num_layers": (["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=1"],
                             ["recompute_num_layers=2"]),
    "recompute_modules": (["recompute_granularity=selective"], ["recompute_modules=['mlp']"]),
    "overlap_grad_reduce": ([], ["overlap_grad_reduce=true"]),
    "overlap_param_gather": (["overlap_grad_reduce=true", "use_distributed_optimizer=true"],
                             ["overlap_param_gather=true"]),
    "tp_comm_overlap": (["tensor_model_parallel_size=2", "sequence_parallel=true"], ["tp_comm_overlap=true"]),
    "attention_backend": ([], ["attention_backend=unfused"]),
    "transformer_impl": ([], ["transformer_impl=local"]),
    "grad_reduce_in_bf16": (["bf16=true"], ["grad_reduce_in_bf16=true"]),
    "fp8_param_gather": (["bf16=true", "hardware.fp8=true", "fp8=e4m3", "use_distributed_optimizer=true"],
                         ["fp8_param_gather=true"]),
    "attention_softmax_in_fp32": ([], ["attention_softmax_in_fp32=true"]),
    "cuda_graph_impl": ([], ["cuda_graph_impl=local"]),
    "cuda_graph_scope": ([], ["cuda_graph_scope=['attn']"]),
    "cuda_graph_warmup_steps": ([], ["cuda_graph_warmup_steps=0"]),
    "use_precision_aware_optimizer": (["use_distributed_optimizer=true"], ["use_precision_aware_optimizer=true"]),
    "main_grads_dtype": (["use_distributed_optimizer=true", "use_precision_aware_optimizer=true"],
                         ["main_grads_dtype=bf16"]),
    "main_params_dtype": (["use_distributed_optimizer=true", "use_precision_aware_optimizer=true"],
                          ["main_params_dtype=fp16"]),
    "exp_avg_dtype": (["use_distributed_optimizer=true", "use_precision_aware_optimizer=true"],
                      ["exp_avg_dtype=bf16"]),
    "exp_avg_sq_dtype": (["use_distributed_optimizer=true", "use_precision_aware_optimizer=true"],
                         ["exp_avg_sq_dtype=bf16"]),
    "optimizer_cpu_offload": (["use_distributed_optimizer=true", "use_precision_aware_optimizer=true"],
                              ["optimizer_cpu_offload=true"]),
    "cpu_offloading_num_layers": ([], ["cpu_offloading_num_layers=2"]),
    "fine_grained_activation_offloading": ([], ["fine_grained_activation_offloading=true",
                                                "offload_modules=['core_attn']"]),
    "offload_modules": (["fine_grained_activation_offloading=true", "offload_modules=['core_attn']"],
                        ["offload_modules=['core_attn','attn_proj']"]),
    "optimizer": ([], ["optimizer=sgd"]),
    "cross_entropy_loss_fusion": ([], ["cross_entropy_loss_fusion=true"]),
    "defer_embedding_wgrad_compute": (["pipeline_model_parallel_size=2"], ["defer_embedding_wgrad_compute=true"]),
    "wgrad_deferral_limit": (["pipeline_model_parallel_size=2", "defer_embedding_wgrad_compute=true"],
                             ["wgrad_deferral_limit=2"]),
    "moe_token_dispatcher_type": (["num_moe_experts=4"], ["moe_token_dispatcher_type=alltoall"]),
    "moe_expert_capacity_factor": (["num_moe_experts=4"], ["moe_expert_capacity_factor=1.5"]),
    "moe_pad_expert_input_to_capacity": (["num_moe_experts=4", "moe_expert_capacity_factor=1.5"],
                                         ["moe_pad_expert_input_to_capacity=true"]),
    "moe_aux_loss_coeff": (["num_moe_experts=4"], ["moe_aux_loss_coeff=0.01"]),
    "moe_grouped_gemm": (["num_moe_experts=4", "bf16=true"], ["moe_grouped_gemm=true"]),
    "moe_router_dtype": (["num_moe_experts=4"], ["moe_router_dtype=fp32"]),
    "moe_flex_dispatcher_backend": (["num_moe_experts=4", "moe_token_dispatcher_type=flex"],
                                    ["moe_flex_dispatcher_backend=hybridep"]),
    "moe_router_force_load_balancing": (["num_moe_experts=4"], ["moe_router_force_load_balancing=true"]),
    "overlap_moe_expert_parallel_comm": (["num_moe_experts=4", "expert_model_parallel_size=2", "bf16=true",
                                          "moe_token_dispatcher_type=alltoall"],
                                         ["overlap_moe_expert_parallel_comm=true"]),
    "delay_wgrad_compute": ([], ["delay_wgrad_compute=true"]),
    "deterministic_mode": ([], ["deterministic_mode=true"]),
    "rampup_batch_size": ([], ["rampup_batch_size=[4, 4, 100]"]),
    "lr": ([], ["lr=0.001"]),
    "check_for_nan_in_loss_and_grad": ([], ["check_for_nan_in_loss_and_grad=false"]),
}
# Fields the plain TE stack refuses for a reason of their own: checked on NVIDIA's container (Apex too).
NEEDS_APEX = ("defer_embedding_wgrad_compute", "wgrad_deferral_limit")
# Read by the training loop itself (train.py), not through a Megatron config.
LOOP_FIELDS = ("micro_batch_size", "global_batch_size", "seq_length", "train_iters", "warmup_iters", "seed",
               "data_path", "expandable_segments")


def _settings(e, stack) -> dict:
    """Everything the workload hands megatron-core for `e` (the implementation decides the spec)."""
    impl = runtime.resolve(e, stack)
    return {"implementation": impl.to_dict(), **train.transformer_settings(e, impl),
            **{f"optimizer.{k}": v for k, v in train.optimizer_settings(e).items()},
            **{f"ddp.{k}": v for k, v in train.ddp_settings(e, e.data_parallel_size).items()}}


@pytest.mark.train
def test_every_training_field_is_used_or_refused():
    fields = [f.name for f in dataclasses.fields(Training)]
    assert set(fields) == set(ALTERNATIVES) | set(LOOP_FIELDS), "a Training field without a use: add it here"
    source = inspect.getsource(train)
    for name in LOOP_FIELDS:
        assert re.search(rf"\.{name}\b", source), f"training.{name}: the workload never reads it"
    for name, (companions, change) in ALTERNATIVES.items():
        before = exp("tiny-local", *companions)
        after = exp("tiny-local", *companions, *change)
        assert validate(before) == [] and validate(after) == [], name
        stack = runtime.assumed(Hardware.load("h100-sxm-80gb")) if name in NEEDS_APEX else GPU_TE
        refused = runtime.problems(after, stack)
        if refused:
            assert refused[0].field == name, (name, refused)
            continue
        old, new = _settings(before, stack), _settings(after, stack)
        assert {k for k in new if new[k] != old.get(k)}, f"training.{name} changes nothing the workload builds"


# --------------------------------------------------------------------------------------------
# What cannot run
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("assignments, stack, field, rule", [
    (["tensor_model_parallel_size=2", "sequence_parallel=true"], GPU, "sequence_parallel",
     "sequence parallelism needs Transformer Engine, which this node lacks"),
    (["tensor_model_parallel_size=2", "sequence_parallel=true"], CPU, "sequence_parallel",
     "needs Transformer Engine on a CUDA GPU, and this node has no CUDA"),
    (["context_parallel_size=2"], GPU, "context_parallel_size", "context parallelism needs Transformer Engine"),
    (["transformer_impl=transformer_engine"], GPU, "transformer_impl", '"auto" would use'),
    (["bf16=true", "hardware.fp8=true", "fp8=e4m3", "fp8_recipe=mxfp8"], GPU_TE, "fp8_recipe",
     "MXFP8 needs compute capability 10.0 or newer (Blackwell); this GPU is 9.0"),
    (["bf16=true", "hardware.fp8=true", "fp8=e4m3"], dataclasses.replace(GPU_TE, capability=(8, 0)), "fp8",
     "needs compute capability 8.9 or newer"),
    (["num_moe_experts=4", "moe_token_dispatcher_type=flex"], GPU_TE, "moe_token_dispatcher_type", "DeepEP"),
    (["use_distributed_optimizer=true", "use_precision_aware_optimizer=true"], GPU, "use_precision_aware_optimizer",
     "FusedAdam"),
    (["cuda_graph_impl=transformer_engine"], GPU_TE, "cuda_graph_impl", "not supported by the training workload"),
    (["bf16=false", "attention_backend=flash"], GPU, "attention_backend",
     "torch's flash attention kernel takes only fp16 and bf16, and this experiment trains in fp32"),
], ids=["sp-no-te", "sp-cpu", "cp-no-te", "te-missing", "mxfp8-hopper", "fp8-ampere", "flex-no-deepep",
        "precision-aware-no-te", "cuda-graphs", "flash-fp32"])
def test_what_a_node_cannot_run_is_one_line_naming_field_value_and_node(assignments, stack, field, rule):
    found = runtime.problems(exp("tiny-local", *assignments), stack)
    assert found and found[0].field == field
    assert rule in found[0].rule and found[0].rule.endswith(f"({stack.source})")


@pytest.mark.parametrize("assignments", [
    ["tensor_model_parallel_size=2", "sequence_parallel=true", "tp_comm_overlap=true"],
    ["bf16=true", "hardware.fp8=true", "fp8=e4m3", "fp8_recipe=blockwise", "context_parallel_size=2"],
    ["num_moe_experts=4", "moe_grouped_gemm=true", "bf16=true"],
], ids=["sp-tp-overlap", "fp8-cp", "grouped-gemm"])
def test_a_node_with_transformer_engine_runs_them(assignments):
    assert runtime.problems(exp("tiny-local", *assignments), GPU_TE) == []


@pytest.mark.parametrize("stack, assignments", [
    (GPU, ["bf16=true", "attention_backend=flash"]),
    (GPU, ["bf16=false", "fp16=true", "attention_backend=flash"]),
    (GPU, ["bf16=false", "attention_backend=fused"]),
    (CPU, ["bf16=false", "attention_backend=flash"]),          # torch's CPU flash kernel takes fp32
], ids=["bf16", "fp16", "fp32-fused", "fp32-cpu"])
def test_flash_attention_in_fp32_is_refused_only_where_no_kernel_takes_it(stack, assignments):
    assert runtime.problems(exp("tiny-local", *assignments), stack) == []


@pytest.mark.parametrize("cuda, half, kernels, native", [
    (True, True, None, True),                                          # torch picks: flash, or math
    (True, True, ("FLASH_ATTENTION",), True),
    (True, True, ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"), False),   # memory-efficient takes no GQA
    (True, False, None, False),                                        # fp32: no flash
    (False, True, None, False),                                        # the CPU
])
def test_sdpa_gets_grouped_query_heads_only_where_a_kernel_surely_takes_them(cuda, half, kernels, native):
    assert runtime.sdpa_takes_gqa(cuda, half, kernels) is native


def no_compiler() -> Stack:
    return dataclasses.replace(GPU, compiler=None, source="test: an H100 without a C compiler")


def test_without_a_c_compiler_the_compiled_fusions_are_off_and_the_plan_says_why():
    """megatron-core's bias-activation, bias-dropout and cross-entropy fusions are torch.compile'd,
    and Triton builds a C launcher for each kernel: without a compiler iteration 1 would fail."""
    NO_CC = no_compiler()
    e = exp("tiny-local", "swiglu=true", "cross_entropy_loss_fusion=true")
    assert {"bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion"} <= \
        set(runtime.resolve(e, GPU).fusions)
    impl = runtime.resolve(e, NO_CC)
    assert not {"bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion"} & set(impl.fusions)
    assert impl.notes == (runtime.NO_COMPILER,) and not impl.compiles
    assert "torch.compile off: no working host C compiler" in impl.describe()
    assert runtime.resolve(e, GPU).notes == () and runtime.resolve(e, GPU).compiles


def test_a_stack_records_its_compiler_and_older_records_assume_one():
    found = dataclasses.replace(GPU, compiler="/usr/bin/gcc")
    assert runtime.Stack.from_dict(found.to_dict(), "x").compiler == "/usr/bin/gcc"
    assert runtime.Stack.from_dict(no_compiler().to_dict(), "x").compiler is None
    older = {"cuda": True, "capability": [9, 0], "extensions": []}          # saved before the check
    assert runtime.Stack.from_dict(older, "x").compiler == runtime.ASSUMED_COMPILER
    assert runtime.assumed(Hardware.load("h100-sxm-80gb")).compiler


def test_the_compiler_check_builds_a_python_extension_as_triton_does(monkeypatch, tmp_path):
    runtime.host_compiler.cache_clear()
    try:
        monkeypatch.delenv("CC", raising=False)
        found = runtime.host_compiler()
        assert found and found.endswith(("gcc", "clang")), found        # CI's machines have gcc
        runtime.host_compiler.cache_clear()
        broken = tmp_path / "cc"
        broken.write_text("#!/bin/sh\nexit 1\n")
        broken.chmod(0o755)
        monkeypatch.setenv("CC", str(broken))                          # Triton takes $CC first
        assert runtime.host_compiler() is None
        runtime.host_compiler.cache_clear()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        assert runtime.host_compiler() is None
    finally:
        runtime.host_compiler.cache_clear()


@pytest.mark.parametrize("stack, optimizer", [
    (GPU_TE, "transformer_engine"), (dataclasses.replace(GPU, extensions=frozenset({"apex"})), "apex"),
    (GPU, "torch"), (CPU, "torch"),
])
def test_the_optimizer_kernels_are_whose_megatron_core_imports(stack, optimizer):
    impl = runtime.resolve(exp("tiny-local"), stack)
    assert impl.optimizer == optimizer and rundir.OPTIMIZERS[optimizer] in impl.describe()
    assert runtime.Implementation.from_dict(impl.to_dict()) == impl


@pytest.mark.train
def test_detect_reports_this_cpu_node():
    stack = runtime.detect()
    assert stack.cuda is False and stack.capability is None and not stack.te
    assert stack.source.startswith("found on ") and stack.compiler == runtime.host_compiler()


# --------------------------------------------------------------------------------------------
# Planning: assumed, or calibrated with `doctor`
# --------------------------------------------------------------------------------------------
def calibrate(hardware="h100-sxm-80gb", *, extensions=(), devices=8, usable=80 * 2**30, outside=3 * 2**30):
    return calibration.save({
        "hardware": hardware, "node": "gpu-node-1", "date": "2026-11-20",
        "stack": {"cuda": True, "capability": [9, 0], "extensions": list(extensions)},
        "memory": {"usable_bytes": usable, "outside_allocator_bytes": outside, "devices": devices},
    })


def test_planning_assumes_transformer_engine_on_nvidia_until_a_node_is_calibrated(charllm_dirs):
    h100 = Hardware.load("h100-sxm-80gb")
    assert calibration.for_planning(h100).te and "assumed for h100-sxm-80gb" in calibration.for_planning(h100).source
    assert not calibration.for_planning(Hardware.load("cpu")).cuda
    path = calibrate()
    assert path.parent == charllm_dirs["data"] / "calibrations"
    stack = calibration.for_planning(h100)
    assert not stack.te and stack.source == "calibrated on gpu-node-1, 2026-11-20"


def test_plan_says_what_will_run_and_what_the_calibrated_node_cannot(capsys):
    from charllm.tui.cli import main

    name = "ppt-h100-llama3-70b-1-01000"
    assert Experiment.load(name).parallel.sequence_parallel
    assert main(["plan", name, "--json"]) == 0
    assumed = json.loads(capsys.readouterr().out)
    assert assumed["implementation"]["transformer_impl"] == "transformer_engine" and assumed["cannot_run"] == []
    assert assumed["usable_source"] == "hardware preset"
    calibrate(usable=70 * 2**30, outside=3 * 2**30)
    main(["plan", name, "--json"])
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["implementation"] == {"transformer_impl": "local", "attention": "sdpa", "device": "cuda",
                                            "fusions": ["bias_activation_fusion", "bias_dropout_fusion"],
                                            "optimizer": "torch", "notes": []}
    assert calibrated["cannot_run"][0].startswith("sequence_parallel = True: sequence parallelism needs "
                                                  "Transformer Engine, which this node lacks")
    assert calibrated["usable_bytes"] == 70 * 2**30 and calibrated["outside_allocator_bytes"] == 3 * 2**30
    assert calibrated["usable_source"] == "calibrated on gpu-node-1, 2026-11-20"
    main(["plan", name])
    text = capsys.readouterr().out
    assert "(calibrated on gpu-node-1, 2026-11-20)" in text and "will not launch: sequence_parallel" in text


def test_a_one_device_calibration_does_not_stand_for_nccl_peers(capsys):
    from charllm.engine.model.memory import budget

    calibrate(devices=1, outside=int(0.5 * 2**30))
    one, eight = exp("tiny-local", "gpus_per_node=1"), exp("tiny-local", "gpus_per_node=8")
    one.hardware = eight.hardware = Hardware.load("h100-sxm-80gb")
    assert budget(one).outside_allocator_bytes == int(0.5 * 2**30)
    assert budget(eight).outside_allocator_bytes == Hardware.load("h100-sxm-80gb").outside_allocator_bytes
    assert "without NCCL peers" in budget(eight).outside_source


def test_a_damaged_calibration_is_ignored_with_one_warning(capsys):
    path = calibrate()
    path.write_text('{"hardware": "h100-sxm-80gb", "node": ')
    h100 = Hardware.load("h100-sxm-80gb")
    assert calibration.for_planning(h100).source.startswith("assumed")
    calibration.for_planning(h100)
    err = capsys.readouterr().err
    assert err.count("not a usable calibration") == 1 and str(path) in err


def test_launch_refuses_what_the_planned_node_cannot_run(capsys):
    from charllm.tui.cli import main

    assert main(["launch", "tiny-tp2", "--set", "sequence_parallel=true", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("charllm-tui: error: sequence_parallel = True: sequence "
                                               "parallelism needs Transformer Engine on a CUDA GPU")


# --------------------------------------------------------------------------------------------
# One FLOP count
# --------------------------------------------------------------------------------------------
def test_the_workload_counts_flops_as_the_summaries_do(tmp_path):
    """One formula (engine.model.flops, Megatron-LM's num_floating_point_operations, causal attention
    counted half) for the live TFLOP/s and for summaries and MFU."""
    from charllm.engine.model import flops
    from charllm.probes.analysis.iterations import read_experiment

    for name in catalog.entries("experiments"):
        e = exp(name)
        e.save(tmp_path / "experiment.toml")
        assert train.flops_per_iteration(e) == flops.flops_per_iteration(
            read_experiment(tmp_path / "experiment.toml").experiment
        )
    e = exp("tiny-local")
    m, b, s = e.model, e.training.global_batch_size, e.seq_length
    h, layers, vocab = m.hidden_size, m.num_layers, m.padded_vocab_size()
    # Per layer: QKV + projection 4h^2, causal attention 2sh (half of QK^T and AV), MLP 2h*ffn;
    # forward 2 FLOPs per multiply-add, backward twice the forward; plus the logits.
    per_token = 6 * (layers * (4 * h * h + 2 * s * h / 2 + 2 * h * m.ffn) + h * vocab)
    assert train.flops_per_iteration(e) == pytest.approx(b * s * per_token)


def test_the_memory_model_follows_the_attention_that_runs():
    """Megatron's unfused attention keeps s x s scores; SDPA keeps K and V at every head in fp32,
    where it expands them for the kernel, and at the query-group count in bf16 (FlashAttention-2
    takes GQA as is); Transformer Engine keeps them at the group count."""
    from charllm.engine.model.memory import _Shapes

    def saved(stack_extensions, *assignments):
        calibration.delete("h100-sxm-80gb")
        calibrate(extensions=stack_extensions)
        e = exp("tiny-local", "num_query_groups=1", *assignments)
        e.hardware = Hardware.load("h100-sxm-80gb")
        return _Shapes(e).layer(False).saved

    m, t = exp("tiny-local").model, exp("tiny-local").training
    s, b, a, d = m.seq_length, t.micro_batch_size, m.num_attention_heads, m.head_dim
    te32, sdpa32 = saved(["transformer_engine"]), saved([])
    assert sdpa32 - te32 == 2 * 4 * s * b * (a - 1) * d                 # K and V at a heads, not 1
    assert saved([], "bf16=true") == saved(["transformer_engine"], "bf16=true")
    unfused = saved([], "attention_backend=unfused")
    assert unfused - te32 >= 4 * a * s * s * b - 4 * a * s * b           # softmax output instead of the LSE
    # restricted to the memory-efficient and cuDNN kernels, bf16 GQA is expanded too (runtime.sdpa_takes_gqa)
    fused16, auto16 = saved([], "bf16=true", "attention_backend=fused"), saved([], "bf16=true")
    assert fused16 - auto16 == 2 * 2 * s * b * (a - 1) * d


def test_a_plan_can_be_for_the_stack_a_node_has():
    """`estimate` plans the hardware's calibrated or assumed stack (NVIDIA's container, with
    Transformer Engine, until a node is calibrated), or the stack it is given: what doctor --train
    found on the node it is about to train on."""
    from charllm.engine.model.memory import estimate

    e = exp("tiny-local", "bf16=true", "num_query_groups=1", "attention_backend=fused")
    e.hardware = Hardware.load("h100-sxm-80gb")
    assumed, found = estimate(e), estimate(e, stack=GPU)
    assert assumed.implementation == runtime.resolve(e, calibration.for_planning(e.hardware))
    assert assumed.implementation.transformer == "transformer_engine"
    assert found.implementation == runtime.resolve(e, GPU) and found.stack_source == GPU.source
    assert found.stages[0].activations > assumed.stages[0].activations   # SDPA's expanded K and V


def test_a_malformed_compute_capability_is_a_validation_problem_not_a_crash():
    e = exp("tiny-local", "hardware.compute_capability=full")
    assert [str(p) for p in validate(e)] == ["compute_capability = 'full': must be major.minor, e.g. \"9.0\""]
    e.hardware.vendor = "nvidia"
    assert calibration.for_planning(e.hardware).capability is None       # planning goes on without it
