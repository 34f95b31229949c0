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
