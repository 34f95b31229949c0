"""The Megatron-Core pretraining loop for one experiment, one process per rank under torchrun.

    torchrun --nproc-per-node N -m charllm.engine.workload.train --run-dir RUN_DIR

Reads RUN_DIR/experiment.toml, trains `training.train_iters` steps of GPTModel (dense or MoE)
with Megatron's DDP, optimizer and pipeline schedules, on synthetic tokens or a Megatron indexed
dataset (`training.data_path`), and appends the iteration log RUN_DIR/iterations.jsonl (rank 0
and the last rank). With CUDA it runs on GPUs with NCCL (Transformer Engine when installed);
without, on CPU with gloo through `cpu_compat`.

Exit status: 0 completed, CANCELLED_EXIT (143) after SIGTERM (the current iteration finishes
first, on every rank), 2 for an experiment this workload cannot run, 1 for any other failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import socket
import sys
import time
import traceback
import warnings
from functools import partial
from pathlib import Path

from charllm.engine.workload import CANCELLED_EXIT
from charllm.probes.errors import UserError


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
                  mem_peak_bytes, tflops_per_gpu, warmup) -> None:
        # Exactly probes.schema.ITERATION_FIELDS.
        self.write("iteration", iteration=iteration, start_ns=start_ns, end_ns=end_ns, loss=loss,
                   grad_norm=grad_norm, samples=samples, tokens=tokens,
                   mem_peak_bytes=mem_peak_bytes, tflops_per_gpu=tflops_per_gpu, warmup=warmup)

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
def check_supported(exp, *, cuda: bool, use_te: bool) -> None:
    """Refuse, before any collective, what megatron-core cannot run here (one line each).
    `use_te`: CUDA, Transformer Engine importable and transformer_impl = "transformer_engine"."""
    p, t, m = exp.parallel, exp.training, exp.model
    te_needed = ("needs Transformer Engine layers (transformer_impl = \"transformer_engine\", TE installed, "
                 "CUDA)" + ("" if cuda else "; this process has no CUDA"))
    if m.multi_latent_attention:
        raise UserError("model.multi_latent_attention = true: not supported by the training workload yet")
    if m.mtp_num_layers:
        raise UserError(f"model.mtp_num_layers = {m.mtp_num_layers}: not supported by the training workload yet")
    if p.use_megatron_fsdp or p.use_torch_fsdp2:
        raise UserError("parallel.use_megatron_fsdp / use_torch_fsdp2 = true: not supported by the training "
                        "workload yet (use use_distributed_optimizer)")
    if p.context_parallel_size > 1 and not use_te:
        raise UserError(f"parallel.context_parallel_size = {p.context_parallel_size}: context parallelism "
                        f"{te_needed}; megatron-core's local attention supports only 1")
    if t.fp8 and not use_te:
        raise UserError(f"training.fp8 = {t.fp8!r}: FP8 {te_needed}")
    if t.fp8 and not fp8_capable_gpu():
        raise UserError(f"training.fp8 = {t.fp8!r}: this GPU has no FP8 (needs compute capability 8.9 or newer)")
    if t.tp_comm_overlap and not use_te:
        raise UserError(f"training.tp_comm_overlap = true: {te_needed}")
    if t.moe_grouped_gemm and not use_te and not (cuda and importlib.util.find_spec("grouped_gemm")):
        raise UserError(f"training.moe_grouped_gemm = true: {te_needed}, or the grouped_gemm package on CUDA")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != exp.world_size:
        raise UserError(f"cluster: the experiment needs {exp.world_size} processes "
                        f"(nodes x gpus_per_node), torchrun started {world}")
    if world % exp.model_parallel_size:
        raise UserError(f"parallel: TP*PP*CP = {exp.model_parallel_size} does not divide the world size {world}")


def fp8_capable_gpu() -> bool:
    import torch

    return torch.cuda.get_device_capability() >= (8, 9)   # Ada, Hopper, Blackwell


# --------------------------------------------------------------------------------------------
# Model, optimizer, data
# --------------------------------------------------------------------------------------------
def transformer_config(exp, *, use_te: bool):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    m, p, t = exp.model, exp.parallel, exp.training
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    fused = use_te   # the fused kernels come with TE on GPUs; off on CPU and with local layers
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.head_dim,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else (lambda x: F.relu(x) ** 2) if m.squared_relu else F.gelu,
        normalization=m.normalization,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=exp.expert_tensor_parallel_size,
        sequence_parallel=p.sequence_parallel,
        num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn if m.is_moe else None,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_layer_freq=m.moe_layer_freq,
        moe_token_dispatcher_type=t.moe_token_dispatcher_type,
        moe_expert_capacity_factor=t.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=t.moe_pad_expert_input_to_capacity,
        moe_aux_loss_coeff=t.moe_aux_loss_coeff,
        moe_grouped_gemm=t.moe_grouped_gemm,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        recompute_modules=t.recompute_modules,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        fp8=t.fp8,
        fp8_recipe=t.fp8_recipe if t.fp8 else "delayed",
        attention_backend=AttnBackend[t.attention_backend] if use_te else AttnBackend.local,
        cross_entropy_loss_fusion=t.cross_entropy_loss_fusion and fused,
        tp_comm_overlap=t.tp_comm_overlap,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        apply_rope_fusion=fused,
        # Megatron's own linear layers (the output layer even under TE) need apex's extension for it.
        gradient_accumulation_fusion=fused and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        # Per-token loss: megatron divides grads by the tokens of the whole global batch, which
        # is right for any DP, CP and microbatch count.
        calculate_per_token_loss=True,
        cuda_graph_scope=[],   # the default "full" is deprecated and warns on every rank
    )


def build_model(exp, config, *, use_te: bool):
    """One GPTModel chunk per virtual stage on this rank, wrapped in Float16Module and DDP."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    m, p, t = exp.model, exp.parallel, exp.training
    vp = p.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_decoder_block_spec(
                config, use_transformer_engine=use_te, normalization=m.normalization, vp_stage=stage),
            vocab_size=m.padded_vocab_size(p.tensor_model_parallel_size),
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            vp_stage=stage,
        )
        # As Megatron-LM's get_model: onto this rank's GPU first (the local spec's torch norms are
        # built on the host), then the half-precision wrapper, whose optimizer wants CUDA tensors.
        model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        chunks.append(model)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not t.grad_reduce_in_bf16,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        average_in_collective=False,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=i > 0)   # as Megatron-LM: bucket the first chunk only
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(exp, config, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = exp.training
    opt_config = OptimizerConfig(
        optimizer=t.optimizer, lr=t.lr, min_lr=t.lr, weight_decay=0.0, clip_grad=1.0,
        bf16=t.bf16, fp16=t.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=exp.parallel.use_distributed_optimizer,
    )
    return get_megatron_optimizer(opt_config, model)


def synthetic_batches(exp, rank_seed: int):
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


def indexed_batches(exp, dp_rank: int, dp_size: int):
    """Micro-batches from a Megatron indexed dataset (`training.data_path` = the file prefix).
    The dataset is built (and checked) now; batches are drawn lazily."""
    import types

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


def forward_step(data_iterator, model, *, seq: int, cp_rank: int, cp_size: int, explicit_mask: bool):
    import torch

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
    # megatron's local attention needs an explicit causal mask (True = masked); TE's builds its own.
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None] \
        if explicit_mask else None
    output = model(tokens, positions, mask, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def loss_func(loss_mask, output_tensor):
    """Per-token loss, as Megatron-LM's pretrain_gpt: (sum, tokens, {report: [sum, tokens]})."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def slice_for_context_parallel(tensor, cp_rank: int, cp_size: int):
    """Megatron's load-balanced CP split of dim 1: 2*cp chunks, rank r keeps r and 2*cp-1-r."""
    import torch

    chunks = tensor.chunk(2 * cp_size, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)


def flops_per_iteration(exp) -> float:
    """Model FLOPs of one global batch (forward + backward), Megatron-LM's formula
    (`num_floating_point_operations` in megatron/training/training.py, without recompute)."""
    m = exp.model
    batch, seq, h, layers = exp.training.global_batch_size, exp.seq_length, m.hidden_size, m.num_layers
    q_ratio = m.head_dim * m.num_attention_heads / h
    gated = 1.5 if m.swiglu else 1.0
    moe = m.moe_layer_pattern()
    mlp = sum((m.moe_ffn * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0)) if is_moe
              else m.ffn for is_moe in moe) / layers / h * gated
    attention = (1 + m.query_groups / m.num_attention_heads + seq / h) * q_ratio
    logits = m.padded_vocab_size(exp.parallel.tensor_model_parallel_size) / (2 * layers * h)
    return 12 * batch * seq * layers * h * h * (attention + mlp + logits)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
class Trainer:
    """Megatron's pieces for one rank, wired the way Megatron-LM's training loop wires them."""

    def __init__(self, exp, *, cuda: bool, use_te: bool, local_rank: int):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        p, t = exp.parallel, exp.training
        self.exp = exp
        torch.distributed.init_process_group(backend="nccl" if cuda else "gloo")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=exp.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        )
        torch.manual_seed(t.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(t.seed)

        config = transformer_config(exp, use_te=use_te)
        self.model = build_model(exp, config, use_te=use_te)
        self.optimizer = build_optimizer(exp, config, self.model)
        # DDP hooks for the schedules: one callable per model chunk, or the callable itself.
        one = (lambda funcs: funcs[0]) if len(self.model) == 1 else (lambda funcs: funcs)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = one([chunk.no_sync for chunk in self.model])
        if t.overlap_grad_reduce:
            config.grad_sync_func = one([chunk.start_grad_sync for chunk in self.model])

        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        # One iterator per chunk over the same batches: the first chunk reads tokens, the last labels.
        if t.data_path:
            data = [indexed_batches(exp, self.dp_rank, self.dp_size) for _ in self.model]
        else:
            data = [synthetic_batches(exp, t.seed + self.dp_rank) for _ in self.model]
        self.data = one(data)
        self.forward_step = partial(forward_step, seq=exp.seq_length, cp_rank=ps.get_context_parallel_rank(),
                                    cp_size=ps.get_context_parallel_world_size(), explicit_mask=not use_te)
        self.forward_backward = get_forward_backward_func()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    def layout(self) -> dict:
        p = self.exp.parallel
        return {
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
            "context_parallel_size": p.context_parallel_size,
            "expert_model_parallel_size": p.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.exp.expert_tensor_parallel_size,
            "data_parallel_size": self.dp_size,
            "sequence_parallel": p.sequence_parallel,
            "use_distributed_optimizer": p.use_distributed_optimizer,
            "num_microbatches": self.exp.num_microbatches,
            "device": self.device.type,
        }

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
        _, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else None   # None: fp16 skipped the step
        if not self.is_last_stage:
            return None, grad_norm
        # Sum [loss, tokens] over micro-batches, then over the DP (x CP) replicas of this stage.
        total = torch.stack([r["lm loss"] for r in reports]).sum(0).to(self.device)
        torch.distributed.all_reduce(total, group=self.dp_cp_group)
        return (total[0] / total[1]).item(), grad_norm

    def agree(self, stop_requested: bool, loss: float | None) -> tuple[bool, float]:
        """One all-reduce: did any rank get SIGTERM (so all leave the loop after the same step and
        none waits in a collective), and the last rank's loss, for rank 0's progress line."""
        import torch

        last_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        shared = torch.tensor([float(stop_requested), loss if last_rank else 0.0], device=self.device)
        torch.distributed.all_reduce(shared)
        return bool(shared[0].item()), shared[1].item()


def run(run_dir: Path, stop: StopFlag, log_holder: list) -> int:
    from charllm.engine.experiment import Experiment
    from charllm.engine.validate import check

    exp = Experiment.load(run_dir / "experiment.toml")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The same node name the sampler records telemetry under: the launcher's, Slurm's, the host's.
    node = os.environ.get("CHARLLM_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    log = IterationLog(run_dir / "iterations.jsonl" if rank in (0, world - 1) else None, rank, node)
    log_holder.append(log)
    check(exp)   # the layout rules, as one line, before a slow import or any collective

    import_started = time.monotonic()
    import torch

    cuda = torch.cuda.is_available()
    have_te = importlib.util.find_spec("transformer_engine") is not None
    use_te = cuda and have_te and exp.training.transformer_impl == "transformer_engine"
    check_supported(exp, cuda=cuda, use_te=use_te)
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        from charllm.engine.workload import cpu_compat

        cpu_compat.apply()
    # Everything setup needs, imported here so that import time is one figure.
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    define_te_general_gemm()

    setup_started = time.monotonic()
    trainer = Trainer(exp, cuda=cuda, use_te=use_te, local_rank=local_rank)
    log.write("start", start_ns=time.time_ns(), world_size=world, layout=trainer.layout(), startup_s={
        "import": round(setup_started - import_started, 3),      # torch, megatron (+ TE)
        "setup": round(time.monotonic() - setup_started, 3),     # process groups, model, optimizer
    })

    t = exp.training
    flops = flops_per_iteration(exp)
    for iteration in range(1, t.train_iters + 1):
        start_ns = time.time_ns()
        loss, grad_norm = trainer.step()
        stop_all, last_loss = trainer.agree(stop.requested, loss)
        if cuda:
            torch.cuda.synchronize()
        end_ns = time.time_ns()
        seconds = (end_ns - start_ns) / 1e9
        log.iteration(
            iteration=iteration, start_ns=start_ns, end_ns=end_ns, loss=loss, grad_norm=grad_norm,
            samples=t.global_batch_size, tokens=t.global_batch_size * exp.seq_length,
            mem_peak_bytes=peak_memory_bytes(cuda), tflops_per_gpu=flops / seconds / world / 1e12,
            warmup=iteration <= t.warmup_iters,
        )
        if rank == 0:
            print(f"iter {iteration}/{t.train_iters} loss {last_loss:.4f} {seconds * 1e3:.0f} ms", flush=True)
        if stop_all:
            log.write("end", end_ns=time.time_ns(), iteration=iteration, status="cancelled")
            print(f"cancelled after iteration {iteration} (SIGTERM)", file=sys.stderr, flush=True)
            return CANCELLED_EXIT
    log.write("end", end_ns=time.time_ns(), iteration=t.train_iters, status="completed")
    return 0


def define_te_general_gemm() -> None:
    """megatron-core 0.16.1's MoE router tests `te_general_gemm is not None`, but moe_utils defines
    that name only when Transformer Engine imports: every MoE model without TE dies with a
    NameError, on GPUs as on CPUs. Without TE the router's own torch.mm path is the right one."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def peak_memory_bytes(cuda: bool) -> int:
    if cuda:
        import torch

        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m charllm.engine.workload.train", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding experiment.toml")
    args = parser.parse_args(argv)
    # megatron warns at import, once per module and rank, that TE/Apex are absent; we choose the
    # implementation ourselves (transformer_impl), so the warning is noise in every rank's log.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="Apex is not installed")
    # Megatron asks for this with TP (one CUDA work queue keeps TP comms ordered before compute).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
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


if __name__ == "__main__":
    code = main()
    # Everything that matters is written and closed; skip the interpreter's module teardown
    # (seconds with torch and megatron loaded) so the launcher sees the exit at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
