"""The suite is hermetic: what the user saved under their own config never reaches it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_collection_ignores_the_users_saved_presets(tmp_path):
    """Test modules build parameter lists at import time; a preset the user saved in their real
    config dir (XDG, HOME) must not become a test case run against the tests' empty config."""
    home = tmp_path / "home"
    saved = home / ".config" / "charllm" / "experiments"
    saved.mkdir(parents=True)
    (saved / "my-tp2.toml").write_text('model = "tiny"\nhardware = "cpu"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLLM_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"))
    # The real user dirs do hold the preset (so the test can fail):
    probe = subprocess.run([sys.executable, "-c", "from charllm.engine.model import catalog; "
                            "print('my-tp2' in catalog.entries('experiments'))"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True", probe.stderr
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS / "engine/model/test_validate.py"),
            str(TESTS / "engine/model/test_megatron_args.py"),
            str(TESTS / "engine/model/test_fuzz_experiments.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "shipped_experiments_are_valid[tiny-tp2]" in done.stdout
    assert "my-tp2" not in done.stdout
