"""One exit-status convention for every command (charllm-tui --help states it): an operating-
system error on a file or directory (read-only, permission denied, disk full) is, like bad
input, "not done": exit 2 and one line naming the path. Exit 1 is kept for a command that did
its work and answers with a failure (plan: does not fit), so a script can tell them apart."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from charllm.engine.model.experiment import Experiment
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run
from charllm.tui.cli import EXIT_STATUS
from infra_cli import one_error_line, run
from infra_disks import tmpfs


def test_help_states_the_convention(capsys):
    with pytest.raises(SystemExit) as done:
        run(capsys, "--help")
    out = capsys.readouterr().out
    assert done.value.code == 0 and EXIT_STATUS in out
    for code in ("0", "1", "2", "3", "130"):
        assert f"\n  {code} " in out


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A read-only filesystem holding the runs and data directories, a finished run and one whose
    supervisor died in it (root mounts it; even root cannot write there)."""
    with tmpfs(tmp_path / "ro", "16m") as disk:
        (disk / "data").mkdir()
        experiment = tmp_path / "experiment.toml"
        Experiment.load("tiny-local").save(experiment)
        for run_id in ("done-run", "orphan-run"):
            run = make_run(disk / "runs", [gpu_frame(np.arange(0, 10, 0.05), power_w=150.0)],
                           experiment=experiment.read_text(),
                           iterations=iteration_rows(np.arange(0, 9, 1.0), 0.9), run_id=run_id)
        # a run left "running" by a supervisor that died (pid 1 is never a supervisor)
        run.update_manifest(status="running", kind="train", supervisor={"pid": 1, "create_time": 0.0})
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
        monkeypatch.setenv("CHARLLM_RUNS_DIR", str(disk / "runs"))
        monkeypatch.setenv("CHARLLM_DATA_DIR", str(disk / "data"))
        yield disk


@pytest.mark.parametrize("argv", [
    ["launch", "tiny-local"],
    ["sweep", "tiny-local", "--parquet", "{ro}/sweep.parquet"],
    ["summarize", "done-run", "--out", "{ro}/summary.json"],
    ["baseline", "save", "done-run", "--name", "b1"],
    ["export", "megatron", "tiny-local", "--out", "{ro}/flags.txt"],
    ["probe", "--backend", "sim", "--duration", "1", "--out", "{ro}/probe-run"],
    ["runs", "delete", "done-run"],
], ids=lambda argv: " ".join(argv[:2]))
def test_a_read_only_place_is_exit_2_in_one_line_naming_it(read_only, argv, capsys):
    before = sorted(str(p) for p in read_only.rglob("*"))
    code, _, err = run(capsys, *(word.format(ro=read_only) for word in argv))
    assert code == 2 and "Read-only file system" in one_error_line(err) and str(read_only) in err, err
    assert sorted(str(p) for p in read_only.rglob("*")) == before


def test_a_read_only_run_is_still_read(read_only, capsys):
    """Summaries are cached in the run; a run that cannot take the cache is summarized all the same."""
    for argv in (["runs", "list"], ["runs", "show", "done-run"], ["summarize", "done-run"],
                 ["compare", "done-run", "done-run"]):
        code, out, err = run(capsys, *argv)
        assert code == 0 and "done-run" in out + err, (argv, err)


def test_a_read_only_run_whose_supervisor_died_costs_only_itself(read_only, capsys):
    """The next reader cannot record its end: one line says so, and other runs list as before."""
    code, out, err = run(capsys, "runs", "list")
    assert code == 0 and "done-run" in out and "completed" in out, err
    assert "orphan-run" in err and "could not be recorded" in err and "Read-only file system" in err
    code, _, err = run(capsys, "runs", "show", "orphan-run")
    line = one_error_line(err)
    assert code == 2 and "its status (failed) could not be recorded" in line and "Read-only file system" in line


def test_a_probe_whose_directory_turns_read_only_stops_in_one_line(tmp_path):
    """`python -m charllm.probes` follows the same convention (it ended in a traceback)."""
    import sys

    from charllm.probes.store.rundir import RunDir
    from infra_runs import finish, start, wait_for

    with tmpfs(tmp_path / "disk", "16m") as disk:
        rd = RunDir(disk / "probe-run")
        proc = start([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--out", str(rd.path)])
        wait_for(lambda: rd.manifest_path.is_file() and len(rd.telemetry_files()) >= 2, 60, "two chunks")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
        code, _, err = finish(proc, 30)
        lines = err.strip().splitlines()
        assert code == 2 and lines[-1].startswith("charllm-probes: error: ") and "Read-only file system" in lines[-1]
        assert "Traceback" not in err, err
        assert rd.scan_telemetry().collect().height > 0, "what was written before stays readable"
