"""Step time, throughput and power of a layout: what one training iteration takes on its hardware.

`estimate(exp)` gives a `SpeedReport`: the step time, tokens/s, MFU, and the share of the step in
compute, exposed communication, pipeline bubble, waiting on the host (host-bound) and the rest
(optimizer, fixed per-step costs),
with the parameters (total and per stage), Megatron's FLOPs per iteration, the average power and
the energy per token; each figure says where its rates come from ("assumed", or a node
calibration). The sweep evaluates the same arithmetic for thousands of layouts at once
(`step_times` on `Layouts`: numpy arrays, one entry per layout).

What it models, from what Megatron-LM (core_v0.16.1) does in one iteration on each rank:

- compute per layer and micro-batch from each GEMM's shape (QKV, attention output, MLP or routed
  experts, MLA's projections, the output layer), at an achieved share of the hardware's dense peak
  that grows with the GEMM's size (`Rates.matmul`), never below the time its operands take to
  stream from memory; FP8 linears at the FP8 peak. The backward runs each GEMM twice (data and
  weight gradients). Attention by kernel: flash-class kernels (TE's cuDNN/flash backends) on the
  causal half of the scores at an efficiency that grows with the sequence; unfused attention as two
  batched GEMMs on the whole s x s square plus the softmax's memory traffic. Element-wise work
  (norms, activation, RoPE, residuals, dropout, MoE permutation, FP8 casts, the cross-entropy)
  as memory traffic at the hardware's bandwidth.
- tensor-parallel collectives (all-gather/reduce-scatter with sequence parallelism, all-reduce
  without), exposed where Megatron waits on them and hidden behind the GEMM they run beside where
  it overlaps them (backward; everywhere with tp_comm_overlap); context-parallel ring exchanges of
  K/V behind the attention; expert-parallel all-to-alls (or the all-gather dispatcher); pipeline
  sends and receives; the data-parallel gradient reduce (all-reduce, or reduce-scatter and
  parameter all-gather with the distributed optimizer), hidden behind the last micro-batch's
  backward with overlap_grad_reduce and the next forward with overlap_param_gather. Each
  collective's time is a latency plus its bus bytes over the link it crosses: NVLink (or the
  node's device link) while its group stays in a node, else the node's network share of each
  device times the group's members on a node.
- the pipeline: per stage and micro-batch the forward and backward of what the stage holds
  (embedding, decoder and MTP layers, loss), recompute included; the 1F1B and interleaved
  schedules take sum(stage) / VP + (micro-batches - 1 / VP) x the slowest stage.
- the host: a Transformer Engine layer costs the host HOST_LAYER_S per micro-batch to launch;
  where the GPU work is shorter, the host sets the pace (small models): that wait is the step's
  host-bound share, apart from the pipeline bubble.
- the optimizer step (memory traffic of Adam per updated parameter), and FIXED_STEP_S per step.

The hardware's peaks and bandwidths come from its preset (engine.model.experiment.Hardware); the
achieved shares below are assumptions stated with their sources, except the large-GEMM efficiency,
which a `charllm-tui doctor --train` calibration of the hardware replaces with what its node
measured. tests/engine/model/test_speed_validation.py holds the model against Megatron-LM's measured
step times (tests/data/memory_dev/); docs/speed-model.md lists every assumption.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from charllm.engine.model import calibration, memory
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.flops import PEAK_FIELDS, flops_per_iteration, num_floating_point_operations, peak_tflops

# --------------------------------------------------------------------------------------------
# Assumed rates (docs/speed-model.md gives each source)
# --------------------------------------------------------------------------------------------
# Each GEMM's fill and drain beyond its FLOPs at the large-GEMM rate (Hardware.matmul_efficiency): a
# bf16 GEMM on an H100 reaches half that rate at about 4 GFLOP (132 SMs' worth of 128x256 output tiles
# and a long K keep it busy), i.e. 4 GFLOP / (0.72 x 989 TFLOP/s).
MATMUL_FILL_S = 5.5e-6
# GEMM output tiles of the cuBLAS/CUTLASS kernels for large GEMMs on Hopper (one tile per SM at a time): 128x256
# and 256x128 warp-specialized tiles, 128x128 where those leave more of the last wave idle (CUTLASS 3's sm90
# GEMM configurations; cuBLAS's heuristics pick among them). A GEMM runs ceil(tiles / SMs) waves, and a wave's
# idle SMs and a tile's padding past the matrix edge are lost (Hardware.sm_count; 0: not counted).
GEMM_TILES = ((128, 256), (256, 128), (128, 128))
# FP8 GEMMs reach a smaller share of their (twice as high) peak than BF16's, by Transformer Engine recipe (the
# scaling of the operands): per-tensor (delayed, tensorwise) and MXFP8 scale in the GEMM's epilogue; blockwise
# (1x128 activations, 128x128 weights) rescales each K block in the main loop. Relative to the large-GEMM
# efficiency of BF16 (Hardware.matmul_efficiency or its calibration).
FP8_MATMUL_SHARE = {"delayed": 0.72, "tensorwise": 0.72, "mxfp8": 0.72, "custom": 0.72, "blockwise": 0.72}
# Flash-class attention (FlashAttention-3, cuDNN's fused attention in Transformer Engine) on the
# causal half of the scores, share of the BF16 peak (forward, backward): FA3's published H100
# figures reach about 0.33 of it at 1k tokens and 0.6 at 8k-16k, head dim 128.
FLASH_EFFICIENCY = (0.68, 0.55)
FLASH_HALF_SEQ = 1024           # the sequence at which it reaches half of that
# torch's scaled_dot_product_attention (megatron-core's local layers here): FlashAttention-2-class
SDPA_EFFICIENCY = (0.45, 0.38)
# The backward of flash attention runs 2.5x the forward's FLOPs (it recomputes the scores).
FLASH_BACKWARD_FLOPS = 2.5
# Element-wise kernels stream at this share of the memory bandwidth.
MEMORY_EFFICIENCY = 0.75
# Collectives: NCCL's bus bandwidth as a share of the link's (8 H100s: 360 of 450 GB/s per direction),
# all-to-all's lower share, and the latency each adds (within a node, across nodes).
LINK_EFFICIENCY = 0.8
ALL_TO_ALL_EFFICIENCY = 0.6
# MoE tokens travel in BF16: none of the dispatchers of megatron-core 0.16-0.19 sends FP8 (fused_a2a.py:
# "Currently, we do not support fp8 dispatch"; main's moe_dispatch_fwd_dtype came after 0.19).
DISPATCH_BYTES = 2
# SMs a communication kernel holds while it runs beside compute, which the compute then lacks: DeepEP's 20
# (TransformerConfig.moe_deepep_num_sms, core_v0.16.1; HybridEP's 16), NCCL's collectives one block per
# channel, 16-32 channels on an NVLink node
COMM_SMS = 20
LATENCY_NODE_S = 20e-6
LATENCY_NETWORK_S = 40e-6
KERNEL_S = 4e-6                 # the least a kernel takes on the GPU
# Host time to launch one Transformer Engine decoder layer's forward and backward for one
# micro-batch (Python, autograd and kernel launches), and megatron-core's local layers'; an MoE
# layer's extra; each collective; per micro-batch and stage the schedule's own; per step the rest
# (optimizer launches, gradient norm, logging). Fitted to the 83 small models of Megatron-LM's CI runs on
# H100 (tests/data/memory_dev/), whose steps are host time. Most of them run --deterministic-mode, which
# makes a Transformer Engine layer cost the host DETERMINISTIC_HOST times as much (its deterministic
# attention path): the two TE figures fitted on either half of the cases and checked on the other give
# mean |error| 19.8% / 16.6% and median 9.3% / 11.5% (one TE figure of 4.0 ms: 20.7% / 18.6%, 11.7% / 10.8%).
HOST_LAYER_S = {"transformer_engine": 3.25e-3, "local": 2.2e-3}
HOST_MOE_LAYER_S = 5.5e-3           # an MoE layer's router, permutation and experts, beyond a dense layer's
DETERMINISTIC_HOST = 1.3
HOST_COLLECTIVE_S = 80e-6           # per collective launched
HOST_MICROBATCH_S = 0.15e-3
FIXED_STEP_S = 40e-3
# Adam's step streams each updated parameter's fp32 master, gradient and two moments and writes them
# back with the half-precision copy (30 bytes), plus the gradient norm's read (4) and zeroing the
# gradient buffer (4 per local parameter).
OPTIMIZER_BYTES = 34
GRAD_ZERO_BYTES = 4
# Power: the share of the board's dynamic range (tdp - idle) a device draws in each kind of work.
ACTIVITY = {"matmul": 1.0, "memory": 0.65, "communication": 0.35, "idle": 0.12}

# Stage features (per stage: what it holds) and their order in Layouts.stages
DENSE, MOE, EMBEDDING, LOSS, MTP, FULL_DENSE, FULL_MOE = range(7)
FEATURES = 7


# --------------------------------------------------------------------------------------------
# Rates: the hardware's figures, and where they come from
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rates:
    matmul_flops: float             # dense peak of the precision the linears run in (FLOP/s)
    matmul: float                   # achieved share of matmul_flops for a large GEMM
    memory_bps: float               # memory bandwidth (B/s)
    node_bps: float                 # device-to-device link within a node, per direction (B/s)
    network_bps: float              # network per device between nodes, per direction (B/s)
    host_bps: float                 # device-host link, per direction (B/s)
    gpus_per_node: int
    sms: int                        # streaming multiprocessors: the GEMM's waves (0: unknown, not counted)
    source: str                     # "assumed" | "calibrated on NODE, DATE"


def rates(exp: Experiment, precision: str, efficiency: float | None = None) -> Rates:
    """The figures `exp`'s hardware offers for matmuls in `precision`: the preset's peaks and
    bandwidths, and its assumed large-GEMM efficiency, or the one its node calibration measured (or
    `efficiency`, given)."""
    hw = exp.hardware
    peak = getattr(hw, PEAK_FIELDS[precision]) or hw.bf16_tflops or 0.0
    share, source = hw.matmul_efficiency, "assumed"
    cal = calibration.load(hw.name)
    if efficiency is not None:
        share, source = efficiency, "given"
    elif cal is not None and cal.matmul_efficiency:
        share, source = cal.matmul_efficiency, cal.source
    share *= FP8_MATMUL_SHARE[exp.training.fp8_recipe] if precision == "fp8" else 1.0
    return Rates(peak * 1e12, share, hw.mem_bandwidth_gbs * 1e9, hw.node_link_gbs * 1e9,
                 hw.network_gbs * 1e9, hw.host_link_gbs * 1e9, exp.cluster.gpus_per_node, hw.sm_count, source)


def missing(exp: Experiment) -> list[str]:
    """The hardware figures the model needs for `exp` that its preset leaves at 0 (unknown)."""
    hw, t = exp.hardware, exp.training
    peak = PEAK_FIELDS[linear_precision(exp)]
    needed = [peak if getattr(hw, peak) is not None else "bf16_tflops", "mem_bandwidth_gbs"]
    calibrated = calibration.load(hw.name)
    if not (calibrated and calibrated.matmul_efficiency):
        needed.append("matmul_efficiency")
    if exp.cluster.gpus_per_node > 1:
        needed.append("node_link_gbs")
    if exp.cluster.nodes > 1:
        needed.append("network_gbs")
    if t.fine_grained_activation_offloading or t.cpu_offloading_num_layers or t.optimizer_cpu_offload:
        needed.append("host_link_gbs")
    return [name for name in needed if not getattr(hw, name)]


def unknown(exp: Experiment) -> str | None:
    """Why the model gives `exp` no step time (figures its hardware lacks), or None."""
    lacking = missing(exp)
    return (f"no step time: hardware {exp.hardware.name!r} gives no {', '.join(lacking)} (0: unknown)"
            if lacking else None)


def linear_precision(exp: Experiment) -> str:
    """What the transformer layers' linears run in (fp32 runs: plain FP32; Megatron sets no TF32)."""
    t = exp.training
    return "fp8" if t.fp8 else "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"


# --------------------------------------------------------------------------------------------
# Layouts: what the arithmetic reads of each layout, as arrays
# --------------------------------------------------------------------------------------------
@dataclass
class Layouts:
    """One entry per layout (numpy arrays) of what varies between layouts of one base experiment.

    stages[i, k] is the k-th distinct stage of layout i (FEATURES: its dense and MoE decoder layers,
    embedding, loss, MTP layers, and fully recomputed layers of each kind), held by stage_count[i, k]
    pipeline ranks, the first of them stage_rank[i, k]; padding entries have count 0."""

    tp: Any
    cp: Any
    ep: Any
    etp: Any
    pp: Any
    vp: Any
    dp: Any
    edp: Any
    sp: Any
    micro_batch: Any
    microbatches: Any
    distributed_optimizer: Any
    selective: Any                  # index into `modules`: the selective-recompute modules of each layout
    modules: list                   # per index: the set of modules selective recompute re-runs
    stages: Any
    stage_count: Any
    stage_rank: Any
    host_bytes: Any = None          # (dense, MoE) layer's bytes sent to the host per micro-batch (offloading)


def stage_features(exp: Experiment, cache: dict | None = None):
    """(features per distinct stage, how many stages have it, the first such stage's rank, each
    stage's index among the distinct ones) of `exp`'s pipeline split and recompute setting, as
    lists (see Layouts.stages)."""
    cache = {} if cache is None else cache
    t = exp.training
    key = ("speed-stages", memory.SPLIT_FIELDS(exp), t.recompute_granularity, t.recompute_method,
           t.recompute_num_layers)
    found = cache.get(key)
    if found is not None:
        return found
    pattern = (exp.model.moe_layer_pattern() + [False] * exp.model.num_layers)[:exp.model.num_layers]
    full = t.recompute_granularity == "full"
    block = full and t.recompute_method == "block"
    group = t.recompute_num_layers or 1
    rows: dict[tuple, list] = {}
    index = []
    for r, stage in enumerate(memory.split_layers(exp)):
        f = [0] * FEATURES
        for chunk in stage:
            kinds = [pattern[i] for i in chunk.layers]
            f[MOE] += sum(kinds)
            f[DENSE] += len(kinds) - sum(kinds)
            f[EMBEDDING] += chunk.embedding
            f[LOSS] += chunk.loss
            f[MTP] += chunk.mtp
            if full:
                again = kinds[:group] if block else kinds
                f[FULL_MOE] += sum(again)
                f[FULL_DENSE] += len(again) - sum(again)
        entry = rows.setdefault(tuple(f), [0, r, len(rows)])
        entry[0] += 1
        index.append(entry[2])
    found = cache[key] = ([list(f) for f in rows], [v[0] for v in rows.values()], [v[1] for v in rows.values()],
                          index)
    return found


def layouts_of(exp: Experiment, cache: dict | None = None) -> Layouts:
    """The one layout of `exp`, as Layouts of one entry."""
    import numpy as np  # deferred: start-up time (the CLI imports this module for every command)

    p, t = exp.parallel, exp.training
    stages, count, first, _ = stage_features(exp, cache)
    modules = set(t.recompute_modules or ["core_attn"]) if t.recompute_granularity == "selective" else set()
    one = lambda v: np.asarray([v])  # noqa: E731
    return Layouts(tp=one(p.tensor_model_parallel_size), cp=one(p.context_parallel_size),
                   ep=one(p.expert_model_parallel_size), etp=one(exp.expert_tensor_parallel_size),
                   pp=one(p.pipeline_model_parallel_size), vp=one(exp.virtual_stages),
                   dp=one(exp.data_parallel_size), edp=one(exp.expert_data_parallel_size),
                   sp=one(p.sequence_parallel and p.tensor_model_parallel_size > 1),
                   micro_batch=one(t.micro_batch_size), microbatches=one(exp.num_microbatches),
                   distributed_optimizer=one(p.use_distributed_optimizer), selective=one(0), modules=[modules],
                   stages=np.asarray([stages], dtype=float), stage_count=np.asarray([count], dtype=float),
                   stage_rank=np.asarray([first], dtype=float),
                   host_bytes=np.asarray([[memory.host_bytes(exp, cache)[k] for k in (False, True)]]))


# --------------------------------------------------------------------------------------------
# The arithmetic, on arrays
# --------------------------------------------------------------------------------------------
def _waves(np, m, n, gemms, sms):
    """The share of the SMs' tile slots a launch of `gemms` GEMMs of m x n outputs each fills: whole waves of
    `sms` tiles, of the tile shape (GEMM_TILES) that fills the most; 1 where the SM count is unknown."""
    if not sms:
        return 1.0
    best = 0.0
    for tile_m, tile_n in GEMM_TILES:
        tiles = np.ceil(np.maximum(m, 1.0) / tile_m) * np.ceil(np.maximum(n, 1.0) / tile_n) * gemms
        best = np.maximum(best, m * n * gemms / (np.ceil(tiles / sms) * sms * tile_m * tile_n))
    return best


def _gemm(np, m, k, n, peak, share, r: Rates, ab, gemms=1):
    """Seconds of `gemms` GEMMs together, each (m / gemms x k) @ (k x n), at `peak` FLOP/s: the FLOPs at the
    large-GEMM share of it over the tile slots their waves fill (`_waves`), plus each GEMM's fill and drain
    (MATMUL_FILL_S), never faster than the operands stream from memory."""
    flops = 2.0 * m * k * n
    streamed = (m * k + k * n + m * n) * ab / (r.memory_bps * MEMORY_EFFICIENCY)
    filled = _waves(np, m / gemms, n, gemms, r.sms)
    return np.maximum(flops / max(peak * share, 1.0) / filled + gemms * MATMUL_FILL_S, streamed + gemms * KERNEL_S)


def _stream(nbytes, r: Rates):
    return nbytes / (r.memory_bps * MEMORY_EFFICIENCY)


def _members_per_node(np, size, stride, gpn):
    """Members of a group of `size` ranks, `stride` apart, that share a node of `gpn` devices."""
    return np.clip(gpn // np.maximum(stride, 1), 1, np.maximum(size, 1))


def _collective(np, factor, nbytes, size, stride, r: Rates, efficiency=LINK_EFFICIENCY):
    """Seconds of a collective moving `factor` x `nbytes` per rank over a group of `size` ranks
    `stride` apart: within a node over its device link, across nodes at most the network share of
    the members on each node. None runs in a group of one, nor with nothing to move (a dense model's
    expert gradients)."""
    local = _members_per_node(np, size, stride, r.gpus_per_node)
    spans = local < size
    link = r.node_bps * efficiency
    bw = np.where(spans, np.minimum(link, local * r.network_bps * efficiency), link)
    latency = np.where(spans, LATENCY_NETWORK_S * np.log2(np.maximum(size / local, 2)), LATENCY_NODE_S)
    return np.where((size > 1) & (nbytes > 0), latency + factor * nbytes / np.maximum(bw, 1.0), 0.0)


def _all_to_all(np, token_bytes, topk, size, stride, r: Rates, per_rank: bool = False):
    """Seconds of an expert-parallel token exchange over a group of `size` ranks `stride` apart, each rank
    sending its tokens (`token_bytes`) to the ranks of their `topk` experts: what stays in the node over its
    device link, the rest over each device's network share (a rail-optimized node: one NIC per device),
    whichever takes longer. The all-to-all dispatcher sends every (token, expert) pair; with `per_rank` (the
    flex dispatcher's DeepEP and HybridEP) a token goes once to each rank holding one of its experts, and
    once over the network to each other node, which forwards it over its own links (experts spread evenly)."""
    local = _members_per_node(np, size, stride, r.gpus_per_node)
    nodes = size / local
    if per_rank:
        inside = token_bytes * (local - 1) * (1 - (1 - 1 / size) ** topk)
        outside = token_bytes * (nodes - 1) * (1 - (1 - 1 / nodes) ** topk)
    else:
        inside = token_bytes * topk * (local - 1) / size
        outside = token_bytes * topk * (size - local) / size
    latency = np.where(local < size, LATENCY_NETWORK_S, LATENCY_NODE_S)
    seconds = np.maximum(inside / max(r.node_bps * ALL_TO_ALL_EFFICIENCY, 1.0),
                         outside / max(r.network_bps * ALL_TO_ALL_EFFICIENCY, 1.0))
    return np.where(size > 1, latency + seconds, 0.0)


def _beside(np, comm, compute, r: Rates):
    """Seconds a collective of `comm` seconds adds when it runs beside `compute` seconds of kernels: what the
    compute does not cover, and the compute it covers slowed by the SMs the communication kernels hold
    (COMM_SMS of the device's)."""
    covered = np.minimum(comm, compute)
    return comm - covered + covered * (COMM_SMS / r.sms if r.sms else 0.0)


def _unit_times(np, exp: Experiment, L: Layouts, r: Rates, half: Rates, impl) -> dict:
    """Per layout, what one micro-batch of each unit a stage holds takes: {unit: (forward seconds,
    backward seconds, exposed communication forward, backward, the GEMM and attention part of forward
    and backward, collectives the host launches)} for a dense and an MoE decoder layer, the
    embedding, the loss and an MTP layer; and the selective-recompute extra per layer kind."""
    m, t = exp.model, exp.training
    ab = 2 if (t.bf16 or t.fp16) else 4
    lin_ab = 1 if t.fp8 else ab
    h, heads = m.hidden_size, m.num_attention_heads
    tp, cp, sp = L.tp.astype(float), L.cp.astype(float), L.sp
    s = exp.seq_length / cp                                  # tokens of a sequence on this rank
    T = L.micro_batch * s                                    # tokens through the layer's GEMMs
    T_sp = np.where(sp, T / tp, T)                           # tokens where SP shards them
    mm = lambda mr, kr, nr, **kw: _gemm(np, mr, kr, nr, r.matmul_flops, r.matmul, r, lin_ab, **kw)  # noqa: E731

    # -- attention projections (forward GEMMs)
    if m.multi_latent_attention:
        qk, rope_d, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        if m.q_lora_rank:
            q_proj = mm(T, h, m.q_lora_rank) + mm(T, m.q_lora_rank, heads * (qk + rope_d) / tp)
        else:
            q_proj = mm(T, h, heads * (qk + rope_d) / tp)
        kv_down = mm(T, h, m.kv_lora_rank + rope_d)
        kv_up = mm(T, m.kv_lora_rank, heads * (qk + v) / tp)
        out_proj = mm(T, heads * v / tp, h)
        attn_gemm = q_proj + kv_down + kv_up + out_proj
        up_proj = kv_up + (mm(T, m.q_lora_rank, heads * (qk + rope_d) / tp) if m.q_lora_rank else 0.0)
        qk_dim, v_dim, kv_heads = qk + rope_d, v, heads
        qkv_width = heads * (qk + rope_d + qk + v) / tp
    else:
        d, g = m.head_dim, m.query_groups
        attn_gemm = mm(T, h, (heads + 2 * g) * d / tp) + mm(T, heads * d / tp, h)
        up_proj = 0.0 * T
        qk_dim = v_dim = d
        kv_heads = g
        qkv_width = (heads + 2 * g) * d / tp

    # -- core attention
    local_heads = heads / tp
    b = L.micro_batch
    if impl.unfused_attention:
        # two batched GEMMs over the whole s x s square, and the softmax's traffic: scores written, read
        # and the probabilities written (forward); their gradients (backward)
        full = s * exp.seq_length
        gem = lambda kdim: _gemm(np, b * local_heads * s, kdim, exp.seq_length, half.matmul_flops, half.matmul,  # noqa: E731
                                 half, ab, gemms=b * local_heads)
        elements = b * local_heads * full
        softmax_ab = 4 if t.attention_softmax_in_fp32 else ab
        # forward: the scores written, read and the probabilities written by the softmax, read by P x V;
        # backward: dP written, read with P by the softmax's backward writing dS, dS read twice, P once
        core_fwd = gem(qk_dim) + gem(v_dim) + _stream(elements * (2 * ab + 2 * softmax_ab), r)
        core_bwd = 2 * (gem(qk_dim) + gem(v_dim)) + _stream(elements * (4 * ab + 3 * softmax_ab), r)
    else:
        fwd_eff, bwd_eff = FLASH_EFFICIENCY if impl.transformer == "transformer_engine" else SDPA_EFFICIENCY
        # causal: each query sees half the keys on average (CP's load-balanced chunks keep it so)
        flops = 2.0 * b * local_heads * s * exp.seq_length / 2 * (qk_dim + v_dim)
        grow = exp.seq_length / (exp.seq_length + FLASH_HALF_SEQ)
        core_fwd = flops / (half.matmul_flops * fwd_eff * grow) + KERNEL_S
        core_bwd = FLASH_BACKWARD_FLOPS * flops / (half.matmul_flops * bwd_eff * grow) + KERNEL_S

    # -- element-wise traffic of the attention block: input norm, RoPE on Q and K, the residual
    # (bias-dropout-add), FP8 casts of the linears' inputs
    drop = 1 if m.hidden_dropout > 0 else 0
    rope = m.position_embedding_type in ("rope", "mrope")
    norm_bytes = 2 * T_sp * h * ab
    attn_mem = norm_bytes + (2 * T * qkv_width * ab if rope else 0.0) + (3 + drop) * T_sp * h * ab
    if t.fp8:
        attn_mem = attn_mem + 3 * T * heads * v_dim / tp           # the output projection's input cast

    # -- MLP (dense)
    gate = 2 if m.swiglu else 1
    ffn = m.ffn / tp
    dense_mlp_gemm = mm(T, h, gate * ffn) + mm(T, ffn, h)
    act_bytes = (gate + 1) * T * ffn * ab
    dense_mlp_mem = norm_bytes + act_bytes + (3 + drop) * T_sp * h * ab + (3 * T * ffn if t.fp8 else 0.0)

    # -- MoE: router, permutation, routed experts (the busiest rank's share where dropless), shared experts
    if m.is_moe:
        E, topk = m.num_moe_experts, m.moe_router_topk
        etp = L.etp.astype(float)
        ep = L.ep.astype(float)
        routed = T * topk * etp / tp                          # token-expert pairs on this rank (mean)
        cf = t.moe_expert_capacity_factor
        imbalance = 1.0 if t.moe_router_force_load_balancing else memory.MOE_DROPLESS_IMBALANCE
        busiest = np.where(ep > 1, imbalance, 1.0) if not cf else \
            (cf if t.moe_pad_expert_input_to_capacity else min(cf, imbalance))
        routed = routed * busiest
        local_experts = E / ep
        effn = m.moe_ffn / etp
        experts = mm(routed, h, gate * effn, gemms=local_experts) + mm(routed, effn, h, gemms=local_experts)
        router = _gemm(np, T_sp, h, E, half.matmul_flops, half.matmul, half, 4)
        shared = 0.0
        if m.moe_shared_expert_intermediate_size:
            sffn = m.moe_shared_expert_intermediate_size / tp
            shared = mm(T, h, gate * sffn) + mm(T, sffn, h)
        moe_gemm = experts + router + shared
        permute = 4 * routed * h * ab                          # permute and unpermute: read and write
        moe_mem = norm_bytes + permute + (gate + 1) * routed * effn * ab + (3 + drop) * T_sp * h * ab \
            + (3 * routed * effn if t.fp8 else 0.0)
        # token exchange per direction (tokens travel in BF16: DISPATCH_BYTES): all-to-all of the routed
        # tokens over EP (and TP's all-gather and reduce-scatter around it with expert TP), or the all-gather
        # dispatcher over TP x EP
        if t.moe_token_dispatcher_type == "allgather":
            group = tp * ep
            dispatch = _collective(np, (group - 1) / group, T_sp * group * h * DISPATCH_BYTES, group, 1, r)
        else:
            # the busiest rank receives (and sends back) `busiest` times the mean, and sets the exchange's pace
            dispatch = _all_to_all(np, T_sp * h * DISPATCH_BYTES * busiest, topk, ep, etp, r,
                                   per_rank=t.moe_token_dispatcher_type == "flex")
            dispatch = dispatch + np.where(etp > 1, _collective(np, (etp - 1) / etp, routed * h * DISPATCH_BYTES,
                                                                etp, 1, r), 0.0)
        moe_comm = 2 * dispatch                               # dispatch and combine
    else:
        moe_gemm = moe_mem = moe_comm = 0.0 * T

    # -- tensor-parallel collectives of a decoder layer's attention and MLP blocks
    tp_bytes = T * h * ab
    gather = _collective(np, (tp - 1) / tp, tp_bytes, tp, 1, r)          # all-gather or reduce-scatter
    reduce = _collective(np, 2 * (tp - 1) / tp, tp_bytes, tp, 1, r)      # all-reduce
    overlap = t.tp_comm_overlap

    def tp_exposed(col_gemm, row_gemm):
        """(forward, backward) exposed TP communication of one block: a column-parallel linear
        (gemm `col_gemm`) and a row-parallel one. With SP: all-gather before the first and
        reduce-scatter after the second in the forward; the backward gathers the input again and
        reduce-scatters the input gradient beside the column linear's two GEMMs and gathers the
        output gradient before the row linear's. Without: an all-reduce after the row linear, and
        in the backward one of the input gradient beside the column linear's weight gradient."""
        if overlap:     # userbuffers pipeline each collective with its GEMM
            hide = lambda c, g: _beside(np, c, g, r)  # noqa: E731
            fwd = hide(gather, col_gemm) + hide(gather, row_gemm)
            bwd = 2 * hide(gather, col_gemm) + hide(gather, row_gemm)
            return np.where(sp, fwd, 0.0), np.where(sp, bwd, 0.0)
        fwd = np.where(sp, 2 * gather, reduce)
        bwd = np.where(sp, gather + 2 * _beside(np, gather, col_gemm, r), _beside(np, reduce, col_gemm, r))
        return fwd, bwd

    attn_col = attn_gemm - (mm(T, heads * v_dim / tp, h) if not m.multi_latent_attention else out_proj)
    attn_row = attn_gemm - attn_col
    a_fwd, a_bwd = tp_exposed(attn_col, attn_row)
    half_mlp = dense_mlp_gemm / 2
    d_fwd, d_bwd = tp_exposed(half_mlp, half_mlp)
    if m.is_moe:
        # the MoE block's TP collectives surround the experts only where ETP shards them like TP
        moe_tp = np.where(L.etp == L.tp, 1.0, 0.0)
        m_fwd, m_bwd = d_fwd * moe_tp, d_bwd * moe_tp
    else:
        m_fwd = m_bwd = 0.0 * T

    # -- context parallelism: the ring passes K and V (forward), and them with their gradients
    # (backward), cp - 1 times per layer, each step beside one block of the attention
    kv_bytes = 2 * T * kv_heads * (qk_dim + v_dim) / 2 / tp * ab
    step = _collective(np, 1.0, kv_bytes, cp, tp, r)
    cp_fwd = (cp - 1) * _beside(np, step, core_fwd / cp, r) + np.where(cp > 1, LATENCY_NODE_S, 0.0)
    cp_bwd = (cp - 1) * _beside(np, 2 * step, core_bwd / cp, r)

    # collectives the host launches per layer and micro-batch (each costs it HOST_COLLECTIVE_S)
    tp_calls = np.where(tp > 1, np.where(sp, 10, 4), 0)
    cp_calls = 3 * (cp - 1)
    ep_calls = np.where(L.ep > 1, 4, 0) if m.is_moe else 0

    def unit(gemm, core_f, core_b, mem, comm_f, comm_b, calls, host=None):
        """(forward, backward, exposed comm forward, backward, matmul seconds, host calls); offloaded
        bytes go to the host during the forward and come back for the backward, beside the compute."""
        fwd = gemm + core_f + _stream(mem, r)
        bwd = 2 * gemm + core_b + _stream(2 * mem, r)
        if host is not None:
            transfer = host / max(r.host_bps * LINK_EFFICIENCY, 1.0)
            fwd, bwd = np.maximum(fwd, transfer), np.maximum(bwd, transfer)
        return fwd, bwd, comm_f, comm_b, 3 * gemm + core_f + core_b, calls

    offload = L.host_bytes if L.host_bytes is not None else np.zeros(T.shape + (2,))
    dense = unit(attn_gemm + dense_mlp_gemm, core_fwd, core_bwd, attn_mem + dense_mlp_mem,
                 a_fwd + d_fwd + cp_fwd, a_bwd + d_bwd + cp_bwd, tp_calls + cp_calls, offload[:, 0])
    moe = unit(attn_gemm + moe_gemm, core_fwd, core_bwd, attn_mem + moe_mem, a_fwd + m_fwd + cp_fwd,
               a_bwd + m_bwd + cp_bwd, tp_calls + cp_calls + ep_calls, offload[:, 1])
    exposed = 2 * moe_comm
    if t.overlap_moe_expert_parallel_comm and m.is_moe:
        # 1F1B A2A overlap: one micro-batch's forward runs beside another's backward, layer by layer, each one's
        # all-to-alls beside the other's compute
        exposed = _beside(np, exposed, moe[0] + moe[1], r)
    moe = (moe[0], moe[1], moe[2] + exposed / 2, moe[3] + exposed / 2, *moe[4:])

    # -- embedding: the lookup, and its TP reduction (reduce-scatter with SP, else all-reduce)
    emb_comm = np.where(sp, gather, reduce)
    embedding = unit(0.0 * T, 0.0, 0.0, 3 * T_sp * h * ab, emb_comm, 0.0 * T, np.where(tp > 1, 1, 0))
    # -- loss: final norm, output layer (BF16), cross-entropy over the local vocabulary shard (fp32)
    vocab = m.padded_vocab_size(1) / tp
    logits = _gemm(np, T, h, vocab, half.matmul_flops, half.matmul, half, ab)
    ce_bytes = T * vocab * (ab + 4 + 4 + ab) * (0.5 if t.cross_entropy_loss_fusion else 1.0)
    loss = unit(logits, 0.0, 0.0, norm_bytes + ce_bytes, np.where(sp, gather, 0.0), np.where(sp, gather, 0.0),
                np.where(tp > 1, 5, 0))
    # MTP: one more decoder layer of the last layer's kind, its projection, and another loss
    mtp_layer = moe if m.is_moe and m.moe_layer_pattern()[-1] else dense
    mtp = tuple(a + c for a, c in zip(mtp_layer, loss))

    # selective recompute: the forward of the modules re-run, per layer kind
    def again(modules, moe_layer: bool):
        extra = 0.0 * T
        if "core_attn" in modules:
            extra = extra + core_fwd
        if "layernorm" in modules:
            extra = extra + _stream(2 * norm_bytes, r)
        if "mla_up_proj" in modules:
            extra = extra + up_proj
        if moe_layer:
            if "moe" in modules:
                extra = extra + moe_gemm + _stream(moe_mem, r)
            elif "moe_act" in modules:
                extra = extra + _stream((gate + 1) * routed * effn * ab, r)
            if "shared_experts" in modules and m.moe_shared_expert_intermediate_size:
                extra = extra + shared
        elif "mlp" in modules:
            extra = extra + dense_mlp_gemm + _stream(act_bytes, r)
        return extra

    selective = {k: np.choose(L.selective, [np.broadcast_to(again(mods, k), T.shape) for mods in L.modules])
                 for k in (False, True)}
    return {"dense": dense, "moe": moe, "embedding": embedding, "loss": loss, "mtp": mtp,
            "selective": selective, "activation_bytes": ab}


@dataclass
class Times:
    """What `step_times` gives per layout (numpy arrays)."""

    step_s: Any
    compute_s: Any                  # the busiest stage's compute, over all its micro-batches
    communication_s: Any            # exposed: the busiest stage's, and the data-parallel sync's
    bubble_s: Any                   # waiting on the pipeline (fill, drain, slower stages)
    host_s: Any                     # the GPUs waiting on the host to launch their work (host-bound)
    other_s: Any                    # optimizer step and fixed per-step costs
    matmul_s: Any                   # of compute_s: in GEMMs and attention (power)
    stage_s: Any                    # per distinct stage: one micro-batch's forward and backward
    params_stage: Any               # per distinct stage: parameters on one rank (dense + expert)
    data_parallel_s: Any = 0.0      # of communication_s: the exposed data-parallel sync (power's timeline)


def step_times(exp: Experiment, L: Layouts, impl=None, efficiency: float | None = None) -> Times:
    """The step time of every layout in `L` (all of `exp`'s other settings), and its parts;
    `efficiency`: the large-GEMM efficiency to assume instead of the hardware's (see `rates`)."""
    import numpy as np  # deferred: start-up time

    m, t = exp.model, exp.training
    precision = linear_precision(exp)
    r = rates(exp, precision, efficiency)
    # attention and the output layer run in the linears' precision, but in BF16/FP16 under FP8 (Transformer
    # Engine's FP8 covers the layers' linears only)
    half = r if precision != "fp8" else rates(exp, "fp16" if t.fp16 else "bf16", efficiency)
    impl = impl or memory.implementation(exp)
    u = _unit_times(np, exp, L, r, half, impl)
    S = L.stages                                           # layouts x stages x features
    col = lambda f: S[:, :, f]  # noqa: E731
    w = lambda x: np.asarray(x)[:, None]  # noqa: E731   per layout -> per layout and stage

    def stage_sum(i):
        """Per layout and stage: part i of the units (0 fwd, 1 bwd, 2 comm fwd, 3 comm bwd, 4 matmul,
        5 host calls)."""
        total = col(DENSE) * w(u["dense"][i]) + col(MOE) * w(u["moe"][i]) + col(EMBEDDING) * w(u["embedding"][i]) \
            + col(LOSS) * w(u["loss"][i]) + col(MTP) * w(u["mtp"][i])
        if i in (0, 2, 5):    # full recompute re-runs the forward of those layers, communication included
            total = total + col(FULL_DENSE) * w(u["dense"][i]) + col(FULL_MOE) * w(u["moe"][i])
        return total

    fwd, bwd, comm_f, comm_b, matmul, calls = (stage_sum(i) for i in range(6))
    selective = col(DENSE) * w(u["selective"][False]) + col(MOE) * w(u["selective"][True])
    compute = fwd + bwd + selective
    comm = comm_f + comm_b
    # pipeline sends: each stage receives and sends an activation forward and a gradient backward
    # per micro-batch; hidden by the interleaved schedule's overlap, exposed in 1F1B
    pp, vp = w(L.pp), w(L.vp)
    p2p_bytes = (
        w(L.micro_batch * exp.seq_length / L.cp * m.hidden_size / np.where(L.sp, L.tp, 1)) * u["activation_bytes"]
    )
    world = exp.world_size
    p2p = _collective(np, 1.0, p2p_bytes, 2 * (pp > 1), world / pp, r)
    comm = comm + np.where(vp > 1, 2 * np.where(pp > 1, LATENCY_NODE_S, 0.0), 2 * p2p)
    # the host: layers to launch per micro-batch (recomputed ones again), and the schedule's own
    layers = col(DENSE) + col(MOE) + col(MTP) + 0.5 * (col(FULL_DENSE) + col(FULL_MOE))
    host = layers * host_layer_seconds(exp, impl) + (col(MOE) + 0.5 * col(FULL_MOE)) * HOST_MOE_LAYER_S \
        + calls * HOST_COLLECTIVE_S + HOST_MICROBATCH_S
    gpu = compute + comm
    stage = np.maximum(gpu, host)
    present = L.stage_count > 0
    vps = L.vp.astype(float)
    mb = L.microbatches.astype(float)

    def schedule(per_stage):
        """The pipeline's time with these stage times (per layout and stage)."""
        slowest = np.where(present, per_stage, 0.0).max(axis=1)
        return (per_stage * L.stage_count).sum(axis=1) / vps + (mb - 1 / vps) * slowest

    pipeline = schedule(stage)
    host_bound = pipeline - schedule(gpu)   # what the host adds where it is slower than the GPU work
    busiest = np.argmax(np.where(present, stage, -1.0), axis=1)
    pick = lambda a: np.take_along_axis(a, busiest[:, None], axis=1)[:, 0]  # noqa: E731
    compute_s, comm_s, matmul_s = mb * pick(compute), mb * pick(comm), mb * pick(matmul)

    # -- data-parallel sync and the optimizer, per stage
    params = _stage_params(np, exp, L)                     # (dense, expert) per layout and stage, on one rank
    pr = memory.precision(exp)
    grad_bytes = pr.grad
    dense_group, expert_group = w(L.dp * L.cp), w(L.edp)
    dist = w(L.distributed_optimizer)
    fsdp = exp.parallel.use_megatron_fsdp or exp.parallel.use_torch_fsdp2
    shard = dist | fsdp
    factor = lambda n: np.where(shard, (n - 1) / n, 2 * (n - 1) / n)  # noqa: E731  reduce-scatter or all-reduce
    dense_stride, expert_stride = w(L.tp), w(L.etp * L.ep)
    grads = (_collective(np, factor(dense_group), params[0] * grad_bytes, dense_group, dense_stride, r)
             + _collective(np, factor(expert_group), params[1] * grad_bytes, expert_group, expert_stride, r))
    gathers = np.where(shard, _collective(np, (dense_group - 1) / dense_group, params[0] * pr.weight, dense_group,
                                          dense_stride, r)
                       + _collective(np, (expert_group - 1) / expert_group, params[1] * pr.weight, expert_group,
                                     expert_stride, r), 0.0)
    last_bwd, first_fwd = bwd + comm_b, fwd + comm_f
    if t.overlap_grad_reduce or fsdp:    # the last bucket waits for the last layer
        grads = np.maximum(_beside(np, grads, last_bwd, r), grads * 0.1)
    if t.overlap_param_gather or fsdp:
        gathers = np.maximum(_beside(np, gathers, first_fwd, r), gathers * 0.1)
    # a later stage ends its backward earlier than stage 0 (by its rank's backward steps)
    slack = L.stage_rank * w(pipeline / np.maximum(mb * vps + L.pp - 1, 1)) * 0.5
    dp_exposed = np.where(present, np.maximum(grads + gathers - slack, 0.0), 0.0).max(axis=1)
    updated = np.where(shard, params[0] / dense_group + params[1] / expert_group, params[0] + params[1])
    if t.optimizer_cpu_offload:
        opt = (updated * (grad_bytes + pr.weight)) / max(r.host_bps, 1.0)
    else:
        opt = _stream(updated * OPTIMIZER_BYTES + (params[0] + params[1]) * GRAD_ZERO_BYTES, r)
    optimizer = np.where(present, opt, 0.0).max(axis=1)
    other = optimizer + FIXED_STEP_S
    step = pipeline + dp_exposed + other
    # no bubble comes out a rounding error below 0
    bubble = np.maximum(pipeline - host_bound - compute_s - comm_s, 0.0)
    return Times(step_s=step, compute_s=compute_s, communication_s=comm_s + dp_exposed, bubble_s=bubble,
                 host_s=host_bound, other_s=other, matmul_s=matmul_s, stage_s=stage, params_stage=params[0] + params[1],
                 data_parallel_s=dp_exposed)


def host_layer_seconds(exp: Experiment, impl) -> float:
    """The host's seconds to launch one decoder layer's forward and backward for one micro-batch."""
    te = impl.transformer == "transformer_engine"
    return HOST_LAYER_S["transformer_engine" if te else "local"] \
        * (DETERMINISTIC_HOST if te and exp.training.deterministic_mode else 1.0)


def _stage_params(np, exp: Experiment, L: Layouts):
    """(dense, expert) parameters on one rank of each distinct stage (per layout and stage)."""
    m = exp.model
    S = L.stages
    pattern = m.moe_layer_pattern()

    def sizes(tp: int, ep: int, etp: int) -> tuple:
        """(dense layer, MoE layer dense and expert, embedding, output layer, MTP layer dense and expert)."""
        moe = memory.layer_params(m, True, tp, ep, etp) if m.is_moe else (0, 0)
        mtp = memory.mtp_layer_params(m, pattern[-1], tp, ep, etp) if m.mtp_num_layers else (0, 0)
        return (sum(memory.layer_params(m, False, tp, ep, etp)), *moe, memory.embedding_params(m, tp),
                m.padded_vocab_size(tp) * m.hidden_size // tp, *mtp)

    # once per distinct (TP, EP, expert TP): a key of the three in one integer
    keys = (L.tp.astype(np.int64) << 40) | (L.ep.astype(np.int64) << 20) | L.etp.astype(np.int64)
    distinct, index = np.unique(keys, return_inverse=True)
    table = np.asarray([sizes(int(k >> 40), int((k >> 20) & 0xFFFFF), int(k & 0xFFFFF)) for k in distinct], dtype=float)
    dense_layer, moe_dense, moe_expert, embedding, output, mtp_dense, mtp_expert = table[index.ravel()].T
    w = lambda x: x[:, None]  # noqa: E731
    # a tied output layer is the embedding's own weight where the stage holds both
    own_output = S[:, :, LOSS] * (1.0 if m.untie_embeddings_and_output_weights else (S[:, :, EMBEDDING] == 0))
    final_norm = memory.norm_params(m, m.hidden_size)
    dense = (S[:, :, DENSE] * w(dense_layer) + S[:, :, MOE] * w(moe_dense) + S[:, :, EMBEDDING] * w(embedding)
             + own_output * w(output) + S[:, :, LOSS] * final_norm + S[:, :, MTP] * w(mtp_dense))
    expert = S[:, :, MOE] * w(moe_expert) + S[:, :, MTP] * w(mtp_expert)
    return dense, expert


# --------------------------------------------------------------------------------------------
# Power
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PowerModel:
    idle_w: float
    max_w: float                    # what the busiest work draws (the board's limit)
    source: str                     # "assumed: ..." | "calibrated from N recorded runs of HW"

    def watts(self, utilization):
        return self.idle_w + (self.max_w - self.idle_w) * utilization


def power_model(exp: Experiment) -> PowerModel | None:
    """The hardware's power model: a fit to its recorded runs where there is one, else its preset's
    idle power and board limit; None where the preset gives no board limit (a CPU)."""
    hw = exp.hardware
    if not hw.tdp_w:
        return None
    fit = calibration.load_power(hw.name)
    if fit is not None:
        runs = [str(p.get("run")) for p in fit.get("points") or [] if isinstance(p, dict)]
        named = f": {', '.join(runs[:2])}" + (f" and {len(runs) - 2} more (doctor --show)" if len(runs) > 2 else "")
        return PowerModel(fit["idle_w"], fit["max_w"], f"calibrated from {fit['runs']} recorded run"
                          f"{'s' if fit['runs'] != 1 else ''} of {hw.name}{named if runs else ''}")
    return PowerModel(hw.idle_w, hw.tdp_w, "assumed")


def utilization(np, times: Times):
    """The share of the board's dynamic range one device draws over a step (ACTIVITY per part)."""
    matmul = np.minimum(times.matmul_s, times.compute_s)
    memory_bound = times.compute_s - matmul + times.other_s
    busy = (ACTIVITY["matmul"] * matmul + ACTIVITY["memory"] * memory_bound
            + ACTIVITY["communication"] * times.communication_s + ACTIVITY["idle"] * (times.bubble_s + times.host_s))
    return np.clip(busy / times.step_s, 0.0, 1.0)


# --------------------------------------------------------------------------------------------
# One experiment
# --------------------------------------------------------------------------------------------
# The parts of a step, each a share of it (`Times`): compute, exposed communication, the pipeline's
# bubble (fill, drain, slower stages), the GPUs waiting on the host to launch work (host-bound, at any
# PP), and the optimizer step with the fixed per-step costs
SHARES = ("compute", "communication", "bubble", "host", "other")


@dataclass
class SpeedReport:
    step_s: float
    tokens_per_s: float
    samples_per_s: float
    flops_per_iteration: float     # Megatron's count (causal attention: half the score matrix)
    flops_full_attention: float     # the same with the whole attention square, as NeMo's tables up to 24.07
    mfu: float | None               # of the dense peak in the precision the matmuls run in
    precision: str
    params_total: int
    params_per_stage: list[int]     # the whole stage (all its TP/EP ranks)
    params_per_device: list[int]    # one rank of each stage
    shares: dict                    # SHARES: each part's share of the step
    power_w: float | None           # average per device
    energy_per_token_j: float | None
    samples_per_s_mj: float | None  # the paper's samples/(s·MJ): samples/s per MJ per iteration
    rates_source: str               # where the GEMM efficiency comes from
    power_source: str | None
    notes: list[str] = field(default_factory=list)
    # the batch ramp-up's steps before the steady ones above: (global batch, steps, step seconds) in order
    ramp: list[tuple[int, int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "samples_per_s": self.samples_per_s,
                "flops_per_iteration": self.flops_per_iteration, "flops_full_attention": self.flops_full_attention,
                "mfu": self.mfu, "mfu_precision": self.precision,
                "params_total": self.params_total, "params_per_stage": self.params_per_stage,
                "params_per_device": self.params_per_device, "shares": self.shares, "power_w": self.power_w,
                "energy_per_token_j": self.energy_per_token_j, "samples_per_s_mj": self.samples_per_s_mj,
                "source": {"step_time": self.rates_source, "power": self.power_source}, "notes": list(self.notes),
                "ramp": [{"global_batch_size": b, "steps": n, "step_s": s} for b, n, s in self.ramp]}


def describe(exp: Experiment) -> str:
    """Where the speed figures of `exp` come from, in one short line (links and memory: its preset)."""
    precision = linear_precision(exp)
    r = rates(exp, precision)
    power = power_model(exp)
    source = "assumed" if r.source == "assumed" else r.source
    return (f"speed: GEMMs at {r.matmul:.0%} of the {precision} peak ({source}) · "
            + (f"power: idle {power.idle_w:.0f} W to {power.max_w:.0f} W ({power.source})" if power
               else "power: none (the preset gives no board limit)"))


def calibrated_efficiency(exp: Experiment, step_s: float, impl=None) -> float | None:
    """The large-GEMM efficiency at which the model gives `exp` the measured `step_s` (`doctor
    --train`'s job), to four digits; None where no efficiency in 2-100% gives it (the step is set by
    what the efficiency does not change, or the measurement is off)."""
    if missing(exp):
        return None
    L = layouts_of(exp)
    impl = impl or memory.implementation(exp)
    step = lambda share: float(step_times(exp, L, impl, share).step_s[0])  # noqa: E731  falls as share grows
    low, high = 0.02, 1.0
    if not step(high) <= step_s <= step(low):
        return None
    while high - low > 1e-4:
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) > step_s else (low, middle)
    return round((low + high) / 2, 4)


def figures(exp: Experiment, L: Layouts, times: Times) -> dict:
    """Per layout (numpy arrays): the step time and what follows from it, as the sweep's columns
    (engine.model.sweep.SPEED) and `estimate` report them."""
    import numpy as np  # deferred: start-up time

    t = exp.training
    samples, tokens = t.global_batch_size, t.global_batch_size * exp.seq_length
    step = times.step_s if not missing(exp) else np.full(times.step_s.shape, np.nan)
    tps = np.unique(L.tp)
    flops = np.asarray([num_floating_point_operations(exp.model, samples, exp.seq_length, int(tp)) for tp in tps])
    flops = flops[np.searchsorted(tps, L.tp)]
    _, peak = peak_tflops(exp, None)
    out = {"step_s": step, "tokens_per_s": tokens / step,
           "mfu": flops / step / exp.world_size / (peak * 1e12) if peak else np.full(step.shape, np.nan),
           **{f"{part}_share": getattr(times, f"{part}_s") / step for part in SHARES}}
    power = power_model(exp)
    if power is not None:
        watts = power.watts(utilization(np, times))
        out["power_w"] = watts
        out["energy_per_token_j"] = watts * exp.world_size * step / tokens
    else:
        out["power_w"] = out["energy_per_token_j"] = np.full(step.shape, np.nan)
    out["flops_per_iteration"] = flops
    out["params"] = np.full(step.shape, float(memory.count_parameters(exp.model)))
    out["params_per_device"] = np.where(L.stage_count > 0, times.params_stage, 0.0).max(axis=1)
    return out


def estimate(exp: Experiment) -> SpeedReport | None:
    """The step time, throughput, MFU, shares and power of `exp` as laid out; None where its hardware
    lacks a figure the model needs (`unknown` says which)."""
    if missing(exp):
        return None
    cache: dict = {}
    L = layouts_of(exp, cache)
    impl = memory.implementation(exp, cache)
    times = step_times(exp, L, impl=impl)
    got = {name: float(value[0]) for name, value in figures(exp, L, times).items()}
    power = power_model(exp)
    watts = got["power_w"] if power is not None else None
    samples = exp.training.global_batch_size
    energy_step = watts * exp.world_size * got["step_s"] if watts is not None else None
    notes = []
    t = exp.training
    if t.optimizer == "muon":
        notes.append("optimizer 'muon': its Newton-Schulz iterations are not modelled (timed as Adam's step)")
    if t.cuda_graph_impl != "none":
        notes.append(f"cuda_graph_impl = {t.cuda_graph_impl!r}: the host's launch time is not reduced for the "
                     "captured parts")
    ramp = []
    for batch, steps in exp.batch_ramp():     # the steps before the global batch, each at its own batch
        early = dataclasses.replace(exp, training=dataclasses.replace(t, global_batch_size=batch,
                                                                      rampup_batch_size=None))
        ramp.append((batch, steps, float(step_times(early, layouts_of(early, cache), impl=impl).step_s[0])))
    if ramp:
        notes.append(f"batch ramp-up: the step above is the steady one (global batch {t.global_batch_size}), after "
                     f"{sum(n for _, n, _ in ramp):,} ramp-up steps of batch {ramp[0][0]} to {ramp[-1][0]} "
                     f"({sum(n * s for _, n, s in ramp):,.0f} s)")
    precision, peak = peak_tflops(exp, None)
    return SpeedReport(step_s=got["step_s"], tokens_per_s=got["tokens_per_s"], samples_per_s=samples / got["step_s"],
                       flops_per_iteration=got["flops_per_iteration"],
                       flops_full_attention=flops_per_iteration(exp, causal=False), mfu=got["mfu"] if peak else None,
                       precision=precision, params_total=int(got["params"]),
                       params_per_stage=_whole_stage_params(exp),
                       params_per_device=[int(times.params_stage[0][i]) for i in stage_features(exp, cache)[3]],
                       shares={part: got[f"{part}_share"] for part in SHARES},
                       power_w=watts, energy_per_token_j=got["energy_per_token_j"] if watts is not None else None,
                       samples_per_s_mj=samples / got["step_s"] / (energy_step / 1e6) if energy_step else None,
                       rates_source=rates(exp, linear_precision(exp)).source,
                       power_source=power.source if power else None, notes=notes, ramp=ramp)


def _whole_stage_params(exp: Experiment) -> list[int]:
    """Parameters of each pipeline stage, all its TP and EP ranks together."""
    m = exp.model
    pattern = m.moe_layer_pattern()
    tied = not m.untie_embeddings_and_output_weights
    pp = exp.parallel.pipeline_model_parallel_size
    out = []
    for stage in memory.split_layers(exp):
        total = 0
        for chunk in stage:
            total += sum(sum(memory.layer_params(m, pattern[i])) for i in chunk.layers)
            if chunk.embedding:
                total += memory.embedding_params(m)
            if chunk.loss:
                total += memory.norm_params(m, m.hidden_size)
                if not tied or pp > 1 or not chunk.embedding:
                    total += m.padded_vocab_size() * m.hidden_size
            if chunk.mtp:
                total += chunk.mtp * sum(memory.mtp_layer_params(m, pattern[-1]))
        out.append(int(total))
    return out
