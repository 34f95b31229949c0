"""What a test does when a daemon or tool it needs is missing here (sshd, Slurm, tmux): skipped with
the reason, or, with CHARLLM_REQUIRE_DAEMONS=1 (set by .ci/run, where tests/run.sh installs them),
failed with it, so a machine that lost one cannot pass by skipping."""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("CHARLLM_REQUIRE_DAEMONS") == "1"


def missing(reason: str) -> None:
    """Skip the test that needs what is missing, or fail it where the suite requires it."""
    if REQUIRED:
        pytest.fail(f"CHARLLM_REQUIRE_DAEMONS=1 and {reason}", pytrace=False)
    pytest.skip(reason)
