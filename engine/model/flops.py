"""Megatron-LM's model FLOP count of an experiment.

`num_floating_point_operations` follows `num_floating_point_operations` in Megatron-LM's
megatron/training/training.py (standard transformer path: GQA, SwiGLU, MoE top-k routing,
shared experts, MLA, MTP, logits over the padded vocabulary), so our TFLOP/s and MFU
match what Megatron itself reports. The workload counts its steps with it and the summaries
count a run's from its experiment.toml, read as the typed Experiment.
"""

from __future__ import annotations

from charllm.engine.model.experiment import Experiment, ModelSpec


def flops_per_iteration(exp: Experiment, samples: int | None = None, causal: bool = True) -> float:
    """Model FLOPs of one training step of `samples` sequences (default: the global batch); `causal=False`:
    counting the whole attention square (see num_floating_point_operations)."""
    batch = exp.training.global_batch_size if samples is None else samples
    return num_floating_point_operations(exp.model, batch, exp.seq_length, exp.parallel.tensor_model_parallel_size,
                                         causal)


def num_floating_point_operations(m: ModelSpec, batch_size: int, seq_length: int, tp: int = 1,
                                  causal: bool = True) -> float:
    """Megatron-LM's FLOPs of one forward+backward pass over `batch_size` sequences. Megatron counts half of
    attention's score matrix (causal); `causal=False` counts all of it, as NeMo's performance tables up to
    24.07 do (their model TFLOP/s over their tokens/s gives 2-12% more FLOPs per token than Megatron's, the
    share of attention in the model's FLOPs: tests/data/public_dev/)."""
    square = 0.5 if causal else 1.0
    h, heads, layers, s = m.hidden_size, m.num_attention_heads, m.num_layers, seq_length
    ffn, groups, kv_channels = m.ffn, m.query_groups, m.head_dim
    padded_vocab = m.padded_vocab_size(tp)

    pattern = m.moe_layer_pattern()
    num_moe, topk, last_is_moe = sum(pattern), m.moe_router_topk if m.is_moe else 0, int(pattern[-1:] == [True])
    num_dense = layers - num_moe
    mtp = m.mtp_num_layers or 0
    num_moe += last_is_moe * mtp
    num_dense += (1 - last_is_moe) * mtp
    moe_ffn = m.moe_ffn
    shared_ffn = m.moe_shared_expert_intermediate_size or 0

    fwd_bwd, fma = 3, 2  # each GEMM runs 3 times (fwd, wgrad, dgrad); a GEMM is 2mnk FLOPs
    ffn_factor = 3 if m.swiglu else 2  # SwiGLU stacks h->2ffn and ffn->h

    if m.multi_latent_attention:
        rope, qk, v = m.qk_pos_emb_head_dim, m.qk_head_dim, m.v_head_dim
        q_lora = m.q_lora_rank
        q_term = h * heads * (qk + rope) if q_lora is None else q_lora * (h + heads * (qk + rope) + 1)
        attn = fwd_bwd * fma * (
            q_term
            + m.kv_lora_rank * (h + heads * (qk + v) + 1)
            + h * rope
            + heads * v * h
            + s * heads * (qk + rope) * square  # causal: half the score matrix
            + s * heads * v * square
        )
    else:
        q = kv_channels * heads
        kv = kv_channels * groups
        attn = fwd_bwd * fma * (h * (q + 2 * kv) + q * s * square * 2 + q * h)

    per_token = (
        fwd_bwd * fma * h * (
            ffn * ffn_factor * num_dense
            + moe_ffn * topk * ffn_factor * num_moe
            + shared_ffn * ffn_factor * num_moe
        )
        + attn * (layers + mtp)
        + fwd_bwd * fma * mtp * (3 * h + 2 * h * h)
        + fwd_bwd * fma * h * padded_vocab * (mtp + 1)
    )
    return float(batch_size * s * per_token)


# The hardware field holding each precision's dense peak (fp16 runs at the bf16 rate on every
# device the presets hold).
PEAK_FIELDS = {"fp8": "fp8_tflops", "bf16": "bf16_tflops", "fp16": "bf16_tflops", "tf32": "tf32_tflops",
               "fp32": "fp32_tflops"}


def matmul_precision(exp: Experiment, tf32: bool | None) -> str:
    """The precision a run's matrix multiplies ran in: fp8, bf16, fp16, else tf32 where the run
    allowed TF32 for fp32 matmuls (the workload records it: torch's float32 matmul precision), else
    fp32 (torch's default, and Megatron-LM sets none)."""
    t = exp.training
    if t.fp8:
        return "fp8"
    if t.bf16 or t.fp16:
        return "bf16" if t.bf16 else "fp16"
    return "tf32" if tf32 else "fp32"


def peak_tflops(exp: Experiment, tf32: bool | None) -> tuple[str, float | None]:
    """(precision, the hardware's dense peak TFLOP/s for it): MFU's denominator; None where the
    hardware preset gives no peak for that precision (MFU is then not applicable)."""
    precision = matmul_precision(exp, tf32)
    return precision, getattr(exp.hardware, PEAK_FIELDS[precision]) or None
