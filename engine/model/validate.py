"""Validation of an experiment: every rule Megatron-LM enforces, or that makes a layout impossible.

`validate(exp)` returns all problems found, each naming the field, its value and the rule it breaks;
`check(exp)` raises the first as a UserError. Rules that divide by a size run only when the sizes are
positive, so a bad size is reported as itself rather than as a follow-on error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import get_origin

from charllm.engine.model.experiment import (
    SECTIONS,
    Experiment,
    Problem,
    Telemetry,
    Training,
    choices,
    declared,
    facts,
    field_names,
    field_options,
    microbatches,
    parse_pipeline_layout,
)
from charllm.engine.model.runtime import parse_capability
from charllm.probes.backends import REPLAY
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import number


def _is_list(section: str, name: str) -> bool:
    return any(get_origin(option) is list for option in field_options(SECTIONS[section], name))


# Choices, as Megatron-LM's argument parser (or our own tooling, for vendor) lists them, in the order their
# problems are listed. The telemetry backend is checked on its own: its last choice is a pattern, replay:RUN.
CHOICES: dict[str, tuple[str, tuple]] = {
    name: (section, options) for section, name, options in declared("choices", ("model", "parallel", "training",
                                                                                 "hardware", "telemetry"))
    if not _is_list(section, name) and name != "backend"
}
ITEM_CHOICES: dict[str, tuple[str, tuple]] = {       # lists whose every item is one of the choices
    name: (section, options) for section, name, options in declared("choices") if _is_list(section, name)
}
BACKENDS: tuple = choices(Telemetry, "backend") or ()   # probes.backends.BACKEND_NAMES, through the field

# Upper bounds far beyond any real model or cluster, checked before any rule, plan or sweep loops
# over a size (a loop over 10^20 nodes or layers never ends) or the arithmetic overflows.
MAX_SIZE = 2**31 - 1      # layer, batch and parallel sizes
MAX_NUMBER = 2**53        # any integer (bytes too): exact as a float, and no overflow in a table
MAX_WORLD_SIZE = 2**20
MAX_LAYOUT_CHARS = 10_000


def _bounds(section: str, name: str) -> tuple[float | None, float | None, float | None]:
    """A field's (minimum, above, maximum), as its metadata states them; a size (minimum 1) is at most
    its own maximum, else MAX_SIZE."""
    stated = facts(SECTIONS[section], name)
    maximum = stated["maximum"] if stated["maximum"] is not None else MAX_SIZE if stated["minimum"] == 1 else None
    return stated["minimum"], stated["above"], maximum


# Every field with a range: (section, field, minimum, above, maximum). None (not set) is allowed where the
# field is optional.
RANGES = [(section, name, *bounds) for section in SECTIONS for name in field_names(SECTIONS[section])
          if (bounds := _bounds(section, name)) != (None, None, None)]


def out_of_range(value: float, minimum: float | None, above: float | None, maximum: float | None) -> str | None:
    """The rule `value` breaks, if any."""
    if minimum is not None and value < minimum:
        return "must be 0 or more" if minimum == 0 else f"must be at least {number(minimum)}"
    if above is not None and value <= above:
        return f"must be greater than {number(above)}"
    if maximum is not None and value > maximum:
        return f"must be at most {number(maximum)}"
    return None


# Text fields end up in file names, shell scripts, sbatch headers and comments: one line each.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
ONE_LINE = "must be one line of printable text (no newlines or control characters)"


def check(exp: Experiment) -> None:
    """Raise UserError naming the first problem, if any."""
    problems = validate(exp)
    if problems:
        raise UserError(str(problems[0]))


def validate(exp: Experiment) -> list[Problem]:
    return value_problems(exp) or rule_problems(exp)   # the rules divide by the sizes the values check


def rule_problems(exp: Experiment) -> list[Problem]:
    """The rules alone, for an experiment whose values `value_problems` found good (the sweep checks
    its base's values once, then the rules for each layout)."""
    problems = []
    for rules in (_layout, _model, _pipeline, _batch, _rampup, _experts, _sequence, _precision, _deterministic,
                  _recompute, _offloading, _optimizer, _profiling):
        problems.extend(rules(exp))
    return problems


# --------------------------------------------------------------------------------------------
@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A section's field names (the sweep validates thousands of layouts: `dataclasses.fields` each
    time was a third of its time)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def value_problems(exp: Experiment) -> list[Problem]:
    """Problems with single values (sizes, ranges, choices). When there are none, the experiment's
    derived sizes (data-parallel size, micro-batch count, ...) are well defined."""
    out = []
    if CONTROL.search(exp.name):
        out.append(Problem("name", exp.name, ONE_LINE))
    for section in ("model", "hardware", "cluster", "parallel", "training", "telemetry"):
        obj = getattr(exp, section)
        for name in _field_names(SECTIONS[section]):
            value = getattr(obj, name)
            if isinstance(value, str) and CONTROL.search(value):
                out.append(Problem(name, value, ONE_LINE))
            elif isinstance(value, float) and not math.isfinite(value):
                out.append(Problem(name, value, "must be a finite number"))
            elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
                out.append(Problem(name, value, f"must be at most {MAX_NUMBER:,} in size"))
    if out:
        return out
    for section, name, *bounds in RANGES:
        value = getattr(getattr(exp, section), name)
        if value is not None and (rule := out_of_range(value, *bounds)):
            out.append(Problem(name, value, rule))
    if not out and exp.world_size > MAX_WORLD_SIZE:
        out.append(Problem("cluster", f"{exp.cluster.nodes} x {exp.cluster.gpus_per_node}",
                           f"at most {MAX_WORLD_SIZE:,} devices in all"))
    capability = exp.hardware.compute_capability
    if capability is not None and parse_capability(capability) is None:
        out.append(Problem("compute_capability", capability, "must be major.minor, e.g. \"9.0\""))
    backend = exp.telemetry.backend
    if backend not in BACKENDS and not backend.startswith(REPLAY):
        out.append(Problem("backend", backend, f"must be one of {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}"))
    for name, (section, options) in CHOICES.items():
        value = getattr(getattr(exp, section), name)
        if value not in options:
            listed = ", ".join("none" if c is None else c for c in options)
            out.append(Problem(name, value, f"must be one of {listed}"))
    for name, (section, options) in ITEM_CHOICES.items():
        items = getattr(getattr(exp, section), name)
        for item in items or []:
            if item not in options:
                out.append(Problem(name, items, f"{item!r} is not one of {', '.join(options)}"))
    m = exp.model
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers:
            out.append(Problem("moe_layer_freq", freq, f"a per-layer pattern needs one entry per layer "
                                                        f"(num_layers = {m.num_layers}), got {len(freq)}"))
        elif any(v not in (0, 1) for v in freq):
            out.append(Problem("moe_layer_freq", freq, "a per-layer pattern holds only 0 (dense) and 1 (MoE)"))
    elif freq < 1:
        out.append(Problem("moe_layer_freq", freq, "must be at least 1 (every Nth layer is MoE)"))
    return out


def _layout(exp: Experiment) -> list[Problem]:
    p = exp.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    out = []
    if exp.world_size % (tp * pp * cp):
        out.append(Problem("world_size", exp.world_size,
                           f"must be a multiple of tensor x pipeline x context parallel sizes "
                           f"({tp} x {pp} x {cp} = {tp * pp * cp}) for a whole data-parallel size"))
    if exp.training.attention_backend == "local" and exp.training.transformer_impl == "transformer_engine":
        # Megatron-LM asserts --spec local for it: it is megatron-core's own attention module.
        out.append(Problem("attention_backend", "local", "is megatron-core's local attention: it needs "
                                                         "transformer_impl = \"local\" or \"auto\""))
    if p.sequence_parallel and tp == 1:
        out.append(Problem("sequence_parallel", True, "needs tensor_model_parallel_size > 1",
                           "sequence_parallel=false"))
    if exp.training.tp_comm_overlap and not p.sequence_parallel:
        out.append(Problem("tp_comm_overlap", True, "needs sequence_parallel = true", "sequence_parallel=true"))
    if p.use_megatron_fsdp and p.use_torch_fsdp2:
        out.append(Problem("use_torch_fsdp2", True, "cannot be combined with use_megatron_fsdp"))
    if p.data_parallel_sharding_strategy != "no_shard" and not p.use_megatron_fsdp:
        out.append(Problem("data_parallel_sharding_strategy", p.data_parallel_sharding_strategy,
                           "applies only with use_megatron_fsdp = true"))
    if p.use_torch_fsdp2:
        for name, value, ok in (("pipeline_model_parallel_size", pp, pp == 1),
                                ("expert_model_parallel_size", p.expert_model_parallel_size,
                                 p.expert_model_parallel_size == 1),
                                ("use_distributed_optimizer", p.use_distributed_optimizer,
                                 not p.use_distributed_optimizer)):
            if not ok:
                out.append(Problem(name, value, "is not supported with use_torch_fsdp2"))
        if not exp.model.untie_embeddings_and_output_weights:     # Megatron's validate_args (0.16.1+)
            out.append(Problem("untie_embeddings_and_output_weights", False, "use_torch_fsdp2 needs untied "
                               "embeddings", "untie_embeddings_and_output_weights=true"))
    return out


def _model(exp: Experiment) -> list[Problem]:
    m, p = exp.model, exp.parallel
    tp = p.tensor_model_parallel_size
    out = []
    if m.num_attention_heads % tp:
        out.append(Problem("num_attention_heads", m.num_attention_heads,
                           f"must be divisible by tensor_model_parallel_size ({tp})"))
    if m.num_query_groups is not None:
        if m.num_query_groups % tp:
            out.append(Problem("num_query_groups", m.num_query_groups,
                               f"must be divisible by tensor_model_parallel_size ({tp})"))
        if m.num_attention_heads % m.num_query_groups:
            out.append(Problem("num_query_groups", m.num_query_groups,
                               f"must divide num_attention_heads ({m.num_attention_heads})"))
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        out.append(Problem("hidden_size", m.hidden_size, f"must be divisible by num_attention_heads "
                                                         f"({m.num_attention_heads}) unless kv_channels is set"))
    if m.ffn % tp:
        out.append(Problem("ffn_hidden_size", m.ffn, f"must be divisible by tensor_model_parallel_size ({tp})"))
    if m.swiglu and m.squared_relu:
        out.append(Problem("squared_relu", True, "cannot be combined with swiglu (one MLP activation)"))
    if not m.multi_latent_attention and m.q_lora_rank is not None:
        out.append(Problem("q_lora_rank", m.q_lora_rank, "applies only with multi_latent_attention = true"))
    if m.multi_latent_attention and m.num_query_groups is not None:
        out.append(Problem("num_query_groups", m.num_query_groups,
                           "multi-latent attention has no query groups; leave it unset"))
    if m.mtp_num_layers and m.position_embedding_type not in ("rope", "none"):
        out.append(Problem("mtp_num_layers", m.mtp_num_layers,
                           f"multi-token prediction needs position_embedding_type rope or none, "
                           f"not {m.position_embedding_type}"))
    return out


def _pipeline(exp: Experiment) -> list[Problem]:
    m, p = exp.model, exp.parallel
    pp, vp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    out = []
    if exp.training.defer_embedding_wgrad_compute and pp == 1:   # megatron-core ModelParallelConfig
        out.append(Problem("defer_embedding_wgrad_compute", True, "needs pipeline_model_parallel_size > 1 (the "
                           "deferred weight gradient is computed during the pipeline flush)",
                           "defer_embedding_wgrad_compute=false"))
    if vp > 1 and pp == 1:
        out.append(Problem("virtual_pipeline_model_parallel_size", vp,
                           "needs pipeline_model_parallel_size > 1 (the interleaved schedule)"))
    if p.pipeline_model_parallel_layout is not None:
        layout = p.pipeline_model_parallel_layout
        if len(layout) > MAX_LAYOUT_CHARS:
            return out + [Problem("pipeline_model_parallel_layout", f"{layout[:40]}...",
                                  f"at most {MAX_LAYOUT_CHARS:,} characters")]
        try:
            stages = parse_pipeline_layout(layout)
        except ValueError as exc:
            return out + [Problem("pipeline_model_parallel_layout", layout, str(exc))]
        decoders = sum(stage.count("t") for stage in stages)
        if len(stages) % pp:
            out.append(Problem("pipeline_model_parallel_layout", layout,
                               f"its {len(stages)} stages must divide over pipeline_model_parallel_size ({pp})"))
        elif vp != len(stages) // pp:      # Megatron takes VP from the layout (engine.model.megatron's import too)
            out.append(Problem("virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size,
                               f"the layout gives {len(stages) // pp} virtual stages per pipeline rank",
                               f"virtual_pipeline_model_parallel_size={len(stages) // pp}"))
        if decoders != m.num_layers:
            out.append(Problem("pipeline_model_parallel_layout", layout,
                               f"places {decoders} decoder layers (t) but num_layers = {m.num_layers}"))
        return out
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        if pp == 1:
            return out + [Problem("decoder_first_pipeline_num_layers" if first is not None else
                                  "decoder_last_pipeline_num_layers", first if first is not None else last,
                                  "an uneven pipeline split needs pipeline_model_parallel_size > 1")]
        for name, value in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
            if value is not None and value % vp:
                out.append(Problem(name, value, f"must be divisible by virtual_pipeline_model_parallel_size ({vp})"))
        middle = pp - (first is not None) - (last is not None)
        rest = m.num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle == 0 and rest) or (middle and rest % (middle * vp)):
            out.append(Problem("num_layers", m.num_layers,
                               f"after {first or 0} first-stage and {last or 0} last-stage layers, the other "
                               f"{rest} must split evenly over {middle} middle stages x {vp} virtual stages"))
        return out
    layers = m.num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
    if layers % (pp * vp):
        counted = " (counting embedding/loss as layers)" if layers != m.num_layers else ""
        out.append(Problem("num_layers", m.num_layers,
                           f"must be divisible by pipeline x virtual stages ({pp} x {vp} = {pp * vp}){counted}, "
                           "or give decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers"))
    return out


def _batch(exp: Experiment) -> list[Problem]:
    t, p = exp.training, exp.parallel
    dp = exp.data_parallel_size
    if t.global_batch_size % (t.micro_batch_size * dp):
        step = t.micro_batch_size * dp
        return [Problem("global_batch_size", t.global_batch_size,
                        f"must be divisible by micro_batch_size x data-parallel size "
                        f"({t.micro_batch_size} x {dp} = {step})",
                        f"global_batch_size={max(step, t.global_batch_size // step * step)}")]
    problem = interleaving_problem(p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1,
                                   p.microbatch_group_size_per_vp_stage, t.global_batch_size, t.micro_batch_size, dp)
    return [problem] if problem else []


def interleaving_problem(pp: int, vp: int, group: int | None, global_batch_size: int, micro_batch_size: int,
                         data_parallel_size: int) -> Problem | None:
    """What the interleaved schedule (VP > 1) refuses of its micro-batch groups, or None. Megatron's
    forward_backward_pipelining_with_interleaving (megatron/core/pipeline_parallel/schedules.py, core_v0.16.1
    and core_v0.19.0) raises unless PP <= group <= M (ValueError), and unless M mod group is 0 or at least PP
    (RuntimeError), M the micro-batches per step and group microbatch_group_size_per_vp_stage (unset: PP, so
    M must be a multiple of PP). The sweep asks this for each micro batch of a layout."""
    if vp <= 1 or pp <= 1:
        return None
    m = microbatches(global_batch_size, micro_batch_size, data_parallel_size)
    step = micro_batch_size * data_parallel_size
    if group is None:        # the micro-batch count must be a positive multiple of PP
        if m >= pp and m % pp == 0:
            return None
        return Problem("global_batch_size", global_batch_size,
                       f"gives {m} micro-batches per step (over micro_batch_size x data-parallel size = {step}); "
                       f"the interleaved pipeline with microbatch_group_size_per_vp_stage unset needs a multiple "
                       f"of pipeline_model_parallel_size ({pp})", f"global_batch_size={-(-m // pp) * pp * step}")
    if not pp <= group <= m:
        return Problem("microbatch_group_size_per_vp_stage", group,
                       f"with the interleaved pipeline must be from pipeline_model_parallel_size ({pp}) to the "
                       f"micro-batches per step ({m})",
                       f"microbatch_group_size_per_vp_stage={pp}" if m % pp == 0 and m >= pp else None)
    if 0 < m % group < pp:
        return Problem("microbatch_group_size_per_vp_stage", group,
                       f"the last group of the {m} micro-batches per step has {m % group}: with the interleaved "
                       f"pipeline it must have at least pipeline_model_parallel_size ({pp}), or none be left over")
    return None


def _experts(exp: Experiment) -> list[Problem]:
    m, p = exp.model, exp.parallel
    ep, etp, pp = p.expert_model_parallel_size, exp.expert_tensor_parallel_size, p.pipeline_model_parallel_size
    out = []
    if not m.is_moe:
        if ep > 1:
            out.append(Problem("expert_model_parallel_size", ep, "needs a mixture-of-experts model (num_moe_experts)"))
        return out
    experts = m.num_moe_experts or 0         # set: is_moe
    if experts % ep:
        out.append(Problem("num_moe_experts", experts, f"must be divisible by expert_model_parallel_size ({ep})"))
    if m.moe_router_topk > experts:
        out.append(Problem("moe_router_topk", m.moe_router_topk, f"cannot exceed num_moe_experts ({experts})"))
    if exp.world_size % (etp * ep * pp):
        stage = exp.world_size // pp
        out.append(Problem("expert_model_parallel_size", ep,
                           f"expert tensor x expert x pipeline parallel ({etp} x {ep} x {pp} = {etp * ep * pp}) "
                           f"must divide the world size ({exp.world_size}); ETP x EP must divide the "
                           f"{plural(stage, 'rank')} (TP x CP x DP) of a pipeline stage"))
    if m.moe_ffn % etp:
        out.append(Problem("moe_ffn_hidden_size", m.moe_ffn,
                           f"must be divisible by expert_tensor_parallel_size ({etp})"))
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        out.append(Problem("sequence_parallel", False, "a mixture-of-experts model with "
                           "tensor_model_parallel_size > 1 needs sequence_parallel = true", "sequence_parallel=true"))
    if exp.training.fp16 and ep > 1:
        out.append(Problem("fp16", True, "expert parallelism does not support fp16 training"))
    out += _a2a_overlap(exp)
    return out


def _a2a_overlap(exp: Experiment) -> list[Problem]:
    """Megatron's rules for the 1F1B A2A overlap (TransformerConfig.__post_init__, core_v0.16.1)."""
    p, t = exp.parallel, exp.training
    if not t.overlap_moe_expert_parallel_comm:
        return []
    rule = "overlap_moe_expert_parallel_comm"
    needs = [(p.expert_model_parallel_size > 1, "needs expert parallelism (expert_model_parallel_size > 1)"),
             (t.moe_token_dispatcher_type in ("alltoall", "flex"), "needs the alltoall or flex token dispatcher"),
             (t.recompute_granularity != "full", "does not run with full recompute"),
             (t.bf16 or t.fp16, "needs bf16 or fp16 training"),
             (p.pipeline_model_parallel_size == 1 or exp.virtual_stages > 1,
              "needs virtual pipeline stages when pipeline_model_parallel_size > 1")]
    return [Problem(rule, True, why) for ok, why in needs if not ok]


def _sequence(exp: Experiment) -> list[Problem]:
    m, cp, seq = exp.model, exp.parallel.context_parallel_size, exp.seq_length
    out = []
    if cp > 1 and seq % (2 * cp):
        out.append(Problem("seq_length", seq, f"must be divisible by 2 x context_parallel_size (2 x {cp} = {2 * cp})"))
    max_pos = m.max_position_embeddings or m.seq_length
    if seq > max_pos:
        out.append(Problem("seq_length", seq, f"must not exceed max_position_embeddings ({max_pos})"))
    return out


def _deterministic(exp: Experiment) -> list[Problem]:
    """Megatron-LM's validate_args for --deterministic-mode (core_v0.16.1)."""
    if exp.training.deterministic_mode and exp.training.cross_entropy_loss_fusion:
        return [Problem("cross_entropy_loss_fusion", True, "is not deterministic: Megatron refuses it with "
                        "deterministic_mode", "cross_entropy_loss_fusion=false")]
    return []


def _rampup(exp: Experiment) -> list[Problem]:
    """Megatron-LM's rules for --rampup-batch-size (core num_microbatches_calculator.py, core_v0.16.1)."""
    t = exp.training
    ramp = t.rampup_batch_size
    if ramp is None:
        return []
    if len(ramp) != 3 or ramp[0] < 1 or ramp[1] < 1 or ramp[2] < 0:
        return [Problem("rampup_batch_size", ramp, "takes start and increment (each at least 1), then the ramp's "
                                                   "samples (0 or more)")]
    start, increment, _ = ramp
    unit = t.micro_batch_size * exp.data_parallel_size
    out = []
    if start > t.global_batch_size:
        out.append(Problem("rampup_batch_size", ramp, f"starts above global_batch_size ({t.global_batch_size})"))
    elif (t.global_batch_size - start) % increment:
        out.append(Problem("rampup_batch_size", ramp, f"its increment ({increment}) must divide global_batch_size "
                                                      f"- start ({t.global_batch_size - start})"))
    if start % unit or increment % unit:
        out.append(Problem("rampup_batch_size", ramp, f"each of its batches must be a multiple of micro batch x "
                                                      f"data parallel ({unit}): start and increment are not"))
    return out


def _precision(exp: Experiment) -> list[Problem]:
    t, hw = exp.training, exp.hardware
    out = []
    if not t.fp16:
        for name in ("loss_scale", "initial_loss_scale"):
            if getattr(t, name) != getattr(Training, name):
                out.append(Problem(name, getattr(t, name), "applies only with fp16 = true (loss scaling)"))
    if t.fp16 and t.bf16:
        out.append(Problem("fp16", True, "cannot be combined with bf16 (choose one)"))
    if t.fp8 is not None and not hw.fp8:
        out.append(Problem("fp8", t.fp8, f"hardware {hw.name} has no FP8 support"))
    if t.moe_grouped_gemm and not t.bf16:
        out.append(Problem("moe_grouped_gemm", True, "needs bf16 = true"))
    if t.fp8_param_gather and not (exp.parallel.use_distributed_optimizer or exp.parallel.use_megatron_fsdp
                                   or exp.parallel.use_torch_fsdp2):
        out.append(Problem("fp8_param_gather", True, "needs use_distributed_optimizer = true (or FSDP)",
                           "use_distributed_optimizer=true"))
    return out


def _recompute(exp: Experiment) -> list[Problem]:
    t, m, p = exp.training, exp.model, exp.parallel
    g = t.recompute_granularity
    out = []
    # Without a granularity Megatron ignores the method and layer count (engine.model.validate.ignored
    # lists them); selective recompute refuses both: Megatron-LM's arguments.py asserts on the
    # method, megatron-core's TransformerConfig on the layer count.
    if g == "selective":
        if t.recompute_method is not None:
            out.append(Problem("recompute_method", t.recompute_method,
                               "is not supported with recompute_granularity = 'selective' (only with 'full')"))
        if t.recompute_num_layers is not None:
            out.append(Problem("recompute_num_layers", t.recompute_num_layers,
                               "must be unset with recompute_granularity = 'selective' (it applies to 'full')"))
    if g == "full" and t.cuda_graph_impl != "none":
        out.append(Problem("cuda_graph_impl", t.cuda_graph_impl, "CUDA graphs cannot be combined with full recompute"))
    if g == "full":
        if t.recompute_method is None:
            out.append(Problem("recompute_method", None, "full recompute needs a method: uniform or block"))
        if t.recompute_num_layers is None:
            out.append(Problem("recompute_num_layers", None, "full recompute needs the number of layers"))
        chunks = p.pipeline_model_parallel_size * (p.virtual_pipeline_model_parallel_size or 1)
        even = (p.pipeline_model_parallel_layout is None and p.decoder_first_pipeline_num_layers is None
                and p.decoder_last_pipeline_num_layers is None and m.num_layers % chunks == 0)
        per_chunk = m.num_layers // chunks
        if even and t.recompute_num_layers is not None and t.recompute_num_layers > per_chunk:
            out.append(
                Problem(
                    "recompute_num_layers",
                    t.recompute_num_layers,
                    f"cannot exceed the {plural(per_chunk, 'layer')} of one pipeline stage "
                    f"({plural(m.num_layers, 'layer')} / {plural(chunks, 'model chunk')})",
                    f"recompute_num_layers={per_chunk}",
                )
            )
    return out


def ignored(exp: Experiment) -> list[str]:
    """Settings Megatron accepts here but does not use: one line each, for plan and Compose."""
    t = exp.training
    out = []
    if t.recompute_granularity is None:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(t, name) is not None:
                out.append(f"{name} = {getattr(t, name)!r}: ignored without recompute_granularity (as Megatron does)")
    if t.recompute_granularity != "selective" and t.recompute_modules is not None:
        out.append(f"recompute_modules = {t.recompute_modules!r}: ignored without recompute_granularity = "
                   "'selective' (as Megatron does)")
    if t.offload_modules and not t.fine_grained_activation_offloading:
        out.append(f"offload_modules = {t.offload_modules!r}: ignored without fine_grained_activation_offloading "
                   "(as Megatron does)")
    return out


def _offloading(exp: Experiment) -> list[Problem]:
    """megatron-core TransformerConfig's rules for activation offloading (core_v0.16.1)."""
    t, m, p = exp.training, exp.model, exp.parallel
    out = []
    if t.cpu_offloading_num_layers:
        if t.cpu_offloading_num_layers >= m.num_layers:
            out.append(
                Problem(
                    "cpu_offloading_num_layers",
                    t.cpu_offloading_num_layers,
                    f"must be below num_layers ({m.num_layers})",
                    f"cpu_offloading_num_layers={m.num_layers - 1}",
                )
            )
        if p.pipeline_model_parallel_size > 1:
            out.append(
                Problem(
                    "cpu_offloading_num_layers",
                    t.cpu_offloading_num_layers,
                    "layer offloading does not support pipeline parallelism",
                    "pipeline_model_parallel_size=1",
                )
            )
        if t.recompute_granularity is not None:
            out.append(
                Problem(
                    "cpu_offloading_num_layers",
                    t.cpu_offloading_num_layers,
                    "layer offloading does not work with activation recompute",
                    "recompute_granularity=none",
                )
            )
        if t.cuda_graph_impl != "none":
            out.append(Problem("cpu_offloading_num_layers", t.cpu_offloading_num_layers,
                               "layer offloading does not work with CUDA graphs", "cuda_graph_impl=none"))
        if t.fine_grained_activation_offloading:
            out.append(Problem("fine_grained_activation_offloading", True,
                               "cannot be combined with layer offloading (cpu_offloading_num_layers)",
                               "cpu_offloading_num_layers=0"))
    if t.fine_grained_activation_offloading:
        modules = t.offload_modules or []
        if not modules:
            out.append(Problem("offload_modules", t.offload_modules,
                               "fine-grained offloading needs the modules whose inputs leave the GPU",
                               "offload_modules=['core_attn']"))
        if "attn_proj" in modules and "core_attn" not in modules:
            out.append(
                Problem(
                    "offload_modules",
                    modules,
                    "attn_proj needs core_attn too (its input is core "
                    "attention's output, which core attention's backward reads)",
                )
            )
    return out


def _optimizer(exp: Experiment) -> list[Problem]:
    p, t = exp.parallel, exp.training
    out = []
    if t.overlap_param_gather:
        if not (p.use_distributed_optimizer or p.use_megatron_fsdp):
            out.append(Problem("overlap_param_gather", True,
                               "needs use_distributed_optimizer = true (or use_megatron_fsdp)",
                               "use_distributed_optimizer=true"))
        if not t.overlap_grad_reduce:
            out.append(Problem("overlap_param_gather", True, "needs overlap_grad_reduce = true",
                               "overlap_grad_reduce=true"))
    if p.num_distributed_optimizer_instances > 1 and not p.use_distributed_optimizer:
        out.append(Problem("num_distributed_optimizer_instances", p.num_distributed_optimizer_instances,
                           "applies only with use_distributed_optimizer = true"))
    if not t.use_precision_aware_optimizer:
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(t, name) != "fp32":
                out.append(Problem(name, getattr(t, name), "applies only with use_precision_aware_optimizer = true"))
        if t.optimizer_cpu_offload:
            out.append(Problem("optimizer_cpu_offload", True, "needs use_precision_aware_optimizer = true"))
    if t.use_precision_aware_optimizer:   # megatron.core.optimizer.OptimizerConfig asserts these
        if t.optimizer != "adam":
            out.append(
                Problem("use_precision_aware_optimizer", True, f"works only with optimizer = adam, not {t.optimizer}")
            )
        if not p.use_distributed_optimizer:
            out.append(Problem("use_precision_aware_optimizer", True, "needs use_distributed_optimizer = true",
                               "use_distributed_optimizer=true"))
    if t.optimizer == "muon" and (p.use_distributed_optimizer or p.use_megatron_fsdp or p.use_torch_fsdp2):
        out.append(Problem("optimizer", "muon", "does not support the distributed optimizer or FSDP"))
    return out


def _profiling(exp: Experiment) -> list[Problem]:
    """The profiler window (engine.model.profiling): steps the run has, each once."""
    steps, iters = exp.telemetry.profile_steps or [], exp.training.train_iters
    out = []
    outside = [s for s in steps if not 1 <= s <= iters]
    if outside:
        out.append(Problem("profile_steps", steps, f"step {outside[0]} is not one of the run's steps "
                                                   f"(1 to train_iters = {iters})"))
    elif len(set(steps)) < len(steps):
        out.append(Problem("profile_steps", steps, "a step is listed twice"))
    return out
