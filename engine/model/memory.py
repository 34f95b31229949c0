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
Calibrated against measured Megatron-LM runs (tests/engine/model/test_memory_validation.py).

Memory outside the allocator (CUDA context, NCCL buffers) and what the allocator reserves beyond
its allocated peak are not in `total_bytes`; they enter the fit verdict (`Budget`), which is one of
fits / tight / does not fit, with its arithmetic (`Budget.explain`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from charllm.engine.model import calibration, megatron, runtime
from charllm.engine.model.experiment import SECTIONS, Experiment, declared, field_options, parse_pipeline_layout
from charllm.engine.model.validate import ignored
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import MIB, size

# Allocations that stay between iterations beyond weights/grads/optimizer state (measured on H100,
# see tests/engine/model/test_memory_validation.py): RNG states, autograd/NCCL-registered buffers, loss-scaler
# and grad-norm scalars; and the cuBLAS/cuDNN workspaces taken from the allocator, by Transformer Engine
# or by torch's own GEMMs alike (Megatron-LM's CI measures the same static memory for the same model
# with --transformer-impl local as with transformer_engine, e.g. gpt3_mcore_tp1_pp4 and _te_tp1_pp4_vp1).
BASE_WORKSPACE_BYTES = 32 * MIB
GEMM_WORKSPACE_BYTES = 64 * MIB
# TE's grouped GEMM keeps one 32 MiB cuBLAS workspace per stream, 4 streams.
GROUPED_GEMM_WORKSPACE_BYTES = 128 * MIB
# TE's TP communication overlap (userbuffers) keeps one 32 MiB workspace per stream, 3 streams.
TP_OVERLAP_WORKSPACE_BYTES = 96 * MIB
# Dropless MoE with expert parallelism: the running peak sees the most loaded rank's tokens, not
# the mean. Measured: 15-40% more routed tokens than balanced in one micro-batch; with EP = 1 every
# rank sees all. The excess is a fluctuation of the routing, not a fixed skew (the load-balancing
# loss keeps the mean even), so over n micro-batches held at once it averages out as 1/sqrt(n): the
# held activations carry n x the mean plus sqrt(n) x one micro-batch's excess.
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


FITS, TIGHT, DOES_NOT_FIT = "fits", "tight", "does not fit"
VERDICTS = (FITS, TIGHT, DOES_NOT_FIT)                          # by severity
# How far a planned peak may be from the measured one: the 90th percentile of |planned / measured - 1|
# over the 87 counted cases of tests/data/memory_dev (3.7%; mean 1.4%, the worst 5.8%; measured with
# tests/engine/model/test_memory_validation.py). A plan within it of the limit, either side, is tight.
PEAK_MARGIN = 0.037
SEVERITY = {name: level for level, name in enumerate(VERDICTS)}
VERDICT_STYLE = {FITS: "green", TIGHT: "yellow", DOES_NOT_FIT: "red"}   # how every command and screen colours one


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
    allocator_bytes: int = 0        # what the allocator may hold on this device (Budget)
    reserve_bytes: int = 0          # what it reserves beyond the allocated peak (Budget.reserve)

    @property
    def static_bytes(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def steady_bytes(self) -> int:
        """Allocated between iterations (what `torch.cuda.memory_allocated` shows then)."""
        return self.static_bytes + self.workspace

    @property
    def churn_bytes(self) -> int:
        """Allocated and freed again within each iteration (what fragments the allocator's pool)."""
        return self.total_bytes - self.steady_bytes

    @property
    def activation_bytes(self) -> int:
        return self.activations

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.activations + self.other

    @property
    def headroom_bytes(self) -> int:
        """Left after the allocated peak and the allocator's reserve; < 0 is tight or does not fit."""
        return self.allocator_bytes - self.total_bytes - self.reserve_bytes

    @property
    def verdict(self) -> str:
        return verdict(self.allocator_bytes, self.total_bytes, self.reserve_bytes)

    @property
    def fits(self) -> bool:
        return self.verdict == FITS

    @property
    def breakdown(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other}

    def to_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "static_bytes": self.static_bytes,
                "activation_bytes": self.activation_bytes, "total_bytes": self.total_bytes,
                "breakdown": self.breakdown, "verdict": self.verdict, "fits": self.fits,
                "reserve_bytes": self.reserve_bytes, "headroom_bytes": self.headroom_bytes,
                "steady_bytes": self.steady_bytes, "in_flight": self.in_flight,
                "chunks": [{"virtual_rank": c.virtual_rank, "num_layers": len(c.layers),
                            "has_embedding": c.has_embedding, "has_loss": c.has_loss,
                            "weights": c.weights, "activation_bytes": c.activation_bytes}
                           for c in self.chunks]}


def severity(allocator_bytes, peak_bytes, reserve_bytes):
    """The verdict's index in VERDICTS: 0 fits (the allocated peak, PEAK_MARGIN more, and the allocator's
    reserve beyond it fit), 2 does not fit (the peak is over even PEAK_MARGIN less), 1 tight in between:
    within the plan's error of the limit, or without room for the reserve. Works on numpy arrays (the
    sweep) as on numbers."""
    import numpy as np

    return np.where(peak_bytes * (1 - PEAK_MARGIN) > allocator_bytes, 2,
                    np.where(peak_bytes * (1 + PEAK_MARGIN) + reserve_bytes > allocator_bytes, 1, 0))


def verdict(allocator_bytes, peak_bytes, reserve_bytes):
    """The verdict's name (see `severity`): a string, or an array of them for arrays."""
    import numpy as np

    out = np.asarray(VERDICTS)[severity(allocator_bytes, peak_bytes, reserve_bytes)]
    return str(out) if out.ndim == 0 else out


@dataclass
class MemoryReport:
    stages: list[StageMemory]
    budget: "Budget"
    ignored_args: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    implementation: "runtime.Implementation | None" = None   # what the plan assumes will run
    runtime_problems: list[str] = field(default_factory=list)  # why it would not launch on that stack
    stack_source: str = ""                                    # where that stack comes from

    @property
    def usable_bytes(self) -> int:
        return self.budget.usable_bytes

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.total_bytes).pp_rank

    @property
    def peak_bytes(self) -> int:
        return max(s.total_bytes for s in self.stages)

    @property
    def worst(self) -> StageMemory:
        """The stage the verdict is about: the worst verdict, then the least headroom."""
        return min(self.stages, key=lambda s: (-SEVERITY[s.verdict], s.headroom_bytes))

    @property
    def verdict(self) -> str:
        return self.worst.verdict

    @property
    def fits(self) -> bool:
        return self.verdict == FITS

    @property
    def headroom_bytes(self) -> int:
        return min(s.headroom_bytes for s in self.stages)

    def explain(self) -> list[str]:
        """The verdict's arithmetic, line by line, with where each figure comes from."""
        return self.budget.explain(self.worst)

    def to_dict(self) -> dict:
        b = self.budget
        return {"verdict": self.verdict, "fits": self.fits, "usable_bytes": b.usable_bytes,
                "peak_bytes": self.peak_bytes, "peak_stage": self.peak_stage, "verdict_stage": self.worst.pp_rank,
                "headroom_bytes": self.headroom_bytes, "stages": [s.to_dict() for s in self.stages],
                "outside_allocator_bytes": b.outside_allocator_bytes, "dispatcher_buffer_bytes": b.dispatcher_bytes,
                "allocator_bytes": b.allocator_bytes,
                "reserve_bytes": self.worst.reserve_bytes, "reserve_fraction": b.reserve_fraction,
                "expandable_segments": b.expandable_segments,
                "usable_source": b.usable_source, "outside_allocator_source": b.outside_source,
                "reserve_source": b.reserve_source, "arithmetic": self.explain(),
                "implementation": self.implementation.to_dict() if self.implementation else None,
                "stack": self.stack_source, "cannot_run": list(self.runtime_problems),
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
    return _split(_split_key(exp))


class _Fields:
    """Reads a fixed set of experiment fields ((section, name) pairs) as one hashable tuple (lists as
    tuples): a cache key."""

    def __init__(self, fields) -> None:
        self.fields = tuple(fields)
        self._get = operator.attrgetter(*(f"{section}.{name}" for section, name in self.fields))
        self._lists = [i for i, (section, name) in enumerate(self.fields)
                       if any(typing.get_origin(o) is list for o in field_options(SECTIONS[section], name))]

    def __iter__(self):
        return iter(self.fields)

    def __contains__(self, item) -> bool:
        return item in self.fields

    def __call__(self, exp: Experiment) -> tuple:
        values = self._get(exp)
        if len(self.fields) == 1:
            values = (values,)
        if not self._lists:
            return values
        return tuple(tuple(v) if i in self._lists and isinstance(v, list) else v for i, v in enumerate(values))


# The fields the split reads, as their metadata says (engine.model.experiment.setting's pipeline_split):
# they key its cache, and `_split` reads them by name from that key alone.
SPLIT_FIELDS = _Fields((section, name) for section, name, _ in declared("pipeline_split"))


def _split_key(exp: Experiment) -> tuple:
    return SPLIT_FIELDS(exp)


@functools.lru_cache(maxsize=4096)
def _split(key: tuple) -> list[list[_Chunk]]:
    f = dict(zip((name for _, name in SPLIT_FIELDS), key))
    n, pp, vp = f["num_layers"], f["pipeline_model_parallel_size"], f["virtual_pipeline_model_parallel_size"] or 1
    layout, first, last = (f["pipeline_model_parallel_layout"], f["decoder_first_pipeline_num_layers"],
                           f["decoder_last_pipeline_num_layers"])
    total = pp * vp
    if layout:
        flat = _parse_layout(layout, total)
    else:
        flat = [_Chunk([]) for _ in range(total)]
        slots: list[str | int] = list(range(n))
        if f["account_for_embedding_in_pipeline_split"]:
            slots.insert(0, "E")
        if f["account_for_loss_in_pipeline_split"]:
            slots.append("L")
        i = 0
        for c, k in enumerate(_even_counts(len(slots), total, first, last, vp)):
            for slot in slots[i:i + k]:
                if slot == "E":
                    flat[c].embedding = True
                elif slot == "L":
                    flat[c].loss = True
                else:
                    flat[c].layers.append(int(slot))
            i += k
        flat[0].embedding = True
        flat[-1].loss = True
        flat[-1].mtp = f["mtp_num_layers"] or 0
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
    try:
        stages = parse_pipeline_layout(layout)
    except ValueError as exc:
        raise UserError(f"pipeline_model_parallel_layout = {layout!r}: {exc}") from None
    if len(stages) != total:
        raise UserError(f"pipeline_model_parallel_layout = {layout!r}: {len(stages)} stages, expected "
                        f"pipeline x virtual = {total}")
    chunks, layer = [], 0
    for stage in stages:
        chunk = _Chunk([], embedding="E" in stage, loss="L" in stage, mtp=stage.count("m"))
        for _ in range(stage.count("t")):
            chunk.layers.append(layer)
            layer += 1
        chunks.append(chunk)
    return chunks


# --------------------------------------------------------------------------------------------
# Parameters on one rank
# --------------------------------------------------------------------------------------------
def norm_params(m, size: int) -> int:
    """Parameters of one norm over `size` elements (LayerNorm: weight and bias; RMSNorm: weight)."""
    return size * (2 if m.normalization == "LayerNorm" else 1)



def attention_params(m, tp: int = 1) -> int:
    """Self-attention parameters of one layer on one TP rank (input norm included)."""
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk, pos, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        if m.q_lora_rank:
            # down projections are replicated across TP ("duplicated"); up projections split
            q = h * m.q_lora_rank + norm_params(m, m.q_lora_rank) + m.q_lora_rank * a * (qk + pos) // tp
        else:
            q = h * a * (qk + pos) // tp
        kv = h * (m.kv_lora_rank + pos) + norm_params(m, m.kv_lora_rank) + m.kv_lora_rank * a * (qk + v) // tp
        out = a * v * h // tp + (h if m.add_bias_linear else 0)
        return norm_params(m, h) + q + kv + out
    d, g = m.head_dim, m.query_groups
    qkv = (a + 2 * g) * d
    qkv_bias = qkv if (m.add_bias_linear or m.add_qkv_bias) else 0
    qk_norm = 2 * norm_params(m, d) if m.qk_layernorm else 0
    proj = a * d * h // tp + (h if m.add_bias_linear else 0)   # row-parallel bias is replicated
    return norm_params(m, h) + (h * qkv + qkv_bias) // tp + qk_norm + proj


def mlp_params(m, ffn: int, tp: int = 1) -> int:
    """One dense MLP (or one expert) on one rank, without its norm."""
    gate = 2 if m.swiglu else 1
    h = m.hidden_size
    bias = (ffn * gate // tp + h) if m.add_bias_linear else 0
    return (h * ffn * gate + ffn * h) // tp + bias


def layer_params(m, moe: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one decoder layer on one rank."""
    dense = attention_params(m, tp) + norm_params(m, m.hidden_size)
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
    return dense + 3 * norm_params(m, h) + 2 * h * h // tp, expert


def count_parameters(m) -> int:
    """All parameters of the model (TP = EP = 1), as megatron-core's GPTModel has them."""
    pattern = m.moe_layer_pattern()
    total = embedding_params(m) + norm_params(m, m.hidden_size)
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
    """Bytes saved for backward, and the extra live bytes while its backward (or recompute) runs; and
    the same per part of the layer a CUDA graph scope can capture (attn, mlp, router, experts)."""

    saved: float
    transient: float
    parts: dict = field(default_factory=dict)      # part -> (saved, transient)
    offloaded: float = 0.0                         # fine-grained offloading: bytes sent to the host


def implementation(exp: Experiment, cache: dict | None = None) -> "runtime.Implementation":
    """What the plan assumes will run: the experiment resolved on its hardware's node stack.
    `cache` (one hardware, see `layout_terms`) keeps that stack: finding it reads the calibration."""
    if cache is None:
        return runtime.resolve(exp, calibration.for_planning(exp.hardware))
    stack = cache.get("stack")
    if stack is None:
        stack = cache["stack"] = calibration.for_planning(exp.hardware)
    return runtime.resolve(exp, stack)


class _Shapes:
    """Per-layer activation sizes for one experiment (computed once, reused per stage)."""

    def __init__(self, exp: Experiment, impl: "runtime.Implementation | None" = None, imbalance: bool = True):
        m, p, t = exp.model, exp.parallel, exp.training
        self.imbalance = imbalance          # plan routed tokens for the busiest rank (see MOE_DROPLESS_IMBALANCE)
        impl = impl or implementation(exp)
        self.exp = exp
        self.tp = p.tensor_model_parallel_size
        self.cp = p.context_parallel_size
        self.etp = exp.expert_tensor_parallel_size
        self.sp = p.sequence_parallel and self.tp > 1
        self.b = t.micro_batch_size
        self.s = exp.seq_length / self.cp
        self.ab = 4 if not (t.bf16 or t.fp16) else 2          # activation element bytes
        self.lin = 1 if t.fp8 else self.ab                     # linear inputs saved in FP8
        self.unfused = impl.unfused_attention
        # megatron-core applies the router probabilities to the expert activation: inside the fused
        # weighted SwiGLU kernel where bias_activation_fusion is on, else as a multiply that keeps the
        # activation's output for its backward (moe/experts.py, bias_act_func, core_v0.16.1)
        self.fused_probs = m.swiglu and "bias_activation_fusion" in impl.fusions
        # megatron-core's unfused softmax without its fused kernel (FusedScaleMaskSoftmax's torch path)
        # upcasts the scores: softmax keeps its fp32 output for backward, the bf16 cast feeds P x V
        self.upcast_softmax = (impl.attention == "megatron-unfused" and "masked_softmax_fusion" not in impl.fusions
                               and t.attention_softmax_in_fp32 and self.ab == 2)
        # SDPA hands GQA to the kernel only where a kernel surely takes it (runtime.sdpa_takes_gqa);
        # elsewhere engine/workload/attention.py expands K and V to every head first, and the kernel
        # keeps the expanded copies for backward.
        self.expanded_kv = impl.attention.startswith("sdpa") and not runtime.sdpa_takes_gqa(
            impl.device == "cuda", self.ab == 2, impl.sdpa_kernels)
        self.attn_dropout = m.attention_dropout > 0
        self.hid_dropout = m.hidden_dropout > 0
        self.modules = set(t.recompute_modules or ["core_attn"]) \
            if t.recompute_granularity == "selective" else set()
        self.full_recompute = t.recompute_granularity == "full"
        # fine-grained activation offloading: these modules' inputs leave the GPU in every layer
        self.offload = set(t.offload_modules or []) if t.fine_grained_activation_offloading else set()
        # sequence-sharded ("full" per rank unless SP) and TP-sharded sizes, elements
        self.sbh = self.s * self.b * m.hidden_size / (self.tp if self.sp else 1)
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
        off = self.offload
        offloaded = 0.0                                    # bytes of this layer's saved tensors on the host

        def kept(module: str, size: float) -> float:
            """`size` saved bytes that stay on the GPU unless `module` is offloaded: megatron-core offloads
            every tensor saved for backward inside the module's offloading context (its saved-tensor
            hooks, pipeline_parallel/fine_grained_activation_offload.py, core_v0.16.1)."""
            nonlocal offloaded
            if module in off:
                offloaded += size
                return 0.0
            return size

        # -- attention block
        saved = kept("attn_norm", ab * sbh)                # input norm's input (the residual)
        if "layernorm" not in self.modules:
            saved += kept("qkv_linear", lin * sbh)         # norm output = QKV input
        a = m.num_attention_heads
        # MLA with mla_up_proj recompute: the up-projections' outputs (Q, K, V) are dropped once core
        # attention has run and recomputed for its backward (multi_latent_attention.py, qkv_up_checkpoint)
        up_recompute = m.multi_latent_attention and "mla_up_proj" in self.modules
        if m.multi_latent_attention:
            qk = m.qk_head_dim + m.qk_pos_emb_head_dim
            q_ranks = (m.q_lora_rank or 0) * 2             # norm input + up-projection input
            # the projections run inside the QKV offloading context (get_query_key_value_tensors)
            saved += kept("qkv_linear", ab * s * b * (q_ranks + 2 * m.kv_lora_rank) / (tp if self.sp else 1))
            q = k = ab * s * b * a * qk / tp
            v = o = ab * s * b * a * m.v_head_dim / tp
        else:
            d, g = m.head_dim, m.query_groups
            q = o = ab * s * b * a * d / tp
            k = v = ab * s * b * (a if self.expanded_kv else g) * d / tp
        core_recompute = "core_attn" in self.modules
        scores = a * s * s * b / tp                        # elements of one s x s tensor of the local heads
        attn_transient = 0.0
        if self.unfused:
            # softmax output (and its fp32 original when upcast); with dropout also its 1-byte mask and output
            probs = (ab + (4 if self.upcast_softmax else 0)) * scores
            core = 0.0 if core_recompute else probs + ((1 + ab) * scores if self.attn_dropout else 0)
            attn_transient = 2 * (4 if self.upcast_softmax else ab) * scores   # softmax grad in + out
        else:
            core = 0.0 if core_recompute else 4 * a * s * b / tp     # fp32 log-sum-exp
        # Q/K norm inputs; MLA normalises its latents inside the up-projections instead (q_layernorm and
        # kv_layernorm are IdentityOp, linear_q/kv_up_proj TE LayerNormColumnParallelLinear: gpt_layer_specs.py,
        # core_v0.16.1 and core_v0.19.0), whose inputs q_ranks and kv_lora_rank count above
        if m.qk_layernorm and not m.multi_latent_attention:
            saved += kept("qkv_linear", q + k)
        # what core attention keeps: its inputs (unless recomputed from the MLA latents), the CP ring's
        # Q and exchanged K/V per step, and its own softmax or log-sum-exp
        inputs = 0.0 if up_recompute else q + k + v
        if up_recompute:
            attn_transient += q + k + v                    # recomputed for the backward
        ring = q + k + v if self.cp > 1 else 0.0
        # a flash-type kernel keeps its output O for backward; the output projection keeps its input: the
        # same tensor, unless FP8 makes the projection keep its own FP8 copy
        out = o if not self.unfused and lin != ab else 0.0
        saved += kept("core_attn", inputs + ring + core + out) + kept("attn_proj", (lin / ab) * o) + mask * sbh
        attn_saved = saved
        # -- MLP / MoE block
        saved += kept("mlp_norm", ab * sbh)                # pre-MLP norm's input
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
            balanced = self.exp.training.moe_router_force_load_balancing
            busiest = MOE_DROPLESS_IMBALANCE if self.imbalance and not balanced else 1.0
            if cf:
                routed *= cf if self.exp.training.moe_pad_expert_input_to_capacity else min(cf, busiest)
            elif self.exp.parallel.expert_model_parallel_size > 1:
                routed *= busiest
            effn = routed * m.moe_ffn / self.etp
            router = 4 * s * b * (m.num_moe_experts or 0) * 2 / (tp if self.sp else 1)  # fp32 logits + probs
            # fc1 input, fc1 output, fc2 input (+ the activation output the probability multiply keeps),
            # and the fp32 routing probabilities; permute and unpermute keep only index maps
            act_out = 0.0 if "moe_act" in self.modules else lin * effn + (0.0 if self.fused_probs else ab * effn)
            experts = kept("expert_fc1", lin * routed * m.hidden_size) + kept("moe_act", ab * effn * gate) \
                + act_out + 4 * routed
            shared = 0.0
            if m.moe_shared_expert_intermediate_size:
                sffn = s * b * m.moe_shared_expert_intermediate_size / tp
                shared = ab * sffn * gate + lin * sffn
                if "shared_experts" in self.modules:
                    shared = 0.0
            moe_saved = router + experts + shared
            if "moe" in self.modules:
                moe_saved = router = 0.0
            saved += moe_saved
            mlp_transient = 2 * ab * effn * gate + 2 * ab * routed * m.hidden_size
            routing = saved - attn_saved - moe_saved + router          # pre-MLP norm and router
        saved += mask * sbh
        # Fine-grained offloading in backward (fine_grained_activation_offload.py, core_v0.16.1): the chunk
        # whose backward comes next keeps its last layer's groups on the GPU (should_bulk_offload), and each
        # group's backward reloads the next offloaded group, last in first out, so while a layer's largest
        # group runs, the groups of the layer before it down to that one are back too: about two layers'
        # offloaded tensors beside the compute's own.
        transient = max(attn_transient, mlp_transient) + 2 * offloaded
        if moe:
            parts = {"attn": (attn_saved, attn_transient), "router": (routing, 0.0),
                     "experts": (saved - attn_saved - routing, mlp_transient)}
        else:
            parts = {"attn": (attn_saved, attn_transient), "mlp": (saved - attn_saved, mlp_transient)}
        return _Act(saved, transient, parts, offloaded)

    def checkpoint_input(self) -> float:
        return self.ab * self.sbh

    def embedding(self) -> float:
        """Token ids (int64) and the embedding dropout mask."""
        return 8 * self.s * self.b + (self.sbh if self.hid_dropout else 0)

    def finalnorm_params(self) -> float:
        return self.ab * self.sbh + self.lin * self.sbh

    def logits(self, vocab: int) -> tuple[float, float]:
        """(bf16 logits, fp32 copy the cross-entropy keeps for backward) on one TP rank."""
        n = self.s * self.b * vocab / self.tp
        return self.ab * n, 4 * n


# --------------------------------------------------------------------------------------------
# Estimate
# --------------------------------------------------------------------------------------------
@dataclass
class StageTerms:
    """What one stage needs, before bytes-per-parameter, sharding and hardware are applied."""

    pp_rank: int
    dense_params: int               # on one rank; sharded over DP x CP by the distributed optimizer
    expert_params: int              # sharded over the expert data-parallel group
    held_loss: float                # activations held while the loss runs (last stage)
    held_max: float                 # the most activations held at any step
    backward: float                 # live extra during a backward (recompute or gradients)
    loss_extra: float               # logits: bf16 + the fp32 copies kept for backward
    fsdp_layer_params: int          # the largest layer, all-gathered on the fly under FSDP
    in_flight: int
    chunks: list[ChunkMemory]
    embedding_params: int = 0       # of dense_params: the embeddings and the output layer
    graph_static: float = 0.0       # CUDA graphs' static buffers (kept between iterations)
    capture: tuple | None = None    # (held_loss, held_max, backward, loss_extra) while the graphs are captured


# The fields the activation terms read, as their metadata says (engine.model.experiment.setting's
# activations): with the implementation they run as, they key the terms' cache (the sweep's too).
ACTIVATION_FIELDS = _Fields((section, name) for section, name, _ in declared("activations"))


def _act_key(exp: Experiment, impl: "runtime.Implementation") -> tuple:
    return ACTIVATION_FIELDS(exp), impl


def stage_terms(exp: Experiment, cache: dict | None = None, *, with_chunks: bool = True,
                peak_candidates: bool = False) -> list[StageTerms]:
    """Per-stage terms of one experiment (`stage_arrays` with one setting). `cache`: see `layout_terms`."""
    cache = {} if cache is None else cache
    chunks, plan, weights = layout_terms(exp, cache, peak_candidates)
    out = []
    for st in stage_arrays(len(chunks), plan, weights, activation_terms(exp, cache), exp.num_microbatches,
                           exp.parallel.microbatch_group_size_per_vp_stage):
        reports = [ChunkMemory(v, list(c.layers), c.embedding, c.loss, c.mtp, st.chunk_weights[v],
                               int(st.chunk_acts[v])) for v, c in enumerate(chunks[st.pp_rank])] \
            if with_chunks else []
        out.append(StageTerms(st.pp_rank, st.dense_params, st.expert_params, float(st.held_loss),
                              float(st.held_max), float(st.backward), float(st.loss_extra),
                              st.fsdp_layer_params, int(st.in_flight), reports, st.embedding_params,
                              float(st.graph_static),
                              tuple(float(v) for v in st.capture) if st.capture is not None else None))
    return out


def layout_terms(exp: Experiment, cache: dict, peak_candidates: bool = False):
    """(chunks, plan, weights): what each stage holds, and its parameters on one rank.

    The plan depends only on the pipeline split (and block recompute); the weights also on TP/EP.
    `cache` may be shared by calls on the same model (the sweep); entries are keyed by every field
    they read. `peak_candidates` leaves out middle stages that cannot be the peak: a stage whose
    chunks hold the same layers as stage 0's holds no more weights (stage 0 adds the embedding)
    and no more in-flight activations (fewer warm-up micro-batches) than stage 0."""
    m, p, t = exp.model, exp.parallel, exp.training
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, exp.expert_tensor_parallel_size
    split_key = _split_key(exp)
    block = t.recompute_granularity == "full" and t.recompute_method == "block"
    key = ("layout", split_key, block, peak_candidates, tp, ep, etp)
    entry = cache.get(key)
    if entry is not None:
        return entry
    chunks = _split(split_key)
    pattern = _pattern(m, cache)
    pkey = ("params", tp, ep, etp)
    if pkey not in cache:
        kinds = (False, True) if m.is_moe else (False,)
        cache[pkey] = ({k: layer_params(m, k, tp, ep, etp) for k in kinds},
                       mtp_layer_params(m, pattern[-1], tp, ep, etp) if m.mtp_num_layers else (0, 0),
                       embedding_params(m, tp), m.padded_vocab_size(tp))
    params, mtp_params, embedding, vocab = cache[pkey]
    plan_key = ("plan", split_key, block, peak_candidates)
    plan = cache.get(plan_key)
    if plan is None:
        plan = cache[plan_key] = _stage_plan(chunks, pattern, block, peak_candidates)
    output_weight = vocab * m.hidden_size // tp
    tied = not m.untie_embeddings_and_output_weights
    pp = p.pipeline_model_parallel_size
    weights = []            # per stage: (dense, expert, per chunk, FSDP layer, embedding) parameters
    for r, kinds_r, _, _, stage_kinds, _, _ in plan:
        dense, expert, per_chunk, embeddings = _chunk_params(
            m, kinds_r, params, mtp_params, embedding,
            output_weight if (not tied or pp > 1 or not any(c.embedding for c in chunks[r])) else 0)
        weights.append((dense, expert, per_chunk, max([sum(params[k]) for k in stage_kinds], default=0),
                        embeddings))
    entry = cache[key] = (chunks, plan, weights)
    return entry


def _pattern(m, cache: dict) -> list[bool]:
    pattern = cache.get("pattern")
    if pattern is None:
        pattern = cache["pattern"] = (m.moe_layer_pattern() + [False] * m.num_layers)[:m.num_layers]
    return pattern


@dataclass
class ActTerms:
    """Activation sizes of one micro-batch for one activation setting (TP/CP/EP, micro batch,
    sequence, precision, recompute, ...): floats, or arrays of them when stacked for a batch."""

    saved: dict                     # layer kind (MoE?) -> bytes saved for backward
    backward: dict                  # layer kind -> live extra while its backward runs
    checkpoint_input: float
    embedding: float
    final_norm: float
    mtp: float
    loss_extra: float               # logits: bf16 + the fp32 copies kept for backward
    full_recompute: bool
    group: int                      # layers per full-recompute group
    offloaded_layers: int = 0       # layer offloading: layers whose activations wait on the host
    moe_excess: float = 0.0         # of saved[True]: the busiest rank's routed tokens above the mean
    mtp_excess: float = 0.0         # ... of mtp
    deferred_wgrad: float = 0.0     # defer_embedding_wgrad_compute: bytes the loss stage keeps per micro-batch
    deferral_limit: int = 0         # ... for at most this many micro-batches (0: all)
    # Transformer Engine CUDA graphs: the terms of the captured parts (these are then the other parts).
    # The allocator counts what a graph keeps only while the graphs are captured, in schedule order
    # (TE make_graphed_callables with _order); replays run in the graphs' private pool.
    capture: "ActTerms | None" = None
    # ... the static input buffers each graphed layer keeps per micro-batch (saved: per layer kind, mtp),
    # held by as many micro-batches as the schedule has in flight (`_graph_buffers`, `stage_arrays`)
    graphs: "ActTerms | None" = None
    graph_fixed: float = 0.0        # ... and the gradient buffers the graphs keep once for all
    # ... the terms of the steps Megatron-LM runs eagerly before it captures the graphs (all parts)
    eager: "ActTerms | None" = None
    # the numbers above, which `stack` turns into arrays (the recompute setting stays one for all)
    PER_SETTING: ClassVar[tuple[str, ...]] = ("checkpoint_input", "embedding", "final_norm", "mtp", "loss_extra",
                                              "moe_excess", "mtp_excess", "deferred_wgrad", "deferral_limit",
                                              "graph_fixed")
    NESTED: ClassVar[tuple[str, ...]] = ("capture", "graphs", "eager")

    @property
    def recompute(self) -> tuple:
        """What `_layer_activations` branches on: settings with other values cannot share arrays."""
        return (self.full_recompute, self.group, self.offloaded_layers,
                *(getattr(self, name) is not None for name in self.NESTED))


def activation_terms(exp: Experiment, cache: dict) -> ActTerms:
    impl = implementation(exp, cache)
    akey = _act_key(exp, impl)
    entry = cache.get(akey)
    if entry is None:
        m, t = exp.model, exp.training
        pattern = _pattern(m, cache)
        shapes = _Shapes(exp, impl)
        acts = {k: shapes.layer(k) for k in ((False, True) if m.is_moe else (False,))}
        mtp_act = (acts[pattern[-1]].saved + 3 * shapes.ab * shapes.sbh + shapes.finalnorm_params()) \
            if m.mtp_num_layers else 0.0
        excess = acts[True].saved - _Shapes(exp, impl, imbalance=False).layer(True).saved if m.is_moe else 0.0
        lb, lf = shapes.logits(m.padded_vocab_size(shapes.tp))
        loss_extra = lb + lf * (1 + (m.mtp_num_layers or 0) + (1 if t.cross_entropy_loss_fusion else 0))
        block = shapes.full_recompute and t.recompute_method == "block"
        group = t.recompute_num_layers or 1
        offloaded = t.cpu_offloading_num_layers
        # Deferred output-layer weight gradients (tensor_parallel/layers.py, core_v0.16.1): its backward
        # appends the logits' gradient to grad_output_buffer, its forward the input (sequence-sharded
        # under SP) to embedding_activation_buffer, kept until the pipeline flush computes the wgrad.
        deferred = (lb + shapes.ab * shapes.sbh) if t.defer_embedding_wgrad_compute else 0.0
        def terms(acts: dict, mtp_act: float, excess: float, **graph_terms) -> ActTerms:
            return ActTerms(
                saved={k: a.saved for k, a in acts.items()},
                # layer offloading brings a layer's activations back ahead of its backward
                backward={k: a.saved * (1 if block else group) if shapes.full_recompute
                          else a.transient + (a.saved if offloaded else 0.0) for k, a in acts.items()},
                checkpoint_input=shapes.checkpoint_input(), embedding=shapes.embedding(),
                final_norm=shapes.finalnorm_params(), mtp=mtp_act, loss_extra=loss_extra,
                full_recompute=shapes.full_recompute, group=group, offloaded_layers=offloaded,
                moe_excess=excess, mtp_excess=excess if m.mtp_num_layers and pattern[-1] else 0.0,
                deferred_wgrad=deferred, deferral_limit=t.wgrad_deferral_limit, **graph_terms)

        graphed = _graphed_parts(exp, impl)
        graph_terms: dict = {}
        if graphed:
            # Megatron-LM runs cuda_graph_warmup_steps steps eagerly (every part in the allocator's count)
            # before it captures the graphs (training.py, core_v0.16.1 and core_v0.19.0)
            if t.cuda_graph_warmup_steps > 0:
                graph_terms["eager"] = terms(acts, mtp_act, excess)

            def part(k: bool, in_graph: bool) -> tuple[float, float]:
                chosen = [acts[k].parts[p] for p in acts[k].parts if (p in graphed[k]) == in_graph]
                return sum((c[0] for c in chosen), 0.0), max((c[1] for c in chosen), default=0.0)

            inside = {k: part(k, True) for k in acts}
            last = pattern[-1]
            captured_excess = excess if m.is_moe and "experts" in graphed[True] else 0.0
            graph_terms["capture"] = capture = ActTerms(
                saved={k: v[0] for k, v in inside.items()},
                backward={k: v[1] for k, v in inside.items()},
                checkpoint_input=0.0,
                embedding=0.0,
                final_norm=0.0,
                mtp=inside[last][0] if m.mtp_num_layers else 0.0,
                loss_extra=0.0,
                full_recompute=False,
                group=group,
                moe_excess=captured_excess,
                mtp_excess=captured_excess if m.mtp_num_layers and last else 0.0,
            )
            outside = {k: part(k, False) for k in acts}
            acts = {k: _Act(outside[k][0], outside[k][1]) for k in acts}
            mtp_act -= capture.mtp
            excess -= captured_excess
            inputs, fixed = _graph_buffers(exp, shapes, graphed)
            graph_terms["graphs"] = ActTerms(
                saved={k: inputs[k] for k in acts}, backward={k: 0.0 for k in acts}, checkpoint_input=0.0,
                embedding=0.0, final_norm=0.0, mtp=inputs[last] if m.mtp_num_layers else 0.0, loss_extra=0.0,
                full_recompute=False, group=group)
            graph_terms["graph_fixed"] = fixed
        entry = cache[akey] = terms(acts, mtp_act, excess, **graph_terms)
    return entry


def host_bytes(exp: Experiment, cache: dict | None = None) -> dict[bool, float]:
    """Bytes one layer of each kind (MoE?) sends to host memory per micro-batch and fetches back for
    its backward: the inputs of the fine-grained offloading modules, or a whole layer's saved
    activations with layer offloading (cpu_offloading_num_layers; for the layers it covers)."""
    t = exp.training
    if not (t.fine_grained_activation_offloading or t.cpu_offloading_num_layers):
        return {False: 0.0, True: 0.0}
    shapes = _Shapes(exp, implementation(exp, cache))
    kinds = (False, True) if exp.model.is_moe else (False,)
    out = {k: (shapes.layer(k).offloaded if t.fine_grained_activation_offloading else shapes.layer(k).saved)
           for k in kinds}
    return {False: out[False], True: out.get(True, 0.0)}


def _graphed_parts(exp: Experiment, impl: "runtime.Implementation") -> dict[bool, set[str]] | None:
    """{MoE layer?: the parts of a layer Transformer Engine's CUDA graphs capture}, or None without them.
    megatron-core's cuda_graph_scope (transformer/cuda_graphs.py, _layer_is_graphable, core_v0.16.1):
    none given captures whole layers; attn the attention, mlp a dense layer's MLP, moe_router and
    moe_preprocess an MoE layer up to its router, moe all of it."""
    t = exp.training
    if t.cuda_graph_impl != "transformer_engine" or impl.transformer != "transformer_engine":
        return None
    scope = set(t.cuda_graph_scope or [])
    if not scope:
        return {False: {"attn", "mlp"}, True: {"attn", "router", "experts"}}
    attn = {"attn"} & scope
    routing = {"router"} if scope & {"moe", "moe_router", "moe_preprocess"} else set()
    return {False: attn | ({"mlp"} if "mlp" in scope else set()),
            True: attn | routing | ({"experts"} if "moe" in scope else set())}


def _graph_buffers(exp: Experiment, shapes: "_Shapes",
                   graphed: dict[bool, set[str]]) -> tuple[dict[bool, float], float]:
    """({MoE layer?: the static input buffers one graphed layer keeps per micro-batch}, the gradient
    buffers all the graphs keep once), in bytes, for Transformer Engine's CUDA graphs (Megatron-LM's
    TECudaGraphHelper; the same in core_v0.16.1 and core_v0.19.0, with Transformer Engine >= 2.7, which
    Megatron-LM's pyproject.toml pinned at release_v2.11 when its CI measured the attn-graph case, 11debfa7b4).

    Inputs: megatron-core makes each graphed layer's sample arguments per micro-batch
    (transformer/cuda_graphs.py, _get_sample_arguments): the hidden states, always BF16, sequence-sharded
    under SP (transformer/module.py, get_layer_static_inputs), and where the graph holds the attention a
    boolean causal mask of micro batch x (sequence / CP) x sequence (transformer_layer.py,
    get_layer_static_inputs). A layer's buffers are handed on to a later forward once its backward is
    done, so the buffers are those of the micro-batches in flight in the pipeline schedule (counted per
    stage, `stage_arrays`). Transformer Engine's make_graphed_callables with
    _reuse_graph_input_output_buffers (transformer_engine/pytorch/graph.py, v2.11) frees each graph's
    static outputs once its backward graph is captured, and each backward's input gradients once the next
    backward has run, and keeps one static gradient-output buffer per output signature: what stays is
    one buffer of the graphs' output gradients per signature and the last backward's input gradient."""
    m = exp.model
    scope = set(exp.training.cuda_graph_scope or [])
    hidden = 2 * shapes.sbh                          # torch.bfloat16 in get_layer_static_inputs
    mask = shapes.b * shapes.s * exp.seq_length if not scope or "attn" in scope else 0.0
    inputs = {k: hidden + mask if graphed.get(k) else 0.0 for k in (False, True)}
    # a graph's outputs: the hidden states, unless it stops at an MoE layer's router (moe_router without
    # moe), where it also returns the residual and the shared experts' output (transformer_layer.py,
    # _te_cuda_graph_replay); the routing probabilities and map are left out (a few bytes per token)
    signatures = set()
    for k, parts in graphed.items():
        if parts and k and "router" in parts and "experts" not in parts:
            signatures.add(2 + (1 if m.moe_shared_expert_intermediate_size else 0))
        elif parts:
            signatures.add(1)
    fixed = sum(signatures) * shapes.ab * shapes.sbh + hidden if signatures else 0.0
    return inputs, fixed


def stack(acts: list[ActTerms]) -> ActTerms:
    """One ActTerms of arrays, entry i from `acts[i]`; the recompute setting must be the same for all."""
    import numpy as np

    first = acts[0]
    assert all(a.recompute == first.recompute for a in acts)
    arrays = {name: np.array([getattr(a, name) for a in acts]) for name in ActTerms.PER_SETTING}
    # (every one has a capture where the first has: the same recompute setting, asserted above)
    nested: dict[str, Any] = {name: stack([getattr(a, name) for a in acts]) if getattr(first, name) is not None
                              else None for name in ActTerms.NESTED}
    # the stacked terms hold arrays where one setting's hold floats (the class says so): mypy reads the fields' types
    return ActTerms(saved={k: np.array([a.saved[k] for a in acts]) for k in first.saved},
                    backward={k: np.array([a.backward[k] for a in acts]) for k in first.backward},
                    full_recompute=first.full_recompute, group=first.group,
                    offloaded_layers=first.offloaded_layers, **arrays,  # type: ignore[arg-type]
                    **nested)


def take(acts: ActTerms, index) -> ActTerms:
    """The entries `index` (a numpy index array) of a stacked ActTerms."""
    nested: dict[str, Any] = {name: take(getattr(acts, name), index) if getattr(acts, name) is not None else None
                              for name in ActTerms.NESTED}
    return dataclasses.replace(acts, saved={k: v[index] for k, v in acts.saved.items()},
                               backward={k: v[index] for k, v in acts.backward.items()},
                               **{name: getattr(acts, name)[index] for name in ActTerms.PER_SETTING},
                               **nested)


@dataclass
class StageArrays:
    """The terms of one pipeline stage (see StageTerms) for a batch of settings, one array entry
    per setting; scalars for a single setting."""

    pp_rank: int
    dense_params: Any
    expert_params: Any
    fsdp_layer_params: Any
    chunk_weights: list[int]        # of the first setting (for the per-chunk report)
    chunk_acts: list                # per chunk, bytes per micro-batch
    held_loss: Any
    held_max: Any
    backward: Any
    loss_extra: Any
    in_flight: Any
    embedding_params: Any = 0
    graph_static: Any = 0           # CUDA graphs' static buffers (kept between iterations)
    capture: tuple | None = None    # (held_loss, held_max, backward, loss_extra) while the graphs are captured


def stage_arrays(pp: int, plan, weights, acts: ActTerms, num_microbatches,
                 group: int | None = None) -> list[StageArrays]:
    """Per stage of `plan` (of a `pp`-stage split), its terms for a batch of settings: `weights[s]` is
    stage s's (dense, expert, per-chunk, FSDP layer, embedding) parameters from `layout_terms`, `acts` the
    activation terms (`activation_terms`, or `take(stack(...))` for a batch with one recompute setting)
    and `num_microbatches` the micro-batch counts, as numpy arrays with one entry per setting (the
    per-chunk parameters: the first setting's); `group` is the interleaved schedule's micro-batches per
    model chunk (microbatch_group_size_per_vp_stage; None: `pp`, Megatron's default). Given one setting's
    numbers instead, the terms are numbers. Either way the arithmetic is the same, in the same order."""
    import numpy as np

    batch = np.ndim(num_microbatches) > 0
    zero = np.zeros(len(num_microbatches)) if batch else 0.0
    num_mb = np.asarray(num_microbatches, dtype=np.int64) if batch else num_microbatches
    out = []
    for s, (r, kinds_r, distinct, index, stage_kinds, has_loss, loss_flags) in enumerate(plan):
        def activity(terms: ActTerms):
            """`_stage_activity` of `terms` on this stage (activations, the graphs' parts or buffers, eager steps)."""
            return _stage_activity(terms, r, pp, kinds_r, distinct, index, stage_kinds, has_loss, loss_flags, num_mb,
                                   zero, group)

        chunk_acts, units, *terms = activity(acts)
        graph_static, captured = zero, None
        if acts.capture is not None:
            # the peak is while the graphs are captured (their parts only), while they replay (the rest),
            # or in the steps run eagerly before the capture (all parts, without the graphs' buffers);
            # `combine` weighs the capture against the others (the optimizer state may not be there yet)
            captured_acts, _, *captured = activity(acts.capture)
            chunk_acts = [c + g for c, g in zip(chunk_acts, captured_acts)]
            # the graphs' static inputs of the micro-batches in flight at once (windows over the schedule,
            # as for activations: TECudaGraphHelper hands a layer's buffers on in schedule order)
            assert acts.graphs is not None                   # made with the capture (activation_terms)
            graph_static = activity(acts.graphs)[3] + acts.graph_fixed
            if acts.eager is not None:
                eager = activity(acts.eager)[2:]
                # eager steps hold no graph buffers: their held terms carry that back (the stage total adds it)
                eager = [eager[0] - graph_static if has_loss else eager[0], eager[1] - graph_static, eager[2],
                         eager[3]]
                later = np.asarray(np.maximum(eager[0] + eager[3], eager[1] + eager[2])
                                   > np.maximum(terms[0] + terms[3], terms[1] + terms[2]))
                terms = [np.where(later, e, t) if batch else (e if later else t) for e, t in zip(eager, terms)]
        held_loss, held_max, backward, loss_extra = terms
        dense, expert, per_chunk, fsdp, embeddings = weights[s]
        out.append(StageArrays(r, dense, expert, fsdp, per_chunk, chunk_acts, held_loss, held_max,
                               backward, loss_extra, units, embeddings, graph_static,
                               tuple(captured) if captured is not None else None))
    return out


def _stage_activity(a: ActTerms, r, pp, kinds_r, distinct, index, stage_kinds, has_loss, loss_flags, num_mb, zero,
                    group=None):
    """(per-chunk activations, units held, held at a loss step, held at most, backward, loss) of one stage."""
    import numpy as np

    batch = np.ndim(num_mb) > 0
    values = [zero + _chunk_activations(kind, a) for kind in distinct]
    chunk_acts = [values[i] for i in index]
    backward = functools.reduce(np.maximum if batch else max, [a.backward[k] for k in stage_kinds], zero)
    # held at once: the busiest rank's routing excess averages over the micro-batches held
    units = _in_flight_units(r, pp, len(kinds_r), num_mb, group)
    averaged = 1 - 1 / np.sqrt(units)
    held = [values[i] - averaged * _chunk_excess(kind, a) for i, kind in enumerate(distinct)]
    held_loss, held_max = _in_flight([held[i] for i in index], loss_flags, r, pp, len(kinds_r), num_mb, units, group)
    if has_loss:
        # deferred output-layer wgrads: by the last micro-batch's loss, those of the ones before it
        minimum = np.minimum if batch else min
        stored = minimum(num_mb - 1, np.where(a.deferral_limit > 0, a.deferral_limit, num_mb))
        held_loss, held_max = held_loss + stored * a.deferred_wgrad, held_max + stored * a.deferred_wgrad
    return chunk_acts, units, held_loss, held_max, backward, a.loss_extra if has_loss else zero


def _stage_plan(chunks: list[list[_Chunk]], pattern: list[bool], block: bool, peak_candidates: bool):
    """Per stage: each chunk as (dense layers, MoE layers, embedding, loss, MTP layers, layer flags
    if block recompute), the distinct ones, which layer kinds the stage holds, and its loss flags."""
    plan, first = [], None
    pp = len(chunks)
    for r, stage in enumerate(chunks):
        kinds, stage_kinds = [], set()
        for chunk in stage:
            flags = tuple(pattern[i] for i in chunk.layers)
            n_moe = sum(flags)
            kinds.append((len(flags) - n_moe, n_moe, chunk.embedding, chunk.loss, chunk.mtp,
                          flags if block else None))
            if n_moe:
                stage_kinds.add(True)
            if len(flags) > n_moe:
                stage_kinds.add(False)
        layers = [k[:2] + k[4:] for k in kinds]          # what the chunks hold besides embedding/loss
        if r == 0:
            first = layers
        elif peak_candidates and r < pp - 1 and layers == first:
            continue
        distinct = list(dict.fromkeys(kinds))
        index = [distinct.index(k) for k in kinds]
        plan.append((r, kinds, distinct, index, tuple(sorted(stage_kinds)), any(c.loss for c in stage),
                     tuple(c.loss for c in stage)))
    return plan


def _chunk_params(m, kinds, params, mtp_params, embedding, output_weight):
    """(dense, expert, per chunk, embedding) parameters of a stage's chunks; `embedding` counts the
    word/position embeddings and the output layer among the dense ones."""
    dense = expert = embeddings = 0
    per_chunk = []
    for n_dense, n_moe, emb, loss, mtp, _ in kinds:
        cd = n_dense * params[False][0] + (n_moe * params[True][0] if n_moe else 0)
        ce = n_moe * params[True][1] if n_moe else 0
        if emb or mtp:
            # the MTP stage builds its own copy of the embedding (megatron-core GPTModel: `if
            # self.pre_process or self.mtp_process: self.embedding = ...`, gpt_model.py in core_v0.16.1)
            cd += embedding
            embeddings += embedding
        if loss:
            cd += norm_params(m, m.hidden_size) + output_weight
            embeddings += output_weight
        cd += mtp * mtp_params[0]
        ce += mtp * mtp_params[1]
        dense += cd
        expert += ce
        per_chunk.append(cd + ce)
    return dense, expert, per_chunk, embeddings


def _layer_activations(kind, a: ActTerms, saved: dict, checkpoint_input):
    """What a chunk's decoder layers keep for one micro-batch after recompute and offloading, given
    each layer kind's `saved` bytes and a recompute group's `checkpoint_input` bytes."""
    n_dense, n_moe, _, _, _, flags = kind
    n = n_dense + n_moe
    if not n:
        return 0.0
    if a.full_recompute:
        if flags is not None:
            # block: the first `group` layers keep only their input, the rest keep everything
            return min(a.group, n) * checkpoint_input + sum(saved[f] for f in flags[a.group:])
        return math.ceil(n / a.group) * checkpoint_input
    act = n_dense * saved[False] + (n_moe * saved[True] if n_moe else 0.0)
    if a.offloaded_layers:     # megatron-core: the first cpu_offloading_num_layers layers' activations
        act = act * (1 - min(a.offloaded_layers, n) / n)
    return act


def _chunk_excess(kind, a: ActTerms):
    """Of `_chunk_activations`: the busiest rank's routed tokens above the mean (MOE_DROPLESS_IMBALANCE)."""
    return _layer_activations(kind, a, {False: 0.0, True: a.moe_excess}, 0.0) + kind[4] * a.mtp_excess


def _chunk_activations(kind, a: ActTerms):
    """Saved activations of one chunk for one micro-batch, after recompute."""
    _, _, emb, loss, mtp, _ = kind
    act = _layer_activations(kind, a, a.saved, a.checkpoint_input)
    if emb:
        act += a.embedding
    if loss:
        act += a.final_norm
    return act + mtp * a.mtp


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter and the sharding degrees that apply to them."""

    weight: int
    grad: int
    optimizer: int                  # of the parameters the optimizer's own algorithm updates
    dp_shard: int                   # distributed-optimizer / FSDP degree for dense parameters
    edp_shard: int                  # ... for expert parameters
    shard_optimizer: bool
    shard_grads: bool
    shard_weights: bool
    embedding_optimizer: int = 0    # of the embeddings and output layer (Muon leaves them to Adam)
    weight_cache: int = 0           # the FP8 copies Transformer Engine keeps of its linear weights
    master: int = 0                 # of optimizer / embedding_optimizer: the main (master) copy, made with the
                                    # optimizer; the rest is state the optimizer creates at its first step
    resident_non_units: bool = False   # Megatron-FSDP keeps the gathered embeddings and output layer (below)


_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

# Megatron-FSDP with optim_grads_params makes only TransformerLayers FSDP units (fsdp_unit_modules in
# megatron/core/distributed/fsdp/mcore_fsdp_adapter.py, core_v0.16.1 and core_v0.19.0); the parameters
# outside them - the embeddings and the output layer (and the final norm, left out here) - share a bucket of
# their own (megatron_fsdp/param_and_grad_buffer.py _get_parameter_groups), which the module hooks never
# release (release_bucket: non-unit modules "should remain persistently allocated"). The all-gather
# pipeline's reset at the end of each step (synchronize_param_gather: from finish_grad_sync, and with
# --log-params-norm from calc_params_l2_norm's stop_communication before the step is logged) freed it in
# core_v0.16.1 (AllGatherPipeline.reset); from Megatron-LM 378d81fbd3 on, first released in core_v0.18.0
# and so in core_v0.19.0, it keeps it (reset(preserve_non_fsdp_units=True)): the gathered, unsharded copy
# stays allocated between iterations beside the shards. (That commit raised the static memory of Megatron-LM's
# CI case deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap by 94 MiB, not its peak; its untied embedding and output
# layer are 98 MiB in bf16.)
FSDP_RESIDENT_NON_UNITS_SINCE = "0.18.0"


def precision(exp: Experiment, use_distributed_optimizer: bool | None = None,
              megatron_version: str | None = None) -> Precision:
    """`megatron_version`: the megatron-core release planned for (default: the one installed here, else the
    newest supported: engine.model.megatron.megatron_version)."""
    p, t = exp.parallel, exp.training
    half = t.bf16 or t.fp16
    instances = max(1, p.num_distributed_optimizer_instances)
    fsdp = p.use_megatron_fsdp or p.use_torch_fsdp2
    strategy = p.data_parallel_sharding_strategy if p.use_megatron_fsdp else (
        "optim_grads_params" if p.use_torch_fsdp2 else "no_shard")
    dist = p.use_distributed_optimizer if use_distributed_optimizer is None else use_distributed_optimizer
    # bf16 accumulates and reduces grads in fp32 unless told otherwise; fp16 keeps them in fp16
    # (Megatron-LM training/arguments.py, core_v0.16.1: only bf16 turns accumulate_allreduce_grads_in_fp32 on)
    grad = 2 if (t.grad_reduce_in_bf16 and half) or t.fp16 else 4
    # Adam: master copy (mixed precision only) + two moments; SGD: master + momentum; fp32 unless the
    # precision-aware optimizer says otherwise; offloaded optimizer state lives on the host
    master = (_DTYPE_BYTES[t.main_params_dtype] if t.use_precision_aware_optimizer else 4) if half else 0
    if t.use_precision_aware_optimizer:
        grad = _DTYPE_BYTES[t.main_grads_dtype]
        moments = _DTYPE_BYTES[t.exp_avg_dtype] + _DTYPE_BYTES[t.exp_avg_sq_dtype]
    else:
        moments = 8
    if t.fp16 and not t.use_precision_aware_optimizer:
        # the fp16 optimizer gives each master weight an fp32 copy of its grad (main_grad.float()), alive
        # from the step until the next zero_grad, sharded like the master (core/optimizer/optimizer.py
        # and distrib_optimizer.py _copy_model_grads_to_main_grads, core_v0.16.1)
        master += 4
    adam = master + moments
    # Muon keeps one momentum buffer of the matrices it orthogonalises and leaves the embeddings, the
    # output layer (and vectors, counted as matrices here) to Adam (megatron-core
    # optimizer/emerging_optimizers.py: _is_nonlinear_or_embedding, core_v0.19.0)
    optimizer = {"sgd": master + 4, "muon": master + 4}.get(t.optimizer, adam)
    embedding_optimizer = master + 4 if t.optimizer == "sgd" else adam
    main_copy = master - (4 if t.fp16 and not t.use_precision_aware_optimizer else 0)
    if t.optimizer_cpu_offload:
        optimizer = embedding_optimizer = main_copy = 0
    return Precision(
        weight=2 if half else 4,
        grad=grad,
        optimizer=optimizer,
        embedding_optimizer=embedding_optimizer,
        # FP8 compute on high-precision weights: Transformer Engine casts each linear weight once per step
        # (is_first_microbatch) and keeps the FP8 copy and its transpose for the other micro-batches and
        # the backward; with fp8_param_gather the weights themselves are FP8 (data + transpose: 2 bytes)
        weight_cache=2 if t.fp8 and not t.fp8_param_gather else 0,
        # the distributed optimizer makes its FP32 main copies when it is built (shard_fp32_from_float16_groups);
        # Transformer Engine's FusedAdam creates exp_avg and exp_avg_sq at its first step (fused_adam.py,
        # step: `if len(state) == 0: self.initialize_state(...)`, v2.11), and the FP16 optimizer its grad copies
        master=main_copy,
        dp_shard=max(1, exp.data_parallel_size * p.context_parallel_size // instances),
        edp_shard=max(1, exp.expert_data_parallel_size // instances),
        shard_optimizer=dist or (fsdp and strategy != "no_shard"),
        shard_grads=fsdp and strategy in ("optim_grads", "optim_grads_params"),
        shard_weights=fsdp and strategy == "optim_grads_params",
        resident_non_units=p.use_megatron_fsdp and strategy == "optim_grads_params"
        and megatron.release_at_least(megatron.megatron_version(megatron_version)[0], FSDP_RESIDENT_NON_UNITS_SINCE))


def workspace_bytes(exp: Experiment, cache: dict | None = None, micro_batch_size=None) -> float:
    """Allocator memory that stays between iterations beyond weights, grads and optimizer state;
    `micro_batch_size`: for these micro batches (a numpy array: the sweep) instead of the experiment's."""
    m, p, t = exp.model, exp.parallel, exp.training
    runs = implementation(exp, cache)
    te = runs.transformer == "transformer_engine"
    total: float = BASE_WORKSPACE_BYTES + (GEMM_WORKSPACE_BYTES if runs.device == "cuda" else 0)
    if te and m.is_moe and t.moe_grouped_gemm:
        total += GROUPED_GEMM_WORKSPACE_BYTES
    if te and t.tp_comm_overlap:
        total += TP_OVERLAP_WORKSPACE_BYTES
    if p.pipeline_model_parallel_size > 1:
        # each model chunk keeps its last received input and sent output (p2p buffers)
        ab = 2 if (t.bf16 or t.fp16) else 4
        mbs = t.micro_batch_size if micro_batch_size is None else micro_batch_size
        sbh = exp.seq_length / p.context_parallel_size * mbs * m.hidden_size \
            / (p.tensor_model_parallel_size if p.sequence_parallel else 1)
        total += 2 * exp.virtual_stages * ab * sbh
    return total


def combine(dense, expert, embedding, held_loss, held_max, backward, loss_extra, fsdp_layer, workspace,
            pr: Precision, graph_static=0.0, capture=None, before_first_step=False):
    """Bytes of one stage from its terms: (weights, grads, optimizer, activations, other); `embedding`
    is the part of `dense` in the embeddings and output layer. With CUDA graphs, `graph_static` is their
    static buffers (in `other`, kept between iterations) and `capture` the held terms while they are
    captured, `before_first_step` where that is before the optimizer's first step (its state not there yet).

    Plain arithmetic, so it works on scalars (estimate) and on numpy arrays (the sweep) alike.
    """
    def sharded(flag):
        return dense / pr.dp_shard + expert / pr.edp_shard if flag else dense + expert

    def optimizer_state(per_param, per_embedding_param):
        """Optimizer bytes at `per_param` bytes a parameter (`per_embedding_param` for the embeddings and
        output layer), sharded as the optimizer is."""
        return (matrices * per_param + embedding * per_embedding_param) / (
            pr.dp_shard if pr.shard_optimizer else 1
        ) + expert * per_param / (pr.edp_shard if pr.shard_optimizer else 1)

    def at_peak(held_loss, held_max, backward, loss_extra):
        """(activations, other) at the peak: either while the loss runs (logits live) or during a backward."""
        loss_peak = (loss_extra > 0) & (held_loss + loss_extra >= held_max + backward)
        return (held_max + loss_peak * (held_loss - held_max),
                workspace + graph_static + backward + loss_peak * (loss_extra - backward))

    matrices = dense - embedding                          # the linear layers, norms and biases
    weights = sharded(pr.shard_weights) * pr.weight + (matrices + expert) * pr.weight_cache
    if pr.resident_non_units:
        # Megatron-FSDP's gathered bucket of the embeddings and output layer, beside their shards
        # (FSDP_RESIDENT_NON_UNITS_SINCE)
        weights = weights + embedding * pr.weight
    grads = sharded(pr.shard_grads) * pr.grad
    optimizer = optimizer_state(pr.optimizer, pr.embedding_optimizer)
    activations, other = at_peak(held_loss, held_max, backward, loss_extra)
    if capture is not None:
        c_activations, c_other = at_peak(*capture)
        if before_first_step:
            # what the optimizer creates at its first step is not there while the graphs are captured
            c_other = c_other - optimizer_state(pr.optimizer - pr.master, pr.embedding_optimizer - pr.master)
        later = c_activations + c_other > activations + other
        activations = activations + later * (c_activations - activations)
        other = other + later * (c_other - other)
    if pr.shard_weights:
        other = other + 2 * fsdp_layer * (pr.weight + pr.grad)
    return weights, grads, optimizer, activations, other


def captured_before_first_step(exp: Experiment) -> bool:
    """Transformer Engine's CUDA graphs are captured before the optimizer's first step: Megatron-LM
    captures them at the start of the step after cuda_graph_warmup_steps eager ones (training.py,
    core_v0.16.1 and core_v0.19.0), so with none, before any step."""
    t = exp.training
    return t.cuda_graph_impl == "transformer_engine" and t.cuda_graph_warmup_steps == 0


# DeepEP's communication buffers, for the flex MoE dispatcher (its default backend in megatron-core
# 0.16, `moe_flex_dispatcher_backend = "deepep"`, with `moe_deepep_num_sms = 20`): DeepEP allocates
# them itself (cudaMalloc for the NVLink buffer, NVSHMEM for the RDMA one), outside the caching
# allocator, over the EP x expert-TP group (token_dispatcher.py, fused_a2a.get_buffer). Their sizes
# follow DeepEP v1.2.1's Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint (csrc/config.hpp)
# under the configs Buffer.get_dispatch_config / get_combine_config recommend (deep_ep/buffer.py):
# tokens received per channel and peer over NVLink, by group size (RDMA: 128), 8 NVLink peers per node.
DEEPEP_NVL_RECV_TOKENS = {2: 256, 4: 256, 8: 256, 16: 288, 24: 288, 32: 288, 64: 288, 128: 560, 144: 720, 160: 720}
DEEPEP_RDMA_RECV_TOKENS, DEEPEP_NUM_SMS, DEEPEP_NVL_PEERS = 128, 20, 8


def dispatcher_buffer_bytes(exp: Experiment) -> int:
    """Device memory the MoE token dispatcher holds outside the caching allocator (DeepEP's buffers)."""
    m, t = exp.model, exp.training
    ranks = exp.parallel.expert_model_parallel_size * exp.expert_tensor_parallel_size
    if not (m.is_moe and t.moe_token_dispatcher_type == "flex" and t.moe_flex_dispatcher_backend == "deepep") \
            or ranks < 2:
        return 0
    recv = DEEPEP_NVL_RECV_TOKENS[min((k for k in DEEPEP_NVL_RECV_TOKENS if k >= ranks),
                                      default=max(DEEPEP_NVL_RECV_TOKENS))]
    channels = DEEPEP_NUM_SMS // 2
    nvl_ranks, rdma_ranks = min(ranks, DEEPEP_NVL_PEERS), max(ranks // DEEPEP_NVL_PEERS, 1)
    # per token: hidden states (bf16 at least), 8 B source metadata, 128 top-k indices (int64),
    # weights and scales (fp32)
    token = m.hidden_size * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl = channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + recv * token)
    rdma = channels * rdma_ranks * ((DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4
                                    + DEEPEP_RDMA_RECV_TOKENS * (token + 16) * 2) if ranks > DEEPEP_NVL_PEERS else 0
    return -(-nvl // 128) * 128 + -(-rdma // 128) * 128


# -- The caching allocator ------------------------------------------------------------------
# `torch.cuda.max_memory_allocated`, what the stages add up to, counts bytes in live tensors. The
# device must also hold what PyTorch's caching allocator has reserved and not handed out at that
# moment (c10/cuda/CUDACachingAllocator.cpp): segments are rounded up (large requests to 2 MiB,
# 1-10 MiB requests share 20 MiB segments) and blocks freed by one micro-batch sit cached and split
# while the next asks for other sizes. Only what is allocated and freed within an iteration (the
# churn: activations, logits, backward buffers) fragments: weights, gradients and optimizer state
# live in Megatron's contiguous buffers from the first step on. On an allocation failure the
# allocator frees its unused cached segments and retries, so what counts is the cache it cannot
# free: free blocks inside segments that still hold live tensors. With expandable_segments a
# stream's memory is one segment that grows and shrinks in 2 MiB pages, so that cache is small.
#
# The share of the churn reserved beyond the allocated peak, where no calibration measured it
# (`charllm-tui doctor --train` does, as reserved minus allocated over the churn of its job):
RESERVE_FRACTION = {True: 0.03, False: 0.15}       # expandable segments on / off (assumed)


@dataclass(frozen=True)
class Budget:
    """What one device offers the caching allocator, and where each figure comes from."""

    usable_bytes: int               # what the framework can allocate
    outside_allocator_bytes: int    # held outside the allocator (CUDA context, NCCL buffers)
    usable_source: str              # "calibrated on NODE, DATE" | "hardware preset"
    outside_source: str
    expandable_segments: bool
    reserve_fraction: float         # reserved beyond the allocated peak, per byte of churn
    reserve_source: str
    dispatcher_bytes: int = 0       # the MoE dispatcher's own buffers (DeepEP), also outside the allocator

    @property
    def allocator_bytes(self) -> int:
        """What the allocator's pool (allocated + reserved) may reach."""
        return self.usable_bytes - self.outside_allocator_bytes - self.dispatcher_bytes

    def dispatcher_text(self) -> str:
        return f" - {size(self.dispatcher_bytes)} DeepEP buffers (flex dispatcher)" if self.dispatcher_bytes else ""

    def reserve(self, churn_bytes):
        """Bytes the allocator reserves beyond the allocated peak (numbers or numpy arrays)."""
        return churn_bytes * self.reserve_fraction

    def describe(self) -> str:
        """The device side of every verdict, with where each figure comes from."""
        return (
            f"usable {size(self.usable_bytes)} per device ({self.usable_source}) - "
            f"{size(self.outside_allocator_bytes)} outside the allocator (CUDA context, NCCL; "
            f"{self.outside_source}){self.dispatcher_text()} = {size(self.allocator_bytes)} for the allocator; "
            f"it reserves "
            f"{self.reserve_fraction:.0%} of each iteration's churn beyond the allocated peak "
            f"({self.segments_text()}; {self.reserve_source})"
        )

    def segments_text(self) -> str:
        return "expandable segments" if self.expandable_segments else "fixed segments"

    def explain(self, stage: StageMemory) -> list[str]:
        """The verdict for `stage`, in three lines of arithmetic."""
        total, reserve = stage.total_bytes, stage.reserve_bytes
        lines = [
            f"allocator: usable {size(self.usable_bytes)} ({self.usable_source}) - "
            f"{size(self.outside_allocator_bytes)} outside it: CUDA context, NCCL ({self.outside_source})"
            f"{self.dispatcher_text()} = {size(self.allocator_bytes)}",
            f"stage {stage.pp_rank}: allocated peak {size(total)} + reserved beyond it {size(reserve)} "
            f"({self.reserve_fraction:.0%} of {size(stage.churn_bytes)} allocated and freed each iteration, "
            f"{self.segments_text()}; {self.reserve_source}) = {size(total + reserve)}",
        ]
        room = self.allocator_bytes - total
        error = f"the plan's error, {PEAK_MARGIN:.1%} of the peak ({size(total * PEAK_MARGIN)})"
        if stage.verdict == FITS:
            lines.append(f"fits: {size(stage.headroom_bytes)} to spare")
        elif stage.verdict == TIGHT and room < 0:
            lines.append(f"tight: the allocated peak is {size(-room)} over, within {error}; it may run or run "
                         "out of memory")
        elif stage.verdict == TIGHT and room < reserve:
            lines.append(f"tight: the allocated peak fits with {size(room)} left, less than the "
                         f"{size(reserve)} the allocator reserves beyond it; it may run out of memory")
        elif stage.verdict == TIGHT:
            lines.append(f"tight: {size(room - reserve)} to spare beyond the reserve, within {error}; it may run "
                         "out of memory")
        else:
            lines.append(f"does not fit: the allocated peak alone is {size(-room)} over")
        return lines


def budget(exp: Experiment) -> Budget:
    """The device's memory budget for `exp`: a calibration of its hardware (`charllm-tui doctor`)
    where there is one, else the hardware preset's figures and the assumed allocator reserve."""
    hw = exp.hardware
    usable, outside = int(hw.usable_bytes or hw.memory_bytes), int(hw.outside_allocator_bytes)
    usable_source = outside_source = "hardware preset"
    expandable = exp.training.expandable_segments
    fraction, reserve_source = RESERVE_FRACTION[expandable], "assumed"
    cal = calibration.load(hw.name)
    if cal is not None and cal.usable_bytes:
        usable, usable_source = cal.usable_bytes, cal.source
    if cal is not None and cal.outside_allocator_bytes is not None:
        # A calibration job on one device had no NCCL peers: its figure leaves out the
        # communicator buffers that every multi-device run holds, so it stands only for one device.
        if cal.devices > 1 or exp.world_size == 1:
            outside, outside_source = cal.outside_allocator_bytes, cal.source
        else:
            outside_source = f"hardware preset (the calibration on {cal.node} ran on one device, without NCCL peers)"
    if cal is not None and cal.reserve_fraction is not None and cal.expandable_segments == expandable:
        fraction, reserve_source = cal.reserve_fraction, f"measured: {cal.source}"
    return Budget(usable, outside, usable_source, outside_source, expandable, fraction, reserve_source,
                  dispatcher_buffer_bytes(exp))


def estimate(exp: Experiment, *, ignored_args: list[str] | None = None,
             warnings: list[str] | None = None, stack: "runtime.Stack | None" = None,
             megatron_version: str | None = None) -> MemoryReport:
    """Peak allocator bytes per pipeline stage, with a fit verdict on `exp.hardware`, for what runs on
    `stack` (default: the hardware's calibrated or assumed stack, `calibration.for_planning`) with
    megatron-core `megatron_version` (default: the installed one, else the newest supported)."""
    hw, t = exp.hardware, exp.training
    stack = stack or calibration.for_planning(hw)
    cache = {"stack": stack}
    notes = list(warnings or []) + ignored(exp)
    pr = precision(exp, megatron_version=megatron_version)
    workspace = workspace_bytes(exp, cache)
    room = budget(exp)
    first_step = captured_before_first_step(exp)
    stages = []
    for st in stage_terms(exp, cache):
        w, g, o, a, x = combine(st.dense_params, st.expert_params, st.embedding_params, st.held_loss, st.held_max,
                                st.backward, st.loss_extra, st.fsdp_layer_params, workspace, pr, st.graph_static,
                                st.capture, first_step)
        chunks = [ChunkMemory(c.virtual_rank, c.layers, c.has_embedding, c.has_loss, c.mtp_layers,
                              int(c.weights * pr.weight), c.activation_bytes) for c in st.chunks]
        stage = StageMemory(pp_rank=st.pp_rank, weights=int(w), gradients=int(g), optimizer=int(o),
                            activations=int(a), other=int(x), in_flight=st.in_flight,
                            workspace=int(workspace + st.graph_static), chunks=chunks,
                            allocator_bytes=room.allocator_bytes)
        stage.reserve_bytes = int(room.reserve(stage.churn_bytes))
        stages.append(stage)
    if not room.usable_bytes:
        notes.append(f"hardware {hw.name!r} has no usable_bytes: no fit verdict possible")
    if t.optimizer not in ("adam", "sgd"):
        notes.append(f"optimizer {t.optimizer!r}: optimizer state counted as Adam's")
    if t.optimizer_cpu_offload:
        notes.append("optimizer state is offloaded to the host: not counted on the GPU")
    if exp.model.is_moe and not t.moe_expert_capacity_factor and exp.parallel.expert_model_parallel_size > 1:
        notes.append(f"dropless MoE: expert activations planned for the busiest rank, {MOE_DROPLESS_IMBALANCE:g}x "
                     "the mean routed tokens in one micro-batch (measured 1.15-1.4x on small models); over n "
                     "micro-batches held at once the excess averages out as 1/sqrt(n)")
    if exp.model.is_moe and t.moe_token_dispatcher_type == "flex" and t.moe_flex_dispatcher_backend == "hybridep":
        notes.append("moe_flex_dispatcher_backend = 'hybridep': HybridEP's buffers (outside the allocator) are not "
                     "modelled")
    if t.cuda_graph_impl == "transformer_engine":
        notes.append("cuda_graph_impl = 'transformer_engine': what the graphed parts keep is planned while the "
                     "graphs are captured (the allocator does not count it when they replay), with the graphs' "
                     "static input buffers of the micro-batches in flight and their gradient buffers kept "
                     "between iterations; the peak is the capture's (before the optimizer's first step where "
                     "cuda_graph_warmup_steps = 0), the replay's or the eager warm-up steps'")
    elif t.cuda_graph_impl != "none":
        notes.append(f"cuda_graph_impl = {t.cuda_graph_impl!r}: megatron-core's own graphs and their static buffers "
                     "are not modelled")
    return MemoryReport(stages, room, list(ignored_args or []), notes, implementation=runtime.resolve(exp, stack),
                        runtime_problems=[str(p) for p in runtime.problems(exp, stack)], stack_source=stack.source)


def _in_flight_units(r: int, pp: int, vp: int, m, group: int | None = None):
    """Micro-batch chunks whose activations rank r holds at once, for arrays of micro-batch counts `m`.

    1F1B: min(PP - r, m) micro-batches. Interleaved: Megatron's warm-up of (PP - r - 1) * 2 +
    (VP - 1) * group forward chunk-steps plus the current one, `group` the micro-batches each chunk runs
    in a row (microbatch_group_size_per_vp_stage, default PP): get_pp_rank_microbatches in
    megatron/core/pipeline_parallel/schedules.py, core_v0.16.1 (the same in core_v0.19.0)."""
    import numpy as np

    minimum = np.minimum if np.ndim(m) else min
    if vp == 1:
        return minimum(pp - r, m)
    group = pp if group is None else group
    return minimum((pp - r - 1) * 2 + (vp - 1) * group + 1, m * vp)


def _in_flight(acts: list, loss: tuple[bool, ...], r: int, pp: int, vp: int, m, n, group: int | None = None):
    """Held activations over the pipeline schedule on rank r, for arrays of settings: (at a loss
    step, max), given each chunk's activations `acts[v]`, the micro-batch counts `m` and the units
    held at once `n` (`_in_flight_units`). Interleaved, the forward steps run `group` micro-batches
    (microbatch_group_size_per_vp_stage, default PP) on chunk 0, the same on chunk 1, ... then the
    next group: chunk c of step k is (k mod group*VP) // group (get_schedule_table in
    megatron/core/pipeline_parallel/schedules.py, core_v0.16.1 and core_v0.19.0; a shorter last group,
    M mod group >= PP micro-batches, is taken as a whole one). The held set is a sliding window of n
    steps over the sequence.
    """
    import numpy as np

    minimum = np.minimum if np.ndim(m) else min
    if vp == 1:
        return n * acts[0], n * acts[0]
    group = pp if group is None else group
    total = m * vp
    held = n * acts[0]
    held_loss = held if any(loss) else 0.0 * held
    if all(a is acts[0] for a in acts):                    # chunks alike: every window holds the same
        return held_loss, held
    stacked = np.array(acts).reshape(vp, -1)               # chunks x settings
    uniform = (stacked == stacked[:1]).all(axis=0)
    period = group * vp
    steps = minimum(total, n + period)                     # after one period past the warm-up the windows repeat
    seq = (np.arange(np.max(steps)) % period) // group
    prefix = np.zeros((len(seq) + 1, stacked.shape[1]))
    np.cumsum(stacked[seq], axis=0, out=prefix[1:])        # running totals, added in step order
    ends = np.arange(len(seq))[:, None]                    # the window of n steps ending at each step
    windows = prefix[1:] - prefix[np.maximum(ends + 1 - n, 0), np.arange(prefix.shape[1])]
    valid = (ends >= n - 1) & (ends < steps)
    at_loss = valid & np.asarray(loss)[seq][:, None]
    window_loss = np.where(at_loss.any(axis=0), np.where(at_loss, windows, -np.inf).max(axis=0), 0.0)
    held_loss = np.where(uniform, held_loss, window_loss)
    held = np.where(uniform, held, np.where(valid, windows, -np.inf).max(axis=0))
    return (held_loss, held) if np.ndim(m) else (held_loss[0], held[0])
