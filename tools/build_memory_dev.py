"""Rebuild the memory and step-time development set (tests/data/memory_dev/memory_dev.json) from a Megatron-LM checkout.

    python tools/build_memory_dev.py MEGATRON_LM [--out FILE]
    MEGATRON_LM_CHECKOUT=/path/to/Megatron-LM python tools/build_memory_dev.py

MEGATRON_LM is a git checkout (or bare mirror) of NVIDIA/Megatron-LM; the set is read from its HEAD with
git, so a bare mirror works and nothing in it is written.

Scope (issue 26): every H100 training case under tests/functional_tests/test_cases/{gpt,moe,mixtral}/
whose golden_values_dev_dgx_h100.json holds the allocator memory Megatron logs
(`mem-allocated-bytes`, `mem-max-allocated-bytes`). Inference and reinforcement-learning (GRPO) cases
are out of scope (their suites hold no vision or hybrid-Mamba cases). HELD_OUT, the project's 12
held-out acceptance cases, are skipped by name before any of their files is listed or read.

Per case, as tests/data/memory_dev/README.md describes:
- the measured bytes: both metrics at the last logged step where both are numbers (rank world_size-1);
- the golden commit: the newest commit in which those values changed; `megatron_args` is the case's
  MODEL_ARGS from model_config.yaml at that commit, read as _run_training.sh reads it
  (engine.model.megatron.model_config_tokens), less the flags that name files or shell variables;
- the world size: from the H100 CI recipes (tests/test_utils/recipes/h100/*.yaml) where the case is
  listed for dgx_h100; else (the release cases, which no public recipe lists) inferred: the
  power-of-two node count of 8 GPUs whose logged iteration time gives a model FLOPs utilisation
  (engine.model.flops, Megatron's own count, against the H100's dense BF16 peak) within
  MFU_RANGE, among the sizes the layout allows; exactly one must;
- the vocabulary: none of the configs gives --vocab-size with a real tokenizer, so it is inferred from
  the tokenizer files (VOCABULARIES) and added as --vocab-size;
- the environment (ENV_VARS), and every choice above, in `provenance` and `notes`;
- the step time (issue 30): `iteration-time` of the same golden file, the median of its finite values
  past the first STEP_WARMUP of the logged steps (the first steps compile, allocate and warm up; a
  checkpoint save spikes one step), with the commit in which those values last changed. Where that
  commit's MODEL_ARGS differ from the ones used, they may differ only in flags that leave a training
  step alone (NO_STEP_EFFECT: data and checkpoint files, checkpoint saving); any other difference
  leaves the case without a step time, and says why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
from pathlib import Path

from devset import build_and_write, git  # tools/ (a script's own folder is on sys.path; pytest adds it too)

REPO = Path(__file__).resolve().parents[1]
CASES = "tests/functional_tests/test_cases"
RECIPES = "tests/test_utils/recipes/h100"
GOLDEN = "golden_values_dev_dgx_h100.json"
STATIC, PEAK = "mem-allocated-bytes", "mem-max-allocated-bytes"
SUITES = {"gpt": "", "moe": "moe_", "mixtral": ""}        # name prefix per suite (moe/: as the first dev set)
OUT_OF_SCOPE = {"inference": "inference", "grpo": "reinforcement learning (GRPO)"}

# The project's held-out acceptance cases (issue 26): never read here.
HELD_OUT = frozenset({
    "gpt3_7b_tp4_pp1_memory_speed", "gpt3_7b_tp1_pp4_memory_speed", "gpt3_mcore_reruns_resume_check_grads",
    "gpt3_15b_8t_release",
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed", "gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental",
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8",
    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading",
    "mixtral_8x7b_tp1pp4ep8vpp8_release", "mixtral_8x7b_alltoall_tp2pp4ep4_release",
    "mixtral_8x22b_tp2pp8ep8vpp1_release", "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release",
})

# Flags whose value is a file or directory on CI's machines (data, vocabulary, checkpoints, logs): left out.
PATH_FLAGS = ("--data-path", "--data-cache-path", "--vocab-file", "--merge-file", "--save", "--load",
              "--tensorboard-dir", "--tokenizer-model", "--wandb-save-dir", "--per-split-data-args-path")

# Tokenizer files -> vocabulary size, and why.
VOCABULARIES = {
    "bpe/vocab.json": (50257, "GPT-2 BPE (GPT2BPETokenizer, pretrain_gpt.py's default, with the CI data's "
                              "bpe/vocab.json and merges.txt: the GPT-2 files, per Megatron-LM's "
                              "tools/common_pile_dataset/README.md); 50257 is GPT-2's vocabulary"),
    "nemotron_2_256k.model": (256000, "GPTSentencePieceTokenizer with nemotron_2_256k.model: Nemotron-4's "
                                      "SentencePiece vocabulary of 256,000 tokens (inferred from its name)"),
}

# Flags that change no training step (files, and checkpointing, which runs between steps): MODEL_ARGS of
# the iteration-time commit may differ from the ones used in these alone.
NO_STEP_EFFECT = (*PATH_FLAGS, "--async-save", "--use-persistent-ckpt-worker", "--verify-integrity")
ITERATION_TIME = "iteration-time"
STEP_WARMUP = 0.25                    # share of the logged steps left out at the start

GPUS_PER_NODE = 8
H100_BF16_FLOPS = 989.4e12            # dense, per GPU (presets/hardware/h100-sxm-80gb.toml)
MFU_RANGE = (0.2, 0.5)


def in_scope(name: str) -> str | None:
    """Why a case is out of scope, or None."""
    for word, why in OUT_OF_SCOPE.items():
        if word in name:
            return why
    return None


def memory_at_last_step(golden: dict) -> dict | None:
    """The two memory metrics at the last step that logged both, with the logging range and the
    range of each over all steps; None without them."""
    if STATIC not in golden or PEAK not in golden:
        return None
    series = {}
    for metric in (STATIC, PEAK):
        values = {}
        for step, value in golden[metric].get("values", {}).items():
            value = float(value)
            if math.isfinite(value):
                values[int(step)] = value
        series[metric] = values
    steps = sorted(set(series[STATIC]) & set(series[PEAK]))
    if not steps:
        return None
    last = steps[-1]
    meta = golden[STATIC]
    return {"step": last, "static": int(series[STATIC][last]), "peak": int(series[PEAK][last]),
            "logged": (meta.get("start_step"), meta.get("end_step"), meta.get("step_interval")),
            "numbers": len(steps),
            "range": {m: (min(series[m].values()), max(series[m].values())) for m in (STATIC, PEAK)}}


def finite_iteration_times(golden: dict) -> list[tuple[int, float]]:
    """Every finite (step, iteration time), in step order: a golden file rewritten without its leading
    NaN steps (Megatron-LM 93ebf8d72f) holds the same measurement."""
    return sorted((int(step), float(value)) for step, value in golden.get(ITERATION_TIME, {}).get("values", {}).items()
                  if math.isfinite(float(value)))


def changed_in(checkout: Path, path: str, read) -> tuple[str, str] | None:
    """(commit, date) in which `read(golden)` last changed to what HEAD's golden file gives: the oldest
    of the newest run of the file's commits that give it; None if HEAD's gives None."""
    found, head = None, None
    for line in git(checkout, "log", "--format=%H %ad", "--date=short", "--", path).splitlines():
        commit, date = line.split()
        try:
            values = read(json.loads(git(checkout, "show", f"{commit}:{path}")))
        except (LookupError, json.JSONDecodeError):
            break
        if found is None:
            head = values
        if values is None or values != head:
            break
        found = (commit, date)
    return found


def step_time(checkout: Path, folder: str, golden: dict, used: list[tuple[str, list[str]]]) -> dict:
    """The case's step time (median, range and count of its steady iteration times, the steps they
    span) with the commit they come from, or why it has none (`why`). `used`: the flags the case's
    megatron_args come from."""
    from charllm.engine.model.megatron import model_config_tokens

    series = finite_iteration_times(golden)
    if not series:
        return {"why": f"its H100 golden values hold no finite {ITERATION_TIME}"}
    steady = series[int(len(series) * STEP_WARMUP):]
    values = [v for _, v in steady]
    commit, date = changed_in(checkout, f"{folder}/{GOLDEN}", lambda g: finite_iteration_times(g) or None)
    _, groups = flags_of(model_config_tokens(git(checkout, "show", f"{commit}:{folder}/model_config.yaml")))
    then, now = ({(flag, tuple(words)) for flag, words in flags if flag not in NO_STEP_EFFECT}
                 for flags in (groups, used))
    differ = sorted({flag for flag, _ in then ^ now})
    if differ:
        return {"why": f"its iteration times last changed in {commit[:10]}, whose MODEL_ARGS differ from the "
                       f"ones used in {', '.join(differ)}"}
    others = sorted({flag for flag, _ in groups} ^ {flag for flag, _ in used})
    return {
        "seconds": round(statistics.median(values), 6),
        "min": min(values),
        "max": max(values),
        "count": len(values),
        "steps": [steady[0][0], steady[-1][0]],
        "commit": commit,
        "date": date,
        "flags": "the MODEL_ARGS used" + (f" but for {', '.join(others)}, which change no step" if others else ""),
    }


def last_memory(golden: dict) -> tuple[int, int] | None:
    measured = memory_at_last_step(golden)
    return measured and (measured["static"], measured["peak"])


def golden_commit(checkout: Path, path: str) -> tuple[str, str]:
    """(commit, date) in which the last step's memory values last changed: the oldest of the newest
    run of the file's commits that hold the values HEAD holds."""
    found = changed_in(checkout, path, last_memory)
    if found is None:
        raise LookupError(f"{path}: no commit in its history holds its memory values")
    return found


def copied_from(checkout: Path, commit: str, suite: str, case: str, measured: dict) -> str | None:
    """The case whose H100 memory values this case's golden file had when `commit` added it, if that
    case is still there after it (the folder copied with another's goldens, its config then changed:
    the values are not a run of this config), or None."""
    path = f"{CASES}/{suite}/{case}/{GOLDEN}"
    added = git(checkout, "log", "--diff-filter=A", "--format=%H", "-1", commit, "--", path).strip()
    if added != commit:
        return None
    for other in git(checkout, "ls-tree", "-d", "--name-only", f"{commit}~1:{CASES}/{suite}").split():
        if other in HELD_OUT or other == case:        # by name, before anything of it is read
            continue
        try:
            values = memory_at_last_step(
                json.loads(git(checkout, "show", f"{commit}~1:{CASES}/{suite}/{other}/{GOLDEN}"))
            )
        except (LookupError, json.JSONDecodeError):
            continue
        if values is not None and (values["step"], values["static"], values["peak"]) == \
                (measured["step"], measured["static"], measured["peak"]):
            try:                          # still there: a copy (a folder renamed away is the same case)
                git(checkout, "cat-file", "-e", f"{commit}:{CASES}/{suite}/{other}/{GOLDEN}")
            except LookupError:
                return None
            return other
    return None


def h100_recipes(checkout: Path, commit: str) -> dict[str, dict]:
    """case -> {"recipe", "nodes", "gpus", "scopes"} for every case a recipe lists for dgx_h100."""
    import yaml  # deferred: a dependency of charllm, imported with it

    out = {}
    for path in git(checkout, "ls-tree", "--name-only", f"{commit}:{RECIPES}").split():
        recipe = yaml.safe_load(git(checkout, "show", f"{commit}:{RECIPES}/{path}"))
        spec = recipe.get("spec") or {}
        default = spec.get("platforms")
        for entry in recipe.get("products") or []:
            for product in entry.get("products") or []:
                platforms = product.get("platforms", default)
                platforms = platforms if isinstance(platforms, list) else [platforms]
                if "dgx_h100" not in platforms or "dev" not in (product.get("environment") or []):
                    continue
                for case in entry.get("test_case") or []:
                    listed = out.setdefault(case, {"recipe": f"{RECIPES}/{path}", "nodes": spec.get("nodes"),
                                                   "gpus": spec.get("gpus"), "scopes": []})
                    listed["scopes"] += [s for s in product.get("scope") or [] if s not in listed["scopes"]]
    return out


def suite_spec(checkout: Path, commit: str, suite: str) -> dict:
    """The `spec` of the suite's own H100 recipe (gpt.yaml, moe.yaml)."""
    import yaml  # deferred: as above

    return yaml.safe_load(git(checkout, "show", f"{commit}:{RECIPES}/{suite}.yaml"))["spec"]


def flags_of(words: list[str]) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """(environment, [(flag, its words)]) of model_config_tokens' words."""
    script = words.index("pretrain_gpt.py")
    env = dict(word.split("=", 1) for word in words[:script])
    groups: list[tuple[str, list[str]]] = []
    for word in words[script + 1:]:
        if word.startswith("--"):
            groups.append((word, []))
        else:
            groups[-1][1].append(word)
    return env, groups


def vocabulary(groups: dict[str, list[str]]) -> tuple[int | None, str]:
    """(vocabulary size to add as --vocab-size, or None when the line gives it, why)."""
    tokenizer = " ".join(groups.get("--tokenizer-type", ["GPT2BPETokenizer"]))
    if "--vocab-size" in groups:
        return None, f"--vocab-size {' '.join(groups['--vocab-size'])} as given ({tokenizer})"
    files = " ".join(groups.get("--vocab-file", []) + groups.get("--tokenizer-model", []))
    for ending, (size, why) in VOCABULARIES.items():
        if files.endswith(ending):
            return size, why
    raise LookupError(f"tokenizer {tokenizer} with {files or 'no file'}: its vocabulary size is not known here "
                      "(add it to VOCABULARIES)")


def infer_world_size(line: str, golden: dict, hardware: str) -> tuple[int, str]:
    """The release cases' world size: the one power-of-two node count whose logged iteration time
    gives an MFU within MFU_RANGE (see the module docstring)."""
    from charllm.engine.model.flops import flops_per_iteration
    from charllm.engine.model.megatron import import_megatron_args
    from charllm.engine.model.validate import validate
    from charllm.probes.core.errors import UserError

    times = [float(v) for v in golden.get("iteration-time", {}).get("values", {}).values()
             if math.isfinite(float(v))]
    if not times:
        raise LookupError("no world size in any recipe and no iteration time to infer it from")
    seconds = statistics.median(times)
    fits = []
    for nodes in (2 ** k for k in range(11)):
        world = nodes * GPUS_PER_NODE
        try:
            exp = import_megatron_args(line, world_size=world, gpus_per_node=GPUS_PER_NODE,
                                       hardware=hardware).experiment
        except UserError:
            continue
        if validate(exp):
            continue
        mfu = flops_per_iteration(exp) / seconds / world / H100_BF16_FLOPS
        if MFU_RANGE[0] <= mfu <= MFU_RANGE[1]:
            fits.append((world, mfu))
    if len(fits) != 1:
        raise LookupError(f"the iteration time ({seconds:.2f} s) fits {len(fits)} world sizes: {fits}")
    world, mfu = fits[0]
    return world, (f"inferred: no public recipe lists the case; {world // GPUS_PER_NODE} nodes x {GPUS_PER_NODE} "
                   f"is the only power-of-two node count the layout allows at which the median logged "
                   f"iteration time ({seconds:.2f} s) gives Megatron's model FLOPs an MFU in "
                   f"{MFU_RANGE[0]:.0%}-{MFU_RANGE[1]:.0%} of the H100's dense BF16 peak ({mfu:.0%})")


def build_case(checkout: Path, head: str, suite: str, case: str, recipes: dict) -> dict | str:
    """One dev-set item, or why the case is left out."""
    from charllm.engine.model.megatron import import_megatron_args, model_config_tokens

    folder = f"{CASES}/{suite}/{case}"
    files = git(checkout, "ls-tree", "--name-only", f"{head}:{folder}").split()
    if GOLDEN not in files:
        return f"no {GOLDEN}"
    golden = json.loads(git(checkout, "show", f"{head}:{folder}/{GOLDEN}"))
    measured = memory_at_last_step(golden)
    if measured is None:
        return "its H100 golden values hold no allocator memory"
    commit, date = golden_commit(checkout, f"{folder}/{GOLDEN}")
    twin = copied_from(checkout, commit, suite, case, measured)
    if twin is not None:
        return (f"its H100 memory values came with the case in {commit[:10]}, equal to {twin}'s then: a copy, "
                "not a run of this case's config")
    try:
        config_text = git(checkout, "show", f"{commit}:{folder}/model_config.yaml")
        config_commit = commit
    except LookupError:                       # the config moved after the golden: use HEAD's
        config_text, config_commit = git(checkout, "show", f"{head}:{folder}/model_config.yaml"), head
    import yaml  # deferred: as above

    config = yaml.load(config_text, Loader=yaml.BaseLoader)
    env, groups = flags_of(model_config_tokens(config_text))
    by_flag = {flag: words for flag, words in groups}
    dropped = [flag for flag, words in groups if flag in PATH_FLAGS or any("$" in w for w in words)]
    added = []
    kept = [(flag, words) for flag, words in groups if flag not in dropped]
    batch = batch_at_step(by_flag, measured["step"])
    if batch is not None:
        # the global batch size ramps up: the one in effect at the measured step stands for it
        flag, size, why = batch
        kept = [(f, w) for f, w in kept if f not in (flag, "--global-batch-size")] + [("--global-batch-size", [size])]
        dropped.append(flag)
        added.append(f"--global-batch-size {size} ({why})")
    size, vocab_why = vocabulary(by_flag)
    if size is not None:
        kept.append(("--vocab-size", [str(size)]))
        added.append(f"--vocab-size {size} ({vocab_why})")
    args = shlex.join([word for flag, words in kept for word in (flag, *words)])
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " pretrain_gpt.py " + args
    listed, when = recipes.get(case), "HEAD"
    if listed is None:
        try:
            listed, when = h100_recipes(checkout, commit).get(case), f"the golden commit {commit[:10]}"
        except LookupError:               # no H100 recipes at that commit
            listed = None
    if listed is not None:
        world, inferred = listed["nodes"] * listed["gpus"], False
        world_why = (f"{listed['recipe']} at {when} (spec nodes {listed['nodes']} x gpus {listed['gpus']}; "
                     f"listed for dgx_h100, scope {', '.join(listed['scopes'])})")
    elif config.get("TEST_TYPE") == "release":
        world, world_why = infer_world_size(line, golden, "h100-sxm-80gb")
        inferred = True
    else:
        spec = suite_spec(checkout, head, suite)
        world, inferred = spec["nodes"] * spec["gpus"], True
        world_why = (f"inferred: no H100 recipe lists the case at HEAD or at its golden commit; "
                     f"{RECIPES}/{suite}.yaml, its suite's recipe, runs every case it lists on "
                     f"{spec['nodes']} x {spec['gpus']}")
    exp = import_megatron_args(line, world_size=world, gpus_per_node=GPUS_PER_NODE,
                               hardware="h100-sxm-80gb").experiment
    timed = step_time(checkout, folder, golden, groups)
    p = exp.parallel
    derived = {"data_parallel_size": exp.data_parallel_size, "virtual_pipeline": p.virtual_pipeline_model_parallel_size,
               "expert_tensor_parallel_size": exp.expert_tensor_parallel_size if exp.model.is_moe else None,
               "expert_data_parallel_size": exp.expert_data_parallel_size if exp.model.is_moe else None,
               "padded_vocab_size": exp.model.padded_vocab_size(p.tensor_model_parallel_size),
               "num_microbatches": exp.num_microbatches}
    name = SUITES[suite] + case
    first_step, last_step, interval = measured["logged"]
    gib = 2 ** 30
    ranges = "; ".join(f"{m} over the logged steps: {lo / gib:.2f}-{hi / gib:.2f} GiB"
                       for m, (lo, hi) in measured["range"].items())
    notes = (f"Measured on rank world_size-1 (the last pipeline stage), H100 ({GOLDEN}), at step "
             f"{measured['step']}, the last of steps {first_step}-{last_step} (every {interval}) that logged both "
             f"metrics: static {measured['static'] / gib:.2f} GiB, peak {measured['peak'] / gib:.2f} GiB; {ranges}. "
             f"World size {world}: {world_why}. Vocabulary: {vocab_why}. Derived by charllm's import: "
             + ", ".join(f"{k} {v}" for k, v in derived.items() if v is not None)
             + f". TEST_TYPE {config.get('TEST_TYPE')}. Memory values last changed in commit {commit[:10]} ({date}); "
             f"megatron_args are the MODEL_ARGS of model_config.yaml at {config_commit[:10]} (HEAD {head[:10]}). "
             + (f"Left out: {', '.join(dropped)} (files, or shell variables CI expands). " if dropped else "")
             + (f"Added: {'; '.join(added)}. " if added else "")
             + f"Env: {', '.join(f'{k}={v}' for k, v in env.items()) or 'none'}. "
             + (f"Step time: {timed['why']}." if "why" in timed else
                f"Step time: the median iteration time of steps {timed['steps'][0]}-{timed['steps'][1]} "
                f"({timed['count']} logged, the first {STEP_WARMUP:.0%} of the logged steps left out), "
                f"{timed['seconds']:.3f} s (range {timed['min']:.3f}-{timed['max']:.3f} s); those values last "
                f"changed in {timed['commit'][:10]} ({timed['date']}), with {timed['flags']}."))
    return {
        "name": name,
        "suite": suite,
        "source": f"NVIDIA/Megatron-LM {folder}/{GOLDEN} + {folder}/model_config.yaml (commit {commit[:10]})",
        "hardware": "h100-sxm-80gb",
        "world_size": world,
        "world_size_inferred": inferred,
        "megatron_args": args,
        "env": env,
        "measured_peak_bytes": measured["peak"],
        "measured_static_bytes": measured["static"],
        "measured_iteration_time_s": timed.get("seconds"),
        "provenance": {"golden_commit": commit, "golden_date": date, "config_commit": config_commit, "head": head,
                       "measured_step": measured["step"], "logged_steps": [first_step, last_step, interval],
                       "test_type": config.get("TEST_TYPE"), "world_size": world_why, "vocabulary": vocab_why,
                       "dropped_flags": dropped, "added_flags": added, "derived": derived,
                       "iteration_time": timed},
        "notes": notes,
    }


def batch_at_step(flags: dict[str, list[str]], step: int) -> tuple[str, str, str] | None:
    """(the flag that ramps the global batch size up, the size in effect at `step`, why), or None when
    the size is fixed. Megatron's two ways: --rampup-batch-size START INCREMENT SAMPLES up to
    --global-batch-size (RampupBatchsizeNumMicroBatchesCalculator), or --step-batch-size-schedule
    "0:B0 T1:B1 ..." over consumed tokens. Only the first size is supported: the measured step must
    come before the first increase."""
    if "--rampup-batch-size" in flags:
        start, increment, samples = (int(v) for v in flags["--rampup-batch-size"])
        final = int(flags["--global-batch-size"][0])
        per_increment = samples / ((final - start) / increment)
        if step * start >= per_increment:
            raise LookupError(f"step {step} is past the first batch-size increase of --rampup-batch-size")
        return ("--rampup-batch-size", str(start), f"--rampup-batch-size {' '.join(flags['--rampup-batch-size'])} "
                f"to {final}: {start} until {per_increment:,.0f} samples, past step {step}")
    if "--step-batch-size-schedule" in flags:
        schedule = " ".join(flags["--step-batch-size-schedule"]).split()
        start = schedule[0].split(":")[1]
        tokens = step * int(start) * int(flags["--seq-length"][0])
        if len(schedule) > 1 and tokens >= _tokens(schedule[1].split(":")[0]):
            raise LookupError(f"step {step} is past the first size of --step-batch-size-schedule")
        return ("--step-batch-size-schedule", start, f"--step-batch-size-schedule {' '.join(schedule)}: {start} "
                f"while fewer than {schedule[1].split(':')[0] if len(schedule) > 1 else 'all'} tokens are seen, "
                f"past step {step} ({tokens / 1e9:.1f} B)")
    return None


def _tokens(text: str) -> float:
    """'200B' -> 2e11 (the schedule's token thresholds)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def build(checkout: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """(items, [(case, why it is left out)])."""
    head = git(checkout, "rev-parse", "HEAD").strip()
    recipes = h100_recipes(checkout, head)
    items, left_out = [], []
    for suite in SUITES:
        for case in git(checkout, "ls-tree", "-d", "--name-only", f"{head}:{CASES}/{suite}").split():
            if case in HELD_OUT:          # by name, before anything of it is read
                left_out.append((case, "held out (issue 26)"))
                continue
            why = in_scope(case)
            if why:
                left_out.append((case, why))
                continue
            try:
                item = build_case(checkout, head, suite, case, recipes)
            except LookupError as exc:
                raise LookupError(f"{suite}/{case}: {exc}") from None
            if isinstance(item, str):
                left_out.append((case, item))
            else:
                items.append(item)
    names = [item["name"] for item in items]
    assert len(names) == len(set(names)), "two cases share a name"
    mark_superseded(items)
    return items, left_out


def mark_superseded(items: list[dict]) -> None:
    """A case whose command line, environment and world size are another's, with memory values from an
    older golden commit that differ, measured an older Megatron-LM: it gets `superseded_by`, and the
    validation reports it without counting it."""
    same: dict[tuple, list[dict]] = {}
    for item in items:
        key = (item["megatron_args"], json.dumps(item["env"], sort_keys=True), item["world_size"])
        same.setdefault(key, []).append(item)
    for group in same.values():
        newest = max(group, key=lambda i: i["provenance"]["golden_date"])
        for item in group:
            measured = (item["measured_static_bytes"], item["measured_peak_bytes"])
            if item["provenance"]["golden_date"] < newest["provenance"]["golden_date"] and \
                    measured != (newest["measured_static_bytes"], newest["measured_peak_bytes"]):
                item["superseded_by"] = newest["name"]
                item["notes"] += (f" Superseded: {newest['name']} has the same command line, environment and world "
                                  f"size, measured at {newest['provenance']['golden_commit'][:10]} "
                                  f"({newest['provenance']['golden_date']}); these values are an older Megatron-LM's.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", default=os.environ.get("MEGATRON_LM_CHECKOUT"),
                        help="a Megatron-LM git checkout or mirror (default: $MEGATRON_LM_CHECKOUT)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "memory_dev" / "memory_dev.json")
    args = parser.parse_args(argv)
    if not args.checkout:
        parser.error("give a Megatron-LM checkout (or set MEGATRON_LM_CHECKOUT)")
    checkout = Path(args.checkout).expanduser()
    return build_and_write("build_memory_dev", lambda: build(checkout), args.out)


if __name__ == "__main__":
    sys.exit(main())
