"""`charllm-tui presets ...` and `charllm-tui export ...`, through main() and the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.megatron import import_megatron_args
from infra_cli import run


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("charllm-tui: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


# --------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------
def test_presets_list_all_kinds(capsys):
    code, out, _ = run(capsys, "presets", "list")
    assert code == 0
    for name in ("models", "hardware", "experiments", "llama3-70b", "h100-sxm-80gb", "tiny-local"):
        assert name in out
    assert "shipped" in out


def test_presets_list_never_wraps_a_name_at_80_columns(capsys, monkeypatch):
    """A name is what one types next: summary and description give way, the name stays whole."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "presets", "list")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    words = set(out.split())
    for kind in ("models", "hardware", "experiments"):
        for name in catalog.entries(kind):
            assert name in words, name


def test_presets_list_imports_no_heavy_library():
    """Listing presets validates them, which needs no polars, torch or textual: polars' 170 MB
    library alone took seconds to load from a cold disk (the first `presets list` after install)."""
    probe = ("import sys; from charllm.tui.cli import main; main(['presets', 'list']); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'polars', 'torch', 'textual', 'numpy'}), "
             "file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "[]"


def user_presets(capsys, charllm_dirs, kind: str, name: str, text: str) -> dict:
    """Write a user preset of KIND, then `presets list KIND --json` by name (it exits 0)."""
    user = charllm_dirs["config"] / kind
    user.mkdir(parents=True)
    (user / f"{name}.toml").write_text(text)
    code, out, _ = run(capsys, "presets", "list", kind, "--json")
    assert code == 0
    return {r["name"]: r for r in json.loads(out)}


def test_presets_list_json_marks_user_presets(capsys, charllm_dirs):
    rows = user_presets(capsys, charllm_dirs, "hardware", "my-gpu",
                        'description = "lab box"\nvendor = "nvidia"\nusable_bytes = 1\nmemory_bytes = 1\n')
    assert {r["kind"] for r in rows.values()} == {"hardware"}
    assert rows["my-gpu"]["source"] == "user" and rows["my-gpu"]["description"] == "lab box"
    assert rows["h100-sxm-80gb"]["source"] == "shipped"
    assert rows["h100-sxm-80gb"]["summary"].startswith("79.1 GiB usable")
    code, out, _ = run(capsys, "presets", "list", "hardware")
    assert "user" in out and "my-gpu" in out


def test_a_broken_user_preset_is_listed_as_invalid(capsys, charllm_dirs):
    rows = user_presets(capsys, charllm_dirs, "models", "broken", "num_layerz = 2\n")
    assert rows["broken"]["summary"].startswith("invalid:") and "num_layers" in rows["broken"]["summary"]
    assert rows["llama3-8b"]["summary"].startswith("32 layers")


def test_an_impossible_user_experiment_is_listed_as_invalid(capsys, charllm_dirs):
    rows = user_presets(capsys, charllm_dirs, "experiments", "zero",
                        'model = "tiny-dense"\nhardware = "cpu"\n[parallel]\ntensor_model_parallel_size = 0\n')
    assert rows["zero"]["summary"] == "invalid: tensor_model_parallel_size = 0: must be at least 1"
    code, out, _ = run(capsys, "presets", "show", "zero", "--json")
    assert code == 0 and json.loads(out)["derived"] is None


def test_presets_show_detects_the_kind(capsys):
    code, out, _ = run(capsys, "presets", "show", "deepseek-v3")
    assert code == 0 and "# model preset 'deepseek-v3' (shipped:" in out and "q_lora_rank = 1536" in out
    code, out, _ = run(capsys, "presets", "show", "ppt-h100-llama3-70b-1-00000", "--json")
    data = json.loads(out)
    assert data["kind"] == "experiments" and data["problems"] == []
    assert data["derived"]["world_size"] == 64 and data["derived"]["data_parallel_size"] == 2
    assert data["data"]["parallel"]["tensor_model_parallel_size"] == 8


def test_presets_show_ambiguous_name_needs_kind(capsys, charllm_dirs):
    user = charllm_dirs["config"] / "hardware"
    user.mkdir(parents=True)
    (user / "tiny-dense.toml").write_text('vendor = "cpu"\n')
    code, _, err = run(capsys, "presets", "show", "tiny-dense")
    assert_one_line_error(code, err, "'tiny-dense' is a model and a hardware preset", "--kind")
    code, out, _ = run(capsys, "presets", "show", "tiny-dense", "--kind", "hardware", "--json")
    assert code == 0 and json.loads(out)["source"] == "user"


def test_presets_show_unknown_name(capsys):
    code, _, err = run(capsys, "presets", "show", "llama3-80b")
    assert_one_line_error(code, err, "preset 'llama3-80b'", "did you mean")


def test_presets_show_flags_an_invalid_user_experiment(capsys, charllm_dirs):
    user = charllm_dirs["config"] / "experiments"
    user.mkdir(parents=True)
    (user / "bad.toml").write_text('model = "tiny-dense"\nhardware = "cpu"\n[cluster]\ngpus_per_node = 3\n'
                                   '[parallel]\ntensor_model_parallel_size = 2\n')
    code, out, _ = run(capsys, "presets", "show", "bad")
    assert code == 0 and "# invalid: world_size = 3: must be a multiple of" in out


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-moe-ep2", "ppt-h200-mixtral-8x22b-2-11000", "ppt-h100-gpt3-175b-5-10000"])
def test_export_megatron_round_trips(capsys, name):
    code, out, err = run(capsys, "export", "megatron", name)
    exp = Experiment.load(name)
    assert code == 0 and f"torchrun --nnodes {exp.cluster.nodes}" in err
    assert out.splitlines()[1].startswith("    --") and out.splitlines()[0].endswith(" \\")
    back = import_megatron_args(out, world_size=exp.world_size, hardware=exp.hardware.name)
    assert back.ignored == []
    assert export_of(back.experiment) == export_of(exp)


def export_of(exp: Experiment) -> list[str]:
    from charllm.engine.model.megatron import export_megatron_args

    return export_megatron_args(exp)


def test_export_with_set_and_out(capsys, tmp_path):
    target = tmp_path / "sub" / "flags.sh"
    target.parent.mkdir()   # a missing directory is refused, never created silently
    code, out, err = run(capsys, "export", "megatron", "tiny-local", "--set", "tensor_model_parallel_size=2",
                         "--set", "global_batch_size=4", "--out", str(target))
    assert code == 0 and out == "" and f"wrote {target}" in err
    exp = import_megatron_args(target.read_text(), world_size=2, hardware="cpu").experiment
    assert exp.parallel.tensor_model_parallel_size == 2 and exp.training.global_batch_size == 4
    assert [p.name for p in target.parent.iterdir()] == ["flags.sh"]   # no temporary file left


def test_export_refuses_an_invalid_experiment_and_writes_nothing(capsys, tmp_path):
    target = tmp_path / "flags.sh"
    code, out, err = run(capsys, "export", "megatron", "tiny-local", "--set", "tensor_model_parallel_size=3",
                         "--out", str(target))
    assert_one_line_error(code, err, "world_size = 2", "(3 x 1 x 1 = 3)")
    assert not target.exists() and out == ""
    code, out, _ = run(capsys, "export", "megatron", "tiny-local", "--set", "tensor_model_parallel_size=3",
                       "--no-validate")
    assert code == 0 and "--tensor-model-parallel-size 3" in out


def test_export_toml_is_the_resolved_experiment(capsys, tmp_path):
    target = tmp_path / "exp.toml"
    code, _, _ = run(capsys, "export", "toml", "ppt-h200-llama3-70b-2-01000", "--out", str(target))
    assert code == 0
    assert Experiment.load(target) == Experiment.load("ppt-h200-llama3-70b-2-01000")
    code, out, _ = run(capsys, "export", "toml", str(target), "--set", "micro_batch_size=2")
    assert code == 0 and "micro_batch_size = 2" in out


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["export", "megatron", "tiny-local", "--set", "tensor_model_parallel_size"], ["expected key=value"]),
        (
            ["export", "megatron", "tiny-local", "--set", "tensor_paralel_size=2"],
            ["unknown key 'tensor_paralel_size'", "did you mean 'tensor_model_parallel_size'"],
        ),
        (["export", "megatron", "tiny-local", "--set", "micro_batch_size=two"], ["expected an integer", "'two'"]),
        (["export", "toml", "no-such-experiment"], ["experiment 'no-such-experiment': no such preset"]),
        (["export", "toml", "/nonexistent/x.toml"], ["no such file"]),
        (
            ["export", "megatron", "tiny-local", "--out", "/proc/charllm/x.sh"],
            ["--out '/proc/charllm/x.sh': directory '/proc/charllm' does not exist"],
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, fragments):
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, *fragments)


def test_entry_point_subprocess(tmp_path):
    env = {**os.environ, "CHARLLM_CONFIG_DIR": str(tmp_path / "c"), "CHARLLM_DATA_DIR": str(tmp_path / "d"),
           "CHARLLM_RUNS_DIR": str(tmp_path / "r")}
    ok = subprocess.run([sys.executable, "-m", "charllm.tui", "export", "megatron", "tiny-pp2"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and "--pipeline-model-parallel-size 2" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "charllm.tui", "presets", "show", "nope"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("charllm-tui: error: preset 'nope'")
