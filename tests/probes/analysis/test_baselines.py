"""Baselines: save a run's summary under a name, list, show, delete; shipped ones are read-only."""

from __future__ import annotations

import numpy as np
import pytest

from charllm.probes.analysis import baselines
from charllm.probes.core.errors import UserError
from charllm.probes.store.synthetic import gpu_frame, make_run
from charllm.tui.cli import main

T = np.round(np.arange(0, 101) * 0.1, 10)


@pytest.fixture
def run(charllm_dirs):
    return make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=120.0)],
                    experiment='name = "x"\n[hardware]\nbf16_tflops = 1.0\n', run_id="20261121-000000-base")


def test_save_show_list_delete(run, charllm_dirs):
    path = baselines.save(run, "mine", description="first try")
    assert path == charllm_dirs["data"] / "baselines" / "mine"
    b = baselines.show("mine")
    assert b.source == "user" and b.meta["run"] == run.id and b.description == "first try"
    assert b.summary["power_mean_w"][0] == pytest.approx(120.0)
    assert b.gpus.height == 1 and "bf16_tflops" in b.experiment_toml
    assert "mine" in [x["name"] for x in baselines.list()]
    with pytest.raises(UserError, match="already exists"):
        baselines.save(run, "mine")
    baselines.delete("mine")
    assert "mine" not in [x["name"] for x in baselines.list()]
    with pytest.raises(UserError, match="no such baseline"):
        baselines.show("mine")


def test_bad_names_and_missing_runs(run):
    with pytest.raises(UserError, match="baseline name"):
        baselines.save(run, "../evil")
    with pytest.raises(UserError, match="no such run"):
        baselines.save("nope", "x")
    with pytest.raises(UserError, match="no such baseline"):
        baselines.delete("ghost")


def test_failed_save_leaves_nothing(charllm_dirs):
    empty = make_run(charllm_dirs["runs"], [gpu_frame([0.0], power_w=1.0)], chunks=1, run_id="one-sample")
    with pytest.raises(UserError):
        baselines.save(empty, "broken")
    root = charllm_dirs["data"] / "baselines"
    assert not root.exists() or list(root.iterdir()) == []


def test_shipped_baselines_load_and_cannot_be_deleted():
    shipped = [b for b in baselines.list() if b["source"] == "shipped"]
    assert shipped, "presets/baselines/ ships baselines (the README compares against them)"
    for info in shipped:
        b = baselines.show(info["name"])
        assert b.summary.height == 1 and b.description
        with pytest.raises(UserError, match="cannot be deleted"):
            baselines.delete(info["name"])


def test_cli(run, capsys):
    assert main(["baseline", "save", run.id, "--name", "b1"]) == 0
    assert main(["baseline", "list"]) == 0
    assert main(["baseline", "show", "b1", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert "saved baseline b1" in out and "b1" in out and "power_mean_w" in out
    assert main(["baseline", "delete", "b1"]) == 0
    assert main(["baseline", "show", "b1"]) == 2
    assert capsys.readouterr().err.startswith("charllm-tui: error: baseline 'b1'")
