"""A full disk under a run: the supervisor and `runs cancel` stop cleanly, one line names the
disk, the status records it and what was written before stays readable. The disk is a small
tmpfs mounted for the test (root only; skipped otherwise)."""

from __future__ import annotations

import errno
import os

import pytest

from charllm.engine.launch.launcher import launch
from charllm.engine.launch.targets import LOCAL
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import mount_point
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir
from infra_cli import one_error_line, run
from infra_disks import tmpfs
from infra_runs import iterations_logged, left_after, logs, wait_final, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    with tmpfs(tmp_path / "disk", "64m") as disk:
        monkeypatch.setenv("CHARLLM_RUNS_DIR", str(disk / "runs"))
        yield disk


def fill(disk) -> None:
    """Take every free byte (what a runaway checkpoint or a neighbour's job does)."""
    with open(disk / "filler", "wb") as fh:
        block = b"\0" * 2**20
        try:
            while True:
                fh.write(block)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with open(disk / "filler-tail", "wb", buffering=0) as fh:  # the last partial MiB
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass


def training(iters: int = 100_000) -> RunDir:
    exp = Experiment.load("tiny-local")
    exp.training.train_iters = iters
    rd = RunDir(launch(exp, LOCAL).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 240, f"the first iteration\n{logs(rd)}")
    return rd


@pytest.mark.train                  # training() launches a run
@pytest.mark.timeout(300)
def test_supervisor_records_a_full_disk_and_stops_everything(small_disk, capsys):
    rd = training()
    before = iterations_logged(rd)
    fill(small_disk)
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed"
    assert f"disk full on {small_disk}" in manifest["failure"], manifest["failure"]
    assert left_after(str(rd.path)) == 0
    assert iterations_logged(rd) >= before, "what was written before stays readable"
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0 and "disk full on" in out, out + err
    assert mount_point(rd.path) == str(small_disk)


@pytest.mark.train                  # training() launches a run
@pytest.mark.timeout(300)
def test_runs_cancel_on_a_full_disk_is_one_line_and_keeps_the_cause(small_disk, capsys):
    rd = training()
    fill(small_disk)
    code, out, err = run(capsys, "runs", "cancel", rd.id)
    assert "Traceback" not in out + err
    if code == 2:  # the ranks failed on the full disk before the cancel came in
        assert "already failed" in one_error_line(err)
    manifest = wait_final(rd, 60)
    assert manifest["status"] in FINAL_STATUSES
    assert "disk full on" in rd.manifest().status_line + str(manifest.get("failure")), manifest
    assert left_after(str(rd.path)) == 0


@pytest.mark.train                  # training() launches a run
@pytest.mark.timeout(300)
def test_a_dead_supervisors_run_on_a_full_disk_is_one_line_and_the_others_still_list(small_disk, capsys):
    from infra_runs import supervisor_process

    rd = training()
    supervisor_process(rd).kill()
    assert left_after(str(rd.path)) == 0
    fill(small_disk)
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 2 and f"disk full on {small_disk}" in one_error_line(err)
    code, out, err = run(capsys, "runs", "list")
    assert code == 0 and rd.id in out, out + err


def fill_to(disk, free: int) -> None:
    """Take all but about `free` bytes of the disk."""
    import shutil

    with open(disk / "filler", "wb") as fh:
        fh.truncate(0)
        fh.seek(0)
        left = shutil.disk_usage(disk).free - free
        block = b"\0" * 2**20
        while left > 0:
            fh.write(block[: min(len(block), left)])
            left -= len(block)
        fh.flush()
        os.fsync(fh.fileno())


def test_a_launch_onto_a_disk_without_room_to_record_itself_is_refused(small_disk, capsys):
    from charllm.engine.launch.launcher import MIN_FREE_BYTES

    fill_to(small_disk, MIN_FREE_BYTES // 2)
    code, out, err = run(capsys, "launch", "tiny-local", "--target", "local")
    line = one_error_line(err)
    assert code == 2 and f"disk full on {small_disk}" in line and "KiB free" in line, line
    runs = small_disk / "runs"
    assert not runs.exists() or list(runs.iterdir()) == [], "nothing was created"


def test_a_supervisor_without_room_for_its_reserve_starts_nothing_and_says_why(small_disk, capsys):
    """The disk filled between the launch's check and the supervisor's start: the run must not
    train to the end and then fail to record it (it once stayed `running`, `damaged` in lists)."""
    import subprocess
    import sys

    from charllm.engine.launch.launcher import RESERVE_BYTES
    from charllm.engine.launch.targets import LOCAL

    rd = RunDir.create(small_disk / "runs" / "20260101-000000-tiny-local", "launch")
    Experiment.load("tiny-local").save(rd.experiment_path)
    rd.logs_dir.mkdir()
    steps = [s.to_dict() for s in LOCAL.plan(Experiment.load("tiny-local"), rd.path, 29500)[0]]
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "pending", "target": LOCAL.to_dict(),
                       "steps": steps, "created_ns": 1})
    fill_to(small_disk, RESERVE_BYTES // 2)
    done = subprocess.run([sys.executable, "-m", "charllm.engine.launch.supervise", str(rd.path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    manifest = rd.read_manifest()
    assert manifest["status"] == "failed" and "nothing was started" in manifest["failure"], manifest
    assert rd.manifest().status_line == f"failed, disk full on {small_disk}"
    assert not rd.iterations_path.exists() and left_after(str(rd.path)) == 0
    code, out, err = run(capsys, "runs", "list")
    assert code == 0 and "failed, disk full on" in out, out + err   # (the list wraps the path)
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0 and f"status    failed, disk full on {small_disk}" in out, out + err


@pytest.mark.timeout(120)
def test_a_probe_only_run_stopped_by_a_full_disk_says_so_in_its_status(small_disk, capsys):
    import sys

    from infra_runs import finish, start, wait_for

    out_dir = small_disk / "runs" / "probe-run"
    (small_disk / "runs").mkdir()
    proc = start([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--sim-gpus", "8", "--hz", "50",
                  "--out", str(out_dir)])
    rd = RunDir(out_dir)
    wait_for(lambda: rd.manifest().sampler and rd.telemetry_files(), 60, "the probe to record")
    fill(small_disk)
    code, _, err = finish(proc, 60)
    assert code == 2 and "disk full" in err, err
    assert rd.manifest().status_line == f"failed, disk full on {small_disk}", rd.read_manifest()
    code, out, err = run(capsys, "runs", "show", str(out_dir))
    assert code == 0 and f"status    failed, disk full on {small_disk}" in out, out + err
