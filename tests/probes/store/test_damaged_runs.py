"""A damaged file of one run (manifest, iteration log, experiment.toml) costs only that run:
every command that reads it answers with one line or without that file, and the other runs
list and summarize as before. (Damaged telemetry files are tests/test_summary*.py's.)"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from charllm.engine.model.experiment import Experiment
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run
from infra_cli import one_error_line, run

DIRECTORY = object()
DAMAGES = {
    "manifest is a JSON list": ("manifest.json", b"[1, 2]"),
    "manifest is null": ("manifest.json", b"null"),
    "manifest is binary": ("manifest.json", b"\xff\xfe\x00\x81garbage"),
    "manifest is empty": ("manifest.json", b""),
    "manifest fields of the wrong type": ("manifest.json", b'{"status": "completed", "target": "x", "nodes": 3}'),
    "manifest status unknown": ("manifest.json", b'{"status": 7}'),
    "manifest is a directory": ("manifest.json", DIRECTORY),
    "iteration log is binary": ("iterations.jsonl", b"\xff\xfe\x00\x01\n\x80\x81\n"),
    "iteration rows of the wrong type": (
        "iterations.jsonl",
        b'{"event": "iteration", "iteration": "x", "start_ns": "a", "end_ns": [1]}\n'
        b'[1, 2]\n5\n"s"\n{"event": 5}\n'
        b'{"event": "iteration", "iteration": 1e400, "start_ns": 1e30, "warmup": 3}\n',
    ),
    "iteration log is a directory": ("iterations.jsonl", DIRECTORY),
    "experiment.toml missing": ("experiment.toml", None),
    "experiment.toml binary": ("experiment.toml", b"\xff\xfe\x00"),
    "experiment.toml a directory": ("experiment.toml", DIRECTORY),
}
COMMANDS = [("runs", "list"), ("runs", "show", "BAD"), ("runs", "logs", "BAD"), ("summarize", "BAD"),
            ("summarize", "BAD", "--by", "gpu"), ("compare", "BAD", "good-run"),
            ("baseline", "save", "BAD", "--name", "b"), ("runs", "delete", "BAD")]


def two_runs(root) -> None:
    exp = Experiment.load("tiny-local")
    exp.save(root.parent / "experiment.toml")
    toml = (root.parent / "experiment.toml").read_text()
    for run_id in ("good-run", "bad-run"):
        make_run(root, [gpu_frame(np.arange(0, 10, 0.05), power_w=150.0)], experiment=toml,
                 iterations=iteration_rows(np.arange(0, 9, 1.0), 0.9), run_id=run_id)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_costs_only_its_run(damage, charllm_dirs, capsys):
    name, content = DAMAGES[damage]
    runs = charllm_dirs["runs"]
    two_runs(runs)
    path = runs / "bad-run" / name
    path.unlink()
    if content is DIRECTORY:
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    for command in COMMANDS:
        argv = [{"BAD": "bad-run"}.get(a, a) for a in command]
        shutil.rmtree(charllm_dirs["data"] / "baselines", ignore_errors=True)
        code, out, err = run(capsys, *argv)
        assert "Traceback" not in out + err, (argv, err)
        if code != 0:
            line = one_error_line(err)
            assert "bad-run" in line or name in line, (argv, line)
        if command == ("runs", "list"):
            assert code == 0 and "good-run" in out and "bad-run" in out, (out, err)
            if name == "manifest.json":
                assert len(err.strip().splitlines()) == 1 and "manifest" in err and "bad-run" in err, err
    code, out, err = run(capsys, "summarize", "good-run")
    assert code == 0, err


DAMAGED_MANIFESTS = {"null": b"null", "a JSON list": b"[1, 2]", "binary": b"\xff\xfe\x00\x81garbage",
                     "truncated JSON": b'{"id": "bad-run", "status": "runn'}


@pytest.mark.parametrize("damage", DAMAGED_MANIFESTS)
def test_a_run_with_a_damaged_manifest_can_be_deleted(damage, charllm_dirs, capsys):
    runs = charllm_dirs["runs"]
    two_runs(runs)
    (runs / "bad-run" / "manifest.json").write_bytes(DAMAGED_MANIFESTS[damage])
    for ref in ("", " ", "run"):  # empty, or matching both runs
        code, out, err = run(capsys, "runs", "delete", ref)
        line = one_error_line(err)
        assert code != 0 and ("give a run id" in line or "ambiguous, matches 2 runs" in line), (ref, line)
        assert (runs / "bad-run").is_dir() and (runs / "good-run").is_dir()
    code, out, err = run(capsys, "runs", "delete", "bad")
    assert code == 0 and "run bad-run: deleted" in out, err
    assert not (runs / "bad-run").exists() and (runs / "good-run" / "manifest.json").is_file()


def test_a_damaged_run_still_in_use_is_not_deleted(charllm_dirs, capsys):
    """A probe recording into the run (its --out names the directory) keeps it until it is gone."""
    import subprocess
    import sys

    import psutil

    from infra_runs import kill_and_wait, start, wait_for

    runs = charllm_dirs["runs"]
    two_runs(runs)
    manifest = runs / "bad-run" / "manifest.json"
    shutil.rmtree(runs / "bad-run")   # the probe makes it, as its own run
    proc = start([sys.executable, "-m", "charllm.probes", "--backend", "host", "--hz", "5",
                  "--out", str(runs / "bad-run"), "--node", "n1"])
    try:
        wait_for(lambda: manifest.is_file() and b'"sampler"' in manifest.read_bytes(), 60, "the probe to record")
        manifest.write_bytes(b"null")
        code, out, err = run(capsys, "runs", "delete", "bad-run")
        assert code != 0 and f"still in use by process {proc.pid}" in one_error_line(err), err
        assert manifest.is_file()
    finally:
        kill_and_wait(psutil.Process(proc.pid))
        proc.communicate()
    # through a wrapper whose own command line names the run (not a user of it)
    done = subprocess.run(["timeout", "60", sys.executable, "-m", "charllm.tui", "runs", "delete",
                           str(runs / "bad-run")], capture_output=True, text=True)
    assert done.returncode == 0 and not (runs / "bad-run").exists(), done.stderr
