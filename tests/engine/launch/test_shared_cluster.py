"""A runs directory shared by login nodes, kept across reboots: a reader never signals what is not
the run's (issue 24). Each case plants a manifest naming processes that are not the run's (victims
the test started) and runs every command that reads runs; the victims must all live. A positive
control, a record that does name a victim exactly, shows the same commands do stop what is the
run's. Another login node is a PID namespace (and a UTS namespace with another host name)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from charllm.engine.launch.launcher import launch
from charllm.engine.launch.targets import LOCAL, parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.core import procid
from charllm.probes.store.rundir import RunDir
from infra_cli import one_error_line, run
from infra_runs import iterations_logged, left_after, logs, run_processes, wait_for
from infra_slurm import slurm_cluster  # noqa: F401 - fixture
from infra_ssh import ssh_nodes  # noqa: F401 - fixture

READERS = (("runs", "list"), ("runs", "show", "{run}"), ("runs", "cancel", "{run}"), ("runs", "delete", "{run}"))
SIGNALLED: list[str] = []   # victims found dead, by case: the figure the issue asks for (must stay empty)


@pytest.fixture
def victims():
    """Start `sleep` processes, each leading a session of its own (as a run's step does)."""
    started = []

    def make(n: int = 1) -> list[psutil.Process]:
        for _ in range(n):
            started.append(subprocess.Popen(["sleep", "600"], start_new_session=True))
        return [psutil.Process(p.pid) for p in started[-n:]]

    yield make
    for p in started:
        p.kill()
        p.wait()


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def plant(runs, run_id: str, **manifest) -> RunDir:
    """A run directory whose manifest says it runs, owned by a supervisor that is gone."""
    rd = RunDir.create(runs / run_id, "launch")
    rd.write_manifest({"id": run_id, "kind": "train", "status": "running", "created_ns": time.time_ns(),
                       "target": LOCAL.to_dict(), "supervisor": {"pid": 999999, "create_time": 1.0},
                       **manifest})
    return rd


def read_everything(rd: RunDir) -> list[tuple[int, str, str]]:
    """Every reader, each in a session of its own: a reader that signalled its own group would
    end only itself, and the victims' check below would still tell."""
    outcomes = []
    for argv in READERS:
        done = subprocess.run([sys.executable, "-m", "charllm.tui", *(w.format(run=rd.id) for w in argv)],
                              capture_output=True, text=True, timeout=120, start_new_session=True)
        outcomes.append((done.returncode, done.stdout, done.stderr))
    return outcomes


def count_dead(case: str, procs) -> int:
    dead = [p for p in procs if not alive(p)]
    SIGNALLED.extend(f"{case}: pid {p.pid}" for p in dead)
    return len(dead)


# --------------------------------------------------------------------------------------------
# This host: planted records that look like a run's but are not
# --------------------------------------------------------------------------------------------
def _planted_here(victim: psutil.Process) -> dict[str, dict]:
    real = procid.identify(victim.pid)
    return {
        # the reproduction: no start time, no place
        "pid and pgid only": {"processes": [{"pid": victim.pid, "pgid": victim.pid}]},
        # the pid was reused: the recorded leader started earlier than the process with that pid now
        "pid reused": {"processes": [{**real, "create_time": real["create_time"] - 7.0, "pgid": victim.pid}]},
        # recorded before a reboot: the ids of another boot mean nothing now
        "before a reboot": {"supervisor": {**real, "boot_id": "00000000-0000-0000-0000-000000000000"},
                            "processes": [{**real, "boot_id": "00000000-0000-0000-0000-000000000000",
                                           "pgid": victim.pid}]},
        # a record from another host's pids
        "another host": {"processes": [{**real, "host": "login2.example", "pgid": victim.pid}]},
    }


@pytest.mark.parametrize("case", ["pid and pgid only", "pid reused", "before a reboot", "another host"])
def test_a_reader_never_signals_a_planted_process(case, victims, charllm_dirs, capsys):
    victim, = victims(1)
    rd = plant(charllm_dirs["runs"], "20260101-000000-planted", **_planted_here(victim)[case])
    outcomes = read_everything(rd)
    time.sleep(0.5)   # (a signal is delivered asynchronously)
    assert count_dead(case, [victim]) == 0, outcomes
    for code, out, err in outcomes:
        assert "Traceback" not in out + err


def test_groups_that_stand_for_everyone_are_never_signalled(monkeypatch):
    """1 is init's group (`kill -- -1` is every process the user may signal), 0 the caller's own,
    negative ones not groups at all. Sending them is never safe to try, so the call is recorded."""
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append(pgid))
    here = {**procid.identify(os.getpid())}
    for pgid in (1, 0, -1, -os.getpid(), True, "7", None):
        record = {**here, "pid": pgid, "pgid": pgid}
        assert procid.group_leader(record) is None and not procid.signal_group(record, 15)
    assert sent == []
    assert procid.remote_signal_line({"remote_pgid": 1, "remote_boot_id": procid.boot_id() or "0" * 8,
                                      "remote_start": 1}, "TERM") is None
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)   # the control: a group that is vouched for
    try:
        assert procid.group_leader({**procid.identify(leader.pid), "pgid": leader.pid}).pid == leader.pid
    finally:
        leader.kill()
        leader.wait()


def test_a_record_that_does_name_the_process_is_stopped(victims, charllm_dirs, capsys):
    """The positive control: the same readers stop what the run recorded exactly, so the test
    above would see a signal."""
    victim, = victims(1)
    rd = plant(charllm_dirs["runs"], "20260101-000000-control",
               processes=[{**procid.identify(victim.pid), "pgid": victim.pid}])
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0 and "failed" in out, out + err
    wait_for(lambda: not alive(victim), 15, "the recorded process to be stopped")


# --------------------------------------------------------------------------------------------
# Another login node: a PID namespace (and another host name) sharing the runs directory
# --------------------------------------------------------------------------------------------
def _elsewhere(argv: list[str], uts: bool = False) -> subprocess.CompletedProcess:
    """`charllm-tui ARGV` from another PID namespace (as another login node sees the runs
    directory: none of its pids); with `uts`, also under another host name."""
    cli = [sys.executable, "-m", "charllm.tui", *argv]
    if uts:
        line = "hostname login2.example && exec " + " ".join(map(_quote, cli))
        wrapped = ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", line]
    else:
        wrapped = ["unshare", "--pid", "--fork", "--mount-proc", *cli]
    return subprocess.run(wrapped, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)


def _namespaces_reason() -> str | None:
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    done = subprocess.run(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return None if done.returncode == 0 else f"cannot make PID namespaces here: {done.stderr.decode().strip()}"


@pytest.mark.train
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_another_login_node_sees_a_live_run_as_running_elsewhere(charllm_dirs):
    reason = _namespaces_reason()
    if reason:
        pytest.skip(reason)
    exp = Experiment.load("tiny-local")
    exp.training.train_iters = 100_000
    rd = RunDir(launch(exp, LOCAL).run_dir)
    try:
        wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
        before = {p.pid for p in run_processes(rd.id)}
        for uts in (False, True):
            listed = _elsewhere(["runs", "list"], uts)
            assert listed.returncode == 0, listed.stderr
            here = procid.place()["host"]   # the run's host, as a reader elsewhere names it
            where = here if uts else f"{here} in another PID namespace"
            row = [line for line in listed.stdout.splitlines() if rd.id in line]
            assert row and "running on" in row[0] and "visible" in listed.stdout, listed.stdout   # (the status wraps)
            shown = _elsewhere(["runs", "show", rd.id], uts)
            assert shown.returncode == 0, shown.stderr
            assert f"status    running on {where} (not visible from here)" in shown.stdout, shown.stdout
            cancelled = _elsewhere(["runs", "cancel", rd.id], uts)
            assert cancelled.returncode == 2 and "cancel it there" in one_error_line(cancelled.stderr)
            deleted = _elsewhere(["runs", "delete", rd.id], uts)
            assert deleted.returncode == 2 and "cancel it first" in one_error_line(deleted.stderr)
        assert rd.status == "running", rd.read_manifest()
        now = {p.pid for p in run_processes(rd.id)}
        assert before <= now, f"processes of the live run ended: {before - now}"
        SIGNALLED.extend(f"another login node: pid {pid}" for pid in before - now)
        first = iterations_logged(rd)
        wait_for(lambda: iterations_logged(rd) > first, 120, "training to go on")
    finally:
        from charllm.engine.launch.launcher import cancel

        status = cancel(rd)
    assert status == "cancelled" and left_after(rd.id) == 0


# --------------------------------------------------------------------------------------------
# SSH: a planted remote group is never signalled on the node
# --------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_reader_never_signals_a_planted_remote_group(ssh_nodes, charllm_dirs, capsys):
    table = ssh_nodes.target_table()
    target = parse_target("nodes", table)
    host = ssh_nodes.hosts[0]
    # A victim on the node, started as a run's step is: it prints its group's identity first.
    client = subprocess.Popen(target.ssh_argv(host) + [target.in_process_group(["sleep", "600"])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        real = procid.parse_remote_identity(client.stdout.readline())
        assert real, "the remote step printed its identity"

        def remote_alive() -> bool:
            done = subprocess.run(target.ssh_argv(host) + [f"kill -0 -- -{real['remote_pgid']}"], capture_output=True)
            return done.returncode == 0

        planted = [
            {"host": host, "remote_pgid": 1},                                     # the reproduction
            {"remote_host": host, "remote_pgid": 1, "remote_boot_id": real["remote_boot_id"], "remote_start": 1},
            {"remote_host": host, **real, "remote_start": real["remote_start"] - 100},   # pid reused there
            {"remote_host": host, **real, "remote_boot_id": "00000000-0000-0000-0000-000000000000"},  # rebooted
            {"remote_host": "not-a-node-of-the-target", **real},
        ]
        rd = plant(charllm_dirs["runs"], "20260101-000000-ssh", target=target.to_dict(), processes=planted)
        outcomes = read_everything(rd)
        time.sleep(1)
        if not remote_alive():
            SIGNALLED.append("ssh: remote victim")
        assert remote_alive(), f"the node's victim was signalled: {outcomes}"
        # the positive control: the exact record is stopped
        control = plant(charllm_dirs["runs"], "20260101-000001-ssh", target=target.to_dict(),
                        processes=[{"remote_host": host, **real}])
        run(capsys, "runs", "show", control.id)
        wait_for(lambda: not remote_alive(), 30, "the recorded remote group to be stopped")
    finally:
        client.kill()
        client.wait()


# --------------------------------------------------------------------------------------------
# Slurm: a planted job id is never cancelled unless it is the run's job
# --------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_reader_never_cancels_a_planted_slurm_job(slurm_cluster, charllm_dirs, capsys):
    def submit(name: str) -> str:
        done = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "--output=/dev/null", "--wrap",
                               "sleep 600"], capture_output=True, text=True, env=slurm_cluster.env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def state(job: str) -> str:
        return slurm_cluster.scontrol("show", "job", "-o", job).split("JobState=")[1].split()[0]

    victim = submit("someone-elses-job")
    other_run = submit("charllm-20260101-000009-another-run")
    wait_for(lambda: state(victim) == "RUNNING" and state(other_run) == "RUNNING", 60, "the jobs to run")
    slurm = {"name": "cluster", "kind": "slurm"}

    def job_of(job: str, old: bool) -> dict:
        """The manifest fields naming the run's job: the target's record of it, or as manifests
        before it kept it (top-level slurm_job_id, still read)."""
        return {"target": slurm, "slurm_job_id": job} if old else {"target": {**slurm, "run": {"job_id": job}}}

    for old in (False, True):
        for n, job in enumerate((victim, other_run)):
            rd = plant(charllm_dirs["runs"], f"20260101-00000{n}-slurm{'-old' * old}", **job_of(job, old))
            read_everything(rd)
        for bad in ("--user=root", "-1", "1 2"):
            rd = plant(charllm_dirs["runs"], f"20260101-00001{len(bad)}-slurm{'-old' * old}", **job_of(bad, old))
            read_everything(rd)
    time.sleep(1)
    SIGNALLED.extend(f"slurm: job {job}" for job in (victim, other_run) if state(job) != "RUNNING")
    assert state(victim) == "RUNNING" and state(other_run) == "RUNNING"
    # the positive control: the run's own job (named after it) is cancelled, in either manifest
    for run_id, old in (("20260101-000002-slurm", False), ("20260101-000003-slurm-old", True)):
        own = submit(f"charllm-{run_id}")
        wait_for(lambda: state(own) == "RUNNING", 60, "the job to run")
        rd = plant(charllm_dirs["runs"], run_id, **job_of(own, old))
        code, out, _ = run(capsys, "runs", "show", rd.id)
        assert f"target    cluster (slurm job {own}" in out, out
        wait_for(lambda: state(own) in ("CANCELLED", "COMPLETING"), 30, "the run's own job to be cancelled")


def test_the_figure_is_printed_at_the_end():
    """The issue's figure: processes signalled that were not the run's (all cases above)."""
    print(f"\nprocesses signalled that were not the run's: {len(SIGNALLED)} {SIGNALLED}")
    assert SIGNALLED == []


def test_a_supervisor_deleted_under_its_feet_writes_no_stub_manifest(charllm_dirs):
    """`runs delete` of a run (from a reader who thought it dead) and then a late write by its
    supervisor: the directory stays gone, no manifest saying "completed" appears."""
    rd = RunDir.create(charllm_dirs["runs"] / "20260101-000000-gone", "launch")
    rd.write_manifest({"id": rd.id, "status": "completed"})
    shutil.rmtree(rd.path)
    with pytest.raises(FileNotFoundError):
        rd.update_manifest(status="completed")
    assert not rd.path.exists()
