"""Shared fixtures: every test gets private charllm config/data/runs directories."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

import pytest

# Test modules build parameter lists at import time (the experiment presets, say), before any
# fixture runs: point every charllm location at an empty directory for the whole session, so
# collection never reads what the user saved. The per-test fixture below then narrows it further.
_SESSION_DIR = tempfile.mkdtemp(prefix="charllm-tests-")
for _kind in ("CONFIG", "DATA", "RUNS"):
    os.environ[f"CHARLLM_{_kind}_DIR"] = os.path.join(_SESSION_DIR, _kind.lower())
# Times show in the local zone (probes/core/formatting.py): pin it, so the screens' snapshots are
# the same on every machine.
os.environ["TZ"] = "UTC"
time.tzset()


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:              # a parent package is missing
        return False


# The [train] extra (torch, megatron-core): tests that train, build models or run Megatron's own code
# carry @pytest.mark.train and are skipped, with this reason, where only [test] is installed.
TRAIN_MISSING = [n for n in ("torch", "megatron.core") if not _importable(n)]


def pytest_configure(config):
    config.addinivalue_line("markers", "train: needs the [train] extra (torch, megatron-core); skipped without it")


def pytest_collection_modifyitems(config, items):
    if not TRAIN_MISSING:
        return
    skip = pytest.mark.skip(reason=f"needs the [train] extra: {', '.join(TRAIN_MISSING)} not installed")
    for item in items:
        if item.get_closest_marker("train"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_lm_mirror():
    """The Megatron-LM git mirror (CHARLLM_MEGATRON_LM, tests/infra_paths.py); skipped without one."""
    from infra_paths import MEGATRON_LM, megatron_lm_missing

    if missing := megatron_lm_missing():
        pytest.skip(missing)
    return MEGATRON_LM


@pytest.fixture
def _pristine_environ():
    """Restore os.environ after each test. Megatron-Core writes NVTE_* variables into os.environ
    when a test builds a model in-process; later torchrun children would inherit them and refuse
    a different attention backend."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def charllm_dirs(_pristine_environ, tmp_path, monkeypatch):
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
