"""The experiment: model + hardware + cluster + parallel layout + training settings.

Field names are Megatron-LM's own argument names (`--tensor-model-parallel-size` is
`tensor_model_parallel_size`), so users can paste what they know. An experiment is stored as TOML:

    name = "llama3-70b-h100-tp8-pp4"
    model = "llama3-70b"                 # a catalog name, or a [model] table (preset = ... + overrides)
    hardware = "h100-sxm-80gb"           # likewise
    [cluster]    nodes = 8, gpus_per_node = 8
    [parallel]   tensor_model_parallel_size = 8, ...
    [training]   micro_batch_size = 1, global_batch_size = 128, ...
    [telemetry]  backend = "auto", hz = 20

Each field's facts live once, in its dataclass metadata (`setting`): its one-line help, the Megatron
flag that sets it, its choices and bounds, its Compose-form label and its TransformerConfig name;
`engine.model.megatron`'s flag tables, `engine.model.validate`'s choice and size checks, the Compose
form, `charllm-tui fields` and the workload's TransformerConfig are derived from them. Validation of the
layout lives in `engine.model.validate`; this module only parses, stores and derives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from charllm.engine.model import catalog
from charllm.probes.backends import BACKEND_NAMES
from charllm.probes.backends.base import DEFAULT_HZ, MAX_HZ
from charllm.probes.core import paths
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Problem:
    """What is wrong with an experiment: the field, its value, the rule it breaks (and a fix)."""

    field: str
    value: Any
    rule: str
    fix: str | None = None      # "field=value" that resolves it, where one value clearly does

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.rule}" + (f"; {self.fix} works" if self.fix else "")


def parse_pipeline_layout(layout: str) -> list[list[str]]:
    """`--pipeline-model-parallel-layout` as Megatron reads it: one list of layer letters per virtual
    stage, in order (E embedding, t decoder layer, m MTP layer, L loss); `(tt|)*6` repeats."""
    text = layout.replace(",", "")

    def repeat(m) -> str:  # bounded before it is built: `t*9999999999` would exhaust memory
        if len(m.group(1)) * int(m.group(2)) > 100_000:
            raise ValueError(f"{m.group(0)!r} repeats to more than 100,000 layers")
        return m.group(1) * int(m.group(2))

    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, repeat, text)
        if len(text) > 100_000:
            raise ValueError("the layout expands to more than 100,000 layers")
    stages = [list(stage) for stage in text.split("|")]
    bad = sorted({c for stage in stages for c in stage} - set("EtmL"))
    if bad:
        raise ValueError(f"unknown layer letter(s) {''.join(bad)!r}; known: E, t, m, L")
    return stages


# --------------------------------------------------------------------------------------------
# Field facts: each field's help, Megatron flag, choices, bounds, form label and TransformerConfig
# name, said once
# --------------------------------------------------------------------------------------------
AUTO = "auto"   # the flag is the field's name in Megatron's spelling: num_layers -> --num-layers
FIELD_DEFAULT = object()   # a `setting`'s megatron_default when Megatron's default is the field's


def setting(default: Any = None, *, help: str, flag: str | None = AUTO, switch: Any = True,
            aliases: dict[str, Any] | None = None, renamed: tuple[str, ...] = (), join: bool = False,
            choices: tuple | None = None,
            minimum: float | None = None, above: float | None = None, maximum: float | None = None,
            label: str | None = None,
            config: bool | str = False, activations: bool = False, pipeline_split: bool = False,
            layout: bool = False, said: bool | tuple[str, tuple] = False, only_with: tuple[str, tuple] | None = None,
            megatron_default: Any = FIELD_DEFAULT) -> Any:
    """A dataclass field with what the rest of charllm derives from it:

    help      one line saying what it sets, with its unit (Compose's hint line, `charllm-tui fields`)
    flag      the `pretrain_gpt.py` flag that sets it (None: no single flag does); how it parses follows
              the field's type: a bool is a switch setting `switch`, a list takes many values (`join`:
              one string of them), anything else one value
    aliases   more switches and the value each sets (`--use-rotary-position-embeddings`: "rope")
    renamed   the flag's other names, which take its values as it does (a Megatron release renamed it)
    choices   the values it accepts; for a list, the values each item accepts (engine.model.validate
              checks them)
    minimum   the least value it accepts when set; a size (minimum 1) is also at most `maximum`, else
              engine.model.validate.MAX_SIZE
    above     a value it must exceed when set (a rate or a scale: above 0)
    maximum   the most it accepts when set
    label     its label in the Compose form
    config    passed to megatron-core's TransformerConfig under its own name (True) or the one given
    activations     it changes what one micro-batch's activations take (engine.model.memory keys its
                    activation terms, and so the sweep's, by these fields)
    pipeline_split  it changes which layers each pipeline chunk holds (likewise for the split)
    layout    part of the parallel layout a run records (`Experiment.layout_record`, iterations.jsonl's
              start row) and `layout_label` reads
    said      the Megatron export writes its flag whatever the value (a size a reader wants to see), or
              (field, values) while that field of the section has one of those values; others only where
              the value differs from Megatron's default
    only_with (field, values): the flag means something only while that field of the section has one of
              those values (rotary_base with rope); the export writes it only then
    megatron_default  Megatron's default where it is not this field's default (`megatron_default`)"""
    facts = {"help": help, "flag": flag, "switch": switch, "aliases": dict(aliases or {}), "renamed": renamed,
             "join": join,
             "choices": choices, "minimum": minimum, "above": above, "maximum": maximum, "label": label,
             "config": config, "activations": activations, "pipeline_split": pipeline_split, "layout": layout,
             "said": said, "only_with": only_with, "megatron_default": megatron_default}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=facts)
    return field(default=default, metadata=facts)


def facts(kind: type, name: str) -> dict[str, Any]:
    """The facts `setting` holds for field `name` of `kind` ({} for a plain field)."""
    return dict(_fields(kind)[name].metadata)


def declared(fact: str, sections: tuple[str, ...] | None = None) -> list[tuple[str, str, Any]]:
    """(section, field, value) of every field whose metadata states `fact` (a value other than None
    or False), in section and field order."""
    return [(section, name, value) for section in sections or tuple(SECTIONS)
            for name in field_names(SECTIONS[section])
            if (value := facts(SECTIONS[section], name).get(fact)) not in (None, False)]


def choices(kind: type, name: str) -> tuple | None:
    return facts(kind, name).get("choices")


def label(kind: type, name: str) -> str | None:
    return facts(kind, name).get("label")


def help_text(kind: type, name: str) -> str:
    return facts(kind, name)["help"]


def megatron_default(kind: type, name: str) -> Any:
    """Megatron-LM's default for field `name` of `kind`: its `megatron_default`, else the field's default."""
    f = _fields(kind)[name]
    stated = f.metadata.get("megatron_default", FIELD_DEFAULT)
    if stated is not FIELD_DEFAULT:
        return stated
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def megatron_flag(kind: type, name: str) -> str | None:
    """The `pretrain_gpt.py` flag that sets the field (`--num-layers`); None where no single flag does."""
    flag = facts(kind, name)["flag"]
    return f"--{name.replace('_', '-')}" if flag == AUTO else flag


@functools.cache
def _fields(kind: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in fields(kind)}


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
MLA = ("multi_latent_attention", (True,))     # only_with of the MLA sizes


@dataclass
class ModelSpec:
    """Architecture, in Megatron-LM argument names. Help texts follow Megatron-LM's own (core_v0.16.1:
    megatron/training/arguments.py and the TransformerConfig docstrings)."""

    name: str = setting("custom", flag=None, help="the model preset's name")
    description: str = setting("", flag=None, help="one line about the model, shown by presets list")
    num_layers: int = setting(2, minimum=1, maximum=10_000, config=True, activations=True, pipeline_split=True,
                              said=True, help="transformer (decoder) layers")
    hidden_size: int = setting(64, minimum=1, config=True, activations=True, said=True,
                               help="width of the hidden states (elements per token)")
    ffn_hidden_size: int | None = setting(None, minimum=1, activations=True, said=True,
                                          help="MLP inner width (elements); unset: 4 x hidden_size")
    num_attention_heads: int = setting(4, minimum=1, config=True, activations=True, said=True,
                                       help="attention heads per layer")
    num_query_groups: int | None = setting(   # set by two flags together: see megatron.SPECIAL_FLAGS
        None, flag=None, minimum=1,
        activations=True,
        help="key/value head groups (grouped-query attention); unset: one per head (multi-head attention)")
    kv_channels: int | None = setting(None, minimum=1,
                                      activations=True,
                                      help="width of one attention head (elements); unset: hidden_size / heads")
    seq_length: int = setting(2048, minimum=1, activations=True, said=True,
                              help="the model's default training sequence length (tokens)")
    max_position_embeddings: int | None = setting(
        None, minimum=1, said=True,
        help="longest sequence the position embedding covers (tokens); unset: seq_length")
    vocab_size: int = setting(50257, minimum=1, activations=True, said=True,
                              help="tokenizer vocabulary before padding (tokens)")
    make_vocab_size_divisible_by: int = setting(
        128, minimum=1, activations=True,
        help="pad the vocabulary to a multiple of this times the tensor-parallel size")
    swiglu: bool = setting(False, activations=True, help="gated SiLU MLP (SwiGLU) instead of GeLU")
    squared_relu: bool = setting(False, help="squared-ReLU MLP activation instead of GeLU")
    untie_embeddings_and_output_weights: bool = setting(
        False, help="separate weights for the input embedding and the output layer")
    add_bias_linear: bool = setting(True, flag="--disable-bias-linear", switch=False, config=True,
                                    help="bias terms in the linear layers (QKV, attention output, MLP)")
    add_qkv_bias: bool = setting(False, help="a bias on the QKV projection only")
    qk_layernorm: bool = setting(False, config=True, activations=True,
                                 help="normalize queries and keys before attention")
    position_embedding_type: str = setting(
        "learned_absolute", aliases={"--use-rotary-position-embeddings": "rope"},
        choices=("learned_absolute", "rope", "mrope", "relative", "none"),
        help="how positions are encoded: a learned table, rotary (rope, mrope), relative, or none")
    rotary_base: int = setting(  # Megatron-LM arguments.py: --rotary-base, int, default 10000
        10000, minimum=1, only_with=("position_embedding_type", ("rope", "mrope")),
        help="rotary embeddings' base period (theta), with rope or mrope; Llama 3 500000, Mixtral 1000000")
    normalization: str = setting("LayerNorm", choices=("LayerNorm", "RMSNorm"), config=True,
                                 help="the normalization layers: LayerNorm or RMSNorm")
    hidden_dropout: float = setting(0.1, minimum=0, maximum=1, config=True,
                                    activations=True, help="dropout probability of the hidden states")
    attention_dropout: float = setting(0.1, minimum=0, maximum=1, config=True,
                                       activations=True, help="dropout probability after attention")
    # Mixture of experts
    num_moe_experts: int | None = setting(None, flag="--num-experts", minimum=1, maximum=100_000, config=True,
                                          activations=True, help="experts per MoE layer; unset: a dense model")
    moe_router_topk: int = setting(2, minimum=1, config=True, activations=True, help="experts each token is routed to")
    moe_ffn_hidden_size: int | None = setting(
        None, minimum=1, activations=True, help="MLP inner width of one expert (elements); unset: ffn_hidden_size")
    moe_shared_expert_intermediate_size: int | None = setting(
        None, minimum=1, config=True, activations=True,
        help="MLP width of all shared experts together (elements); unset: none")
    moe_layer_freq: int | list[int] = setting(
        1, config=True, activations=True,
        help="which layers are MoE: every Nth, or a 0/1 list with one entry per layer")
    # Multi-latent attention (DeepSeek)
    multi_latent_attention: bool = setting(
        False, activations=True, help="multi-latent attention (DeepSeek): keys and values through a low-rank latent")
    q_lora_rank: int | None = setting(None, minimum=1, only_with=MLA,
                                      activations=True,
                                      help="MLA: rank of the queries' low-rank projection; unset: full rank")
    kv_lora_rank: int = setting(512, minimum=1, activations=True, said=True, only_with=MLA, megatron_default=32,
                                help="MLA: rank of the key/value latent")
    qk_head_dim: int = setting(128, minimum=1, said=True, only_with=MLA,
                               activations=True, help="MLA: query/key width per head, rotary part excluded (elements)")
    qk_pos_emb_head_dim: int = setting(64, minimum=1, said=True, only_with=MLA,
                                       activations=True,
                                       help="MLA: rotary part of the query/key width per head (elements)")
    v_head_dim: int = setting(128, minimum=1, activations=True, said=True, only_with=MLA,
                              help="MLA: value width per head (elements)")
    # Multi-token prediction
    mtp_num_layers: int | None = setting(None, minimum=1, maximum=10_000,
                                         activations=True, pipeline_split=True,
                                         help="multi-token prediction layers after the decoder; unset: none")

    # -- derived ------------------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    def architecture(self) -> tuple:
        """What makes two models the same network (their weights' shapes), whatever their names,
        sequence lengths or dropout: how a Megatron command line is recognised as a preset."""
        moe = (self.num_moe_experts, self.moe_router_topk, self.moe_ffn, self.moe_shared_expert_intermediate_size,
               tuple(self.moe_layer_pattern())) if self.is_moe else ()
        mla = (self.q_lora_rank, self.kv_lora_rank, self.qk_head_dim, self.qk_pos_emb_head_dim,
               self.v_head_dim) if self.multi_latent_attention else ()
        return (self.num_layers, self.hidden_size, self.ffn, self.num_attention_heads, self.query_groups,
                self.head_dim, self.vocab_size, self.swiglu, self.untie_embeddings_and_output_weights,
                self.add_bias_linear, self.mtp_num_layers, moe, mla)

    def moe_layer_pattern(self) -> list[bool]:
        """True for each decoder layer that is an MoE layer."""
        if not self.is_moe:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return [bool(x) for x in freq]
        return [(i % freq) == 0 for i in range(self.num_layers)]

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @classmethod
    def load(cls, name: str) -> "ModelSpec":
        """The model preset `name` (the user's or shipped)."""
        return build(cls, catalog.read("models", name), f"model preset {name!r}")


@dataclass
class Hardware:
    """One accelerator as the software sees it (one MI250X GCD is one device). No Megatron flag sets these."""

    name: str = setting("cpu", flag=None, help="the hardware preset's name")
    description: str = setting("", flag=None, help="one line about the hardware, shown by presets list")
    vendor: str = setting("cpu", flag=None, choices=("nvidia", "amd", "cpu"),
                          help="who makes the device: which telemetry and kernels apply")
    # Amounts below are 0 where unknown (a CPU, or a device the presets lack)
    memory_bytes: int = setting(0, flag=None, minimum=0, help="physical memory per device (bytes); 0: unknown")
    usable_bytes: int = setting(0, flag=None, minimum=0, help="memory the framework can allocate: the total "
                                                              "minus the driver's reserve (bytes); 0: unknown")
    outside_allocator_bytes: int = setting(0, flag=None, minimum=0,
                                           help="memory outside PyTorch's allocator: CUDA/HIP context, NCCL "
                                                "buffers, library workspaces (bytes); 0: unknown")
    bf16_tflops: float = setting(0.0, flag=None, minimum=0,
                                 help="peak dense BF16 (and FP16) tensor throughput (TFLOP/s): the MFU peak of "
                                      "bf16/fp16 runs; 0: unknown")
    fp8_tflops: float | None = setting(None, flag=None, minimum=0,
                                       help="peak dense FP8 throughput (TFLOP/s): the MFU peak of FP8 runs; "
                                            "unset: no FP8")
    tf32_tflops: float | None = setting(None, flag=None, minimum=0,
                                        help="peak dense TF32 throughput (TFLOP/s): the MFU peak of fp32 runs that "
                                             "allow TF32; unset: none")
    fp32_tflops: float | None = setting(None, flag=None, minimum=0,
                                        help="peak FP32 throughput without TF32 (TFLOP/s): the MFU peak of fp32 "
                                             "runs; unset: unknown")
    fp8: bool = setting(False, flag=None, help="the device has FP8 matrix units")
    mem_bandwidth_gbs: float = setting(0.0, flag=None, minimum=0, help="peak memory bandwidth (GB/s); 0: unknown")
    node_link_gbs: float = setting(0.0, flag=None, minimum=0,
                                   help="device-to-device bandwidth in a node, each way (GB/s): NVLink, Infinity "
                                        "Fabric or PCIe; 0: unknown")
    network_gbs: float = setting(0.0, flag=None, minimum=0,
                                 help="network bandwidth between nodes per device, each way (GB/s): the node's "
                                      "NICs over its devices; 0: unknown")
    host_link_gbs: float = setting(0.0, flag=None, minimum=0,
                                   help="device-to-host bandwidth, each way, with every device of the node "
                                        "transferring (GB/s): offloading; 0: unknown")
    matmul_efficiency: float = setting(0.0, flag=None, minimum=0, maximum=1,
                                       help="share of the dense peak large GEMMs reach in training; assumed until "
                                            "doctor --train measures it")
    tdp_w: float = setting(0.0, flag=None, minimum=0, help="board power limit (W); 0: unknown")
    idle_w: float = setting(0.0, flag=None, minimum=0, help="power of an idle device (W), until recorded runs of "
                                                            "the hardware calibrate it; 0: unknown")
    devices_per_package: int = setting(1, flag=None, minimum=1, maximum=64,
                                       help="devices one package shows the software (MI250X: 2 GCDs)")
    max_sm_clock_mhz: float = setting(0.0, flag=None, minimum=0, help="highest SM clock (MHz); 0: unknown")
    sm_count: int = setting(0, flag=None, minimum=0, help="streaming multiprocessors (compute units): the waves "
                                                          "of a GEMM's tiles the step time counts; 0: unknown")
    compute_capability: str | None = setting(None, flag=None, help="NVIDIA compute capability, major.minor "
                                                                   "(9.0: Hopper): which kernels it can run")
    device_names: list[str] = setting([], flag=None,
                                      help="device names (torch, NVML) as whole-name shell patterns, any case: "
                                           "`doctor` matches a node's GPUs by them")
    temp_limit_c: float = setting(85.0, flag=None, help="GPU temperature above which time counts as hot (°C)")
    interconnect: str = setting("", flag=None, help="how the devices are connected, as shown (e.g. NVLink 4)")

    @classmethod
    def load(cls, name: str) -> "Hardware":
        """The hardware preset `name` (the user's or shipped)."""
        return build(cls, catalog.read("hardware", name), f"hardware preset {name!r}")


@dataclass
class Cluster:
    nodes: int = setting(1, flag=None, minimum=1, maximum=1_000_000, label="nodes", help="machines in the run")
    gpus_per_node: int = setting(1, flag=None, minimum=1, maximum=1024, label="devices/node",
                                 help="devices used on each node (processes per node for CPU runs)")


@dataclass
class Parallel:
    tensor_model_parallel_size: int = setting(
        1, minimum=1, label="TP  tensor", config=True, layout=True, said=True,
        activations=True, help="tensor parallel: each layer's matrices split over this many devices")
    pipeline_model_parallel_size: int = setting(1, minimum=1, label="PP  pipeline", config=True,
                                                pipeline_split=True, layout=True, said=True,
                                                help="pipeline parallel: the layers split into this many stages")
    virtual_pipeline_model_parallel_size: int | None = setting(   # set by either of two flags: SPECIAL_FLAGS
        None, flag=None, minimum=1, label="VP  virtual", config=True,
        pipeline_split=True, layout=True, help="interleaved pipeline: model chunks per pipeline stage; unset: 1")
    # megatron-core ModelParallelConfig.microbatch_group_size_per_vp_stage (core_v0.16.1, the same in core_v0.19.0;
    # __post_init__ sets it to the pipeline size when unset). It sets the interleaved schedule's warm-up, and so the
    # activations held at once: engine.model.memory passes it to the schedule (it is not an activation term's key)
    microbatch_group_size_per_vp_stage: int | None = setting(
        None, flag="--microbatch-group-size-per-virtual-pipeline-stage", minimum=1, config=True,
        help="interleaved pipeline: micro-batches each model chunk runs in a row, PP to the micro-batch count; "
             "unset: PP")
    context_parallel_size: int = setting(1, minimum=1, label="CP  context", config=True,
                                         activations=True, layout=True,
                                         help="context parallel: each sequence split over this many devices")
    expert_model_parallel_size: int = setting(1, minimum=1, label="EP  expert", config=True,
                                              activations=True, layout=True,
                                              help="expert parallel: the experts split over this many devices")
    expert_tensor_parallel_size: int | None = setting(
        None, minimum=1, label="ETP expert TP",
        activations=True, layout=True, help="tensor parallel inside the experts; unset: tensor_model_parallel_size")
    sequence_parallel: bool = setting(False, label="seq. parallel", config=True,
                                      activations=True, layout=True,
                                      help="with TP: norms and dropout split along the sequence too (less memory)")
    use_distributed_optimizer: bool = setting(False, label="dist. optimizer", layout=True,
                                              help="shard the optimizer state over the data-parallel ranks")
    num_distributed_optimizer_instances: int = setting(
        1, minimum=1, help="copies of the distributed optimizer across the data-parallel ranks")
    use_megatron_fsdp: bool = setting(False, layout=True,
                                      help="shard with Megatron FSDP (see data_parallel_sharding_strategy)")
    use_torch_fsdp2: bool = setting(False, layout=True,
                                    help="shard parameters, gradients and optimizer state with PyTorch FSDP2")
    data_parallel_sharding_strategy: str = setting(   # Megatron's default: megatron.VERSIONED_DEFAULTS
        "no_shard", said=("use_megatron_fsdp", (True,)),
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
        help="Megatron FSDP: what is sharded: nothing, the optimizer state, + gradients, + parameters")
    decoder_first_pipeline_num_layers: int | None = setting(
        None, minimum=1, config="num_layers_in_first_pipeline_stage",
        pipeline_split=True, help="layers on the first pipeline stage; unset: an even split")
    decoder_last_pipeline_num_layers: int | None = setting(
        None, minimum=1, config="num_layers_in_last_pipeline_stage",
        pipeline_split=True, help="layers on the last pipeline stage; unset: an even split")
    account_for_embedding_in_pipeline_split: bool = setting(
        False, config=True, pipeline_split=True, help="count the embedding as a layer when splitting the pipeline")
    account_for_loss_in_pipeline_split: bool = setting(
        False, config=True, pipeline_split=True, help="count the loss as a layer when splitting the pipeline")
    pipeline_model_parallel_layout: str | None = setting(
        None, config=True, pipeline_split=True,
        help="layers per stage, e.g. E|(t|)*3,m|L (Embedding, decoder t, MTP m, Loss; | ends a stage)")


@dataclass
class Training:
    micro_batch_size: int = setting(1, minimum=1, label="micro batch",
                                    activations=True, help="sequences per micro-batch on one data-parallel rank")
    global_batch_size: int = setting(1, minimum=1, label="global batch",
                                     help="sequences per optimizer step, over all data-parallel ranks")
    seq_length: int | None = setting(None, flag=None, minimum=1, label="seq length",   # --seq-length sets the model's
                                     activations=True,
                                     help="training sequence length (tokens); unset: the model's seq_length")
    train_iters: int = setting(20, minimum=1, help="optimizer steps (iterations) to run")
    # Megatron-LM's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by INCREMENT,
    # one increment per SAMPLES / increments consumed samples (core num_microbatches_calculator.py,
    # RampupBatchsizeNumMicroBatchesCalculator); Experiment.batch_ramp gives its steps
    rampup_batch_size: list[int] | None = setting(
        None, help="global batch ramp-up: start, increment, samples; unset: the global batch from the first step")
    warmup_iters: int = setting(2, flag=None, minimum=0, help="first iterations marked warm-up in the "
                                                              "iteration log (not learning-rate warm-up)")
    bf16: bool = setting(True, config=True, activations=True, megatron_default=False, help="BF16 mixed precision")
    fp16: bool = setting(False, config=True, activations=True, help="FP16 mixed precision, with loss scaling")
    loss_scale: float | None = setting(None, above=0, help="FP16: a static loss scale; unset: dynamic, from "
                                                           "initial_loss_scale")
    initial_loss_scale: float = setting(4294967296.0, above=0, help="FP16: where dynamic loss scaling "
                                                                    "starts (Megatron: 2^32)")
    fp8: str | None = setting(None, flag="--fp8-format", choices=(None, "e4m3", "hybrid"), config=True,
                              activations=True,
                              help="FP8 (Transformer Engine): e4m3 throughout, or hybrid (e5m2 gradients); "
                                   "unset: off")
    fp8_recipe: str = setting("delayed", choices=("delayed", "tensorwise", "blockwise", "mxfp8", "custom"),
                              help="FP8 scaling recipe (mxfp8: Blackwell only)")
    recompute_granularity: str | None = setting(
        None, aliases={"--recompute-activations": "selective"}, choices=(None, "full", "selective"),
        label="recompute", config=True,
        activations=True, help="activation recompute: whole layers (full), some modules (selective), or none")
    recompute_method: str | None = setting(
        None, choices=(None, "uniform", "block"), label="recompute how", config=True,
        activations=True, help="full recompute: layers in uniform chunks, or a block of layers per stage")
    recompute_num_layers: int | None = setting(
        None, minimum=1, label="recompute layers", config=True,
        activations=True, help="full recompute: layers per chunk (uniform) or per pipeline stage (block)")
    recompute_modules: list[str] | None = setting(
        None, config=True,
        choices=("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"),
        activations=True, help="selective recompute: the modules recomputed; unset: core_attn")
    overlap_grad_reduce: bool = setting(False, label="overlap grads",
                                        help="overlap the gradient reduce with the backward pass")
    overlap_param_gather: bool = setting(
        False, label="overlap params", help="overlap the distributed optimizer's parameter all-gather "
                                            "with the forward pass")
    tp_comm_overlap: bool = setting(False, label="TP comm overlap", config=True,
                                    help="overlap tensor-parallel communication with the GEMMs")
    check_for_nan_in_loss_and_grad: bool = setting(
        True, flag="--no-check-for-nan-in-loss-and-grad", switch=False,
        help="stop at a NaN or Inf loss or gradient, checked each step as Megatron-LM does (host syncs)")
    # what each becomes on a node: engine.model.runtime
    attention_backend: str = setting("auto", choices=("auto", "flash", "fused", "unfused", "local"),
                                     activations=True, help="attention kernel; auto: Transformer Engine picks (local: "
                                          "megatron-core's own)")
    transformer_impl: str = setting("auto", choices=("auto", "transformer_engine", "local"),
                                    activations=True,
                                    help="layer implementation; auto: Transformer Engine where it imports, "
                                         "else local")
    grad_reduce_in_bf16: bool = setting(False, help="reduce gradients in BF16 (default: FP32 main gradients "
                                                    "and reduction)")
    # Memory-relevant Megatron flags (defaults are Megatron's):
    fp8_param_gather: bool = setting(False, config="fp8_param",
                                     help="keep the compute weights in FP8 and all-gather them in FP8 "
                                          "(no BF16 copy)")
    # unfused attention upcasts the s x s scores to fp32 (--apply-query-key-layer-scaling implies it in Megatron)
    attention_softmax_in_fp32: bool = setting(False, aliases={"--apply-query-key-layer-scaling": True},
                                              config=True, activations=True,
                                              help="attention masking and softmax in FP32")
    # graphs keep static buffers; --enable-cuda-graph and --external-cuda-graph are Megatron's deprecated aliases
    cuda_graph_impl: str = setting("none", choices=("none", "local", "transformer_engine"), activations=True,
                                   aliases={"--enable-cuda-graph": "local",
                                            "--external-cuda-graph": "transformer_engine"},
                                   help="CUDA graph capture: none, megatron-core's (local) or Transformer Engine's")
    # megatron-core 0.19 renamed it cuda_graph_modules (--cuda-graph-scope still parses, deprecated)
    cuda_graph_scope: list[str] | None = setting(
        None, config=True, activations=True, renamed=("--cuda-graph-modules",),
        choices=("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration"),
        help="what the CUDA graphs capture of each layer; unset: whole layers")
    # Megatron-LM captures Transformer Engine's graphs once this many steps have run eagerly (training.py,
    # `iteration - start_iteration == args.cuda_graph_warmup_steps`, core_v0.16.1 and core_v0.19.0)
    cuda_graph_warmup_steps: int = setting(3, config=True, activations=True, minimum=0,
                                           only_with=("cuda_graph_impl", ("local", "transformer_engine")),
                                           help="steps run eagerly before the CUDA graphs are captured")
    use_precision_aware_optimizer: bool = setting(
        False, help="Transformer Engine's optimizer, with the four optimizer dtypes below")
    main_grads_dtype: str = setting("fp32", choices=("fp32", "bf16"),
                                    help="precision-aware optimizer: dtype of the main gradients")
    main_params_dtype: str = setting("fp32", choices=("fp32", "fp16"),
                                     help="precision-aware optimizer: dtype of the main parameters")
    exp_avg_dtype: str = setting("fp32", choices=("fp32", "fp16", "bf16", "fp8"),
                                 help="precision-aware optimizer: dtype of Adam's first moment")
    exp_avg_sq_dtype: str = setting("fp32", choices=("fp32", "fp16", "bf16", "fp8"),
                                    help="precision-aware optimizer: dtype of Adam's second moment")
    # Megatron-LM's --deterministic-mode (validate_args): torch's deterministic algorithms, a fixed NCCL algorithm
    # and Transformer Engine's deterministic attention; Megatron's CI runs most of its cases so
    deterministic_mode: bool = setting(False, config=True,
                                       help="bitwise-reproducible steps: deterministic kernels and NCCL algorithm")
    optimizer_cpu_offload: bool = setting(False, help="keep the optimizer state in host memory")
    optimizer: str = setting("adam", choices=("adam", "sgd", "muon"), help="the optimizer")
    cross_entropy_loss_fusion: bool = setting(False, activations=True, help="a fused cross-entropy kernel for the loss")
    defer_embedding_wgrad_compute: bool = setting(
        False, config=True, activations=True,
        help="compute the output layer's weight gradient at the pipeline flush, keeping its inputs and gradients")
    wgrad_deferral_limit: int = setting(
        0, minimum=0, config=True, activations=True,
        help="deferred output-layer weight gradients: micro-batches kept at most; 0: all")
    # PyTorch's own default is off; on, the caching allocator reserves little beyond its allocated peak
    # (see engine.model.memory.Budget)
    expandable_segments: bool = setting(True, flag=None, help="the workload's PyTorch allocator grows "
                                                              "segments in place (PYTORCH_CUDA_ALLOC_CONF)")
    # Activation offloading to the host (megatron-core). Layer-level: Megatron then sets cpu_offloading;
    # activations only, as its CLI offers
    cpu_offloading_num_layers: int = setting(0, minimum=0, config=True,
                                             activations=True,
                                             help="layers whose activations go to host memory; 0: off")
    # Module-level
    fine_grained_activation_offloading: bool = setting(
        False, config=True, activations=True, help="send the inputs of offload_modules to host memory, in every layer")
    # megatron-core TransformerConfig.offload_modules in core_v0.16.1 (core_v0.19.0 adds fused_group_mlp)
    offload_modules: list[str] | None = setting(
        None, choices=("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"),
        activations=True, help="fine-grained offloading: the modules whose inputs leave the GPU")
    moe_token_dispatcher_type: str = setting("allgather", choices=("allgather", "alltoall", "flex"), config=True,
                                             help="how tokens reach their experts (flex: DeepEP or HybridEP)")
    moe_expert_capacity_factor: float | None = setting(
        None, above=0, config=True,
        activations=True, help="tokens an expert takes, as a multiple of an even share; unset: none dropped")
    moe_pad_expert_input_to_capacity: bool = setting(
        False, config=True, activations=True, help="pad each expert's input to its capacity (with a capacity factor)")
    moe_aux_loss_coeff: float = setting(0.0, minimum=0, config=True,
                                        help="weight of the router's load-balancing loss; 0: off")
    moe_grouped_gemm: bool = setting(False, config=True, help="one grouped GEMM for a rank's local experts")
    # benchmarks route evenly (Megatron-Bridge's performance recipes: "force-balance the token distribution")
    moe_router_force_load_balancing: bool = setting(
        False, config=True, activations=True,
        help="route tokens evenly over the experts (benchmarking): no expert rank gets more than the mean")
    # megatron-core ModelParallelConfig (core_v0.16.1+): the 1F1B A2A overlap of pipeline_parallel/combined_1f1b.py
    overlap_moe_expert_parallel_comm: bool = setting(
        False, config=True, help="each micro-batch's expert-parallel all-to-alls beside another's compute "
                                 "(1F1B A2A overlap)")
    delay_wgrad_compute: bool = setting(
        False, config=True, help="weight gradients after the input gradients, beside the backward's all-to-all "
                                 "(A2A overlap)")
    moe_router_dtype: str | None = setting(None, choices=(None, "fp32", "fp64"), config=True,
                                           help="dtype of routing and the weighted expert sum; unset: the "
                                                "training dtype")
    # --moe-enable-deepep is Megatron's deprecated alias (0.16.1+)
    moe_flex_dispatcher_backend: str = setting("deepep", aliases={"--moe-enable-deepep": "deepep"},
                                               choices=("deepep", "hybridep"), config=True,
                                               help="the flex token dispatcher's backend")
    lr: float = setting(1.0e-4, above=0, help="initial learning rate")
    seed: int = setting(1234, help="random seed")
    # --data-path 0.3 /a 0.7 /b: one string
    data_path: str | None = setting(None, join=True, aliases={"--mock-data": None},
                                    help="Megatron indexed dataset prefix, or weights and prefixes; unset: "
                                         "synthetic tokens")


@dataclass
class Telemetry:
    backend: str = setting("auto", flag=None, choices=BACKEND_NAMES,
                           help="where telemetry comes from (replay:RUN replays a recorded run)")
    hz: float = setting(DEFAULT_HZ, flag=None, above=0, maximum=MAX_HZ,   # what the sampler accepts
                       help="telemetry samples per second (Hz)")
    # Megatron-LM profiles a range (--profile-step-start/end); charllm names the steps, checked by
    # engine.model.validate against train_iters (engine.model.profiling says what they cost)
    profile_steps: list[int] | None = setting(
        None, flag=None, help="steps (1-based) whose PyTorch profiler trace (Kineto JSON) goes into the run's "
                              "traces/; unset: none")
    profile_scope: str = setting("stage", flag=None, choices=("stage", "all"),
                                 help="which ranks record the profiled steps: the first rank of each pipeline "
                                      "stage, or every rank")

SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "hardware": Hardware,
    "cluster": Cluster,
    "parallel": Parallel,
    "training": Training,
    "telemetry": Telemetry,
}


# --------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------
def _quotient(size: int, parts: int) -> int:
    """`size` // `parts`, at least 1: a derived size of any layout, even an invalid one (`validate` names
    a part below 1) rather than a division by zero."""
    return max(1, size // parts) if parts > 0 else 1


def microbatches(global_batch_size, micro_batch_size, data_parallel_size):
    """Micro-batches per data-parallel rank in one step, at least 1: numbers, or numpy arrays (the sweep)."""
    step = micro_batch_size * data_parallel_size
    if isinstance(step, int):
        return _quotient(global_batch_size, step)
    count = global_batch_size // step
    import numpy as np  # deferred: only the sweep passes arrays

    return np.maximum(count, 1)


def layout_label(layout: Mapping[str, Any]) -> str:
    """A parallel layout in short, from a layout record (`Experiment.layout_record`, or a run's read back, or a
    sweep's row: the fields' names): "TP8 PP2 DP2", "TP2 PP4 VP2 EP8 DP4", "TP8 FSDP DP4" (sizes of 1 and
    missing ones left out, but TP, PP and DP always said)."""
    def size(name: str) -> int:
        value = layout.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    parts = [f"TP{size('tensor_model_parallel_size')}", f"PP{size('pipeline_model_parallel_size')}"]
    parts += [f"{short}{size(name)}" for short, name in (
        ("VP", "virtual_pipeline_model_parallel_size"), ("CP", "context_parallel_size"),
        ("EP", "expert_model_parallel_size")) if size(name) > 1]
    parts += ["FSDP"] if layout.get("use_torch_fsdp2") is True or layout.get("use_megatron_fsdp") is True else []
    return " ".join(parts + [f"DP{size('data_parallel_size')}"])


@dataclass
class Experiment:
    name: str = "experiment"
    description: str = ""
    model: ModelSpec = field(default_factory=ModelSpec)
    hardware: Hardware = field(default_factory=Hardware)
    cluster: Cluster = field(default_factory=Cluster)
    parallel: Parallel = field(default_factory=Parallel)
    training: Training = field(default_factory=Training)
    telemetry: Telemetry = field(default_factory=Telemetry)

    # -- derived sizes --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def model_parallel_size(self) -> int:
        p = self.parallel
        return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """World / (TP*PP*CP), rounded down, at least 1; `engine.model.validate` checks that it divides, and
        names a size below 1 (for which this is 1: the form shows the sizes while such a value is typed)."""
        return _quotient(self.world_size, self.model_parallel_size)

    @property
    def expert_tensor_parallel_size(self) -> int:
        p = self.parallel
        return p.expert_tensor_parallel_size or p.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks of one pipeline stage (TP*CP*DP) / (ETP*EP)."""
        p = self.parallel
        stage = _quotient(self.world_size, p.pipeline_model_parallel_size)
        return _quotient(stage, self.expert_tensor_parallel_size * p.expert_model_parallel_size)

    @property
    def seq_length(self) -> int:
        return self.training.seq_length or self.model.seq_length

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return microbatches(t.global_batch_size, t.micro_batch_size, self.data_parallel_size)

    def batch_ramp(self) -> list[tuple[int, int]]:
        """(global batch, steps) of the batch ramp-up before the global batch, in order; [] without one.
        As Megatron-LM counts them (training.py update_train_iters, core_v0.16.1): the batch of each step is
        START + INCREMENT x (samples consumed before it / samples per increment) until SAMPLES are consumed."""
        t = self.training
        if not t.rampup_batch_size or len(t.rampup_batch_size) != 3:
            return []
        start, increment, samples = t.rampup_batch_size
        increments = (t.global_batch_size - start) // increment if increment > 0 else 0
        if increments <= 0 or start <= 0:
            return []
        per_increment = samples / increments
        steps: list[tuple[int, int]] = []
        consumed = 0
        while consumed <= samples:
            batch = min(start + int(consumed / per_increment) * increment, t.global_batch_size)
            if batch == t.global_batch_size:
                break
            steps = steps[:-1] + [(batch, steps[-1][1] + 1)] if steps and steps[-1][0] == batch else \
                steps + [(batch, 1)]
            consumed += batch
        return steps

    @property
    def virtual_stages(self) -> int:
        return self.parallel.virtual_pipeline_model_parallel_size or 1

    @property
    def layout_label(self) -> str:
        """The parallel layout in short (`layout_label` of `layout_record`)."""
        return layout_label(self.layout_record())

    def layout_record(self) -> dict[str, Any]:
        """The parallel layout a run records (iterations.jsonl's start row; `Trainer.layout`): each field
        marked `layout`, as this experiment resolves it where a property of the same name does
        (expert_tensor_parallel_size: unset is TP), then the data-parallel size and micro-batch count."""
        out = {}
        for section, name, _ in declared("layout"):
            resolved = isinstance(getattr(type(self), name, None), property)
            out[name] = getattr(self, name) if resolved else getattr(getattr(self, section), name)
        return {**out, "data_parallel_size": self.data_parallel_size, "num_microbatches": self.num_microbatches}

    def transformer_config_fields(self) -> dict[str, Any]:
        """The fields marked `config` (see `setting`), under megatron-core TransformerConfig's names."""
        out = {}
        for section in ("model", "parallel", "training"):
            obj = getattr(self, section)
            for f in fields(obj):
                if name := f.metadata.get("config"):
                    out[f.name if name is True else name] = getattr(obj, f.name)
        return out

    # -- editing ----------------------------------------------------------------------------------
    def copy(self) -> "Experiment":
        return dataclasses.replace(
            self, **{name: dataclasses.replace(getattr(self, name)) for name in SECTIONS}
        )

    def set(self, key: str, value: Any) -> None:
        """Set one field, as `section.field` or a bare Megatron name (`tensor_model_parallel_size`)."""
        if key in ("name", "description"):
            setattr(self, key, str(value))
            return
        if key in ("model", "hardware"):  # a preset by name, as `model = "llama3-8b"` in a TOML file
            if not isinstance(value, str):
                raise UserError(f"{key} = {value!r}: expected a {key} preset name (charllm-tui presets list {key})")
            setattr(self, key, (ModelSpec if key == "model" else Hardware).load(value))
            return
        section, name = resolve_key(key)
        obj = getattr(self, section)
        setattr(obj, name, coerce(type(obj), name, value, where=key))

    def apply(self, assignments: list[str]) -> "Experiment":
        """Apply `key=value` strings (the CLI's --set); values parse as TOML, else as strings."""
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise UserError(f"--set {item!r}: expected key=value, e.g. tensor_model_parallel_size=4")
            try:
                value = parse_value(raw.strip())
            except ValueError as exc:
                raise UserError(f"--set {key.strip()}: {exc}") from None
            self.set(key.strip(), value)
        return self

    # -- TOML -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Fully resolved: a run directory's copy does not depend on the catalog later."""
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        for section in SECTIONS:
            out[section] = _drop_none(dataclasses.asdict(getattr(self, section)))
        return out

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    def save(self, path: Path) -> Path:
        """Write atomically (no half-written file on error)."""
        text = self.to_toml()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, text)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "experiment") -> "Experiment":
        data = dict(data)
        top_allowed = {"name", "description", *SECTIONS}
        for key in data:
            if key not in top_allowed:
                raise UserError(_unknown(source, key, top_allowed))
        exp = cls(name=str(data.get("name", "experiment")), description=str(data.get("description", "")))
        for section, kind in SECTIONS.items():
            value = data.get(section)
            if value is None:
                continue
            if section in ("model", "hardware"):
                loader: Callable[[str], Any] = ModelSpec.load if section == "model" else Hardware.load
                if isinstance(value, str):
                    setattr(exp, section, loader(value))
                    continue
                if not isinstance(value, dict):
                    raise UserError(f"{source}: {section} must be a preset name or a table, got {value!r}")
                value = dict(value)
                preset = value.pop("preset", None)
                base = loader(preset) if preset else kind()
                setattr(exp, section, build(kind, value, f"{source}: {section}", base=base))
            else:
                if not isinstance(value, dict):
                    raise UserError(f"{source}: [{section}] must be a table, got {value!r}")
                setattr(exp, section, build(kind, value, f"{source}: [{section}]"))
        return exp

    @classmethod
    def load(cls, ref: str | Path) -> "Experiment":
        """An experiment from a TOML file, or the experiment preset named `ref` (the user's or shipped)."""
        path = Path(ref).expanduser()
        if path.suffix == ".toml" or path.is_file():
            return cls.from_dict(paths.read_toml(path, "experiment file"), source=str(path))
        return cls.from_dict(catalog.read("experiments", str(ref)), source=f"experiment preset {ref!r}")


# --------------------------------------------------------------------------------------------
# Helpers: typed construction, key resolution, value coercion
# --------------------------------------------------------------------------------------------
def field_names(kind: type) -> list[str]:
    return [f.name for f in fields(kind)]


# A bare name found in several sections means what Megatron's flag of that name means:
# `seq_length` and `fp8` are the training run's (--seq-length, --fp8-format), not the model
# preset's default or the hardware's capability.
KEY_PRECEDENCE = ("training", "parallel", "cluster", "telemetry", "model", "hardware")


def all_keys() -> dict[str, str]:
    """Bare field name -> section, for every settable field (model/hardware names are sectioned)."""
    out: dict[str, str] = {}
    for section in KEY_PRECEDENCE:
        for name in field_names(SECTIONS[section]):
            if name in ("name", "description"):
                continue
            out.setdefault(name, section)
    return out


def resolve_key(key: str) -> tuple[str, str]:
    if "." in key:
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise UserError(_unknown("key", key, [f"{s}.<field>" for s in SECTIONS]))
        names = field_names(SECTIONS[section])
        if name not in names:
            raise UserError(_unknown(f"[{section}]", name, names))
        return section, name
    keys = all_keys()
    if key not in keys:
        raise UserError(_unknown("key", key, [*keys, "model", "hardware"]))
    return keys[key], key


def build(kind: type, values: dict[str, Any], where: str, base=None):
    names = field_names(kind)
    obj = dataclasses.replace(base) if base is not None else kind()
    for key, value in values.items():
        if key not in names:
            raise UserError(_unknown(where, key, names))
        setattr(obj, key, coerce(kind, key, value, where=f"{where}.{key}"))
    return obj


@functools.cache  # get_type_hints re-evaluates every annotation: 90% of a preset load without the cache
def field_types(kind: type) -> dict[str, Any]:
    """Each field's annotation, evaluated."""
    return get_type_hints(kind)


def field_options(kind: type, name: str) -> tuple:
    """The types the field's annotation allows (`int | None`: int, NoneType)."""
    hint = field_types(kind)[name]
    return get_args(hint) if get_origin(hint) in (types.UnionType, typing.Union) else (hint,)


def expected(kind: type, name: str) -> str:
    """What the field takes, in words: "an integer or none" (as coerce's errors say it)."""
    return " or ".join(_type_name(o) for o in field_options(kind, name))


def set_key(section: str, name: str) -> str:
    """The key `Experiment.set` (and --set) takes for the field: its bare name where that names it."""
    return name if all_keys().get(name) == section else f"{section}.{name}"


def coerce(kind: type, name: str, value: Any, *, where: str) -> Any:
    """Check `value` against the field's annotation; ints are accepted for floats."""
    options = field_options(kind, name)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in options):
        if type(None) in options:
            return None
        raise UserError(f"{where}: a value is required (got none)")
    for option in options:
        if option is type(None):
            continue
        if option is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
                return value.lower() in ("true", "yes", "on")
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not math.isfinite(float(value)):
                    raise UserError(f"{where}: {value!r} is not a finite number")
                return float(value)
        elif option is str:
            if isinstance(value, str):
                return value
        elif get_origin(option) is list:
            (item,) = get_args(option)
            if isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                return list(value)
    raise UserError(f"{where}: expected {expected(kind, name)}, got {value!r}")


def _type_name(option) -> str:
    if option is type(None):
        return "none"
    if get_origin(option) is list:
        return f"a list of {get_args(option)[0].__name__}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(option, str(option))


def parse_value(raw: str) -> Any:
    """A --set value: TOML syntax (4, 1.5, true, [1, 2], "x"), else the bare string. A value no
    field could hold (a number of thousands of digits, lists nested thousands deep) is a ValueError
    saying so."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    except RecursionError:
        raise ValueError("the value is nested too deeply") from None
    except ValueError:   # int() past the interpreter's 4,300 digits
        raise ValueError(f"a number of {len(raw):,} characters (far beyond any field's range)") from None


def _unknown(where: str, key: str, valid) -> str:
    return f"{where}: unknown key {key!r}{did_you_mean(key, valid)}"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
