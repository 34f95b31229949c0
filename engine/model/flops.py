"""A run's experiment as the summary needs it, and Megatron-LM's model FLOP count.

`probes` never imports `charllm.engine` (the engine imports probes), so this reads
RUN_DIR/experiment.toml with tomllib. The engine writes that file fully resolved; a
hand-written one may name a model or hardware preset, which is read from the shipped or
user catalog TOML. Missing fields take Megatron-LM's defaults (the same as ModelSpec's).

`flops_per_iteration` follows `num_floating_point_operations` in Megatron-LM's
megatron/training/training.py (standard transformer path: GQA, SwiGLU, MoE top-k routing,
shared experts, MLA, MTP, logits over the padded vocabulary), so our TFLOP/s and MFU
match what Megatron itself reports.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from charllm.probes.core import paths
from charllm.probes.core.errors import UserError

# Megatron-LM defaults for fields a hand-written [model] table may leave out.
_MODEL_DEFAULTS = {
    "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 2048,
    "vocab_size": 50257, "make_vocab_size_divisible_by": 128, "swiglu": False,
    "moe_router_topk": 2, "moe_layer_freq": 1, "multi_latent_attention": False,
    "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
}


@dataclass(frozen=True)
class RunExperiment:
    """The experiment of a run, as plain TOML tables (`model`, `hardware`, `cluster`, ...)."""

    data: dict

    def section(self, name: str) -> dict:
        value = self.data.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def name(self) -> str:
        return str(self.data.get("name", ""))

    @property
    def model(self) -> dict:
        return {**_MODEL_DEFAULTS, **self.section("model")}

    @property
    def hardware(self) -> dict:
        return self.section("hardware")

    @property
    def world_size(self) -> int | None:
        c = self.section("cluster")
        return int(c.get("nodes", 1)) * int(c.get("gpus_per_node", 1)) if c else None

    @property
    def gpus_per_node(self) -> int | None:
        return self.section("cluster").get("gpus_per_node")

    @property
    def seq_length(self) -> int:
        return int(self.section("training").get("seq_length") or self.model["seq_length"])

    @property
    def global_batch_size(self) -> int | None:
        return self.section("training").get("global_batch_size")

    @property
    def peak_tflops(self) -> float | None:
        """Dense BF16 peak per device (the MFU denominator); None when unknown or 0."""
        return float(self.hardware.get("bf16_tflops") or 0) or None

    @property
    def temp_limit_c(self) -> float | None:
        return self.hardware.get("temp_limit_c")

    @property
    def max_sm_clock_mhz(self) -> float | None:
        return float(self.hardware.get("max_sm_clock_mhz") or 0) or None

    def flops_per_iteration(self, samples: int | None = None) -> float:
        """Model FLOPs of one training step of `samples` sequences (default: global batch)."""
        batch = samples if samples is not None else self.global_batch_size
        if not batch:
            raise UserError("experiment [training] global_batch_size: needed for the FLOP count")
        tp = int(self.section("parallel").get("tensor_model_parallel_size", 1))
        return num_floating_point_operations(self.model, int(batch), self.seq_length, tp)


def read_experiment(path: Path) -> RunExperiment | None:
    """The experiment at `path` (RUN_DIR/experiment.toml); None when the run has none."""
    path = Path(path)
    if not path.is_file():
        return None
    data = paths.read_toml(path, "experiment file")
    for section, kind in (("model", "models"), ("hardware", "hardware")):
        value = data.get(section)
        if isinstance(value, str):
            data[section] = _catalog_table(kind, value)
        elif isinstance(value, dict) and isinstance(value.get("preset"), str):
            data[section] = {**_catalog_table(kind, value["preset"]), **value}
    return RunExperiment(data)


def _catalog_table(kind: str, name: str) -> dict:
    """A preset's TOML table: the user's catalog first, then the shipped one; {} if unknown."""
    user = paths.config_dir() / kind / f"{name}.toml"
    if user.is_file():
        text = user.read_text()
    else:
        shipped = resources.files("charllm.presets") / kind / f"{name}.toml"
        if not shipped.is_file():
            return {}
        text = shipped.read_text()
    table = tomllib.loads(text)
    if isinstance(table.get("preset"), str):  # presets may build on presets
        table = {**_catalog_table(kind, table["preset"]), **table}
    return table


def num_floating_point_operations(model: dict, batch_size: int, seq_length: int, tp: int = 1) -> float:
    """Megatron-LM's FLOPs of one forward+backward pass over `batch_size` sequences."""
    m = {**_MODEL_DEFAULTS, **model}
    h = m["hidden_size"]
    heads = m["num_attention_heads"]
    layers = m["num_layers"]
    s = seq_length
    ffn = m.get("ffn_hidden_size") or 4 * h
    groups = m.get("num_query_groups") or heads
    kv_channels = m.get("kv_channels") or h // heads
    multiple = m["make_vocab_size_divisible_by"] * tp
    padded_vocab = -(-m["vocab_size"] // multiple) * multiple

    if m.get("num_moe_experts"):
        freq = m["moe_layer_freq"]
        pattern = list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(layers)]
        num_moe, topk, last_is_moe = sum(pattern), m["moe_router_topk"], pattern[-1]
    else:
        num_moe, topk, last_is_moe = 0, 0, 0
    num_dense = layers - num_moe
    mtp = m.get("mtp_num_layers") or 0
    num_moe += last_is_moe * mtp
    num_dense += (1 - last_is_moe) * mtp
    moe_ffn = m.get("moe_ffn_hidden_size") or ffn
    shared_ffn = m.get("moe_shared_expert_intermediate_size") or 0

    fwd_bwd, fma = 3, 2  # each GEMM runs 3 times (fwd, wgrad, dgrad); a GEMM is 2mnk FLOPs
    ffn_factor = 3 if m["swiglu"] else 2  # SwiGLU stacks h->2ffn and ffn->h

    if m["multi_latent_attention"]:
        rope, qk, v = m["qk_pos_emb_head_dim"], m["qk_head_dim"], m["v_head_dim"]
        q_lora = m.get("q_lora_rank")
        q_term = h * heads * (qk + rope) if q_lora is None else q_lora * (h + heads * (qk + rope) + 1)
        attn = fwd_bwd * fma * (
            q_term
            + m["kv_lora_rank"] * (h + heads * (qk + v) + 1)
            + h * rope
            + heads * v * h
            + s * heads * (qk + rope) / 2  # causal: half the score matrix
            + s * heads * v / 2
        )
    else:
        q = kv_channels * heads
        kv = kv_channels * groups
        attn = fwd_bwd * fma * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h)

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
