"""A runs directory shared by login nodes, kept across reboots: nothing is signalled that is not
the run's (issues 24 and 35). Each case plants a manifest naming processes that are not the run's
(victims the test started), with made-up identities or with the victims' true ones copied from /proc
(a forged identity), and runs every command that reads runs, and cancel; the victims must all
live. Readers never signal at all; `runs cancel` signals only what carries the run's token. A
positive control, a process that does carry the run's token, shows that cancel does stop what is
the run's, and readers still do not. Another login node is a PID namespace (and a UTS namespace
with another host name)."""

from __future__ import annotations

import json
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

READERS = (("runs", "list"), ("runs", "show", "{run}"), ("runs", "logs", "{run}"), ("runs", "cancel", "{run}"),
           ("runs", "delete", "{run}"))
CAMPAIGN_READERS = (("campaign", "list"), ("campaign", "status", "{name}"), ("campaign", "summary", "{name}"),
                    ("campaign", "report", "{name}"), ("campaign", "cancel", "{name}"))
SIGNALLED: list[str] = []   # victims found dead, by case: the figure the issue asks for (must stay empty)


@pytest.fixture
def victims():
    """Start `sleep` processes, each leading a session of its own (as a run's step does); with
    `token`, carrying that run token in their environment (as the run's own processes do)."""
    started = []

    def make(n: int = 1, token: str | None = None) -> list[psutil.Process]:
        env = procid.run_environment(token) if token else None
        for _ in range(n):
            started.append(subprocess.Popen(["sleep", "600"], start_new_session=True, env=env))
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


def read_everything(rd: RunDir, ref: str | None = None, readers=READERS) -> list[tuple[int, str, str]]:
    """Every reader (and cancel), each in a session of its own: a reader that signalled its own
    group would end only itself, and the victims' check below would still tell. `ref`: how the
    commands name the run (its id, or a path)."""
    outcomes = []
    for argv in readers:
        words = [w.format(run=ref or rd.id, name=ref) for w in argv]
        done = subprocess.run([sys.executable, "-m", "charllm.tui", *words], capture_output=True, text=True,
                              timeout=180, start_new_session=True)
        outcomes.append((done.returncode, done.stdout, done.stderr))
        assert "Traceback" not in done.stdout + done.stderr, (words, done.stderr)
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
        "pid reused": {"processes": [{**real, "create_time": real["create_time"] - 7.0,
                                      "start_ticks": real["start_ticks"] - 700, "pgid": victim.pid}]},
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


def test_a_process_is_known_by_its_start_since_boot_when_the_wall_clock_moves():
    """psutil's create_time adds /proc/stat's boot time, whole seconds worked out from the wall clock:
    a clock slewed across a second moves every process's create_time by 1 s (once, a freshly started
    leader read so in CI and could not be vouched for). The start in ticks since boot does not move;
    a record without it (made before) is judged by create_time as before."""
    token = procid.new_token()
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True, env=procid.run_environment(token))
    try:
        record = {**procid.identify(leader.pid), "pgid": leader.pid}
        assert record["start_ticks"] == procid.start_ticks(leader.pid) > 0
        moved = {**record, "create_time": record["create_time"] - 1.0}    # the boot time read a second later
        assert procid.group_leader(moved, token).pid == leader.pid
        assert procid.group_leader({**record, "start_ticks": record["start_ticks"] - 1}, token) is None
        older = {k: v for k, v in record.items() if k != "start_ticks"}
        assert procid.group_leader(older, token).pid == leader.pid and procid.group_leader(
            {**older, "create_time": older["create_time"] - 1.0}, token) is None
    finally:
        leader.kill()
        leader.wait()


def test_groups_that_stand_for_everyone_are_never_signalled(monkeypatch):
    """1 is init's group (`kill -- -1` is every process the user may signal), 0 the caller's own,
    negative ones not groups at all. Sending them is never safe to try, so the call is recorded."""
    sent = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append(pgid))
    here = {**procid.identify(os.getpid())}
    token = procid.new_token()
    for pgid in (1, 0, -1, -os.getpid(), True, "7", None):
        record = {**here, "pid": pgid, "pgid": pgid}
        assert procid.group_leader(record, token) is None and not procid.signal_group(record, 15, token)
    assert sent == []
    assert procid.remote_signal_line({"remote_pgid": 1, "remote_boot_id": procid.boot_id() or "0" * 8,
                                      "remote_start": 1}, "TERM") is None
    # the control: a group that is vouched for, once its leader carries the token
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True, env=procid.run_environment(token))
    try:
        record = {**procid.identify(leader.pid), "pgid": leader.pid}
        assert procid.group_leader(record, token).pid == leader.pid
        assert procid.group_leader(record, procid.new_token()) is None, "another run's token proves nothing"
        assert procid.group_leader(record, None) is None, "no token, no proof"
    finally:
        leader.kill()
        leader.wait()


def _forged(victim: psutil.Process) -> dict[str, dict]:
    """Manifests that name the victim by its true identity, as anyone can read it from /proc."""
    real = {**procid.identify(victim.pid), "pgid": victim.pid, "node": "n1", "role": "train"}
    dead = {**procid.identify(os.getpid()), "pid": 999_999, "create_time": 1.0}
    return {
        # the reproduction: running, a dead supervisor, the victim among its processes
        "a process of a dead supervisor": {"supervisor": dead, "processes": [real]},
        # the victim named as the supervisor itself (cancel would SIGTERM it)
        "the supervisor": {"supervisor": real, "processes": [real]},
        # a supervisor that never recorded itself, launched long ago from here
        "no supervisor yet": {"launched_from": procid.place(), "created_ns": 1, "processes": [real]},
        # a probe-only run whose sampler is the victim
        "a probe's sampler": {"kind": "probe", "sampler": real},
    }


FORGED = ["a process of a dead supervisor", "the supervisor", "no supervisor yet", "a probe's sampler"]


@pytest.mark.parametrize("token_file", [False, True], ids=["no token file", "a token file of its own"])
@pytest.mark.parametrize("case", FORGED)
def test_a_forged_identity_is_never_signalled(case, token_file, victims, charllm_dirs):
    """The victim's true identity (host, boot, namespace, start time: all readable by anyone) in a
    manifest of the user's own, with or without a token file the forger made: neither the readers
    nor `runs cancel` signal it (the victim carries no token of the run)."""
    victim, = victims(1)
    rd = plant(charllm_dirs["runs"], f"20260101-000000-forged-{int(token_file)}", **_forged(victim)[case])
    if token_file:
        procid.write_token(rd.path)
    outcomes = read_everything(rd)
    time.sleep(0.5)   # (a signal is delivered asynchronously)
    assert count_dead(f"forged: {case}, {'with' if token_file else 'without'} a token file", [victim]) == 0, outcomes


@pytest.mark.parametrize("place", ["outside the runs directory", "in the runs directory, without a marker"])
def test_a_forged_run_found_by_path_is_never_signalled(place, victims, charllm_dirs, tmp_path):
    """`runs show /any/path` of a directory holding a marker, and a run in the runs directory with
    no marker at all (as runs made before the marker are): read, never acted on against a victim."""
    victim, = victims(1)
    fields = _forged(victim)["a process of a dead supervisor"]
    if place == "outside the runs directory":
        rd = RunDir.create(tmp_path / "elsewhere" / "20260101-000000-forged", "launch")
        ref = str(rd.path)
    else:
        rd = RunDir(charllm_dirs["runs"] / "20260101-000000-forged")
        rd.path.mkdir(parents=True)
        ref = rd.id
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "running", "created_ns": time.time_ns(),
                       "target": LOCAL.to_dict(), **fields})
    procid.write_token(rd.path)
    outcomes = read_everything(rd, ref)
    time.sleep(0.5)
    assert count_dead(f"forged, found by path: {place}", [victim]) == 0, outcomes


def test_a_forged_campaign_record_is_never_acted_on(victims, charllm_dirs):
    """A planted campaign record: its supervisor the victim's true identity, its member's run a
    planted run naming another victim. Every campaign reader, and cancel, leave both alive."""
    from charllm.engine.campaign.state import directory

    supervisor, member = victims(2)
    rd = plant(charllm_dirs["runs"], "20260101-000000-member", **_forged(member)["a process of a dead supervisor"])
    procid.write_token(rd.path)
    folder = directory("forged")
    folder.mkdir(parents=True)
    procid.write_token(folder)
    real = {**procid.identify(supervisor.pid), "pgid": supervisor.pid}
    record = {"name": "forged", "source": "forged", "description": "", "target": LOCAL.to_dict(), "max_parallel": 1,
              "time_limit_s": None, "include_oom": False, "status": "running", "created_ns": 1, "started_ns": 1,
              "ended_ns": None, "supervisor": real,
              "members": [{"index": 0, "key": "k", "name": "tiny-local", "base": "tiny-local", "model": "tiny",
                           "hardware": "cpu", "layout": "TP1 PP1 DP2", "variant": "base", "micro_batch_size": 1,
                           "varied": {}, "verdict": "fits", "reason": "", "planned": None, "status": "running",
                           "run": rd.id, "runs": [], "failure": None, "started_ns": 1, "ended_ns": None}]}
    (folder / "campaign.json").write_text(json.dumps(record))
    outcomes = read_everything(rd, "forged", CAMPAIGN_READERS)
    time.sleep(0.5)
    assert count_dead("forged campaign: supervisor and member", [supervisor, member]) == 0, outcomes


def test_what_carries_the_run_token_is_stopped_by_cancel_only(victims, charllm_dirs, capsys):
    """The positive control: a process that is the run's (it carries the run's token), left by a
    supervisor that died. The readers record the run failed and name it, and signal nothing;
    `runs cancel` then stops it, and the run keeps its status."""
    rd = plant(charllm_dirs["runs"], "20260101-000000-control")
    token = procid.write_token(rd.path)
    own, = victims(1, token)
    rd.update_manifest(processes=[{**procid.identify(own.pid), "pgid": own.pid, "node": "n1", "role": "train"}])
    code, out, err = run(capsys, "runs", "show", rd.id)
    assert code == 0 and "status    failed" in out and f"train@n1 (pid {own.pid})" in out, out + err
    assert "runs cancel" in out, "the status says how to stop what was left"
    for argv in READERS[:3]:
        run(capsys, *(w.format(run=rd.id) for w in argv))
    time.sleep(0.5)
    assert alive(own), "a reader never signals, not even the run's own process"
    code, out, err = run(capsys, "runs", "cancel", rd.id)
    assert code == 1 and "failed" in out, out + err
    wait_for(lambda: not alive(own), 15, "the run's own process to be stopped by cancel")
    manifest = rd.read_manifest()
    assert manifest["status"] == "failed" and "stopped" in manifest["note"], manifest


def test_a_manifest_someone_else_could_write_is_only_read(victims, charllm_dirs, capsys):
    """A runs directory writable by its group: a manifest there may be anyone's, so nothing in it is
    acted on, not even what carries a token, and cancel says why in one line."""
    rd = plant(charllm_dirs["runs"], "20260101-000000-shared")
    token = procid.write_token(rd.path)
    own, = victims(1, token)
    rd.update_manifest(processes=[{**procid.identify(own.pid), "pgid": own.pid}])
    os.chmod(charllm_dirs["runs"], 0o775)
    try:
        code, out, err = run(capsys, "runs", "show", rd.id)
        assert code == 0 and "status    running" in out, "an untrusted manifest is not settled either"
        code, out, err = run(capsys, "runs", "cancel", rd.id)
        assert code == 2 and "may be written by its group" in one_error_line(err) and "chmod go-w" in err
        time.sleep(0.5)
        assert alive(own)
    finally:
        os.chmod(charllm_dirs["runs"], 0o755)


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
    if reason:   # a kernel feature, not a daemon tests/run.sh installs: skipped even where daemons are required
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
def _remote_group(target, host: str, token: str):
    """A group on the node started as a run's step is (it carries `token`); (its ssh client, its
    identity there as it printed it, whether it still lives)."""
    from charllm.engine.launch.ssh import give_token

    client = subprocess.Popen(target.ssh_argv(host) + [target.in_process_group(["sleep", "600"])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    give_token(client, token)
    real = procid.parse_remote_identity(client.stdout.readline())
    assert real, "the remote step printed its identity"

    def remote_alive() -> bool:
        done = subprocess.run(target.ssh_argv(host) + [f"kill -0 -{real['remote_pgid']}"], capture_output=True)
        return done.returncode == 0
    return client, real, remote_alive


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_reader_never_signals_a_planted_remote_group(ssh_nodes, charllm_dirs, capsys):
    table = ssh_nodes.target_table()
    target = parse_target("nodes", table)
    host = ssh_nodes.hosts[0]
    clients = []
    try:
        # A victim on the node: another run's step (it carries that run's token, not this one's).
        client, real, remote_alive = _remote_group(target, host, procid.new_token())
        clients.append(client)
        planted = [
            {"host": host, "remote_pgid": 1},                                     # the reproduction
            {"remote_host": host, "remote_pgid": 1, "remote_boot_id": real["remote_boot_id"], "remote_start": 1},
            {"remote_host": host, **real, "remote_start": real["remote_start"] - 100},   # pid reused there
            {"remote_host": host, **real, "remote_boot_id": "00000000-0000-0000-0000-000000000000"},  # rebooted
            {"remote_host": "not-a-node-of-the-target", **real},
            {"remote_host": host, **real, "node": host, "role": "train"},      # its true identity: forged
        ]
        rd = plant(charllm_dirs["runs"], "20260101-000000-ssh", target=target.to_dict(), processes=planted)
        procid.write_token(rd.path)
        outcomes = read_everything(rd)
        time.sleep(1)
        if not remote_alive():
            SIGNALLED.append("ssh: remote victim")
        assert remote_alive(), f"the node's victim was signalled: {outcomes}"
        # the positive control: the run's own group (it carries the run's token) is left alone by the
        # readers, and stopped by cancel
        control = plant(charllm_dirs["runs"], "20260101-000001-ssh", target=target.to_dict())
        own_client, own, own_alive = _remote_group(target, host, procid.write_token(control.path))
        clients.append(own_client)
        control.update_manifest(processes=[{"remote_host": host, **own, "node": host, "role": "train"}])
        code, out, _ = run(capsys, "runs", "show", control.id)
        assert code == 0 and "status    failed" in out, out
        time.sleep(1)
        assert own_alive(), "a reader never signals"
        code, out, err = run(capsys, "runs", "cancel", control.id)
        assert code == 1, out + err
        wait_for(lambda: not own_alive(), 30, "the run's own remote group to be stopped by cancel")
        assert remote_alive(), "the other run's group still runs"
    finally:
        for client in clients:
            client.kill()
            client.wait()


# --------------------------------------------------------------------------------------------
# Slurm: a planted job id is never cancelled unless it is the run's job
# --------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_reader_never_cancels_a_planted_slurm_job(slurm_cluster, charllm_dirs, tmp_path, capsys):
    def submit(name: str, workdir=tmp_path) -> str:
        done = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", f"--chdir={workdir}", "--output=/dev/null",
                               "--wrap", "sleep 600"], capture_output=True, text=True, env=slurm_cluster.env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def state(job: str) -> str:
        return slurm_cluster.scontrol("show", "job", "-o", job).split("JobState=")[1].split()[0]

    victim = submit("someone-elses-job")
    other_run = submit("charllm-20260101-000009-another-run")
    # named after a run planted below, but working elsewhere: a copy of that run's manifest cannot own it
    namesake = submit("charllm-20260101-000020-slurm")
    jobs = (victim, other_run, namesake)
    wait_for(lambda: all(state(job) == "RUNNING" for job in jobs), 60, "the jobs to run")
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
    rd = plant(charllm_dirs["runs"], "20260101-000020-slurm", **job_of(namesake, False))
    procid.write_token(rd.path)
    outcomes = read_everything(rd)
    assert any("not in this run's directory" in err for _, _, err in outcomes), outcomes
    time.sleep(1)
    SIGNALLED.extend(f"slurm: job {job}" for job in jobs if state(job) != "RUNNING")
    assert all(state(job) == "RUNNING" for job in jobs)
    # the positive control: the run's own job (named after it, working in its directory) is left
    # alone by the readers, and cancelled by cancel, in either manifest
    for run_id, old in (("20260101-000002-slurm", False), ("20260101-000003-slurm-old", True)):
        rd = plant(charllm_dirs["runs"], run_id)
        own = submit(f"charllm-{run_id}", rd.path)
        rd.update_manifest(**job_of(own, old))
        wait_for(lambda: state(own) == "RUNNING", 60, "the job to run")
        code, out, _ = run(capsys, "runs", "show", rd.id)
        assert f"target    cluster (slurm job {own}" in out and "status    running" in out, out
        time.sleep(1)
        assert state(own) == "RUNNING", "a reader never cancels: Slurm runs the job without its supervisor"
        run(capsys, "runs", "cancel", rd.id)
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
