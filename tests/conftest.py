"""Shared fixtures: every test gets private charllm config/data/runs directories."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def charllm_dirs(tmp_path, monkeypatch):
    """Isolate CHARLLM_* locations so tests never touch the user's real config or runs."""
    dirs = {
        "config": tmp_path / "charllm-config",
        "data": tmp_path / "charllm-data",
        "runs": tmp_path / "charllm-runs",
    }
    monkeypatch.setenv("CHARLLM_CONFIG_DIR", str(dirs["config"]))
    monkeypatch.setenv("CHARLLM_DATA_DIR", str(dirs["data"]))
    monkeypatch.setenv("CHARLLM_RUNS_DIR", str(dirs["runs"]))
    return dirs
