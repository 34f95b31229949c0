"""Core attention through torch's scaled_dot_product_attention, for megatron-core's local spec.

megatron-core's local layer spec computes attention with `DotProductAttention`: the s x s scores
and softmax output in memory, K and V repeated for grouped-query attention. Without Transformer
Engine that is the only attention it has. `SDPAttention` takes the same place in the spec with
torch's fused kernels (FlashAttention-2, memory-efficient, cuDNN), so a plain pip install trains
with flash-class speed and memory. It keeps DotProductAttention's interface and semantics: causal
masking, the softmax scale, attention dropout under the tensor-parallel RNG tracker, tensors laid
out [s, b, heads, head_dim] in and [s, b, heads * head_dim] out.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from charllm.engine.model import runtime

_HALF = (torch.float16, torch.bfloat16)


class SDPAttention(MegatronModule):
    """Drop-in for megatron.core.transformer.dot_product_attention.DotProductAttention."""

    # The SDPBackend names this class may use (None: torch chooses); set by `with_sdpa`.
    kernels: tuple[str, ...] | None = None

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism needs Transformer Engine's attention")
        tp = pg_collection.tp.size() if pg_collection is not None else \
            tensor_parallel.get_tensor_model_parallel_world_size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias need Transformer Engine")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        dropout = self.dropout if self.training else 0.0
        # As DotProductAttention: dropout draws from the tensor-parallel RNG tracker, except under
        # sequence parallelism where each rank's tokens are its own anyway.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() \
            if dropout and not self.config.sequence_parallel else contextlib.nullcontext()
        with rng, self._kernels():
            context = attend(query, key, value, causal=causal, mask=None if causal else attention_mask,
                             dropout=dropout, scale=self.softmax_scale,
                             native_gqa=native_gqa(query, self.kernels))
        sq, b = context.shape[:2]
        return context.reshape(sq, b, -1)

    def _kernels(self):
        if not self.kernels:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, name) for name in self.kernels])


def native_gqa(query, kernels: tuple[str, ...] | None) -> bool:
    """Whether `query`'s attention takes grouped-query heads as they are (runtime.sdpa_takes_gqa)."""
    return runtime.sdpa_takes_gqa(query.is_cuda, query.dtype in _HALF, kernels)


def attend(query, key, value, *, causal: bool, mask=None, dropout: float = 0.0, scale: float | None = None,
           native_gqa: bool = False):
    """[sq, b, np, hn] query, [sk, b, ng, hn] key/value -> [sq, b, np, hn] context.

    Grouped-query attention is handed to the kernel as is (`enable_gqa`) when `native_gqa`
    (runtime.sdpa_takes_gqa); otherwise K and V are expanded to every head first, which any kernel
    takes.
    `mask`: megatron's convention, True where attention is NOT allowed."""
    heads, groups = query.shape[2], key.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))        # [b, heads, s, hn]
    if heads != groups and not native_gqa:
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    context = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=dropout, is_causal=causal,
        scale=scale, enable_gqa=heads != groups and native_gqa)
    return context.permute(2, 0, 1, 3).contiguous()                      # [sq, b, np, hn]


def with_sdpa(block_spec, kernels: tuple[str, ...] | None):
    """A copy of a local-spec decoder block spec whose layers attend with SDPAttention."""
    spec = copy.deepcopy(block_spec)
    attention = type("SDPAttention", (SDPAttention,), {"kernels": kernels}) if kernels else SDPAttention
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = attention
    return spec
