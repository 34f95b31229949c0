"""The headless packages never import textual (nor torch): the dependency rule of docs/architecture.md."""

import pkgutil
import subprocess
import sys

import pytest

import charllm.engine
import charllm.probes


def _modules(pkg) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
            if ".workload" not in m.name]  # the workload runs on compute nodes and imports torch


@pytest.mark.parametrize("pkg", [charllm.engine, charllm.probes])
def test_headless_packages_do_not_import_textual(pkg):
    mods = _modules(pkg)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted(n for n in ('textual', 'textual_plotext', 'torch', 'megatron') if n in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{pkg.__name__} imported {out.stdout.strip()}"


def test_cli_help_does_not_import_textual():
    code = (
        "import sys\nfrom charllm.tui.cli import build_parser\nbuild_parser()\n"
        "print('textual' in sys.modules, 'polars' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
