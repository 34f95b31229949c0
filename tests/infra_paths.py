"""Inputs that live outside the repository, on the machines that have them: each from an environment
variable, with the team's location as the default. Tests that need one are skipped, saying which
variable to set, where it is missing (the fixtures in tests/conftest.py, or these reasons for tests
that parametrize over the files at import time)."""

from __future__ import annotations

import os
from pathlib import Path

# A git mirror of NVIDIA/Megatron-LM (its argument code and functional-test configs).
MEGATRON_LM = Path(os.environ.get("CHARLLM_MEGATRON_LM")
                   or os.environ.get("MEGATRON_LM_MIRROR")      # the name used before
                   or "/work/.mirror/NVIDIA+Megatron-LM/repo")
# Git mirrors of NVIDIA's other public repositories, each at OWNER+NAME/repo under this directory (the public
# throughput dev set's sources: NVIDIA/NeMo, NVIDIA/NeMo-Framework-Launcher, NVIDIA-NeMo/Megatron-Bridge).
MIRRORS = Path(os.environ.get("CHARLLM_MIRRORS") or "/work/.mirror")


def megatron_lm_missing() -> str | None:
    """Why there is no Megatron-LM mirror here, or None."""
    if (MEGATRON_LM / "HEAD").exists() or (MEGATRON_LM / ".git").exists():
        return None
    return f"needs a Megatron-LM git mirror: set CHARLLM_MEGATRON_LM ({MEGATRON_LM} is missing)"


def mirror(name: str) -> Path:
    """The git directory of the mirror of `name` (owner/name) under MIRRORS."""
    return MIRRORS / name.replace("/", "+") / "repo"


def mirrors_missing(*names: str) -> str | None:
    """Why one of these repositories has no mirror here, or None."""
    lacking = [name for name in names if not (mirror(name) / "HEAD").exists()]
    if not lacking:
        return None
    return f"needs git mirrors of {', '.join(lacking)}: set CHARLLM_MIRRORS (a directory of OWNER+NAME/repo)"
