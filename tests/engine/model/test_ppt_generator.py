"""tools/generate_ppt_experiments.py: the shipped ppt-* presets are exactly what it writes, it writes
nothing when a preset would be invalid, and it stays out of the installed package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from charllm.engine.model import catalog

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tools" / "generate_ppt_experiments.py"
SHIPPED = REPO / "presets" / "experiments"


@pytest.fixture
def generator(monkeypatch):
    """The script as a module, with its own copies of the layout and split tables to change."""
    spec = importlib.util.spec_from_file_location("generate_ppt_experiments", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LAYOUTS", {key: dict(value) for key, value in module.LAYOUTS.items()})
    monkeypatch.setattr(module, "SPLITS", dict(module.SPLITS))
    return module


def test_shipped_presets_are_what_the_generator_writes(tmp_path):
    """Byte for byte: nobody edited a ppt-* file by hand, and none is missing or left over."""
    out = tmp_path / "new" / "experiments"         # a folder that does not exist yet
    run = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, check=True)
    assert run.stdout == f"wrote 128 presets to {out}\n" and run.stderr == ""
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    shipped = {p.name: p.read_bytes() for p in SHIPPED.glob("ppt-*.toml")}
    assert set(written) == set(shipped) == {f"{n}.toml" for n in catalog.entries("experiments") if n.startswith("ppt-")}
    assert [name for name in sorted(shipped) if written[name] != shipped[name]] == []


def test_a_users_model_preset_is_refused(generator, tmp_path, charllm_dirs, capsys):
    """Layer counts come from the model presets, the shipped ones only: a user's preset of the same name
    (half the layers here) would change what ships, so it is one error line and nothing is written."""
    out = tmp_path / "out"
    assert generator.main([str(out)]) == 0
    gpt3 = tomllib.loads((out / "ppt-h200-gpt3-175b-2-01000.toml").read_text())
    assert gpt3["training"]["recompute_num_layers"] == 96 // 8
    mine = charllm_dirs["config"] / "models" / "gpt3-175b.toml"
    mine.parent.mkdir(parents=True)
    mine.write_text((REPO / "presets" / "models" / "gpt3-175b.toml").read_text()
                    .replace("num_layers = 96", "num_layers = 48"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert generator.main([str(out)]) == 2
    assert capsys.readouterr().err == (f"generate_ppt_experiments: error: model preset 'gpt3-175b': your own "
                                       f"preset ({mine}) hides the shipped one, and the ppt-* presets follow "
                                       "the shipped models; move yours aside\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_invalid_layout_writes_nothing(generator, tmp_path, capsys):
    """Without our uneven split, H100 llama3-70b layout 4 (80 layers over 32 stages) is invalid: one error
    line, and the folder keeps what it had."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ppt-h100-gpt3-175b-1-00000.toml").write_text("kept")
    del generator.SPLITS["h100", "llama3-70b", 4]
    assert generator.main([str(out)]) == 2
    err = capsys.readouterr().err
    assert err == ("generate_ppt_experiments: error: ppt-h100-llama3-70b-4-00000: num_layers = 80: must be "
                   "divisible by pipeline x virtual stages (32 x 1 = 32), or give decoder_first_pipeline_num_layers"
                   " / decoder_last_pipeline_num_layers\n")
    assert [(p.name, p.read_text()) for p in out.iterdir()] == [("ppt-h100-gpt3-175b-1-00000.toml", "kept")]


def test_the_package_leaves_tools_out():
    """The wheel's packages are the four concerns' folders: tools/ is none of them, and presets/ holds
    no script that would ship with the data."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = setuptools["package-dir"]
    folders = set()
    for package in setuptools["packages"]:
        root = max((r for r in roots if package == r or package.startswith(r + ".")), key=len)
        folders.add(Path(roots[root], *package[len(root):].split(".")[1:]))
    assert Path("presets") in folders and Path("engine", "model") in folders
    assert not [f for f in folders if f.parts[0] == "tools"]
    assert not (REPO / "tools" / "__init__.py").exists()
    assert [p.name for p in (REPO / "presets").rglob("*.py")] == ["__init__.py"]
