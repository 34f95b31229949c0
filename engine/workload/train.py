"""The Megatron-Core pretraining loop for one experiment, one process per rank under torchrun.

    torchrun --nproc-per-node N -m charllm.engine.workload.train --run-dir RUN_DIR

Reads RUN_DIR/experiment.toml, trains `training.train_iters` steps of a GPT (dense or MoE: GPTModel,
or HybridModel where megatron-core prefers it, see `model_builder`) with Megatron's DDP, optimizer
and pipeline schedules, on synthetic tokens or a Megatron indexed dataset (`training.data_path`),
and appends the iteration log RUN_DIR/iterations.jsonl (rank 0 and the last rank; rank 0's line
carries every rank's step timers, `timers`). With CUDA it
runs on GPUs with NCCL, built the way `engine.model.runtime` resolves the experiment on this node
(Transformer Engine where it imports, else megatron-core's local layers with SDPA attention);
without, on CPU with gloo through `cpu_compat`. It follows Megatron-LM's training.py, arguments.py
and initialize.py; where it departs, a comment says why.

Exit status: 0 completed, CANCELLED_EXIT (143) after SIGTERM (the current iteration finishes
first, on every rank), 2 for an experiment this workload cannot run, 1 for any other failure.

For tests only: CHARLLM_TEST_ONLY_SLOW_RANK=RANK:SECONDS makes that global rank sleep SECONDS in each
micro-batch's forward step (a straggler on purpose); nothing else reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import sys
import time
import traceback
import types
import warnings
from functools import partial
from pathlib import Path
from typing import Any

from charllm.engine.model import runtime
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import flops_per_iteration
from charllm.engine.model.megatron import deterministic_environment
from charllm.engine.model.validate import check
from charllm.engine.workload import CANCELLED_EXIT, TORCHRUN_MODULE, model_builder
from charllm.engine.workload.profiler import ProfileWindow
from charllm.engine.workload.timers import FIELDS as TIMER_FIELDS, StepTimers
from charllm.probes.core.errors import UserError, plural


# --------------------------------------------------------------------------------------------
# The iteration log
# --------------------------------------------------------------------------------------------
class IterationLog:
    """Appends JSON lines to iterations.jsonl. Each line is one os.write on an O_APPEND
    descriptor, so the lines of two ranks (and of a tailing reader) never interleave."""

    def __init__(self, path: Path | None, rank: int, node: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.rank, self.node = rank, node

    def write(self, event: str, **fields) -> None:
        if self.fd is None:
            return
        record = {"event": event, "rank": self.rank, "node": self.node, **fields}
        os.write(self.fd, (json.dumps(record) + "\n").encode())

    def iteration(self, iteration, start_ns, end_ns, loss, grad_norm, samples, tokens,
                  mem_peak_bytes, mem_reserved_bytes, tflops_per_gpu, warmup, profiled, timers) -> None:
        # Exactly probes.store.schema.ITERATION_FIELDS.
        self.write("iteration", iteration=iteration, start_ns=start_ns, end_ns=end_ns, loss=loss,
                   grad_norm=grad_norm, samples=samples, tokens=tokens, mem_peak_bytes=mem_peak_bytes,
                   mem_reserved_bytes=mem_reserved_bytes, tflops_per_gpu=tflops_per_gpu, warmup=warmup,
                   profiled=profiled, timers=timers)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StopFlag:
    """Set by SIGTERM; the training loop agrees on it across ranks once per iteration."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


# --------------------------------------------------------------------------------------------
# What this workload can run
# --------------------------------------------------------------------------------------------
def check_supported(exp: Experiment, stack) -> None:
    """Refuse, before any collective, what cannot run on this node (engine.model.runtime's rules)."""
    found = runtime.problems(exp, stack)
    if found:
        raise UserError(str(found[0]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != exp.world_size:
        raise UserError(f"cluster: the experiment needs {plural(exp.world_size, 'process', 'processes')} "
                        f"(nodes x gpus_per_node), torchrun started {world}")


# --------------------------------------------------------------------------------------------
# Model, optimizer, data
# --------------------------------------------------------------------------------------------
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}   # Megatron-LM's map


def params_dtype(t):
    import torch

    return torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32


def transformer_config(exp: Experiment, impl, builder):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**builder.config_settings(exp, transformer_settings(exp, impl)))


def transformer_settings(exp: Experiment, impl) -> dict:
    """Megatron-LM's core_transformer_config_from_args for this experiment and implementation:
    the TransformerConfig arguments."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.enums import AttnBackend

    m, p, t = exp.model, exp.parallel, exp.training
    dtype = params_dtype(t)
    fused = set(impl.fusions)
    vp = p.virtual_pipeline_model_parallel_size
    # The fields passed as they are (engine.model.experiment.setting's `config`), then the computed ones.
    return exp.transformer_config_fields() | dict(
        ffn_hidden_size=m.ffn,
        num_query_groups=m.query_groups,
        kv_channels=m.head_dim,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else squared_relu if m.squared_relu else F.gelu,
        add_qkv_bias=m.add_qkv_bias or m.add_bias_linear,   # Megatron-LM keeps them in sync
        expert_tensor_parallel_size=exp.expert_tensor_parallel_size,
        # Megatron-LM: the interleaved schedule overlaps its P2P (--overlap-p2p-communication is on
        # by default, and required at PP 2), and batch_p2p_comm = not overlap_p2p_comm; batched
        # sends between the same two ranks would pair activations with gradients.
        overlap_p2p_comm=vp is not None,
        batch_p2p_comm=vp is None,
        # Megatron-LM frees each stage's sent output (the receiver holds the copy). NCCL keeps a
        # posted send's memory alive; gloo reads a tensor when its send runs, after the free, so
        # on CPU the output stays until its backward.
        deallocate_pipeline_outputs=impl.device == "cuda",
        moe_ffn_hidden_size=m.moe_ffn if m.is_moe else None,
        cpu_offloading=t.cpu_offloading_num_layers > 0,        # as Megatron's arguments.py sets it
        offload_modules=list(t.offload_modules or []),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        fp8_recipe=t.fp8_recipe if t.fp8 else "delayed",
        attention_backend=AttnBackend[impl.attention.removeprefix("te-")] if impl.transformer == "transformer_engine"
        else AttnBackend.local,
        bias_activation_fusion="bias_activation_fusion" in fused,
        bias_dropout_fusion="bias_dropout_fusion" in fused,
        masked_softmax_fusion="masked_softmax_fusion" in fused,
        apply_rope_fusion="apply_rope_fusion" in fused,
        gradient_accumulation_fusion="gradient_accumulation_fusion" in fused,
        cross_entropy_loss_fusion="cross_entropy_loss_fusion" in fused,
        # persist_layer_norm (on in Megatron-LM) is read only by Apex's FusedLayerNorm; torch's norms
        # assert it is off, and TE's ignore it.
        persist_layer_norm=False,
        # Per-token loss: megatron divides grads by the tokens of the whole global batch, which
        # is right for any DP, CP and microbatch count.
        calculate_per_token_loss=True,
        cuda_graph_scope=t.cuda_graph_scope or [],   # the default "full" is deprecated and warns on every rank
    )


def build_model(exp: Experiment, config, impl, builder):
    """One model chunk per virtual stage on this rank (GPTModel or HybridModel, as `builder`
    chose), wrapped in Float16Module and DDP."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    vp = exp.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        model = builder.build(exp, config, impl, vp_stage=stage,
                              pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                              post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage))
        # As Megatron-LM's get_model: onto this rank's GPU first (the local spec's torch norms are
        # built on the host), then the half-precision wrapper, whose optimizer wants CUDA tensors.
        model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        chunks.append(model)

    ddp = ddp_config(exp, ps.get_data_parallel_world_size(with_context_parallel=True))
    return [
        DistributedDataParallel(config=config, ddp_config=ddp, module=chunk,
                                disable_bucketing=i > 0)   # as Megatron-LM: bucket the first chunk only
        for i, chunk in enumerate(chunks)
    ]


def ddp_config(exp: Experiment, dp_cp_size: int):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**ddp_settings(exp, dp_cp_size))


def ddp_settings(exp: Experiment, dp_cp_size: int) -> dict:
    """Megatron-LM's DistributedDataParallelConfig arguments (training.py get_model)."""
    p, t = exp.parallel, exp.training
    return dict(
        # Megatron-LM: bf16 accumulates and reduces grads in fp32 unless --grad-reduce-in-bf16 (or
        # a narrower --main-grads-dtype); fp16 and fp32 keep the parameters' own dtype.
        grad_reduce_in_fp32=t.bf16 and not t.grad_reduce_in_bf16 and t.main_grads_dtype == "fp32",
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        fp8_param_gather=t.fp8_param_gather,
        check_for_nan_in_grad=checks_for_nan(exp),
        # Megatron-LM's bucket size: large enough to stay bandwidth-bound at scale; one bucket
        # when grads are reduced after the backward anyway.
        bucket_size=max(40_000_000, 1_000_000 * dp_cp_size) if t.overlap_grad_reduce else None,
        average_in_collective=False,
    )


def checks_for_nan(exp: Experiment) -> bool:
    """Whether each step checks the loss and gradients for NaN and Inf: --check-for-nan-in-loss-and-grad
    (Megatron-LM's default), which Megatron-LM's arguments.py turns off for fp16 with dynamic loss
    scaling, where an Inf gradient is the loss scaler's signal to back off."""
    t = exp.training
    return t.check_for_nan_in_loss_and_grad and not (t.fp16 and not t.loss_scale)


def optimizer_config(exp: Experiment):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**optimizer_settings(exp))


def optimizer_settings(exp: Experiment) -> dict:
    """Megatron-LM's OptimizerConfig arguments (get_megatron_optimizer_config)."""
    import torch

    t = exp.training
    dtype = {name: getattr(torch, DTYPES[getattr(t, name)])
             for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")}
    return dict(
        # A constant learning rate and no weight decay (Megatron-LM: 0.01): a characterization run
        # measures the step, not the model; neither changes the step's work or memory.
        optimizer=t.optimizer, lr=t.lr, min_lr=t.lr, weight_decay=0.0, clip_grad=1.0,
        bf16=t.bf16, fp16=t.fp16, params_dtype=params_dtype(t),
        loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
        use_distributed_optimizer=exp.parallel.use_distributed_optimizer,
        overlap_param_gather=t.overlap_param_gather,
        use_precision_aware_optimizer=t.use_precision_aware_optimizer,
        optimizer_cpu_offload=t.optimizer_cpu_offload,
        optimizer_offload_fraction=1.0 if t.optimizer_cpu_offload else 0.0,   # Megatron-LM's default
        fp8_recipe=t.fp8_recipe if t.fp8 else None,
        **dtype,
    )


def synthetic_batches(exp: Experiment, rank_seed: int):
    """Endless micro-batches of a learnable pattern: each sample cycles through a short random
    phrase over a small slice of the vocabulary, so the loss falls within a few steps."""
    import torch

    t, m = exp.training, exp.model
    seq = exp.seq_length
    gen = torch.Generator().manual_seed(rank_seed)
    alphabet = torch.randperm(m.vocab_size, generator=gen)[: min(64, m.vocab_size)]
    phrases = alphabet[torch.randint(len(alphabet), (8, 16), generator=gen)]   # 8 phrases, period 16
    while True:
        pick = torch.randint(len(phrases), (t.micro_batch_size,), generator=gen)
        shift = torch.randint(16, (t.micro_batch_size,), generator=gen)
        idx = (torch.arange(seq + 1)[None, :] + shift[:, None]) % 16
        text = phrases[pick][torch.arange(t.micro_batch_size)[:, None], idx]
        yield {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(t.micro_batch_size, seq)}


def indexed_batches(exp: Experiment, dp_rank: int, dp_size: int):
    """Micro-batches from a Megatron indexed dataset (`training.data_path` = the file prefix).
    The dataset is built (and checked) now; batches are drawn lazily."""
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    t, m = exp.training, exp.model
    prefix = str(t.data_path)
    if not (Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()):
        raise UserError(f"training.data_path = {prefix!r}: expected {prefix}.bin and {prefix}.idx "
                        "(a Megatron indexed dataset prefix)")
    # The data is already token ids: GPTDataset asks its tokenizer only for these attributes.
    # End-of-document is the last vocabulary id.
    tokenizer = types.SimpleNamespace(
        vocab_size=m.vocab_size, eod=m.vocab_size - 1, pad=m.vocab_size - 1,
        unique_identifiers={"class": "token-ids", "vocab_size": m.vocab_size})
    config = GPTDatasetConfig(
        random_seed=t.seed, sequence_length=exp.seq_length, blend=([prefix], None), split="100,0,0",
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    samples = t.train_iters * t.global_batch_size
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()

    def batches():
        index = dp_rank * t.micro_batch_size
        while True:
            items = [train[(index + i) % len(train)] for i in range(t.micro_batch_size)]
            index += dp_size * t.micro_batch_size
            yield {key: torch.stack([item[key] for item in items]) for key in ("tokens", "labels", "loss_mask")}

    return batches()


def forward_step(data_iterator, model, *, seq: int, cp_rank: int, cp_size: int, check_nan: bool,
                 slow_s: float = 0.0):
    import torch

    if slow_s:
        time.sleep(slow_s)   # CHARLLM_TEST_ONLY_SLOW_RANK: a straggler for the tests
    batch = next(data_iterator)
    if cp_size > 1:
        batch = {k: slice_for_context_parallel(v, cp_rank, cp_size) for k, v in batch.items()}
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    tokens = batch["tokens"]
    full_positions = torch.arange(seq, device=device)
    positions = slice_for_context_parallel(full_positions[None], cp_rank, cp_size) if cp_size > 1 \
        else full_positions[None]
    positions = positions.expand(tokens.shape[0], -1)
    # No attention mask: every attention the workload builds is causal by its layer spec (TE's and
    # SDPA's kernels mask inside; megatron's unfused softmax builds its causal mask itself).
    output = model(tokens, positions, None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], check_nan=check_nan)


def loss_func(loss_mask, output_tensor, *, check_nan: bool = False):
    """Per-token loss, as Megatron-LM's pretrain_gpt: (sum, tokens, {report: [sum, tokens]}); with
    `check_nan` (--check-for-nan-in-loss-and-grad, Megatron-LM's default) a NaN or Inf loss on this
    rank stops the run before the data-parallel reduce, as pretrain_gpt's loss_func does."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    if check_nan:
        from megatron.core.rerun_state_machine import get_rerun_state_machine  # deferred: loads megatron-core

        rerun = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


SLOW_RANK_ENV = "CHARLLM_TEST_ONLY_SLOW_RANK"


def test_only_slowdown(rank: int) -> float:
    """Seconds this rank sleeps per micro-batch: CHARLLM_TEST_ONLY_SLOW_RANK=RANK:SECONDS (tests only)."""
    value = os.environ.get(SLOW_RANK_ENV, "")
    who, _, seconds = value.partition(":")
    try:
        return float(seconds) if who.strip() and int(who) == rank else 0.0
    except ValueError:
        raise UserError(f"{SLOW_RANK_ENV} = {value!r}: expected RANK:SECONDS") from None


def slice_for_context_parallel(tensor, cp_rank: int, cp_size: int):
    """Megatron's load-balanced CP split of dim 1: 2*cp chunks, rank r keeps r and 2*cp-1-r."""
    import torch

    chunks = tensor.chunk(2 * cp_size, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)


def initialize_userbuffers(exp: Experiment) -> None:
    """As Megatron-LM's _initialize_tp_communicators (initialize.py): Transformer Engine's
    userbuffers for TP communication/GEMM overlap, for one micro-batch of [s*b/cp, h]."""
    from transformer_engine.pytorch import module as te_module

    t, p = exp.training, exp.parallel
    shape = [exp.seq_length * t.micro_batch_size // p.context_parallel_size, exp.model.hidden_size]
    base = te_module.base
    if hasattr(base, "UserBufferQuantizationMode"):   # TE >= 2.7
        mode = base.UserBufferQuantizationMode.FP8 if t.fp8 else base.UserBufferQuantizationMode.NONE
        base.initialize_ub(shape=shape, tp_size=p.tensor_model_parallel_size, quantization_modes=[mode],
                           bootstrap_backend="nccl")
    else:
        base.initialize_ub(shape=shape, tp_size=p.tensor_model_parallel_size, use_fp8=t.fp8 is not None,
                           bootstrap_backend="nccl")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
class Trainer:
    """Megatron's pieces for one rank, wired the way Megatron-LM's training loop wires them."""

    def __init__(self, exp: Experiment, impl, *, cuda: bool, local_rank: int):
        import numpy as np
        import torch
        from megatron.core import parallel_state as ps, tensor_parallel
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

        p, t = exp.parallel, exp.training
        self.exp = exp
        self.cuda = cuda
        torch.distributed.init_process_group(backend="nccl" if cuda else "gloo")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=exp.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
            # Megatron-LM also makes gloo copies of the groups, for saving distributed-optimizer
            # checkpoints; this workload saves none.
            create_gloo_process_groups=False,
        )
        # Megatron-LM's rerun state machine checks the loss and gradients (check_for_nan_in_loss_and_grad).
        # Its re-running modes (--rerun-mode validate_results) re-run a step to attribute a fault and
        # need Megatron-LM's loop around them; disabled, a NaN or Inf stops the run at once.
        initialize_rerun_state_machine(mode=RerunMode.DISABLED)
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        # Megatron-LM's _set_random_seed: each pipeline stage its own seed.
        self.seed = t.seed + 100 * self.pp_rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        if t.tp_comm_overlap:
            initialize_userbuffers(exp)

        self.builder = model_builder.choose(exp)
        config = transformer_config(exp, impl, self.builder)
        self.model = build_model(exp, config, impl, self.builder)
        from megatron.core.optimizer import get_megatron_optimizer

        self.optimizer = get_megatron_optimizer(optimizer_config(exp), self.model,
                                                use_gloo_process_groups=False)   # none were made
        if impl.optimizer == "torch":
            use_torch_fast_paths(exp, self.optimizer)
        # Megatron-LM's train(): the schedules scale the loss (fp16), and with overlapped grad
        # reduction hold it back until the last micro-batch and start it per bucket.
        one = (lambda funcs: funcs[0]) if len(self.model) == 1 else (lambda funcs: funcs)
        self.config = config
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if t.overlap_grad_reduce:
            config.no_sync_func = one([chunk.no_sync for chunk in self.model])
            config.grad_sync_func = one([chunk.start_grad_sync for chunk in self.model])
        # With the overlapped param all-gather, the interleaved schedule starts each chunk's gather
        # itself (--align-param-gather: on, except without the interleaved schedule, where
        # arguments.py turns it off) ...
        if t.overlap_param_gather and p.virtual_pipeline_model_parallel_size:
            config.param_sync_func = one([chunk.start_param_sync for chunk in self.model])
        # ... and the first step runs with the forward pre-hooks (the gathers) off and without
        # param_sync_func, so that a bad initialization fails on its rank instead of spreading
        # through the first all-gather (should_disable_forward_pre_hook, training.py). They come
        # back after the first step that updated the weights (fp16 may skip the first ones).
        self.overlapped_param_gather = p.use_distributed_optimizer and t.overlap_param_gather
        self.param_sync_held = self.overlapped_param_gather
        if self.param_sync_held:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=False)
            self.held_param_sync_func, config.param_sync_func = config.param_sync_func, None

        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        # One iterator per chunk over the same batches: the first chunk reads tokens, the last labels.
        if t.data_path:
            data = [indexed_batches(exp, self.dp_rank, self.dp_size) for _ in self.model]
        else:
            data = [synthetic_batches(exp, t.seed + self.dp_rank) for _ in self.model]
        self.data = one(data)
        self.forward_step = partial(forward_step, seq=exp.seq_length, cp_rank=ps.get_context_parallel_rank(),
                                    cp_size=ps.get_context_parallel_world_size(),
                                    check_nan=checks_for_nan(exp),
                                    slow_s=test_only_slowdown(torch.distributed.get_rank()))
        # Megatron's timers, as its schedules, P2P and gradient finalization call them (timers.py)
        self.timers = config.timers = StepTimers(cuda)
        self.forward_backward = get_forward_backward_func()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        self.device_memory = DeviceMemory(local_rank if cuda else None)

    def layout(self) -> dict:
        """The experiment's layout record (`Experiment.layout_record`) with the data-parallel size of the
        world that runs it and the device it runs on."""
        return {**self.exp.layout_record(), "data_parallel_size": self.dp_size, "device": self.device.type}

    def step(self) -> tuple[float | None, float | None]:
        """One training iteration: (lm loss on the last stage else None, grad norm)."""
        import torch

        t = self.exp.training
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self.forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=self.data,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=self.exp.num_microbatches,
            seq_length=self.exp.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
        )
        self.timers("optimizer").start()
        updated, grad_norm, _ = self.optimizer.step()
        self.timers("optimizer").stop()
        grad_norm = float(grad_norm) if grad_norm is not None else None   # None: fp16 skipped the step
        if updated and self.param_sync_held:
            self.resume_param_sync()
        if not self.is_last_stage:
            return None, grad_norm
        # Sum [loss, tokens] over micro-batches, then over the DP (x CP) replicas of this stage.
        total = torch.stack([r["lm loss"] for r in reports]).sum(0).to(self.device)
        torch.distributed.all_reduce(total, group=self.dp_cp_group)
        return (total[0] / total[1]).item(), grad_norm

    def resume_param_sync(self) -> None:
        """After the first step that updated the weights: the forward pre-hooks and param_sync_func
        that the overlapped param all-gather held back come on."""
        for chunk in self.model:
            chunk.enable_forward_pre_hook()
        self.config.param_sync_func = self.held_param_sync_func
        self.param_sync_held = False

    def finish(self) -> None:
        """As Megatron-LM's train() ends: with the overlapped param all-gather, the pre-hooks off
        with a last param sync, so no gather is left in flight when the process groups go."""
        if self.overlapped_param_gather and not self.param_sync_held:
            for chunk in self.model:
                chunk.disable_forward_pre_hook()

    def agree(self, stop_requested: bool, loss: float | None,
              timings: dict[str, float] | None = None) -> tuple[bool, float, list[tuple], dict[str, list]]:
        """One all-gather per iteration: did any rank get SIGTERM (so all leave the loop after the
        same step and none waits in a collective), the last rank's loss for rank 0's progress
        line, every rank's memory: (pipeline stage, allocator peak, reserved peak, most
        memory seen outside the allocator), and every rank's step timers (`timings`, this rank's:
        TIMER_FIELDS and step_s) as {field: [rank 0's, rank 1's, ...]}."""
        import torch

        allocated, reserved = memory_peaks(self.cuda)
        outside = self.device_memory.outside_allocator()
        nan = float("nan")
        timed = [(timings or {}).get(name, nan) for name in (*TIMER_FIELDS, "step_s")]
        row = torch.tensor(
            [
                float(stop_requested),
                loss if loss is not None else 0.0,
                float(self.pp_rank),
                float(allocated),
                nan if reserved is None else float(reserved),
                nan if outside is None else float(outside),
                *timed,
            ],
            dtype=torch.float64,
            device=self.device,
        )
        rows = [torch.empty_like(row) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(rows, row)
        table = torch.stack(rows).cpu().tolist()
        known = lambda x: None if x != x else int(x)   # noqa: E731 - NaN marks "not measured here"
        peaks = [(int(r[2]), int(r[3]), known(r[4]), known(r[5])) for r in table]
        per_rank = {name: [None if r[6 + i] != r[6 + i] else round(r[6 + i], 6) for r in table]
                    for i, name in enumerate((*TIMER_FIELDS, "step_s"))}
        return any(r[0] for r in table), table[-1][1], peaks, per_rank

    def place(self) -> dict:
        """Where this rank sits: its node, local rank and coordinates in the layout."""
        from megatron.core import parallel_state as ps

        return {"rank": torch_rank(), "node": node_name(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "pp_rank": self.pp_rank, "tp_rank": ps.get_tensor_model_parallel_rank(),
                "cp_rank": ps.get_context_parallel_rank(), "dp_rank": self.dp_rank}


def alloc_conf(inherited: str, expandable: bool) -> str:
    """PYTORCH_CUDA_ALLOC_CONF with the experiment's expandable_segments (the memory plan assumes
    it), keeping any other allocator option the environment sets. Read at the first CUDA
    allocation, so it is set before torch is imported."""
    options = [o for o in inherited.split(",") if o.strip() and not o.strip().startswith("expandable_segments")]
    return ",".join([*options, f"expandable_segments:{expandable}"])


def node_name() -> str:
    """The same node name the sampler records telemetry under: the launcher's, Slurm's, the host's."""
    return os.environ.get("CHARLLM_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def torch_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run(run_dir: Path, stop: StopFlag, log_holder: list) -> int:
    exp = Experiment.load(run_dir / "experiment.toml")
    rank = torch_rank()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node = node_name()
    log = IterationLog(run_dir / "iterations.jsonl" if rank in (0, world - 1) else None, rank, node)
    log_holder.append(log)
    check(exp)   # the layout rules, as one line, before a slow import or any collective
    p = exp.parallel
    if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        # Megatron-LM asserts this for TP and CP (before Blackwell): one hardware work queue keeps
        # each TP/CP communication kernel ahead of the compute that waits for it. Set, not
        # defaulted: a value inherited from the shell would break that order. CUDA reads it when
        # it creates the context, so it is set before torch is imported.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                                                       exp.training.expandable_segments)
    for name, value in deterministic_environment(exp).items():   # read when NCCL, TE and cuBLAS start
        os.environ.setdefault(name, value)

    if runtime.host_compiler() is None:
        # Nothing can compile here (runtime.NO_COMPILER): megatron-core's torch.compile'd helpers
        # (jit_fuser: some activations, norms and MoE routing, besides the fusions resolve turns
        # off) run eagerly instead of failing in iteration 1. Read when torch is imported.
        os.environ["TORCHDYNAMO_DISABLE"] = "1"

    import_started = time.monotonic()
    import torch

    if exp.training.deterministic_mode:
        torch.use_deterministic_algorithms(True)     # as Megatron-LM's validate_args does for --deterministic-mode
    stack = runtime.detect()
    check_supported(exp, stack)
    impl = runtime.resolve(exp, stack)
    cuda = stack.cuda
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        from charllm.engine.workload import cpu_compat  # deferred: loads torch (start-up time)

        cpu_compat.apply()
    # Everything setup needs, imported here so that import time is one figure.
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.pipeline_parallel
    if model_builder.hybrid_preferred():
        import megatron.core.models.hybrid.hybrid_model  # noqa: F401
    define_te_general_gemm()

    setup_started = time.monotonic()
    trainer = Trainer(exp, impl, cuda=cuda, local_rank=local_rank)
    places: list[Any] = [None] * world   # every rank's node and coordinates: rank 0's start record names them
    torch.distributed.all_gather_object(places, trainer.place())
    tel = exp.telemetry
    window = ProfileWindow(exp, run_dir, places[rank], cuda)
    if window.steps:   # a rank that records logs its traces; one that logs no steps opens the log for them
        window.log = log if log.fd is not None else IterationLog(run_dir / "iterations.jsonl", rank, node)
        log_holder.append(window.log)
    if log.fd is not None:   # what ran, as the run directory, `runs show` and Live report it
        log.write("start", start_ns=time.time_ns(), world_size=world, layout=trainer.layout(), seed=trainer.seed,
                  ranks=places if rank == 0 else None,
                  runtime={"implementation": impl.to_dict(), "model": trainer.builder.describe(exp),
                           # fp32 matmuls on TF32 tensor cores (torch's setting; Megatron-LM sets none):
                           # which peak MFU is against (engine.model.flops.peak_tflops)
                           "tf32": cuda and torch.get_float32_matmul_precision() != "highest",
                           **runtime.describe(stack)},
                  startup_s={
                      "import": round(setup_started - import_started, 3),      # torch, megatron (+ TE)
                      "setup": round(time.monotonic() - setup_started, 3),     # process groups, model, optimizer
                  })

    t = exp.training
    flops = flops_per_iteration(exp)
    peaks: list[tuple] = []
    for iteration in range(1, t.train_iters + 1):
        start_ns = time.time_ns()
        window.start(iteration)
        loss, grad_norm = trainer.step()
        stepped_ns = time.time_ns()
        window.stop(iteration)   # the trace export is part of the profiled step's cost
        timings = {**trainer.timers.read(), "step_s": (stepped_ns - start_ns) / 1e9}
        stop_all, last_loss, peaks, per_rank = trainer.agree(stop.requested, loss, timings)
        if cuda:
            torch.cuda.synchronize()
        end_ns = time.time_ns()
        seconds = (end_ns - start_ns) / 1e9
        reserved = [r for _, _, r, _ in peaks if r is not None]
        log.iteration(
            iteration=iteration, start_ns=start_ns, end_ns=end_ns, loss=loss, grad_norm=grad_norm,
            samples=t.global_batch_size, tokens=t.global_batch_size * exp.seq_length,
            mem_peak_bytes=max(a for _, a, _, _ in peaks), mem_reserved_bytes=max(reserved) if reserved else None,
            tflops_per_gpu=flops / seconds / world / 1e12, warmup=iteration <= t.warmup_iters,
            profiled=iteration in (tel.profile_steps or ()), timers=per_rank if rank == 0 else None,
        )
        if rank == 0:
            print(f"iter {iteration}/{t.train_iters} loss {last_loss:.4f} {seconds * 1e3:.0f} ms", flush=True)
        if stop_all:
            log.write("end", end_ns=time.time_ns(), iteration=iteration, status="cancelled", memory=stage_peaks(peaks))
            print(f"cancelled after iteration {iteration} (SIGTERM)", file=sys.stderr, flush=True)
            trainer.finish()
            return CANCELLED_EXIT
    trainer.finish()
    log.write("end", end_ns=time.time_ns(), iteration=t.train_iters, status="completed", memory=stage_peaks(peaks))
    return 0


def stage_peaks(peaks: list[tuple]) -> list[dict]:
    """Per pipeline stage, the highest of its ranks' allocator peak, reserved peak and memory
    outside the allocator (None where not measured: CPU, or no NVML)."""
    out: dict[int, dict] = {}
    for stage, *values in peaks:
        entry = out.setdefault(stage, {"pp_rank": stage, "allocated_bytes": None, "reserved_bytes": None,
                                       "outside_allocator_bytes": None})
        for key, value in zip(("allocated_bytes", "reserved_bytes", "outside_allocator_bytes"), values):
            if value is not None:
                entry[key] = max(entry[key] or 0, value)
    return [out[stage] for stage in sorted(out)]


def use_torch_fast_paths(exp: Experiment, optimizer) -> None:
    """Without Transformer Engine or Apex, megatron-core falls back to torch for Adam and for its
    multi-tensor kernels, the slow way: torch's AdamW built without fused=True, and a gradient norm
    (utils.local_multi_tensor_l2_norm) that reads every parameter's norm to the host, a sync per
    parameter per step. Here Adam runs fused (torch reads `fused` per parameter group at each step;
    set before the first) and the norm stays on the device: one result, the same value."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = device_l2_norm
    t = exp.training
    if t.optimizer == "adam" and not t.optimizer_cpu_offload:   # the CPU offload builds its own optimizers
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            for group in inner.optimizer.param_groups:
                group["fused"], group["foreach"] = True, None


def device_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's local_multi_tensor_l2_norm (a drop-in for apex's amp_C.multi_tensor_l2norm):
    the L2 norm of all the tensors as a 1-element float tensor, computed on their device."""
    import torch

    tensors = [tensor for tensors in tensor_lists for tensor in tensors]
    return torch.nn.utils.get_total_norm(tensors, 2.0).float().reshape(1), None


def define_te_general_gemm() -> None:
    """megatron-core 0.16.1's MoE router tests `te_general_gemm is not None`, but moe_utils defines
    that name only when Transformer Engine imports: every MoE model without TE dies with a
    NameError, on GPUs as on CPUs. Without TE the router's own torch.mm path is the right one."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class DeviceMemory:
    """What this rank holds on its GPU beyond the caching allocator's pool (CUDA context, NCCL
    buffers, library handles): NVML's figure for this process minus torch's reserved bytes, the
    most seen so far. None without a GPU or where NVML cannot attribute memory to this process."""

    def __init__(self, local_rank: int | None):
        self.handle = None
        self.most: int | None = None
        if local_rank is None:
            return
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            self.handle = nvml_handle(str(torch.cuda.get_device_properties(local_rank).uuid))
        except Exception:   # noqa: BLE001 - no NVML (or an old torch): not measured, never fatal
            self.handle = None

    def outside_allocator(self) -> int | None:
        if self.handle is None:
            return None
        import pynvml
        import torch

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except pynvml.NVMLError:
            return self.most
        mine = [p for p in procs if p.pid == os.getpid()] or (procs if len(procs) == 1 else [])   # PID namespaces
        if mine and mine[0].usedGpuMemory:
            now = int(mine[0].usedGpuMemory) - int(torch.cuda.memory_reserved())
            self.most = now if self.most is None else max(self.most, now)
        return self.most


def nvml_handle(uuid: str):
    """NVML's handle of the device torch calls `uuid`, else None. torch gives the UUID without a
    prefix; NVML names a whole GPU "GPU-<uuid>" and a MIG instance "MIG-<uuid>"."""
    import pynvml

    names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
    for name in names:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            continue
    return None


def memory_peaks(cuda: bool) -> tuple[int, int | None]:
    """(peak allocated, peak reserved) of the CUDA caching allocator; on CPU (max RSS, None)."""
    if cuda:
        import torch

        return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None   # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m charllm.engine.workload.train", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding experiment.toml")
    args = parser.parse_args(argv)
    # megatron warns at import, once per module and rank, that TE/Apex are absent; we choose the
    # implementation ourselves (transformer_impl), so the warning is noise in every rank's log.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="Apex is not installed")
    stop = StopFlag()
    logs: list[IterationLog] = []
    status = 1
    try:
        status = run(args.run_dir, stop, logs)
    except UserError as exc:
        print(f"charllm-tui: error: {exc}", file=sys.stderr, flush=True)
        status = 2
    except BaseException:   # noqa: BLE001 - a rank must record why it died, whatever it was
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        status = 1
    finally:
        if status not in (0, CANCELLED_EXIT) and logs:
            logs[0].write("end", end_ns=time.time_ns(), status="failed")
        for log in logs:
            log.close()
        teardown()
    return status


def teardown() -> None:
    """Leave process groups cleanly (skipped when torch was never imported)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:   # noqa: BLE001 - a dead peer must not turn an exit into a hang or a crash
            pass


# A rank's parent as launched (TORCHRUN_MODULE) or as a user may start it; torchrun puts
# TORCHELASTIC_RUN_ID in its workers' environment (torch/distributed/elastic/agent/server/local_elastic_agent.py).
TORCHRUN = (TORCHRUN_MODULE, "torchrun")

if __name__ == "__main__":
    # A rank never outlives torchrun: torch starts it in a session of its own, out of reach of
    # the signals that stop torchrun's process group.
    from charllm.probes.core.lifeline import die_with_parent

    die_with_parent(started_by=TORCHRUN if "TORCHELASTIC_RUN_ID" in os.environ else ())
    code = main()
    # Everything that matters is written and closed; skip the interpreter's module teardown
    # (seconds with torch and megatron loaded) so the launcher sees the exit at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
