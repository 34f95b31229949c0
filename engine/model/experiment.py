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

Validation of the layout lives in `engine.model.validate`; this module only parses, stores and derives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from charllm.engine.model import catalog
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
# Sections
# --------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """Architecture, in Megatron-LM argument names."""

    name: str = "custom"
    description: str = ""
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int | None = None          # None: 4 * hidden_size
    num_attention_heads: int = 4
    num_query_groups: int | None = None         # None: multi-head attention (= heads)
    kv_channels: int | None = None              # None: hidden_size / num_attention_heads
    seq_length: int = 2048                      # the model's default training sequence length
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int = 50257
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = False
    squared_relu: bool = False
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"   # learned_absolute | rope | none
    normalization: str = "LayerNorm"                     # LayerNorm | RMSNorm
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # Mixture of experts
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None              # None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | list[int] = 1                 # every Nth layer is MoE, or a 0/1 pattern per layer
    # Multi-latent attention (DeepSeek)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Multi-token prediction
    mtp_num_layers: int | None = None

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
    """One accelerator as the software sees it (one MI250X GCD is one device)."""

    name: str = "cpu"
    description: str = ""
    vendor: str = "cpu"                 # nvidia | amd | cpu
    memory_bytes: int = 0               # physical memory per device
    usable_bytes: int = 0               # what the framework can allocate (total minus driver reserve)
    outside_allocator_bytes: int = 0    # CUDA/HIP context, NCCL buffers, library workspaces
    bf16_tflops: float = 0.0            # peak dense BF16 TFLOP/s
    fp8_tflops: float | None = None     # peak dense FP8 TFLOP/s; None: no FP8
    fp8: bool = False
    mem_bandwidth_gbs: float = 0.0
    tdp_w: float = 0.0
    devices_per_package: int = 1        # MI250X: 2 GCDs per package
    max_sm_clock_mhz: float = 0.0
    compute_capability: str | None = None   # NVIDIA "major.minor" ("9.0": Hopper); what kernels it can run
    temp_limit_c: float = 85.0          # GPU temperature above which time is counted as hot
    interconnect: str = ""

    @classmethod
    def load(cls, name: str) -> "Hardware":
        """The hardware preset `name` (the user's or shipped)."""
        return build(cls, catalog.read("hardware", name), f"hardware preset {name!r}")


@dataclass
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 1              # devices per node (processes per node for CPU runs)


@dataclass
class Parallel:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None      # None: = tensor_model_parallel_size
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    data_parallel_sharding_strategy: str = "no_shard"   # no_shard | optim | optim_grads | optim_grads_params
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None


@dataclass
class Training:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_length: int | None = None       # None: the model's seq_length
    train_iters: int = 20
    warmup_iters: int = 2               # iterations marked warm-up in the iteration log (not LR warm-up)
    bf16: bool = True
    fp16: bool = False
    loss_scale: float | None = None     # fp16: a static loss scale; None: dynamic, from initial_loss_scale
    initial_loss_scale: float = 4294967296.0   # fp16 dynamic loss scaling starts here (Megatron: 2**32)
    fp8: str | None = None              # None | e4m3 | hybrid
    fp8_recipe: str = "delayed"         # delayed | tensorwise | blockwise | mxfp8
    recompute_granularity: str | None = None   # None | full | selective
    recompute_method: str | None = None        # None | uniform | block (full only)
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None  # selective: default ["core_attn"]
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    attention_backend: str = "auto"     # auto | flash | fused | unfused | local (see engine.model.runtime)
    transformer_impl: str = "auto"      # auto (TE where it imports, else local) | transformer_engine | local
    grad_reduce_in_bf16: bool = False   # default: fp32 main grads and fp32 reduction
    # Memory-relevant Megatron flags (defaults are Megatron's):
    fp8_param_gather: bool = False      # keep compute weights in FP8 (no bf16 copy)
    attention_softmax_in_fp32: bool = False    # unfused attention upcasts the s x s scores to fp32
    cuda_graph_impl: str = "none"       # none | local | transformer_engine (graphs keep static buffers)
    use_precision_aware_optimizer: bool = False    # enables the four optimizer dtypes below
    main_grads_dtype: str = "fp32"      # fp32 | bf16
    main_params_dtype: str = "fp32"     # fp32 | fp16
    exp_avg_dtype: str = "fp32"         # fp32 | fp16 | bf16 | fp8 (Adam first moment)
    exp_avg_sq_dtype: str = "fp32"      # fp32 | fp16 | bf16 | fp8 (Adam second moment)
    optimizer_cpu_offload: bool = False    # optimizer state on the host
    optimizer: str = "adam"             # adam | sgd
    cross_entropy_loss_fusion: bool = False
    # PYTORCH_CUDA_ALLOC_CONF expandable_segments for the workload (PyTorch's own default is off): the
    # caching allocator then reserves little beyond its allocated peak (see engine.model.memory.Budget)
    expandable_segments: bool = True
    # Activation offloading to the host (megatron-core). Layer-level: > 0 sends the activations of this
    # many layers to the host (Megatron then sets cpu_offloading; activations only, as its CLI offers)
    cpu_offloading_num_layers: int = 0
    # Module-level: the inputs of offload_modules (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm,
    # expert_fc1, moe_act), in every layer
    fine_grained_activation_offloading: bool = False
    offload_modules: list[str] | None = None
    moe_token_dispatcher_type: str = "allgather"   # allgather | alltoall | flex
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_grouped_gemm: bool = False
    moe_router_dtype: str | None = None          # None | fp32 | fp64: routing and the weighted expert sum
    moe_flex_dispatcher_backend: str = "deepep"  # deepep | hybridep (with moe_token_dispatcher_type "flex")
    lr: float = 1.0e-4
    seed: int = 1234
    data_path: str | None = None        # Megatron indexed dataset prefix; None: synthetic tokens


@dataclass
class Telemetry:
    backend: str = "auto"               # auto | nvml | amdsmi | host | sim
    hz: float = 20.0


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
        """World / (TP*PP*CP), rounded down; `engine.model.validate` checks that it divides."""
        return max(1, self.world_size // self.model_parallel_size)

    @property
    def expert_tensor_parallel_size(self) -> int:
        p = self.parallel
        return p.expert_tensor_parallel_size or p.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks of one pipeline stage (TP*CP*DP) / (ETP*EP)."""
        p = self.parallel
        stage = self.world_size // p.pipeline_model_parallel_size
        return max(1, stage // (self.expert_tensor_parallel_size * p.expert_model_parallel_size))

    @property
    def seq_length(self) -> int:
        return self.training.seq_length or self.model.seq_length

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return max(1, t.global_batch_size // (t.micro_batch_size * self.data_parallel_size))

    @property
    def virtual_stages(self) -> int:
        return self.parallel.virtual_pipeline_model_parallel_size or 1

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
            self.set(key.strip(), parse_value(raw.strip()))
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
                loader = kind.load
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
def _hints(kind: type) -> dict[str, Any]:
    return get_type_hints(kind)


def coerce(kind: type, name: str, value: Any, *, where: str) -> Any:
    """Check `value` against the field's annotation; ints are accepted for floats."""
    hint = _hints(kind)[name]
    options = get_args(hint) if get_origin(hint) in (types.UnionType, typing.Union) else (hint,)
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
    expected = " or ".join(_type_name(o) for o in options)
    raise UserError(f"{where}: expected {expected}, got {value!r}")


def _type_name(option) -> str:
    if option is type(None):
        return "none"
    if get_origin(option) is list:
        return f"a list of {get_args(option)[0].__name__}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(option, str(option))


def parse_value(raw: str) -> Any:
    """A --set value: TOML syntax (4, 1.5, true, [1, 2], "x"), else the bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _unknown(where: str, key: str, valid) -> str:
    return f"{where}: unknown key {key!r}{did_you_mean(key, valid)}"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
