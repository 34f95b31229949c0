"""Megatron-LM's own argument code, from a git mirror of NVIDIA/Megatron-LM, for tests that check what
charllm writes against what Megatron accepts (tests/megatron_lm_validate.py runs in the checkout).

The mirror is CHARLLM_MEGATRON_LM (tests/infra_paths.py), else the team's read-only mirror; where neither
exists (CI) the tests that need it are skipped with that reason, and plain unit tests of the same rules still
run.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from infra_paths import MEGATRON_LM, megatron_lm_missing

MIRROR = MEGATRON_LM
RELEASES = ("0.16.1", "0.17.1", "0.18.0", "0.19.0")     # the releases charllm supports, as tags core_v<release>
RUNNER = Path(__file__).with_name("megatron_lm_validate.py")


def mirror_reason() -> str | None:
    """Why the Megatron-LM tests cannot run here, or None."""
    if missing := megatron_lm_missing():
        return missing
    try:
        import torch  # noqa: F401  (Megatron's argument code imports it)
    except ImportError:
        return "needs torch"
    return None


needs_mirror = pytest.mark.skipif(mirror_reason() is not None, reason=mirror_reason() or "")


def checkout(release: str, root: Path) -> Path:
    """The files of tag core_v<release> that pretrain_gpt.py's argument handling imports, under `root`
    (extracted once per directory)."""
    target = root / f"core_v{release}"
    if not (target / "megatron").is_dir():
        archive = subprocess.run(["git", "-C", str(MIRROR), "archive", f"core_v{release}", "megatron"],
                                 capture_output=True, check=True, timeout=300).stdout
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
    return target


def validate(release: str, root: Path, cases: list[dict]) -> list[dict]:
    """Run each case ({"argv", "env", "world_size"}) through Megatron's parse_args, validate_args and
    tokenizer builder of `release`; one result per case ({"error": ...} or resolved arguments)."""
    source = checkout(release, root)
    done = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=600, cwd=source,
                          env={**os.environ, "PYTHONPATH": str(source), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# What Megatron-LM's pretrain_gpt.py needs of its checkout to train (core_v0.16.1 and core_v0.19.0).
TRAINING_FILES = ("megatron", "pretrain_gpt.py", "gpt_builders.py", "model_provider.py")


def training_checkout_reason() -> str | None:
    """Why Megatron-LM's own pretrain_gpt.py cannot train here, or None: a mirror, torch and megatron-core
    (the [train] extra), and pybind11, with which the checkout compiles its dataset helpers."""
    if reason := mirror_reason():
        return reason
    import importlib.util

    for module, why in (("megatron.core", "the [train] extra"), ("pybind11", "pybind11 (Megatron-LM's checkout "
                                                                             "compiles its dataset helpers with it)")):
        if importlib.util.find_spec(module) is None:
            return f"needs {why}"
    if subprocess.run(["which", "g++", "make"], capture_output=True).returncode != 0:
        return "needs g++ and make (Megatron-LM's checkout compiles its dataset helpers with them)"
    return None


def training_checkout(release: str, root: Path) -> Path:
    """The files of tag core_v<release> that pretrain_gpt.py trains with, under `root` (once per
    directory), its dataset helpers compiled as Megatron's own Makefile builds them (which pretrain_gpt.py
    would do on its first rank at start: once here instead of in every run)."""
    target = root / f"train_v{release}"
    if not (target / "pretrain_gpt.py").is_file():
        archive = subprocess.run(["git", "-C", str(MIRROR), "archive", f"core_v{release}", *TRAINING_FILES],
                                 capture_output=True, check=True, timeout=300).stdout
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"   # the python that has pybind11
        subprocess.run(["make", "-C", str(target / "megatron" / "core" / "datasets")], check=True,
                       capture_output=True, timeout=600, env={**os.environ, "PATH": path})
    return target


def logged_steps(text: str) -> dict[int, dict]:
    """Megatron's step lines in a log, read another way than probes.store.trainlogs does (split on '|',
    then 'key: value'), by iteration: what a parsed record must agree with. Megatron-LM's first line
    (iteration 1) leaves its sums unreset, so the next line's means start at iteration 1: they are taken
    back out, as training.py's `should_reset = not is_first_iteration` implies."""
    steps = {}
    for line in text.splitlines():
        if "elapsed time per iteration (ms)" not in line or " iteration " not in line:
            continue
        fields = {}
        for part in line.split("|"):
            key, _, value = part.strip().rpartition(":")
            fields[key.strip()] = value.strip()
        iteration = int(line.split("|")[0].split(" iteration ")[-1].split("/")[0])
        steps[iteration] = {"step_s": float(fields["elapsed time per iteration (ms)"]) / 1000,
                            "loss": float(fields["lm loss"]) if "lm loss" in fields else None,
                            "samples": int(fields["global batch size"])}
    order = sorted(steps)
    if len(order) > 1 and order[0] == 1:
        first, second = steps[1], steps[order[1]]
        n = order[1]
        for key in ("step_s", "loss"):
            if first[key] is not None and second[key] is not None:
                second[key] = (n * second[key] - first[key]) / (n - 1)
    return steps


@pytest.fixture(scope="session")
def megatron_lm_checkout(tmp_path_factory):
    """Megatron-LM's training files at core_v0.16.1, extracted and built once per session (the tests that
    train with Megatron-LM's own pretrain_gpt.py); skipped, with the reason, where they cannot."""
    if reason := training_checkout_reason():
        pytest.skip(reason)
    return training_checkout("0.16.1", tmp_path_factory.mktemp("megatron-lm-training"))


def pretrain_gpt_argv(checkout: Path, exp, extra: list[str] | None = None) -> list[str]:
    """Megatron-LM's pretrain_gpt.py on `exp`'s layout under torchrun, through the CPU path of
    charllm.engine.workload.megatron_lm (on a GPU it runs as is): `export megatron`'s flags and the
    planned node's runtime switches, logging every step."""
    from charllm.engine.model.megatron import export_megatron_args, runtime_flags

    flags = export_megatron_args(exp, "0.16.1") + runtime_flags(exp) + ["--log-interval", "1", *(extra or [])]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={exp.cluster.gpus_per_node}",
            "-m", "charllm.engine.workload.megatron_lm", str(checkout / "pretrain_gpt.py"), *flags]
