"""Megatron-LM command lines in and out.

`import_megatron_args` reads `pretrain_gpt.py` flags as people keep them in launch scripts
(`\\`-continued lines, comments, `--flag=value`, `NAME=value` and `export` lines, a `torchrun ...
pretrain_gpt.py` prefix that gives the world size) or in a Megatron-LM functional test's
`model_config.yaml`, and builds an Experiment from the flags that shape memory and speed; flags known to
change nothing it plans are listed in `no_effect` with why, every other flag in `ignored`, never an error. Flags
that are absent take Megatron-LM's own defaults (`megatron/training/arguments.py`), which
are not always ours: dropout 0.1, biases on, 4h FFN (SwiGLU: `int(8h/3/64)*64`), `--kv-lora-rank` 32,
fp32 unless `--bf16`/`--fp16`, and sequence parallelism switched off at TP 1.

`export_megatron_args` writes the flags back for the user's megatron-core (a token list for
`subprocess`; `format_megatron_args` lays them out one per line; `export_script` wraps them with the
environment and torchrun into a launch script), with what pretrain_gpt.py needs to start. Importing an export gives
the same experiment except where Megatron
itself resolves a value (see `ROUND_TRIP_NORMALIZED`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, get_origin

from charllm.engine.model import calibration, runtime
from charllm.engine.model.experiment import (
    MLA,
    Experiment,
    Hardware,
    ModelSpec,
    Parallel,
    Training,
    declared,
    field_options,
    megatron_default,
    megatron_flag,
    parse_pipeline_layout,
)
from charllm.probes.core.errors import UserError, plural, shown

# Megatron-LM defaults that changed between the releases charllm supports (core_v0.16.1 to
# core_v0.19.0): key -> (first release with the default, default), newest first. Import gives what the
# command line leaves out the default of the user's release; export writes what the user's release
# needs for the same experiment. Found by comparing parse_args() defaults of core_v0.16.1, 0.17.1, 0.18.0
# and 0.19.0, and the TransformerConfig, DistributedDataParallelConfig and OptimizerConfig field
# defaults: of the changes, only these two reach the memory plan or a flag charllm writes
# (tests/engine/model/test_megatron_lm.py checks the table against each release's own code where a mirror is at hand).
VERSIONED_DEFAULTS: dict[str, tuple[tuple[str, Any], ...]] = {
    # megatron/training/arguments.py: 'no_shard' up to core_v0.17.1, 'optim_grads_params' from core_v0.18.0
    "--data-parallel-sharding-strategy": (("0.18.0", "optim_grads_params"), ("0.0", "no_shard")),
    # Tokens NullTokenizer has beyond --vocab-size: its end-of-document token up to core_v0.17.1
    # (megatron/core/tokenizers/text/libraries/null_tokenizer.py and, in 0.16.1, the legacy
    # megatron/training/tokenizer/tokenizer.py: vocab_size = _vocab_size_without_eod + 1); none from
    # core_v0.18.0 (vocab_size = _vocab_size). Megatron pads the tokenizer's vocabulary, not --vocab-size.
    "--tokenizer-type NullTokenizer": (("0.18.0", 0), ("0.0", 1)),
}
SUPPORTED_VERSIONS = ("0.16.1", "0.19.0")      # what charllm's import, export and workload are checked against

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_HARDWARE = "h100-sxm-80gb"

# Fields an import resolves the way Megatron does, so an export/import round trip returns the
# resolved value: explicit FFN and max-position sizes, the sequence length on the model, a
# virtual-pipeline size of 1 as none, sequence parallelism off at TP 1, MLA sizes only with MLA,
# transformer_impl "auto" as the implementation it becomes, and on the local path SDPA attention
# as Megatron's own (unfused) attention, since Megatron-LM has no SDPA path.
ROUND_TRIP_NORMALIZED = (
    "model.ffn_hidden_size", "model.max_position_embeddings", "model.seq_length", "training.seq_length",
    "parallel.virtual_pipeline_model_parallel_size", "parallel.sequence_parallel",
    "model.q_lora_rank", "model.kv_lora_rank", "model.qk_head_dim", "model.qk_pos_emb_head_dim",
    "model.v_head_dim", "training.transformer_impl", "training.attention_backend",
)

# Megatron's defaults for MLA sizes when `--multi-latent-attention` is given without them (the fields
# that mean something only with MLA, and their `megatron_default`).
MLA_DEFAULTS = {name: megatron_default(ModelSpec, name) for _, name, needs in declared("only_with", ("model",))
                if needs == MLA}


@dataclass
class MegatronImport:
    experiment: Experiment
    ignored: list[str] = field(default_factory=list)    # flags we do not model, as written
    warnings: list[str] = field(default_factory=list)   # assumptions made and values Megatron overrides
    no_effect: list[str] = field(default_factory=list)  # flags read that change nothing charllm plans, and why


# --------------------------------------------------------------------------------------------
# The flags we model
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Switch:
    """A flag without a value that sets `value` (`--swiglu`, `--disable-bias-linear`)."""
    value: Any


@dataclass(frozen=True)
class Value:
    """A flag with one value, converted by `parse`."""
    parse: Callable[[str], Any]


@dataclass(frozen=True)
class Many:
    """A flag with zero or more values (`--recompute-modules core_attn mlp`); with `join`, one string
    of them (`--data-path 0.3 /a 0.7 /b`), none when empty."""
    parse: Callable[[str], Any] = str
    join: bool = False


def _int(raw: str) -> int:
    return int(raw)


def _float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def parse_layer_pattern(raw: str) -> int | list[int]:
    """`--moe-layer-freq`: an int, or a Python list expression such as `([0]*3+[1]*58)`.

    Evaluated over its syntax tree (list literals, ints, `+` and `*` only), never with eval().
    """
    text = raw.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ValueError(raw) from None
    value = _pattern_value(tree)
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError(raw)
    return value


_MAX_PATTERN = 1_000_000


def _pattern_value(node: ast.AST) -> int | list:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_pattern_value(e) for e in node.elts]
        if not all(isinstance(i, int) for i in items):
            raise ValueError("nested lists")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(left, int) and isinstance(right, int):
                return left + right
            if isinstance(left, list) and isinstance(right, list):
                return left + right
            raise ValueError("int + list")
        if isinstance(left, int) and isinstance(right, int):
            return left * right
        if isinstance(left, list) and isinstance(right, list):
            raise ValueError("list * list")
        seq, times = (left, right) if isinstance(left, list) and isinstance(right, int) else (right, left)
        assert isinstance(seq, list) and isinstance(times, int)
        if times < 0 or len(seq) * times > _MAX_PATTERN:
            raise ValueError("pattern too long")
        return seq * times
    raise ValueError(ast.dump(node))


def format_layer_pattern(pattern: int | list[int]) -> str:
    """The shortest run-length form Megatron reads: [0,0,0,1,1] -> `([0]*3+[1]*2)`."""
    if isinstance(pattern, int):
        return str(pattern)
    runs: list[list[int]] = []
    for v in pattern:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "(" + "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs) + ")"


def _flags(kind: type) -> dict[str, tuple[str, Switch | Value | Many]]:
    """Flag -> (field, how it parses) for the fields of `kind` that name a Megatron flag
    (engine.model.experiment.setting): a field's own flag first, then its other names and its aliases,
    in field order."""
    out: dict[str, tuple[str, Switch | Value | Many]] = {}
    for f in dataclasses.fields(kind):
        flag = megatron_flag(kind, f.name)
        if flag is None:
            continue
        out[flag] = (f.name, _parser(kind, f.name, f.metadata))
        out.update({other: out[flag] for other in f.metadata["renamed"]})
        out.update({alias: (f.name, Switch(value)) for alias, value in f.metadata["aliases"].items()})
    return out


# Megatron's own syntax for a value that is not a plain int, float or string.
_PARSERS: dict[str, Callable[[str], Any]] = {"moe_layer_freq": parse_layer_pattern}


def _parser(kind: type, name: str, facts) -> Switch | Value | Many:
    """How the flag of a field parses, from its type: a bool is a switch, a list (or a string the
    flag's values join into) takes many values, anything else one value."""
    options = [o for o in field_options(kind, name) if o is not type(None)]
    if name in _PARSERS:
        return Value(_PARSERS[name])
    if options == [bool]:
        return Switch(facts["switch"])
    if facts["join"] or get_origin(options[0]) is list:
        return Many(_int if options[0] == list[int] else str, join=facts["join"])
    parsers: dict[Any, Callable[[str], Any]] = {int: _int, float: _float, str: str}
    return Value(parsers[options[0]])


MODEL_FLAGS = _flags(ModelSpec)
PARALLEL_FLAGS = _flags(Parallel)
TRAINING_FLAGS = _flags(Training)

# Flags that take part in the import but set no single field.
SPECIAL_FLAGS = {
    "--group-query-attention", "--num-query-groups",
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--world-size", "--train-samples", "--tokenizer-type",
}

# Flags Megatron reads that change nothing charllm plans (memory, layout, steps), and why: an import
# says so instead of listing them as ignored.
NO_MEMORY_EFFECT = {
    "--ckpt-format": "the checkpoint files' format",
    "--apply-layernorm-1p": "LayerNorm keeps its weight as w - 1 (zero-centred gamma): the same tensors",
    "--no-gradient-accumulation-fusion": "a kernel choice: the same fp32 main-gradient buffer",
    "--spec": "a layer-spec module: charllm plans Megatron's own GPT layers",
    "--tokenizer-model": "the tokenizer's file (its vocabulary size is --vocab-size here)",
    "--eval-iters": "evaluation steps, between training steps: not a training step's memory or time",
    "--eval-interval": "how often evaluation runs",
}

FLAGS: dict[str, tuple[str, str, Switch | Value | Many]] = {
    **{f: ("model", n, k) for f, (n, k) in MODEL_FLAGS.items()},
    **{f: ("parallel", n, k) for f, (n, k) in PARALLEL_FLAGS.items()},
    **{f: ("training", n, k) for f, (n, k) in TRAINING_FLAGS.items()},
}

_TYPE_WORDS: dict[Callable[[str], Any], str] = {_int: "an integer", _float: "a number", parse_layer_pattern:
               "an integer or a list expression such as ([0]*3+[1]*58)"}


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------
def split_command_line(args: str | list[str]) -> list[str]:
    """Shell words of a launch script's command: `\\`-newlines joined, `#` comments dropped; or the
    words of a Megatron-LM `model_config.yaml`."""
    if isinstance(args, list):
        return [str(a) for a in args]
    from_yaml = model_config_tokens(args)
    if from_yaml is not None:
        return from_yaml
    text = re.sub(r"\\\r?\n", " ", args)
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:  # unbalanced quotes
        raise UserError(f"megatron args: cannot split the command line ({exc})") from None


def model_config_tokens(text: str) -> list[str] | None:
    """A Megatron-LM functional-test `model_config.yaml` (ENV_VARS, MODEL_ARGS) as a launch line's words,
    or None if `text` is not one. As tests/functional_tests/shell_test_utils/_run_training.sh reads it
    (scalars as written, anchors expanded): `--flag: true` is the bare flag, `[a b c]` the words a, b
    and c, any other value one word (`"0:384 200B:768"`, `([0]*3+[1]*12)`); false or empty leave the
    flag out."""
    if not re.search(r"^MODEL_ARGS:", text, re.MULTILINE):   # a shell script's MODEL_ARGS=( ... ) is not one
        return None
    import yaml  # deferred: only a model_config.yaml needs it

    try:
        data = yaml.load(text, Loader=yaml.BaseLoader)      # every scalar as its text, as yq prints it
    except yaml.YAMLError as exc:
        raise UserError(f"model_config.yaml: not YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise UserError("model_config.yaml: nested too deeply") from None
    except ValueError as exc:   # e.g. an integer of more than 4,300 digits
        raise UserError(f"model_config.yaml: a value no flag could hold ({str(exc)[:80]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("MODEL_ARGS"), dict):
        return None
    env = data.get("ENV_VARS") or {}
    if not isinstance(env, dict):
        raise UserError("model_config.yaml: ENV_VARS must be a mapping of NAME: value")
    words = [f"{name}={value}" for name, value in env.items()] + ["pretrain_gpt.py"]
    for flag, value in data["MODEL_ARGS"].items():
        if isinstance(value, list):
            words += [str(flag), *map(str, value)]
            continue
        value = str(value).strip()
        if value == "true":
            words.append(str(flag))
        elif value not in ("false", ""):
            items = value[1:-1].split() if re.fullmatch(r"\[[^\]]+\]", value) else [value]
            words += [str(flag), *items]
    return words


def _is_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def _group(tokens: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(words before the first flag, [(flag, its values)]); `--flag=value` is split."""
    first = next((i for i, t in enumerate(tokens) if _is_flag(t)), len(tokens))
    head, groups = tokens[:first], []
    for token in tokens[first:]:
        if _is_flag(token):
            name, eq, value = token.partition("=")
            groups.append((name, [value] if eq else []))
        else:
            groups[-1][1].append(token)
    return head, groups


def _split_launcher(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(words up to and including the script, the script's arguments): `torchrun ... pretrain_gpt.py`."""
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), -1)
    return tokens[: script + 1], tokens[script + 1:]


def launcher_world_size(args: str | list[str]) -> int | None:
    """The world size a `torchrun --nnodes N --nproc-per-node G ... x.py` prefix gives, else None."""
    return launcher_shape(args)[0]


def launcher_shape(args: str | list[str]) -> tuple[int | None, int | None]:
    """(world size, processes per node) a `torchrun --nnodes N --nproc-per-node G ... x.py` prefix gives;
    (None, None) where it does not say both as numbers."""
    launcher, _ = _split_launcher(split_command_line(args))
    return _launcher_world(launcher)


def _launcher_world(head: list[str]) -> tuple[int | None, int | None]:
    """World size and devices per node from a `torchrun --nnodes N --nproc-per-node G ... x.py` prefix;
    (None, None) unless both are plain numbers (`$GPUS_PER_NODE` or an elastic `1:4` tells us nothing)."""
    _, groups = _group(head)
    values = {name.replace("_", "-"): vals[0] for name, vals in groups if vals}
    nnodes, nproc = values.get("--nnodes", "1"), values.get("--nproc-per-node")
    if nproc is None or not (nproc.isdigit() and nnodes.isdigit()):
        return None, None
    return int(nnodes) * int(nproc), int(nproc)


def _convert(flag: str, kind: Switch | Value | Many, values: list[str]):
    if isinstance(kind, Switch):
        if values:
            raise UserError(f"{flag} = {' '.join(values)!r}: this flag takes no value")
        return kind.value
    if isinstance(kind, Many):
        if kind.join:
            return " ".join(values) or None
        return [_parse(flag, kind.parse, v) for v in values]
    if len(values) != 1:
        got = "nothing" if not values else repr(" ".join(values))
        raise UserError(f"{flag}: expected one value, got {got}")
    return _parse(flag, kind.parse, values[0])


def _parse(flag: str, parse: Callable[[str], Any], raw: str):
    try:
        return parse(raw)
    except ValueError:
        word = _TYPE_WORDS.get(parse, "a value")
        hint = " (a shell variable: give the expanded command line, e.g. from the job's log)" \
            if raw.startswith("$") else ""
        raise UserError(f"{flag} = {shown(raw)}: expected {word}{hint}") from None


def _one_int(flag: str, values: list[str]) -> int:
    return _convert(flag, Value(_int), values)


def import_megatron_args(
    args: str | list[str],
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    hardware: str | Hardware | None = None,
    version: str | None = None,
) -> MegatronImport:
    """Build an Experiment from a Megatron-LM command line (see the module docstring). A flag whose
    default changed between Megatron releases (VERSIONED_DEFAULTS) and that the line leaves out
    takes the default of `version`, else of the installed megatron-core."""

    launcher, tokens = _split_launcher(split_command_line(args))
    stray, groups = _group(tokens)

    result = MegatronImport(experiment=Experiment(name="megatron-import"))
    exp = result.experiment
    exp.model = ModelSpec(name="megatron")
    # Megatron trains in fp32 unless told otherwise, with Transformer Engine layers unless told otherwise.
    # PyTorch's allocator runs with fixed segments unless the environment says otherwise.
    exp.training = Training(bf16=False, transformer_impl="transformer_engine",
                            expandable_segments=_expandable_segments(launcher))
    if stray:
        result.warnings.append(f"ignored words before the first flag: {' '.join(stray)}")
    special = _read_flags(groups, exp, result)
    given = {flag for flag, _ in groups}

    _check_sizes(exp, given)
    _resolve_model(exp.model, special, given, result)
    _resolve_virtual_pipeline(exp, special)
    p, t = exp.parallel, exp.training
    release, source = megatron_version(version)
    if p.use_megatron_fsdp and "--data-parallel-sharding-strategy" not in given:
        p.data_parallel_sharding_strategy = versioned_default("--data-parallel-sharding-strategy", release)
        result.warnings.append(f"no --data-parallel-sharding-strategy: {p.data_parallel_sharding_strategy}, the "
                               f"default of megatron-core {release} ({source})")
    _resolve_tokenizer(exp.model, special, given, release, source, result)
    if "--moe-enable-deepep" in given and t.moe_token_dispatcher_type != "flex":
        # TransformerConfig.__post_init__ (core_v0.16.1+): "DeepEP backend is only supported with flex token
        # dispatcher."
        raise UserError(f"--moe-enable-deepep: needs --moe-token-dispatcher-type flex (got "
                        f"{t.moe_token_dispatcher_type}), as Megatron requires")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        p.sequence_parallel = False
        result.warnings.append("--sequence-parallel is switched off at tensor parallel size 1 (as Megatron does)")
    if t.transformer_impl == "local" and t.attention_backend in ("auto", "flash", "fused"):
        # Megatron-LM's local spec computes attention with DotProductAttention whatever the backend
        # says; charllm's local path would use SDPA for these, so keep Megatron's meaning.
        t.attention_backend = "unfused"

    if hardware is None:
        hardware = DEFAULT_HARDWARE
        result.warnings.append(f"no hardware given: assumed {DEFAULT_HARDWARE}")
    exp.hardware = Hardware.load(hardware) if isinstance(hardware, str) else hardware
    _resolve_cluster(exp, launcher, special, world_size, gpus_per_node, result)

    if "--global-batch-size" not in given:
        t = exp.training
        t.global_batch_size = t.micro_batch_size * exp.data_parallel_size
        result.warnings.append(f"no --global-batch-size: Megatron uses micro batch x data parallel = "
                               f"{t.global_batch_size}")
    _resolve_train_samples(exp, special, given, result)
    _read_environment(exp, launcher, result)
    _name_model(exp.model, result)
    return result


def _name_model(m: ModelSpec, result: MegatronImport) -> None:
    """Name the model after the preset with its architecture, so that a run of Megatron's own command
    is compared with the same model's runs (`campaign compare`, Compare); else it stays "megatron"."""
    from charllm.engine.model import catalog  # deferred: reads the presets only here

    files = []
    for name, path in catalog.entries("models").items():
        try:
            files.append((name, str(path), path.stat().st_mtime_ns))
        except OSError:     # gone since listed: nothing to name after
            continue
    mine = m.architecture()
    for name, architecture, description in _preset_architectures(tuple(files)):
        if architecture == mine:
            m.name, m.description = name, description
            result.warnings.append(f"model: the flags give the architecture of model preset {name}")
            return


@functools.lru_cache(maxsize=4)
def _preset_architectures(files: tuple[tuple[str, str, int], ...]) -> list[tuple[str, tuple, str]]:
    """(name, architecture, description) of each model preset, read once for these files as they are
    (their paths and times: a preset saved or edited since is read again). Reading them was most of an
    import's time, and a campaign of commands imports one line per member."""
    out = []
    for name, _, _ in files:
        try:
            preset = ModelSpec.load(name)
        except UserError:   # a damaged user preset costs only itself
            continue
        out.append((name, preset.architecture(), preset.description))
    return out


def _resolve_tokenizer(m: ModelSpec, special: dict, given: set[str], release: str, source: str,
                       result: MegatronImport) -> None:
    """The vocabulary Megatron pads is the tokenizer's: NullTokenizer's is --vocab-size plus, before
    megatron-core 0.18, its end-of-document token (VERSIONED_DEFAULTS)."""
    if "--tokenizer-type" not in special:
        return
    kind = " ".join(special["--tokenizer-type"])
    if kind == "NullTokenizer" and "--vocab-size" in given:
        extra = versioned_default("--tokenizer-type NullTokenizer", release)
        m.vocab_size += extra
        if extra:
            result.warnings.append(f"--tokenizer-type NullTokenizer: vocabulary {m.vocab_size} (--vocab-size plus "
                                   f"its end-of-document token in megatron-core {release}, {source})")
    elif kind != "NullTokenizer":
        result.warnings.append(f"--tokenizer-type {kind}: its vocabulary is not read; the plan uses --vocab-size "
                               f"{m.vocab_size}{'' if '--vocab-size' in given else ' (not given: the default)'}")


def _resolve_train_samples(exp: Experiment, special: dict, given: set[str], result: MegatronImport) -> None:
    """--train-samples instead of --train-iters: Megatron runs train_samples // global_batch_size
    iterations after the batch ramp-up's (megatron/training/training.py update_train_iters)."""
    if "--train-samples" not in special:
        return
    if "--train-iters" in given:
        raise UserError("megatron args: --train-iters and --train-samples cannot be combined (Megatron takes one)")
    samples = _one_int("--train-samples", special["--train-samples"])
    t = exp.training
    if samples < t.global_batch_size:
        raise UserError(f"--train-samples = {samples}: fewer than one global batch ({t.global_batch_size})")
    ramp = exp.batch_ramp()
    ramped = sum(batch * steps for batch, steps in ramp)
    t.train_iters = sum(steps for _, steps in ramp) + max(samples - ramped, 0) // t.global_batch_size
    result.warnings.append(f"--train-samples {samples} / global batch {t.global_batch_size}"
                           + (f" after {ramped} samples of batch ramp-up" if ramp else "")
                           + f" = {t.train_iters} iterations")


# Environment variables before the script that charllm models, with what they set.
def _read_environment(exp: Experiment, launcher: list[str], result: MegatronImport) -> None:
    """`NAME=value` words before the script: the allocator's expandable segments (read earlier) and
    Transformer Engine's attention switches; the others change nothing charllm plans."""
    env = _assignments(launcher)
    t = exp.training
    flash, fused = env.get("NVTE_FLASH_ATTN"), env.get("NVTE_FUSED_ATTN")
    if t.attention_backend == "auto" and t.transformer_impl != "local" and "0" in (flash, fused):
        # With --attention-backend auto Transformer Engine picks among the backends these leave on.
        t.attention_backend = "unfused" if flash == fused == "0" else "fused" if flash == "0" else "flash"
        result.warnings.append(f"NVTE_FLASH_ATTN={flash or '(unset)'} NVTE_FUSED_ATTN={fused or '(unset)'}: "
                               f"attention backend {t.attention_backend}")
    for name, value in env.items():
        if name not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN"):
            result.no_effect.append(f"{name}={value}: an environment variable charllm does not plan with")


def _assignments(launcher: list[str]) -> dict[str, str]:
    """`NAME=value` words (also after `export`) before the script, the last one of a name winning."""
    out = {}
    for token in launcher:
        name, eq, value = token.partition("=")
        if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            out[name] = value
    return out


def installed_version() -> str | None:
    """The megatron-core release `import megatron.core` would load here, or None, without importing
    it (that imports torch). Its package_info.py first: a Megatron-LM checkout on PYTHONPATH, the
    usual way to run pretrain_gpt.py, shadows the installed distribution; else the distribution's."""
    from importlib import metadata, util  # deferred: ~17 ms at start-up, for plan/export only

    try:
        spec = util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        try:
            info = ast.parse((Path(spec.origin).parent / "package_info.py").read_text())
            parts = {t.id: node.value.value for node in info.body if isinstance(node, ast.Assign)
                     for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.Constant)
                     and isinstance(node.value.value, (int, str))}
            return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}"
        except (OSError, SyntaxError, KeyError):
            pass
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not match:
        raise UserError(f"megatron_version = {version!r}: expected a release such as 0.16.1 or 0.19.0")
    return tuple(int(part or 0) for part in match.groups())


def megatron_version(version: str | None = None) -> tuple[str, str]:
    """(release, where it comes from): the one given, else the installed one, else the newest supported."""
    if version:
        _release(version)
        return version, "given"
    installed = installed_version()
    if installed:
        return installed, "installed"
    return SUPPORTED_VERSIONS[-1], "the newest supported; megatron-core is not installed here"


def release_at_least(version: str, since: str) -> bool:
    """Whether megatron-core `version` is release `since` or newer."""
    return _release(version) >= _release(since)


def versioned_default(flag: str, version: str) -> Any:
    """Megatron's default for `flag` in `version` (a flag of VERSIONED_DEFAULTS)."""
    release = _release(version)
    return next(default for since, default in VERSIONED_DEFAULTS[flag] if release >= _release(since))


def _expandable_segments(launcher: list[str]) -> bool:
    """Whether a `PYTORCH_CUDA_ALLOC_CONF=...` assignment before the script turns them on."""
    env = _assignments(launcher)
    value = env.get("PYTORCH_CUDA_ALLOC_CONF", env.get("PYTORCH_ALLOC_CONF", ""))
    options = dict(o.partition(":")[::2] for o in value.split(","))
    return options.get("expandable_segments", "").strip().lower() == "true"


def export_environment(exp: Experiment) -> dict[str, str]:
    """The environment pretrain_gpt.py needs for `exp`, besides its flags."""
    p = exp.parallel
    env = {}
    if (p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1) \
            and not (p.use_megatron_fsdp or p.use_torch_fsdp2):
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"      # Megatron asserts it for TP/CP, and refuses it with FSDP
    if exp.training.fine_grained_activation_offloading:
        env["NVTE_CPU_OFFLOAD_V1"] = "1"              # Megatron asks for it with TE >= 2.10 (validate_args)
    if exp.training.expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"   # what the memory plan assumes
    env.update(deterministic_environment(exp))
    return env


def deterministic_environment(exp: Experiment) -> dict[str, str]:
    """What --deterministic-mode needs in the environment: Megatron-LM asserts an NCCL_ALGO of its list
    (validate_args), Transformer Engine's attention NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, and torch's
    deterministic cuBLAS a fixed workspace."""
    if not exp.training.deterministic_mode:
        return {}
    return {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _read_flags(groups, exp: Experiment, result: MegatronImport) -> dict[str, list[str]]:
    """Set a field for every flag in FLAGS (`--no-X` turns a switch off), list the unknown ones as
    ignored, and return the values of SPECIAL_FLAGS for the steps that combine flags."""
    special: dict[str, list[str]] = {}
    for flag, values in groups:
        if flag in FLAGS:
            section, name, kind = FLAGS[flag]
            setattr(getattr(exp, section), name, _convert(flag, kind, values))
        elif flag.startswith("--no-") and _is_switch_on(f"--{flag[5:]}") and not values:
            section, name, _ = FLAGS[f"--{flag[5:]}"]
            setattr(getattr(exp, section), name, False)
        elif flag in SPECIAL_FLAGS:
            special[flag] = values
        elif flag in NO_MEMORY_EFFECT:
            result.no_effect.append(f"{' '.join([flag, *values])}: {NO_MEMORY_EFFECT[flag]}")
        else:
            result.ignored.append(" ".join([flag, *values]))
    return special


def _is_switch_on(flag: str) -> bool:
    kind = FLAGS.get(flag, (None, None, None))[2]
    return isinstance(kind, Switch) and kind.value is True


def _check_sizes(exp: Experiment, given: set[str]) -> None:
    """The flags Megatron cannot do without, and the sizes the import derives everything else from."""
    for required in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        if required not in given:
            raise UserError(f"megatron args: {required} is required (Megatron has no default for it)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--expert-model-parallel-size", "--expert-tensor-parallel-size"):
        section, name, _ = FLAGS[flag]
        value = getattr(getattr(exp, section), name)
        if value is not None and value < 1:
            raise UserError(f"{flag} = {value}: must be at least 1")


def _resolve_model(m: ModelSpec, special: dict, given: set[str], result: MegatronImport) -> None:
    """Megatron's own resolution of what the command line leaves out."""
    # Grouped-query attention: --num-query-groups counts only with --group-query-attention (default 1).
    if "--group-query-attention" in special:
        if special["--group-query-attention"]:
            raise UserError("--group-query-attention: this flag takes no value")
        m.num_query_groups = _one_int("--num-query-groups", special.get("--num-query-groups", ["1"]))
    elif "--num-query-groups" in special:
        result.warnings.append("--num-query-groups has no effect without --group-query-attention "
                               "(Megatron uses multi-head attention)")
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if m.swiglu else 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    flag_of = {name: flag for flag, (section, name, _) in FLAGS.items() if section == "model"}
    for name, theirs in MLA_DEFAULTS.items():
        if not m.multi_latent_attention:
            setattr(m, name, getattr(ModelSpec, name))     # unused without MLA: keep ours
        elif flag_of[name] not in given:
            setattr(m, name, theirs)


def _resolve_virtual_pipeline(exp: Experiment, special: dict) -> None:
    """VP from a layout, a count of virtual stages per rank, or layers per virtual stage (one of them)."""
    m, p = exp.model, exp.parallel
    pp, layout = p.pipeline_model_parallel_size, p.pipeline_model_parallel_layout
    sources = [f for f in ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")
               if f in special] + (["--pipeline-model-parallel-layout"] if layout is not None else [])
    if len(sources) > 1:
        raise UserError(f"megatron args: {' and '.join(sources)} cannot be combined "
                        "(Megatron takes one way to set the virtual pipeline)")
    if layout is not None:
        try:
            stages = parse_pipeline_layout(layout)
        except ValueError as exc:
            raise UserError(f"--pipeline-model-parallel-layout = {layout!r}: {exc}") from None
        if len(stages) % pp:
            raise UserError(f"--pipeline-model-parallel-layout = {layout!r}: {len(stages)} stages do not "
                            f"divide over pipeline size {pp}")
        p.virtual_pipeline_model_parallel_size = len(stages) // pp
    elif "--num-virtual-stages-per-pipeline-rank" in special:
        p.virtual_pipeline_model_parallel_size = _one_int(
            "--num-virtual-stages-per-pipeline-rank", special["--num-virtual-stages-per-pipeline-rank"])
    elif "--num-layers-per-virtual-pipeline-stage" in special:
        per_vstage = _one_int("--num-layers-per-virtual-pipeline-stage",
                              special["--num-layers-per-virtual-pipeline-stage"])
        layers = m.num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
        if per_vstage < 1 or layers % pp or (layers // pp) % per_vstage:
            raise UserError(f"--num-layers-per-virtual-pipeline-stage = {per_vstage}: must divide the "
                            f"{layers} layers per pipeline size {pp} evenly")
        p.virtual_pipeline_model_parallel_size = layers // pp // per_vstage
    if p.virtual_pipeline_model_parallel_size == 1:                 # Megatron: no interleaving
        p.virtual_pipeline_model_parallel_size = None


def _resolve_cluster(exp: Experiment, launcher: list[str], special: dict, world_size: int | None,
                     gpus_per_node: int | None, result: MegatronImport) -> None:
    """World size from the argument, --world-size, or the launcher; else the smallest the layout
    allows, with a warning. Nodes of `gpus_per_node` devices (default 8, at most the world)."""
    p = exp.parallel
    if world_size is None and "--world-size" in special:
        world_size = _one_int("--world-size", special["--world-size"])
    if world_size is None:
        launch_world, launch_gpn = _launcher_world(launcher)
        if launch_world is not None and launch_gpn is not None:
            world_size, gpus_per_node = launch_world, gpus_per_node or launch_gpn
            result.warnings.append(
                f"world size {world_size} = {plural(world_size // launch_gpn, 'node')} x {launch_gpn}, "
                "from the torchrun prefix"
            )
    if world_size is None:
        stage = p.tensor_model_parallel_size * p.context_parallel_size
        expert = (p.expert_tensor_parallel_size or p.tensor_model_parallel_size) * p.expert_model_parallel_size
        world_size = p.pipeline_model_parallel_size * math.lcm(stage, expert)
        result.warnings.append(
            f"no world size given (--world-size N): assumed the smallest that fits the layout, {world_size} "
            f"(data parallel size {world_size // (p.pipeline_model_parallel_size * stage)})")
    exp.cluster.nodes, exp.cluster.gpus_per_node = nodes_of(world_size, gpus_per_node)


def nodes_of(world_size: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(nodes, devices per node) of `world_size` devices in nodes of `gpus_per_node` (default 8, at
    most the world)."""
    if world_size < 1:
        raise UserError(f"world_size = {world_size}: must be at least 1")
    gpn = min(gpus_per_node or DEFAULT_GPUS_PER_NODE, world_size)
    if gpn < 1 or world_size % gpn:
        raise UserError(f"world_size = {world_size}: not a whole number of nodes of {gpn} devices "
                        "(pass gpus_per_node)")
    return world_size // gpn, gpn


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def export_megatron_args(exp: Experiment, version: str | None = None) -> list[str]:
    """`pretrain_gpt.py` flags for `exp`, as argv tokens, for megatron-core `version` (default: the
    installed one). Values that equal Megatron's defaults are left out, except the sizes a reader wants
    to see (layers, hidden, heads, FFN, TP, PP, batches) and what a release's default would change."""
    m, p, t = exp.model, exp.parallel, exp.training
    release, _ = megatron_version(version)
    out: list[str] = []

    def add(flag: str, *values: Any) -> None:
        out.append(flag)
        out.extend(_fmt(v) for v in values)

    # The model: every flag from its field's metadata (`said`, `only_with`, `megatron_default`), in field
    # order; these write a value the experiment resolves, or more flags than their own.
    # pretrain_gpt.py builds a tokenizer before anything else; NullTokenizer (synthetic tokens, no file)
    # needs only the vocabulary size, which it counts with or without its end-of-document token
    # depending on the release (VERSIONED_DEFAULTS). Megatron pads the tokenizer's vocabulary.
    groups = [("--group-query-attention",), ("--num-query-groups", m.num_query_groups)]
    written: dict[str, list[tuple]] = {
        "ffn_hidden_size": [("--ffn-hidden-size", m.ffn)],
        "num_query_groups": groups if m.num_query_groups is not None else [],
        "seq_length": [("--seq-length", exp.seq_length)],
        "max_position_embeddings": [("--max-position-embeddings", m.max_position_embeddings or m.seq_length)],
        "vocab_size": [("--tokenizer-type", "NullTokenizer"),
                       ("--vocab-size", m.vocab_size - versioned_default("--tokenizer-type NullTokenizer", release))],
    }
    _add_non_default(add, m, MODEL_FLAGS, written=written)

    # The layout, likewise; the pipeline's split is one flag of three, and Megatron FSDP's sharding strategy
    # is always said (its default depends on the release: VERSIONED_DEFAULTS).
    if p.pipeline_model_parallel_layout is not None:
        split = [("--pipeline-model-parallel-layout", p.pipeline_model_parallel_layout)]
    elif p.virtual_pipeline_model_parallel_size not in (None, 1):
        split = [("--num-virtual-stages-per-pipeline-rank", str(p.virtual_pipeline_model_parallel_size))]
    else:
        split = []
    _add_non_default(add, p, PARALLEL_FLAGS, skip={"pipeline_model_parallel_layout"},
                     written={"virtual_pipeline_model_parallel_size": split})
    if p.use_megatron_fsdp:
        # validate_args: "Megatron FSDP only supports fsdp_dtensor checkpoint format" (core_v0.16.1+)
        add("--ckpt-format", "fsdp_dtensor")
    if p.use_torch_fsdp2:
        # validate_args: "--use-torch-fsdp2 is not supported with gradient accumulation fusion", which
        # is on by default (core_v0.16.1+)
        add("--no-gradient-accumulation-fusion")

    add("--micro-batch-size", t.micro_batch_size)
    add("--global-batch-size", t.global_batch_size)
    ramp = exp.batch_ramp()
    if t.rampup_batch_size:
        # validate_args: "expected no batch-size rampup for iteration-based training": the same steps in samples
        ramp_steps = sum(steps for _, steps in ramp)
        add("--train-samples", sum(batch * steps for batch, steps in ramp)
            + max(t.train_iters - ramp_steps, 0) * t.global_batch_size)
    else:
        add("--train-iters", t.train_iters)
    # charllm's workload never evaluates. Megatron evaluates 100 steps by default, and pretrain_gpt.py
    # cannot start without an interval: get_train_valid_test_num_samples divides by eval_interval, whose
    # default is None (megatron/training/training.py:3307 at core_v0.16.1, :4481 at core_v0.19.0).
    add("--eval-iters", 0)
    add("--eval-interval", t.train_iters)
    add("--lr", t.lr)
    if t.data_path:
        add("--data-path", *t.data_path.split())
    else:
        add("--mock-data")
    # Megatron has no "auto": say what it becomes on the node planned for (engine.model.runtime).
    skip = {"micro_batch_size", "global_batch_size", "train_iters", "lr", "data_path", "transformer_impl"}
    if runtime.transformer_impl(exp, calibration.for_planning(exp.hardware)) == "local":
        add("--transformer-impl", "local")
        # Megatron's local spec has one attention (DotProductAttention), whatever the backend says. And
        # `--attention-backend local` would not start: validate_args asserts `--spec local` with it
        # (core_v0.16.1 to 0.19.0), which pretrain_gpt.py then cannot load (spec_utils.import_module
        # wants a module and a name).
        skip.add("attention_backend")
    _add_non_default(add, t, TRAINING_FLAGS, skip=skip)
    return out


# Megatron-LM's switches for what its flags turn on by default, and the runtime's name for each
# (megatron/training/arguments.py, _add_training_args and _add_mixed_precision_args, core_v0.16.1 and
# core_v0.19.0): where engine.model.runtime leaves one off on the planned node, the flag says so.
FUSION_SWITCHES = (
    ("bias_activation_fusion", "--no-bias-swiglu-fusion", "swiglu"),
    ("bias_activation_fusion", "--no-bias-gelu-fusion", "gelu"),
    ("bias_dropout_fusion", "--no-bias-dropout-fusion", None),
    ("masked_softmax_fusion", "--no-masked-softmax-fusion", None),
    ("apply_rope_fusion", "--no-rope-fusion", "rope"),
    ("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion", None),
)


def runtime_flags(exp: Experiment) -> list[str]:
    """The flags that make Megatron-LM's pretrain_gpt.py run what charllm's workload runs for `exp` on its
    planned node (calibration.for_planning), beyond `export_megatron_args`: each fusion engine.model.runtime
    leaves off there, which Megatron would turn on (a fused bias-GeLU is tanh's approximation: other
    losses); with megatron-core's local layers and no Apex, no persistent LayerNorm (megatron-core's
    WrappedTorchNorm refuses it: core/transformer/torch_norm.py:30 at core_v0.16.1); the workload's
    constant learning rate without weight decay (engine.workload.train.optimizer_settings; Megatron
    decays it linearly and decays weights by 0.01 by default); and, with a dataset, its whole split for
    training (Megatron's default is 969,30,1). What `launch --runner megatron-lm` adds."""
    stack = calibration.for_planning(exp.hardware)
    impl = runtime.resolve(exp, stack)
    m = exp.model
    activation = "swiglu" if m.swiglu else "gelu" if not m.squared_relu else None
    out = []
    for fusion, flag, needs in FUSION_SWITCHES:
        applies = needs is None or needs == activation or (needs == "rope" and m.position_embedding_type == "rope")
        if applies and fusion not in impl.fusions and flag not in out:
            out.append(flag)
    if impl.transformer == "local" and not stack.has("apex"):
        out.append("--no-persist-layer-norm")
    out += ["--lr-decay-style", "constant", "--weight-decay", "0.0"]
    if exp.training.data_path:
        out += ["--split", "100,0,0"]
    return out


def one_line(text: str) -> str:
    """`text` as one line of a script (a comment, say): control characters shown as escapes, so a
    newline in a name can never start a command (export --no-validate writes any name)."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m[0]):02x}", text)


def export_script(exp: Experiment, version: str | None = None) -> str:
    """A bash launch script for `exp`: the environment Megatron needs, then torchrun pretrain_gpt.py with
    the flags of `export_megatron_args`. Run it on every node, with MEGATRON_LM pointing at the
    Megatron-LM checkout (default: here) and, across nodes, NODE_RANK, MASTER_ADDR and MASTER_PORT set."""
    release, source = megatron_version(version)
    c = exp.cluster
    lines = ["#!/usr/bin/env bash",
             f"# {one_line(exp.name)}: {exp.world_size} processes = {plural(c.nodes, 'node')} x {c.gpus_per_node}; "
             f"flags for megatron-core {release} ({source}). Written by charllm-tui export megatron --script.",
             "set -euo pipefail"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in export_environment(exp).items()]
    launcher = ["torchrun", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.gpus_per_node)]
    if c.nodes > 1:
        launcher += ["--node-rank", '"${NODE_RANK:?set NODE_RANK on each node}"',
                     "--master-addr", '"${MASTER_ADDR:?set MASTER_ADDR}"', "--master-port", '"${MASTER_PORT:-6000}"']
    launcher.append('"${MEGATRON_LM:-.}/pretrain_gpt.py"')
    flags = format_megatron_args(export_megatron_args(exp, release))
    return "\n".join(lines) + "\n" + " ".join(launcher) + " \\\n    " + flags + "\n"


def _add_non_default(add, obj, table, *, skip: frozenset[str] | set[str] = frozenset(),
                     written: dict[str, list[tuple]] | None = None) -> None:
    """The flags of `obj`'s fields, in field order, as their metadata says (engine.model.experiment.setting):
    a field `said` always, any other where its value differs from Megatron's default (`megatron_default`),
    and one that means something only with another field's value (`only_with`) only then. A field in
    `written` writes those (flag, *values) instead; one in `skip` nothing (written before)."""
    kind, written = type(obj), written or {}
    flags: dict[str, list[tuple[str, Switch | Value | Many]]] = {}
    for flag, (name, how) in table.items():
        flags.setdefault(name, []).append((flag, how))
    for f in dataclasses.fields(kind):
        name, facts = f.name, f.metadata
        needs = facts.get("only_with")
        if name in skip or (needs and getattr(obj, needs[0]) not in needs[1]):
            continue
        if name in written:
            for flag, *values in written[name]:
                add(flag, *values)
            continue
        value, said = getattr(obj, name), facts.get("said")
        if isinstance(said, tuple):
            said = getattr(obj, said[0]) in said[1]
        if not said and value == megatron_default(kind, name):
            continue
        for flag, how in flags.get(name, ()):
            if isinstance(how, Switch):
                if value == how.value:
                    add(flag)
                    break
            elif isinstance(how, Many):
                add(flag, *value)
                break
            else:
                add(flag, _FORMATS.get(name, _fmt)(value))
                break


# How a value that is not a plain int, float or string is written (the inverse of _PARSERS).
_FORMATS: dict[str, Callable[[Any], str]] = {"moe_layer_freq": format_layer_pattern}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_megatron_args(tokens: list[str], *, indent: str = "    ") -> str:
    """One flag (with its values) per line, shell-quoted, joined by backslash continuations."""
    lines: list[list[str]] = []
    for token in tokens:
        if _is_flag(token) or not lines:
            lines.append([token])
        else:
            lines[-1].append(token)
    rendered = [" ".join(shlex.quote(w) for w in words) for words in lines]
    return (" \\\n" + indent).join(rendered)
