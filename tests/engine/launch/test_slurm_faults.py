"""A busy controller, as production clusters have them, on the loopback Slurm (slurmctld and two
slurmd): Slurm's clients fail, time out or print garbage (wrappers first on PATH, acting out a plan:
infra_slurm.fault_wrappers), slurmctld stops for 30 s and comes back, the login node kills the
process that follows a job. A healthy run is never recorded failed; every final status is the job's
own and Slurm's; a job Slurm no longer knows is decided by its own end record, else said unknown."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from charllm.engine.launch import slurmctl
from charllm.engine.launch.launcher import launch
from charllm.engine.launch.targets import parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.core import procid
from charllm.probes.store.rundir import FINAL_STATUSES, RunDir
from infra_cli import run
from infra_runs import (
    iterations_logged,
    kill_and_wait,
    left_after,
    logs,
    run_processes,
    supervisor_process,
    wait_final,
    wait_for,
)
from infra_slurm import fault_wrappers, slurm_cluster  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration]

# Each kind of hiccup a follower meets: the client's own timeout message, no controller, output that
# is no answer (random bytes, nothing, an answer cut short) and a client that hangs past its time limit.
HICCUPS = ("fail", "garbage", "unreachable", "empty", "truncate", "fail", "garbage", "hang")


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """The fault wrappers first on the PATH of everything the test starts (launch's supervisors,
    the readers here), and a quicker pace, so that many calls (and faults) happen in a short run."""
    wrappers = fault_wrappers(tmp_path / "faults")
    monkeypatch.setenv("PATH", f"{wrappers.folder / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(slurmctl.PACE_ENV, "0.2,1,4")
    return wrappers


def target(**extra):
    # Not whole nodes: the three runs share the two nodes (a CPU job asks for its ranks' CPUs).
    return parse_target("testcluster", {"kind": "slurm", "partition": "debug", "time": "00:15:00",
                                        "python": sys.executable, "exclusive": False, **extra})


def two_nodes(iters: int):
    exp = Experiment.load("tiny-local")
    exp.cluster.nodes, exp.cluster.gpus_per_node = 2, 1
    exp.training.train_iters = iters
    return exp


def job_state(cluster, job: str) -> str:
    fields = dict(word.split("=", 1) for word in cluster.scontrol("show", "job", "-o", job).split() if "=" in word)
    return fields.get("JobState", "?")


@pytest.mark.train
@pytest.mark.timeout(900)
def test_hiccups_a_controller_restart_and_a_killed_follower_never_fail_a_healthy_run(slurm_cluster, faults, capsys,
                                                                                     monkeypatch):
    """Two healthy runs followed through at least 50 injected faults of scontrol (two calls in three),
    slurmctld stopped for 30 s and restarted mid-run, and the supervisor of one killed mid-run, as a
    login node kills it: its run is settled by a reader (`runs list`) through the same faults. Both
    complete, as Slurm says. (Each step of rank 1 sleeps 0.2 s a micro-batch: the runs last a minute
    or more however fast the machine, with little CPU.)"""
    monkeypatch.setenv("CHARLLM_TEST_ONLY_SLOW_RANK", "1:0.2")
    faults.plan("scontrol", [entry for i in range(60) for entry in (HICCUPS[i % len(HICCUPS)], "ok")[:1 + i % 2]])
    faults.plan("sacct", ["fail", "garbage"])
    rds = [RunDir(launch(two_nodes(150), target()).run_dir) for _ in range(2)]
    jobs = [rd.manifest().target["run"]["job_id"] for rd in rds]
    followed, orphan = rds
    wait_for(lambda: all(iterations_logged(rd) >= 1 for rd in rds), 300, f"both runs training\n{logs(followed)}")
    kill_and_wait(supervisor_process(orphan))          # the login node kills its follower: the job goes on
    slurm_cluster.stop_controller()
    try:
        said = wait_for(lambda: "no answer from Slurm since" in _described(followed), 20,
                        "the follower to say Slurm does not answer")
        before = [iterations_logged(rd) for rd in rds]
        outage_ends = time.monotonic() + 30 - 1
        while time.monotonic() < outage_ends:
            time.sleep(1)
            run(capsys, "runs", "list")                   # a reader looks meanwhile, through the same faults
            # nothing is recorded failed while Slurm cannot be asked (a run may end on its own record)
            assert {rd.manifest().status for rd in rds} <= {"running", "completed"}, \
                [rd.manifest().failure for rd in rds]
    finally:
        slurm_cluster.start_controller()
    assert said and all(iterations_logged(rd) > was for rd, was in zip(rds, before)), "training went on meanwhile"

    def settled():
        time.sleep(1)
        run(capsys, "runs", "list")                   # the reader settles the run whose follower was killed
        return all(rd.status in FINAL_STATUSES for rd in rds)
    wait_for(settled, 600, "both runs to end")
    manifests = [rd.read_manifest() for rd in rds]
    assert [m["status"] for m in manifests] == ["completed"] * 2, [(m.get("failure"), m.get("note")) for m in manifests]
    assert [job_state(slurm_cluster, job) for job in jobs] == ["COMPLETED"] * 2
    said_last = manifests[0]["target"]["run"]
    assert said_last["state"] == "COMPLETED" and "silent_since_ns" not in said_last, "Slurm answers again"
    assert "the supervisor died" in manifests[1]["note"]
    injected = faults.injected()
    kinds = {line.split()[1] for line in injected}
    print(f"{len(injected)} faults injected", file=sys.stderr)
    assert len(injected) >= 50 and kinds >= set(HICCUPS), (len(injected), kinds)
    # the followed run's supervisor exits just after recording the end
    assert [left_after(rd.id) for rd in rds] == [0, 0], [p.cmdline() for rd in rds for p in run_processes(rd.id)]



@pytest.mark.train
@pytest.mark.timeout(400)
def test_an_sbatch_without_an_answer_never_submits_a_run_twice(slurm_cluster, faults):
    """sbatch meets the controller's timeout, hangs past its time limit, loses its answer after the
    job was taken, prints garbage, finds no controller: before asking again, each launch looks for
    its job by name, so each run has exactly one job, and both complete."""
    faults.plan("sbatch", ["fail", "hang", "lost", "garbage", "unreachable"])
    rds = [RunDir(launch(two_nodes(4), target()).run_dir) for _ in range(2)]
    assert [line.split()[1] for line in faults.injected()] == ["fail", "hang", "lost", "garbage", "unreachable"]
    names = [word.split("=", 1)[1] for line in slurm_cluster.scontrol("show", "job", "-o").splitlines()
             for word in line.split() if word.startswith("JobName=")]
    assert [names.count(rd.id) for rd in rds] == [1, 1], names
    manifests = [wait_final(rd, 300) for rd in rds]
    assert [m["status"] for m in manifests] == ["completed"] * 2, [(m.get("failure"), logs(rd)) for m, rd in
                                                                   zip(manifests, rds)]

def _described(rd: RunDir) -> str:
    from charllm.engine.launch.targets import describe

    return describe(rd.manifest().target)


def _orphan(runs_dir, name: str, job: str) -> RunDir:
    """A run launched on the loopback Slurm whose follower died long ago (a process that has ended),
    its job `job`."""
    sleeper = subprocess.Popen(["sleep", "60"])
    dead = procid.identify(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    rd = RunDir.create(runs_dir / name, "launch")
    rd.logs_dir.mkdir()
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "running", "created_ns": 1, "started_ns": 2,
                       "supervisor": dead, "target": {**target().to_dict(), "run": {"job_id": job}}})
    return rd


def test_a_job_slurm_no_longer_knows_is_decided_by_its_own_end_record_else_said_unknown(slurm_cluster,
                                                                                       charllm_dirs, capsys):
    """Slurm has purged the job and keeps no accounting (the loopback's accounting_storage/none, as on
    many clusters): its own end record decides, and without one the run is 'unknown', said with why.
    Where accounting keeps the job (sacct), its state decides."""
    forgotten = "424242"              # no such job on this controller
    assert slurmctl.show_jobs([forgotten]) == {}
    ended = _orphan(charllm_dirs["runs"], "20260101-000000-ended", forgotten)
    (ended.logs_dir / "train.exit").write_text(f"0 {time.time_ns()}\n")
    ended.iterations_path.write_text('{"event": "end", "status": "completed", "rank": 0}\n')
    silent = _orphan(charllm_dirs["runs"], "20260101-000000-silent", forgotten)
    code, out, err = run(capsys, "runs", "list")
    assert code == 0, err
    assert ended.read_manifest()["status"] == "completed"
    manifest = silent.read_manifest()
    assert manifest["status"] == "unknown", manifest
    assert manifest["failure"].startswith(f"slurm job {forgotten} ended without its end record (logs/train.exit)")
    code, out, _ = run(capsys, "runs", "show", silent.id)
    assert "unknown" in out and "how it ended is unknown" in out


def test_accounting_s_word_decides_a_purged_job(slurm_cluster, charllm_dirs, capsys, faults):
    """Where accounting keeps the job, sacct's state decides (here sacct answers as an accounting
    cluster's does, --parsable2; the loopback keeps none), after sacct's timeout, garbage and a hang."""
    script = faults.folder / "bin" / "sacct"
    script.write_text(script.read_text().replace(
        '*) exec "$REAL" "$@" ;;', '*) echo "424243|TIMEOUT|0:15|n[1-2]"; exit 0 ;;'))
    faults.plan("sacct", ["fail", "garbage", "hang"])
    rd = _orphan(charllm_dirs["runs"], "20260101-000000-accounted", "424243")

    def settled():
        time.sleep(0.5)
        run(capsys, "runs", "list")
        return rd.status in FINAL_STATUSES
    wait_for(settled, 60, "the reader to settle the run")
    manifest = rd.read_manifest()
    assert manifest["status"] == "failed" and manifest["failure"] == "slurm job timeout (exit code 0:15, reason -) " \
                                                                       "on n[1-2]", manifest
    assert [line.split()[:2] for line in faults.injected()] == [["sacct", "fail"], ["sacct", "garbage"],
                                                                 ["sacct", "hang"]]
