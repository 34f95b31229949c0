"""What charllm writes for Megatron-LM, checked against Megatron-LM's own argument code of each supported
release (parse_args, validate_args and the tokenizer builder, as pretrain_gpt.py runs them before it
needs a GPU). Needs a Megatron-LM git mirror (tests/infra_megatron_lm.py); without one these are skipped,
and tests/engine/model/test_megatron_args.py still holds each rule as a plain unit test."""

from __future__ import annotations

import pytest

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.megatron import export_environment, export_megatron_args, versioned_default
from infra_megatron_lm import RELEASES, needs_mirror, validate

pytestmark = needs_mirror

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "2", "--mock-data", "--bf16"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron-lm")


def _case(argv, world_size=8, **env):
    return {"argv": argv, "env": env, "world_size": world_size}


@pytest.fixture(scope="module")
def small(root):
    """The short cases of this module, run once per release (each run imports Megatron: seconds)."""
    cache: dict[str, list[dict]] = {}

    def results(release: str) -> list[dict]:
        if release not in cache:
            cache[release] = validate(release, root, SMALL_CASES)
        return cache[release]
    return results


@pytest.mark.parametrize("release", RELEASES)
def test_versioned_defaults_are_each_releases_own(release, small):
    """engine.model.megatron.VERSIONED_DEFAULTS against the release's parse_args and NullTokenizer."""
    parsed, tokenized = small(release)[:2]
    assert parsed["data_parallel_sharding_strategy"] == versioned_default("--data-parallel-sharding-strategy", release)
    assert tokenized["padded_vocab_size"] == 1000 + versioned_default("--tokenizer-type NullTokenizer", release)


@pytest.mark.parametrize("release", [RELEASES[0], RELEASES[-1]])
def test_every_shipped_experiment_exports_a_line_megatron_starts(release, root):
    """Every flag parses, validate_args accepts the line with the exported environment, the tokenizer
    builds, and Megatron resolves the sizes charllm plans with (data parallel size, padded vocabulary,
    sequence parallelism)."""
    names = sorted(catalog.entries("experiments"))
    exps = [Experiment.load(n) for n in names]
    results = validate(release, root, [_case(export_megatron_args(e, release), e.world_size,
                                             **export_environment(e)) for e in exps])
    refused = {n: r["error"] for n, r in zip(names, results) if "error" in r}
    assert not refused
    for name, exp, got in zip(names, exps, results):
        p = exp.parallel
        assert (got["data_parallel_size"], got["padded_vocab_size"], got["sequence_parallel"]) == (
            exp.data_parallel_size,
            exp.model.padded_vocab_size(p.tensor_model_parallel_size),
            p.sequence_parallel,
        ), name


# The rules export follows, each as Megatron states it (its message) in every supported release.
RULES = [
    ("no tokenizer", [*TINY, "--vocab-size", "1000"], {},
     r"(None tokenizer is not implemented|Tokenizer path must be specified|tokenizer_type None)"),
    ("TP without one connection", [*TINY, *NULL_TOKENIZER, "--tensor-model-parallel-size", "2"], {},
     "CUDA_DEVICE_MAX_CONNECTIONS to 1"),
    ("Megatron-FSDP checkpoints", [*TINY, *NULL_TOKENIZER, "--use-megatron-fsdp"], {},
     r"Megatron.FSDP (only supports |requires the `)fsdp_dtensor"),
    ("FSDP with one connection", [*TINY, *NULL_TOKENIZER, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
     {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, r"FSDP (always )?requires CUDA_DEVICE_MAX_CONNECTIONS"),
    ("FSDP2 tied embeddings", [*TINY, *NULL_TOKENIZER, "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"],
     {}, "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    ("FSDP2 gradient accumulation fusion", [*TINY, *NULL_TOKENIZER, "--use-torch-fsdp2",
                                            "--untie-embeddings-and-output-weights"], {},
     "not supported with gradient accumulation fusion"),
    # validate_args asserts `args.spec[0] == 'local'` (a TypeError without --spec); with `--spec local` it
    # passes, but pretrain_gpt.py's builder then fails to import_module(['local']): export never writes it.
    ("local attention without --spec local", [*TINY, *NULL_TOKENIZER, "--transformer-impl", "local",
                                              "--attention-backend", "local"], {},
     r"(only supported with --spec local|'NoneType' object is not subscriptable)"),
]
# ... and each accepted once export's fix is applied.
FIXED = [([*TINY, *NULL_TOKENIZER, "--tensor-model-parallel-size", "2"], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
         ([*TINY, *NULL_TOKENIZER, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], {}),
         ([*TINY, *NULL_TOKENIZER, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
           "--no-gradient-accumulation-fusion"], {}),
         ([*TINY, *NULL_TOKENIZER, "--transformer-impl", "local"], {})]
SMALL_CASES = [
    {"argv": [], "env": {}, "world_size": 1, "parse_only": True, "names": ["data_parallel_sharding_strategy"]},
    _case([*TINY, *NULL_TOKENIZER, "--make-vocab-size-divisible-by", "1"], world_size=1),
    *(_case(argv, **env) for _, argv, env, _ in RULES),
    *(_case(argv, **env) for argv, env in FIXED),
]


@pytest.mark.parametrize("release", RELEASES)
def test_megatron_refuses_what_export_avoids(release, small):
    import re

    results = small(release)[2:]
    refused = [(what, got.get("error")) for (what, _, _, message), got in zip(RULES, results)
               if not re.search(message, got.get("error", ""))]
    assert not refused
    for (argv, _), got in zip(FIXED, results[len(RULES):]):
        assert "error" not in got, (argv, got)


def test_megatron_lms_own_gpt_test_configs_import(megatron_lm_mirror):
    """Every model_config.yaml of Megatron-LM's GPT functional tests (core_v0.16.1) imports, or is refused
    with one UserError line (a shell variable where a number belongs, a config without --num-layers)."""
    import subprocess

    from charllm.engine.model.megatron import import_megatron_args
    from charllm.probes.core.errors import UserError

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(megatron_lm_mirror), *args], capture_output=True, text=True, check=True
        ).stdout

    paths = [p for p in git("ls-tree", "-r", "--name-only", "core_v0.16.1", "tests/functional_tests/test_cases/gpt")
             .split() if p.endswith("model_config.yaml")]
    imported, refused = 0, []
    for path in paths:
        try:
            import_megatron_args(git("show", f"core_v0.16.1:{path}"), world_size=8, hardware="h100-sxm-80gb",
                                 version="0.16.1")
            imported += 1
        except UserError as exc:
            refused.append(str(exc))
    assert len(paths) > 100 and imported >= len(paths) - 5, refused
    assert all("\n" not in r for r in refused)
