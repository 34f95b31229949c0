"""Per-GPU training memory: what the PyTorch caching allocator peaks at on each pipeline stage.

`estimate(exp)` returns a `MemoryReport` with one `StageMemory` per pipeline rank: the peak of
`torch.cuda.max_memory_allocated` over a training iteration on that stage's most loaded rank, split
into weights, gradients, optimizer state, activations and other (logits, embedding, workspaces).

The formulas start from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", 34sbh + 5as²b bytes per layer) and Megatron-LM's
`theoretical_memory_usage.py`, and fix what those miss: every saved tensor is counted from its own
shape (SwiGLU, GQA, MLA, flash vs unfused attention, dropout masks only when dropout is on,
sequence-parallel sharding only where SP shards), routed-token MoE activations, the in-flight
micro-batches of 1F1B and of the interleaved schedule (walked chunk by chunk), recompute, and the
last stage's logits: the bf16 logits plus the fp32 copy that the cross-entropy keeps for backward.
Calibrated against measured Megatron-LM runs (tests/test_memory_validation.py).

Memory outside the allocator (CUDA context, NCCL buffers) and an allocator fragmentation margin are
not in `total_bytes`; they enter the fit verdict.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from charllm.engine.experiment import Experiment
from charllm.probes.errors import UserError

GIB = 1 << 30

# The caching allocator rounds and splits blocks; runs allocating ~74% of an 80 GB H100 have been
# seen to OOM. We keep this share of the allocator peak free on top of outside-allocator memory.
FRAGMENTATION_FRACTION = 0.10

# Allocations that stay between iterations beyond weights/grads/optimizer state (measured on H100,
# see tests/test_memory_validation.py): RNG states, autograd/NCCL-registered buffers, loss-scaler
# and grad-norm scalars, and the cuBLAS/cuDNN workspaces Transformer Engine takes from the allocator.
MIB = 1 << 20
BASE_WORKSPACE_BYTES = 32 * MIB
TE_WORKSPACE_BYTES = 64 * MIB
# TE's grouped GEMM keeps one 32 MiB cuBLAS workspace per stream, 4 streams.
GROUPED_GEMM_WORKSPACE_BYTES = 128 * MIB
# TE's TP communication overlap (userbuffers) keeps one 32 MiB workspace per stream, 3 streams.
TP_OVERLAP_WORKSPACE_BYTES = 96 * MIB
# Dropless MoE with expert parallelism: the running peak sees the most loaded rank's tokens, not
# the mean. Measured: 15-40% more routed tokens than balanced; with EP = 1 every rank sees all.
MOE_DROPLESS_IMBALANCE = 1.3


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
@dataclass
class ChunkMemory:
    """One virtual pipeline chunk of a stage."""

    virtual_rank: int
    layers: list[int]               # decoder layer indices
    has_embedding: bool
    has_loss: bool
    mtp_layers: int
    weights: int
    activation_bytes: int           # per micro-batch


@dataclass
class StageMemory:
    pp_rank: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    other: int
    in_flight: int                  # micro-batch chunks whose activations are held at the peak
    workspace: int = 0              # the part of `other` that stays allocated between iterations
    chunks: list[ChunkMemory] = field(default_factory=list)
    usable_bytes: int = 0
    outside_allocator_bytes: int = 0
    fragmentation_margin_bytes: int = 0

    @property
    def static_bytes(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def steady_bytes(self) -> int:
        """Allocated between iterations (what `torch.cuda.memory_allocated` shows then)."""
        return self.static_bytes + self.workspace

    @property
    def activation_bytes(self) -> int:
        return self.activations

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.activations + self.other

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.outside_allocator_bytes - self.fragmentation_margin_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def breakdown(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other}

    def to_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "static_bytes": self.static_bytes,
                "activation_bytes": self.activation_bytes, "total_bytes": self.total_bytes,
                "breakdown": self.breakdown, "fits": self.fits, "headroom_bytes": self.headroom_bytes,
                "steady_bytes": self.steady_bytes, "in_flight": self.in_flight,
                "chunks": [{"virtual_rank": c.virtual_rank, "num_layers": len(c.layers),
                            "has_embedding": c.has_embedding, "has_loss": c.has_loss,
                            "weights": c.weights, "activation_bytes": c.activation_bytes}
                           for c in self.chunks]}


@dataclass
class MemoryReport:
    stages: list[StageMemory]
    usable_bytes: int
    outside_allocator_bytes: int
    fragmentation_margin_bytes: int
    ignored_args: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.total_bytes).pp_rank

    @property
    def peak_bytes(self) -> int:
        return max(s.total_bytes for s in self.stages)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def headroom_bytes(self) -> int:
        return min(s.headroom_bytes for s in self.stages)

    def to_dict(self) -> dict:
        return {"fits": self.fits, "usable_bytes": self.usable_bytes, "peak_bytes": self.peak_bytes,
                "peak_stage": self.peak_stage, "headroom_bytes": self.headroom_bytes,
                "stages": [s.to_dict() for s in self.stages],
                "outside_allocator_bytes": self.outside_allocator_bytes,
                "fragmentation_margin_bytes": self.fragmentation_margin_bytes,
                "ignored_args": list(self.ignored_args), "warnings": list(self.warnings)}


# --------------------------------------------------------------------------------------------
# Pipeline split: which decoder layers, embedding, loss and MTP layers each virtual chunk holds
# --------------------------------------------------------------------------------------------
@dataclass
class _Chunk:
    layers: list[int]
    embedding: bool = False
    loss: bool = False
    mtp: int = 0


def split_layers(exp: Experiment) -> list[list[_Chunk]]:
    """chunks[pp_rank][virtual_rank]; global chunk c = v * PP + r (Megatron's interleaving)."""
    p, m = exp.parallel, exp.model
    pp, vp, n = p.pipeline_model_parallel_size, exp.virtual_stages, m.num_layers
    mtp = m.mtp_num_layers or 0
    total = pp * vp
    if p.pipeline_model_parallel_layout:
        flat = _parse_layout(p.pipeline_model_parallel_layout, total)
    else:
        flat = [_Chunk([]) for _ in range(total)]
        first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
        slots: list[str | int] = list(range(n))
        if p.account_for_embedding_in_pipeline_split:
            slots.insert(0, "E")
        if p.account_for_loss_in_pipeline_split:
            slots.append("L")
        counts = _even_counts(len(slots), total, first, last, vp)
        i = 0
        for c, k in enumerate(counts):
            for slot in slots[i:i + k]:
                if slot == "E":
                    flat[c].embedding = True
                elif slot == "L":
                    flat[c].loss = True
                else:
                    flat[c].layers.append(slot)
            i += k
        flat[0].embedding = True
        flat[-1].loss = True
        flat[-1].mtp = mtp
    return [[flat[v * pp + r] for v in range(vp)] for r in range(pp)]


def _even_counts(slots: int, total: int, first: int | None, last: int | None, vp: int) -> list[int]:
    if vp == 1 and (first or last):
        rest = slots - (first or 0) - (last or 0)
        middle = total - (first is not None) - (last is not None)
        each = rest // middle if middle else 0
        counts = [each] * total
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        if middle:
            counts[(1 if first is not None else 0)] += rest - each * middle
        return counts
    each, extra = divmod(slots, total)
    return [each + (1 if c < extra else 0) for c in range(total)]


def _parse_layout(layout: str, total: int) -> list[_Chunk]:
    """Megatron's --pipeline-model-parallel-layout: E embedding, t layer, m MTP, L loss, | stage."""
    text = layout.replace(" ", "").replace('"', "").replace("'", "")
    pattern = re.compile(r"\(([^()]*)\)\*(\d+)")
    while (match := pattern.search(text)):
        text = text[:match.start()] + match.group(1) * int(match.group(2)) + text[match.end():]
    text = re.sub(r"([EtmL])\*(\d+)", lambda mm: mm.group(1) * int(mm.group(2)), text)
    parts = text.split("|")
    if parts and parts[-1] == "" and len(parts) == total + 1:
        parts = parts[:-1]
    if len(parts) != total or set("".join(parts)) - set("EtmL"):
        raise UserError(f"pipeline_model_parallel_layout = {layout!r}: expected {total} stages "
                        f"of E/t/m/L separated by '|'")
    chunks, layer = [], 0
    for part in parts:
        chunk = _Chunk([], embedding="E" in part, loss="L" in part, mtp=part.count("m"))
        for _ in range(part.count("t")):
            chunk.layers.append(layer)
            layer += 1
        chunks.append(chunk)
    return chunks


# --------------------------------------------------------------------------------------------
# Parameters on one rank
# --------------------------------------------------------------------------------------------
def _norm(m, size: int) -> int:
    return size * (2 if m.normalization == "LayerNorm" else 1)


def attention_params(m, tp: int = 1) -> int:
    """Self-attention parameters of one layer on one TP rank (input norm included)."""
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk, pos, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        if m.q_lora_rank:
            # down projections are replicated across TP ("duplicated"); up projections split
            q = h * m.q_lora_rank + _norm(m, m.q_lora_rank) + m.q_lora_rank * a * (qk + pos) // tp
        else:
            q = h * a * (qk + pos) // tp
        kv = h * (m.kv_lora_rank + pos) + _norm(m, m.kv_lora_rank) + m.kv_lora_rank * a * (qk + v) // tp
        out = a * v * h // tp + (h if m.add_bias_linear else 0)
        return _norm(m, h) + q + kv + out
    d, g = m.head_dim, m.query_groups
    qkv = (a + 2 * g) * d
    qkv_bias = qkv if (m.add_bias_linear or m.add_qkv_bias) else 0
    qk_norm = 2 * _norm(m, d) if m.qk_layernorm else 0
    proj = a * d * h // tp + (h if m.add_bias_linear else 0)   # row-parallel bias is replicated
    return _norm(m, h) + (h * qkv + qkv_bias) // tp + qk_norm + proj


def mlp_params(m, ffn: int, tp: int = 1) -> int:
    """One dense MLP (or one expert) on one rank, without its norm."""
    gate = 2 if m.swiglu else 1
    h = m.hidden_size
    bias = (ffn * gate // tp + h) if m.add_bias_linear else 0
    return (h * ffn * gate + ffn * h) // tp + bias


def layer_params(m, moe: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one decoder layer on one rank."""
    dense = attention_params(m, tp) + _norm(m, m.hidden_size)
    if not moe:
        return dense + mlp_params(m, m.ffn, tp), 0
    dense += m.num_moe_experts * m.hidden_size                    # router, replicated
    if m.moe_shared_expert_intermediate_size:
        dense += mlp_params(m, m.moe_shared_expert_intermediate_size, tp)
    expert = (m.num_moe_experts // ep) * mlp_params(m, m.moe_ffn, etp)
    return dense, expert


def embedding_params(m, tp: int = 1) -> int:
    pos = (m.max_position_embeddings or m.seq_length) * m.hidden_size \
        if m.position_embedding_type == "learned_absolute" else 0
    return m.padded_vocab_size(tp) * m.hidden_size // tp + pos


def mtp_layer_params(m, moe: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """enorm + hnorm + eh_proj (2h -> h) + one decoder layer + final norm."""
    dense, expert = layer_params(m, moe, tp, ep, etp)
    h = m.hidden_size
    return dense + 3 * _norm(m, h) + 2 * h * h // tp, expert


def count_parameters(m) -> int:
    """All parameters of the model (TP = EP = 1), as megatron-core's GPTModel has them."""
    pattern = m.moe_layer_pattern()
    total = embedding_params(m) + _norm(m, m.hidden_size)
    total += sum(sum(layer_params(m, moe)) for moe in pattern)
    if m.untie_embeddings_and_output_weights:
        total += m.padded_vocab_size() * m.hidden_size
    if m.mtp_num_layers:
        total += m.mtp_num_layers * sum(mtp_layer_params(m, pattern[-1]))
    return total


# --------------------------------------------------------------------------------------------
# Activations of one micro-batch on one rank
# --------------------------------------------------------------------------------------------
@dataclass
class _Act:
    """Bytes saved for backward, and the extra live bytes while its backward (or recompute) runs."""

    saved: float
    transient: float


def _attention_impl(exp: Experiment) -> str:
    t = exp.training
    if t.attention_backend in ("unfused", "local") or (
            t.transformer_impl == "local" and t.attention_backend == "auto"):
        return "unfused"
    return "flash"


class _Shapes:
    """Per-layer activation sizes for one experiment (computed once, reused per stage)."""

    def __init__(self, exp: Experiment, micro_batch_size: int | None = None):
        m, p, t = exp.model, exp.parallel, exp.training
        self.exp = exp
        self.tp = p.tensor_model_parallel_size
        self.cp = p.context_parallel_size
        self.etp = exp.expert_tensor_parallel_size
        self.sp = p.sequence_parallel and self.tp > 1
        self.b = micro_batch_size or t.micro_batch_size
        self.s = exp.seq_length / self.cp
        self.ab = 4 if not (t.bf16 or t.fp16) else 2          # activation element bytes
        self.lin = 1 if t.fp8 else self.ab                     # linear inputs saved in FP8
        self.unfused = _attention_impl(exp) == "unfused"
        self.attn_dropout = m.attention_dropout > 0
        self.hid_dropout = m.hidden_dropout > 0
        self.modules = set(t.recompute_modules or ["core_attn"]) \
            if t.recompute_granularity == "selective" else set()
        self.full_recompute = t.recompute_granularity == "full"
        # sequence-sharded ("full" per rank unless SP) and TP-sharded sizes, elements
        self.sbh = self.s * self.b * m.hidden_size / (self.tp if self.sp else 1)
        self.tokens_tp = self.s * self.b / self.tp
        self._cache: dict[bool, _Act] = {}

    def layer(self, moe: bool) -> _Act:
        act = self._cache.get(moe)
        if act is None:
            act = self._cache[moe] = self._layer(moe)
        return act

    def _layer(self, moe: bool) -> _Act:
        m, ab, lin, sbh = self.exp.model, self.ab, self.lin, self.sbh
        s, b, tp = self.s, self.b, self.tp
        mask = 1 if self.hid_dropout else 0
        # -- attention block
        saved = ab * sbh                                   # input norm's input (the residual)
        if "layernorm" not in self.modules:
            saved += lin * sbh                             # norm output = QKV input
        a = m.num_attention_heads
        if m.multi_latent_attention:
            qk = m.qk_head_dim + m.qk_pos_emb_head_dim
            q_ranks = (m.q_lora_rank or 0) * 2             # norm input + up-projection input
            saved += ab * s * b * (q_ranks + 2 * m.kv_lora_rank) / (tp if self.sp else 1)
            q = k = ab * s * b * a * qk / tp
            v = o = ab * s * b * a * m.v_head_dim / tp
        else:
            d, g = m.head_dim, m.query_groups
            q = o = ab * s * b * a * d / tp
            k = v = ab * s * b * g * d / tp
        core_recompute = "core_attn" in self.modules
        scores = ab * a * s * s * b / tp                   # one s x s tensor of the local heads
        attn_transient = 0.0
        if self.unfused:
            core = 0.0 if core_recompute else scores * (1 + (1.5 if self.attn_dropout else 0))
            attn_transient = 2 * scores                    # softmax grad in + out
        else:
            core = 0.0 if core_recompute else 4 * a * s * b / tp     # fp32 log-sum-exp
        if m.qk_layernorm:
            saved += q + k                                 # Q/K norm inputs
        if self.cp > 1:
            saved += q + k + v                             # CP ring: Q and the exchanged K/V per step
        saved += q + k + v + core + (lin / ab) * o + mask * sbh
        # -- MLP / MoE block
        saved += ab * sbh                                  # pre-MLP norm's input
        if "layernorm" not in self.modules:
            saved += lin * sbh                             # norm output = FC1 / router input
        gate = 2 if m.swiglu else 1
        if not moe:
            ffn = s * b * m.ffn / tp
            mlp = ab * ffn * gate + lin * ffn
            if "mlp" in self.modules:
                mlp = 0.0
            saved += mlp
            mlp_transient = 2 * ab * ffn * gate
        else:
            topk = m.moe_router_topk
            cf = self.exp.training.moe_expert_capacity_factor
            # tokens reaching one rank's experts: its expert-TP group's sequence shards, top-k each
            routed = s * b * topk * self.etp / tp
            if cf:
                routed *= cf if self.exp.training.moe_pad_expert_input_to_capacity else min(cf, MOE_DROPLESS_IMBALANCE)
            elif self.exp.parallel.expert_model_parallel_size > 1:
                routed *= MOE_DROPLESS_IMBALANCE
            effn = routed * m.moe_ffn / self.etp
            router = 4 * s * b * m.num_moe_experts * 2 / (tp if self.sp else 1)  # fp32 logits + probs
            experts = lin * routed * m.hidden_size + ab * effn * gate \
                + (0 if "moe_act" in self.modules else lin * effn) + ab * routed * m.hidden_size
            shared = 0.0
            if m.moe_shared_expert_intermediate_size:
                sffn = s * b * m.moe_shared_expert_intermediate_size / tp
                shared = ab * sffn * gate + lin * sffn
                if "shared_experts" in self.modules:
                    shared = 0.0
            moe_saved = router + experts + shared
            if "moe" in self.modules:
                moe_saved = 0.0
            saved += moe_saved
            mlp_transient = 2 * ab * effn * gate + 2 * ab * routed * m.hidden_size
        saved += mask * sbh
        transient = max(attn_transient, mlp_transient)
        return _Act(saved, transient)

    def checkpoint_input(self) -> float:
        return self.ab * self.sbh

    def embedding(self) -> float:
        """Token ids (int64) and the embedding dropout mask."""
        return 8 * self.s * self.b + (self.sbh if self.hid_dropout else 0)

    def final_norm(self) -> float:
        return self.ab * self.sbh + self.lin * self.sbh

    def logits(self, vocab: int) -> tuple[float, float]:
        """(bf16 logits, fp32 copy the cross-entropy keeps for backward) on one TP rank."""
        n = self.s * self.b * vocab / self.tp
        return self.ab * n, 4 * n


# --------------------------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------------------------
def estimate(exp: Experiment, *, ignored_args: list[str] | None = None,
             warnings: list[str] | None = None) -> MemoryReport:
    """Peak allocator bytes per pipeline stage, with a fit verdict on `exp.hardware`."""
    m, p, t, hw = exp.model, exp.parallel, exp.training, exp.hardware
    notes = list(warnings or [])
    pp, vp = p.pipeline_model_parallel_size, exp.virtual_stages
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, exp.expert_tensor_parallel_size
    chunks = split_layers(exp)
    pattern = m.moe_layer_pattern()
    if len(pattern) < m.num_layers:
        pattern = pattern + [False] * (m.num_layers - len(pattern))
    shapes = _Shapes(exp)
    vocab = m.padded_vocab_size(tp)
    tied_copy = not m.untie_embeddings_and_output_weights

    # Bytes per parameter
    half = t.bf16 or t.fp16
    w_bytes = 2 if half else 4
    g_bytes = 2 if (t.grad_reduce_in_bf16 and half) else 4
    o_bytes = (12 if half else 8) if t.optimizer == "adam" else (8 if half else 4)
    instances = max(1, p.num_distributed_optimizer_instances)
    dp_shard = max(1, exp.data_parallel_size * p.context_parallel_size // instances)
    edp_shard = max(1, exp.expert_data_parallel_size // instances)
    fsdp = p.use_megatron_fsdp or p.use_torch_fsdp2
    strategy = p.data_parallel_sharding_strategy if p.use_megatron_fsdp else (
        "optim_grads_params" if p.use_torch_fsdp2 else "no_shard")
    shard_opt = p.use_distributed_optimizer or (fsdp and strategy != "no_shard")
    shard_grads = fsdp and strategy in ("optim_grads", "optim_grads_params")
    shard_weights = fsdp and strategy == "optim_grads_params"

    te = t.transformer_impl == "transformer_engine"
    workspace = BASE_WORKSPACE_BYTES + (TE_WORKSPACE_BYTES if te else 0)
    if te and m.is_moe and t.moe_grouped_gemm:
        workspace += GROUPED_GEMM_WORKSPACE_BYTES
    if te and t.tp_comm_overlap:
        workspace += TP_OVERLAP_WORKSPACE_BYTES
    if pp > 1:
        # each model chunk keeps its last received input and sent output (p2p buffers)
        workspace += 2 * vp * shapes.ab * shapes.sbh
    num_mb = exp.num_microbatches
    stages = []
    for r in range(pp):
        dense = expert = 0
        chunk_reports = []
        chunk_acts = []
        for v, chunk in enumerate(chunks[r]):
            cd = ce = 0
            act = 0.0
            for i in chunk.layers:
                d, e = layer_params(m, pattern[i], tp, ep, etp)
                cd += d
                ce += e
            if chunk.embedding:
                cd += embedding_params(m, tp)
                act += shapes.embedding()
            if chunk.loss:
                cd += _norm(m, m.hidden_size)
                if not tied_copy or pp > 1 or not any(c.embedding for c in chunks[r]):
                    cd += vocab * m.hidden_size // tp       # output weight (own copy when PP > 1)
                act += shapes.final_norm()
            for _ in range(chunk.mtp):
                d, e = mtp_layer_params(m, pattern[-1], tp, ep, etp)
                cd += d
                ce += e
                la = shapes.layer(pattern[-1])
                act += la.saved + 3 * shapes.ab * shapes.sbh + shapes.final_norm()
            act += _stack_activations(shapes, [pattern[i] for i in chunk.layers])
            dense += cd
            expert += ce
            chunk_acts.append(act)
            chunk_reports.append(ChunkMemory(v, list(chunk.layers), chunk.embedding, chunk.loss,
                                             chunk.mtp, (cd + ce) * w_bytes, int(act)))
        weights = _sharded(dense, dp_shard, shard_weights) + _sharded(expert, edp_shard, shard_weights)
        grads = _sharded(dense, dp_shard, shard_grads) + _sharded(expert, edp_shard, shard_grads)
        opt = _sharded(dense, dp_shard, shard_opt) + _sharded(expert, edp_shard, shard_opt)

        has_loss = any(c.loss for c in chunks[r])
        loss_extra = 0.0
        if has_loss:
            lb, lf = shapes.logits(vocab)
            kept = lf * (1 + (m.mtp_num_layers or 0) + (1 if t.cross_entropy_loss_fusion else 0))
            loss_extra = lb + kept
        windows, units = _in_flight(chunk_acts, [c.loss for c in chunks[r]], r, pp, vp, num_mb)
        # Backward: the recompute of a layer group (full), else the gradients of the largest layer.
        layer_acts = [shapes.layer(pattern[i]) for c in chunks[r] for i in c.layers]
        if shapes.full_recompute:
            group = 1 if t.recompute_method == "block" else (t.recompute_num_layers or 1)
            bwd = max((a.saved for a in layer_acts), default=0.0) * group
        else:
            bwd = max((a.transient for a in layer_acts), default=0.0)
        held_loss, held_max = windows
        if has_loss and held_loss + loss_extra >= held_max + bwd:
            activations, dynamic = held_loss, loss_extra
        else:
            activations, dynamic = held_max, bwd
        other = workspace + dynamic
        if shard_weights:
            # FSDP all-gathers a layer's bf16 weights (and reduce-scatters its grads) on the fly
            biggest = max((sum(layer_params(m, pattern[i], tp, ep, etp)) for c in chunks[r] for i in c.layers),
                          default=0)
            other += 2 * biggest * (w_bytes + g_bytes)
        stages.append(StageMemory(
            pp_rank=r, weights=int(weights * w_bytes), gradients=int(grads * g_bytes),
            optimizer=int(opt * o_bytes), activations=int(activations), other=int(other), in_flight=units,
            workspace=int(workspace),
            chunks=chunk_reports))
    usable = int(hw.usable_bytes or hw.memory_bytes)
    peak = max(s.total_bytes for s in stages)
    margin = int(FRAGMENTATION_FRACTION * peak)
    for s in stages:
        s.usable_bytes, s.outside_allocator_bytes, s.fragmentation_margin_bytes = \
            usable, int(hw.outside_allocator_bytes), margin
    if not usable:
        notes.append(f"hardware {hw.name!r} has no usable_bytes: no fit verdict possible")
    if t.optimizer not in ("adam", "sgd"):
        notes.append(f"optimizer {t.optimizer!r}: optimizer state counted as Adam's")
    return MemoryReport(stages, usable, int(hw.outside_allocator_bytes), margin,
                        list(ignored_args or []), notes)


def _sharded(params: int, degree: int, sharded: bool) -> float:
    return params / degree if sharded else params


def _stack_activations(shapes: _Shapes, moe_flags: list[bool]) -> float:
    """Saved activations of a chunk's decoder layers for one micro-batch, after recompute."""
    if not moe_flags:
        return 0.0
    t = shapes.exp.training
    if shapes.full_recompute:
        n = t.recompute_num_layers or 1
        if t.recompute_method == "block":
            kept = moe_flags[min(n, len(moe_flags)):]
            return n * shapes.checkpoint_input() + sum(shapes.layer(f).saved for f in kept)
        return math.ceil(len(moe_flags) / n) * shapes.checkpoint_input()
    return sum(shapes.layer(f).saved for f in moe_flags)


def _in_flight(acts: list[float], loss: list[bool], r: int, pp: int, vp: int,
               m: int) -> tuple[tuple[float, float], int]:
    """Held activations over the pipeline schedule on rank r: ((at a loss step, max), units).

    1F1B: min(PP - r, m) micro-batches. Interleaved: Megatron's warm-up of (PP - r - 1) * 2 +
    (VP - 1) * PP forward chunk-steps plus the current one, chunk c of step k being
    (k mod PP*VP) // PP; the held set is a sliding window of that many steps over the sequence.
    """
    if vp == 1:
        n = min(pp - r, m)
        return (n * acts[0], n * acts[0]), n
    total = m * vp
    n = min((pp - r - 1) * 2 + (vp - 1) * pp + 1, total)
    seq = [(k % (pp * vp)) // pp for k in range(min(total, n + pp * vp))]
    at_loss = best = window = 0.0
    for e, c in enumerate(seq):
        window += acts[c]
        if e >= n:
            window -= acts[seq[e - n]]
        best = max(best, window)
        if loss[c]:
            at_loss = max(at_loss, window)
    return (at_loss, best), n
