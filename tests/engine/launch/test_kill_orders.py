"""Whoever dies first, nothing a local run started is left running, and the status says what
happened: real torchrun training, the real sampler and supervisor, killed in each order."""

from __future__ import annotations

import signal

import pytest

from charllm.engine.launch.launcher import cancel, launch, reconcile
from charllm.engine.launch.targets import LOCAL
from charllm.engine.model.experiment import Experiment
from charllm.probes.store.rundir import RunDir
from infra_cli import run
from infra_runs import (
    iterations_logged,
    left_after,
    logs,
    rank_process,
    role_process,
    run_processes,
    supervisor_process,
    wait_final,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.train]   # they launch training (torchrun)


def alive(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def started(iters: int = 100_000, **telemetry) -> RunDir:
    exp = Experiment.load("tiny-local")
    exp.training.train_iters = iters
    for name, value in telemetry.items():
        setattr(exp.telemetry, name, value)
    rd = RunDir(launch(exp, LOCAL).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 240, f"the first iteration\n{logs(rd)}")
    return rd


@pytest.mark.timeout(300)
def test_killed_torchrun_takes_its_ranks_along():
    """torch starts ranks in sessions of their own: killpg of torchrun's group misses them."""
    rd = started()
    ranks = [rank_process(str(rd.path), r) for r in (0, 1)]
    role_process(str(rd.path), "torch.distributed.run").kill()
    manifest = wait_final(rd, 60)
    assert manifest["status"] == "failed" and "SIGKILL" in manifest["failure"], manifest.get("failure")
    assert left_after(str(rd.path)) == 0
    assert not any(alive(r) for r in ranks)


@pytest.mark.timeout(300)
def test_killed_supervisor_takes_everything_along_and_the_next_reader_finishes_the_run(capsys):
    rd = started()
    supervisor_process(rd).kill()
    assert left_after(str(rd.path)) == 0, "the sampler, torchrun and both ranks die with the supervisor"
    assert rd.status == "running"  # nobody has looked yet
    code, out, err = run(capsys, "runs", "list")
    assert code == 0 and rd.id in out and "failed" in out, out + err
    manifest = rd.read_manifest()
    assert manifest["status"] == "failed" and "the supervisor died" in manifest["failure"]
    code, out, err = run(capsys, "runs", "cancel", rd.id)
    assert code == 2 and "already failed" in err, "a finished run is never recorded as cancelled later"


@pytest.mark.timeout(300)
def test_cancel_stops_a_rank_that_does_not_answer_sigterm():
    """A rank stuck (here: stopped) ignores the SIGTERM torchrun forwards; it still goes."""
    rd = started()
    stuck = rank_process(str(rd.path), 1)
    stuck.send_signal(signal.SIGSTOP)
    assert cancel(rd) == "cancelled"
    assert left_after(str(rd.path)) == 0
    assert not alive(stuck)


@pytest.mark.timeout(300)
def test_a_dead_sampler_is_told_in_the_status():
    rd = started(iters=40)
    role_process(str(rd.path), "charllm.probes").kill()
    manifest = wait_final(rd, 240)
    assert manifest["status"] == "completed", logs(rd)
    line = rd.manifest().status_line
    assert line.startswith("completed, telemetry lost at ") and "SIGKILL" in manifest["telemetry_lost"][0]["reason"]
    assert left_after(str(rd.path)) == 0


def probe_here(out_dir):
    """A probe-only run on this machine (`python -m charllm.probes --out DIR`), once it recorded."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "charllm.probes", "--backend", "host", "--out", str(out_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rd = RunDir(out_dir)
    wait_for(lambda: rd.manifest().sampler and rd.telemetry_files(), 60, "the probe to record")
    return proc, rd


@pytest.mark.timeout(120)
def test_a_killed_probe_only_run_is_finished_by_the_next_reader(tmp_path, capsys):
    out_dir = tmp_path / "probe-run"
    proc, rd = probe_here(out_dir)
    proc.kill()
    proc.wait()
    assert rd.status == "running"
    assert reconcile(rd) == "failed"
    assert "the sampler died" in rd.read_manifest()["failure"]
    code, out, _ = run(capsys, "runs", "show", str(out_dir))
    assert code == 0 and "status    failed" in out


@pytest.mark.timeout(120)
def test_runs_cancel_stops_a_probe_only_run(tmp_path, capsys):
    """It once recorded `cancelled` after 20 s of waiting for a supervisor, the sampler still running."""
    out_dir = tmp_path / "probe-run"
    proc, rd = probe_here(out_dir)
    code, out, err = run(capsys, "runs", "cancel", str(out_dir))
    assert code == 0 and "cancelled" in out, out + err
    assert proc.wait(timeout=15) == 0, "the sampler stopped cleanly when asked"
    assert left_after(str(out_dir)) == 0
    assert rd.read_manifest()["status"] == "cancelled"
    assert rd.scan_telemetry().collect().height > 0, "its last chunk was closed"


def test_a_probe_recorded_on_another_host_is_judged_there(tmp_path):
    """Its pid means nothing here (a compute node's probe on a shared filesystem): the status is
    left to that host, and a cancel says where to stop it."""
    from charllm.probes.core.errors import UserError

    rd = RunDir.create(tmp_path / "remote-probe", "probe")
    rd.write_manifest({"id": rd.id, "kind": "probe", "status": "running",
                       "sampler": {"pid": 1, "create_time": 0.0, "host": "node-elsewhere"}})
    assert reconcile(rd) == "running"
    with pytest.raises(UserError, match="runs on node-elsewhere, not visible from here; stop it there"):
        cancel(rd)
    assert rd.status == "running"


@pytest.mark.timeout(300)
def test_simultaneous_launches_both_start_and_keep_their_own_directories():
    """Two launches of one experiment in the same second want the same run id: the loser takes
    the next name instead of failing (and its cleanup once removed the winner's directory)."""
    import threading

    for _ in range(2):
        barrier, results, errors = threading.Barrier(2), [], []

        def one():
            barrier.wait()
            try:
                results.append(launch(Experiment.load("tiny-local"), LOCAL).run_dir)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(set(results)) == 2, (errors, results)
        for path in results:
            rd = RunDir(path)
            assert rd.manifest_path.is_file() and rd.experiment_path.is_file()
            if cancel_if_running(rd):
                assert left_after(str(rd.path)) == 0


def cancel_if_running(rd: RunDir) -> bool:
    from charllm.probes.core.errors import UserError

    try:
        cancel(rd)
    except UserError:  # it ended first
        pass
    return True


def test_a_run_whose_supervisor_never_started_is_finished_by_the_next_reader(charllm_dirs, capsys):
    """Killed before it recorded itself (or unable to start), it left the run `pending` forever."""
    import time

    rd = RunDir.create(charllm_dirs["runs"] / "20260101-000000-tiny-local", "launch")
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "pending", "target": LOCAL.to_dict(),
                       "created_ns": time.time_ns()})
    assert reconcile(rd) == "pending", "a launch hands the run over within moments"
    rd.update_manifest(created_ns=time.time_ns() - 120 * 10**9)
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0 and "status    failed" in out and "the supervisor died before it started the run" in out, out + err


@pytest.mark.timeout(120)
def test_cancel_stops_a_supervisor_that_has_not_recorded_itself_yet(charllm_dirs):
    """On a loaded machine a supervisor can take longer to start than cancel waits for its record:
    cancel recorded `cancelled`, and the supervisor then started the whole run. It is found by its
    command line instead (here a stand-in that never records itself)."""
    import subprocess
    import sys
    import time

    from charllm.probes.core import procid

    rd = RunDir.create(charllm_dirs["runs"] / "20260101-000000-tiny-local", "launch")
    token = procid.write_token(rd.path)
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "pending", "target": LOCAL.to_dict(),
                       "created_ns": time.time_ns()})
    argv = [sys.executable, "-c", "import time; time.sleep(100)", "-m", "charllm.engine.launch.supervise", str(rd.path)]
    slow = subprocess.Popen(argv, env=procid.run_environment(token, rd.id))   # as launch starts it
    namesake = subprocess.Popen(argv)   # the same command line without the run's token: not the run's
    try:
        assert cancel(rd) == "cancelled"
        assert slow.wait(timeout=10) == -signal.SIGTERM, "the supervisor was stopped before it started anything"
        assert namesake.poll() is None, "a process with the supervisor's command line but not its token lives on"
    finally:
        for proc in (slow, namesake):
            proc.kill()
            proc.wait()


@pytest.mark.timeout(300)
def test_killed_doctor_takes_its_train_check_along(tmp_path):
    """`doctor --train` starts torchrun and its ranks (in a temporary directory, not a run): a
    SIGKILL of doctor leaves none of them."""
    import os
    import subprocess
    import sys

    marker = str(tmp_path / "tmp")
    os.mkdir(marker)
    doctor = subprocess.Popen([sys.executable, "-m", "charllm.tui", "doctor", "--train", "--iters", "100000",
                               "--sample-seconds", "0.5"], env={**os.environ, "TMPDIR": marker},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any("charllm.engine.workload.train" in p.cmdline() for p in run_processes(marker)), 180,
                 "the train check's ranks")
        doctor.kill()
        doctor.wait()
        assert left_after(marker) == 0
    finally:
        doctor.kill()
        for proc in run_processes(marker):
            proc.kill()


def test_follow_returns_only_once_the_supervisor_has_exited(tmp_path, capsys):
    """After the final status the supervisor keeps the run's summaries, then exits: `launch --follow`
    (and `runs logs -f`) return only then, so nothing of the run outlives them."""
    import subprocess
    import sys

    import psutil

    from charllm.engine.launch.launcher import wait_for_supervisor
    from charllm.tui.commands.launch import follow

    rd = RunDir.create(tmp_path / "20260101-000000-finishing", "launch")
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "completed", "world_size": 1,
                       "target": {"name": "local", "kind": "local"}})
    rd.logs_dir.mkdir()
    finishing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])   # a supervisor still at work
    rd.update_manifest(supervisor={"pid": finishing.pid, "create_time": psutil.Process(finishing.pid).create_time()})
    try:
        assert wait_for_supervisor(rd, timeout=0.2) is False
        assert follow(rd.path) == 0
        assert finishing.poll() == 0, "follow returned while the supervisor was still running"
        assert wait_for_supervisor(rd, timeout=0) is True
    finally:
        finishing.kill()
        finishing.wait()
