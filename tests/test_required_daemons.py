"""CHARLLM_REQUIRE_DAEMONS=1 (.ci/run) turns a missing daemon's skip into a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def outcome(tmp_path: Path, required: bool) -> str:
    (tmp_path / "test_needs_a_daemon.py").write_text(
        "import infra_daemons\n\ndef test_it():\n    infra_daemons.missing('needs slurmd (not found)')\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("CHARLLM_REQUIRE_DAEMONS", None)
    if required:
        env["CHARLLM_REQUIRE_DAEMONS"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout


def test_a_missing_daemon_skips_with_its_reason_or_fails_where_required(tmp_path):
    skipped = outcome(tmp_path, required=False)
    assert "1 skipped" in skipped and "needs slurmd (not found)" in skipped, skipped
    failed = outcome(tmp_path, required=True)
    assert "1 failed" in failed and "CHARLLM_REQUIRE_DAEMONS=1 and needs slurmd (not found)" in failed, failed
