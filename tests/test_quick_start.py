"""The README's Quick start installs as written on Debian 12's own Python, which is externally managed
(PEP 668: its pip refuses to install into it), from a fresh copy of the tree, and leaves a working
`charllm-tui`; the system Python is left as it was."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from test_readme import README, readme_blocks, shell_commands

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DEBIAN_PYTHON = Path("/usr/bin/python3")


def quick_start_command() -> str:
    """The Quick start's one command: install, then open the workbench."""
    text = README.read_text()
    start = text.index("## Quick start")
    line = text.count("\n", 0, start) + 1
    block = next(b for b in readme_blocks(text) if b.lang == "bash" and b.line > line)
    (command,) = shell_commands(block.text)
    return command


def system_python_problem() -> str | None:
    if not DEBIAN_PYTHON.exists():
        return f"{DEBIAN_PYTHON} does not exist (not a Debian-like system)"
    stdlib = subprocess.run([DEBIAN_PYTHON, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    if not (Path(stdlib) / "EXTERNALLY-MANAGED").exists():
        return f"{DEBIAN_PYTHON} has no EXTERNALLY-MANAGED marker in {stdlib} (not a PEP 668 system Python)"
    if subprocess.run([DEBIAN_PYTHON, "-c", "import ensurepip, venv"], capture_output=True).returncode != 0:
        return f"{DEBIAN_PYTHON} cannot make a venv: install python3-venv (tests/run.sh does, as root)"
    return None


def site_packages(python: Path) -> dict[str, list[str]]:
    """What the interpreter's own package directories hold (the system Python's, to see it left alone)."""
    script = "import json, site, sysconfig; print(json.dumps([*site.getsitepackages(), sysconfig.get_path('purelib')]))"
    dirs = json.loads(subprocess.run([python, "-c", script], capture_output=True, text=True, check=True).stdout)
    return {d: sorted(os.listdir(d)) if os.path.isdir(d) else [] for d in dict.fromkeys(dirs)}


def tracked_tree(dest: Path) -> None:
    """The files git tracks (or would: untracked, not ignored), as they are now: what a clone of this
    tree with its changes committed holds, without the developer's .venv or build outputs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_the_quick_start_command_installs_and_opens_the_workbench():
    command = quick_start_command()
    assert command.endswith(" && charllm-tui"), command
    assert "python3 -m pip install" not in command     # the system Python's pip: refused under PEP 668


def test_the_quick_start_installs_with_the_externally_managed_system_python(tmp_path):
    if problem := system_python_problem():
        pytest.skip(problem)
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and this tree's repository to copy what a clone holds")
    tree = tmp_path / "charllm-tui"
    tracked_tree(tree)
    first = tmp_path / "bin"
    first.mkdir()
    (first / "python3").symlink_to(DEBIAN_PYTHON)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{first}{os.pathsep}/usr/bin{os.pathsep}/bin"   # no pyenv, no other venv
    before = site_packages(DEBIAN_PYTHON)

    # the Quick start as written, but the workbench's --help where it would open the workbench
    command = re.sub(r"&& charllm-tui$", "&& charllm-tui --help", quick_start_command())
    done = subprocess.run(["bash", "-c", command], cwd=tree, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "usage: charllm-tui" in done.stdout
    # it ran from the venv made of Debian's Python, and a new shell finds it there as the README says
    venv_python = tree / ".venv/bin/python"
    base = subprocess.run([venv_python, "-c", "import sys; print(sys._base_executable)"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert Path(base).resolve() == DEBIAN_PYTHON.resolve()
    again = subprocess.run(["bash", "-c", ". .venv/bin/activate && charllm-tui presets list hardware"],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "h100" in again.stdout, again.stderr[-2000:]
    assert subprocess.run([tree / ".venv/bin/charllm-tui", "--version"], env=env, capture_output=True).returncode == 0
    assert site_packages(DEBIAN_PYTHON) == before       # nothing installed into the system Python
