"""Launching through a real Slurm (slurmctld + two slurmd fake nodes on loopback)."""

from __future__ import annotations

import sys

import pytest

from charllm.engine.launch.launcher import launch
from charllm.engine.launch.targets import describe, parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.store.rundir import RunDir
from infra_runs import iterations_logged, logs, rank_process, run_processes, wait_final, wait_for
from infra_slurm import slurm_cluster  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.train]   # they launch training (torchrun)


def target(**extra):
    return parse_target("testcluster", {"kind": "slurm", "partition": "debug", "time": "00:10:00",
                                        "python": sys.executable, **extra})


HOSTILE_NAME = "x'; touch PWNED; echo \"$(touch PWNED)\" #"   # one line: a name may hold any of it


def two_nodes(iters: int):
    exp = Experiment.load("tiny-local")
    exp.cluster.nodes, exp.cluster.gpus_per_node = 2, 1
    exp.training.train_iters = iters
    return exp


@pytest.mark.timeout(400)
def test_submitted_job_runs_and_completes(slurm_cluster, tmp_path, monkeypatch):
    """With an env line as users write them (a comment at its end) and a name full of shell: the
    comment ends at its line, the name is never a command. A profiler window on every rank writes
    its traces into the run directory on the shared filesystem, accounted for in the manifest."""
    monkeypatch.chdir(tmp_path)
    exp = two_nodes(4)
    exp.name = HOSTILE_NAME
    exp.telemetry.profile_steps, exp.telemetry.profile_scope = [3], "all"
    result = launch(exp, target(env_setup="export OMP_NUM_THREADS=1  # one thread per rank, as on our nodes"))
    rd = RunDir(result.run_dir)
    # the job is the target's own record of the run, which the target describes for readers
    assert result.job_id and rd.manifest().target["run"] == {"job_id": result.job_id}
    assert result.job == f"slurm job {result.job_id}"
    assert (rd.path / "job.sbatch").read_text() == result.job_script
    manifest = wait_final(rd, 300)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    assert manifest["target"]["run"] == {"job_id": result.job_id, "state": "COMPLETED"}
    assert "slurm_job_id" not in manifest and "slurm_state" not in manifest
    assert describe(manifest["target"]) == f"testcluster (slurm job {result.job_id}, COMPLETED)"
    assert f" JobName={rd.id} " in slurm_cluster.scontrol("show", "job", "-o", result.job_id), "named after the run"
    assert manifest["nodes"] == ["n1", "n2"] and manifest["exit_codes"] == {"train@n1": 0, "train@n2": 0}
    steps = rd.read_iterations()
    steps = steps.filter(steps["event"] == "iteration")
    assert set(steps["rank"].to_list()) == {0, 1} and steps["iteration"].max() == 4
    telemetry = rd.scan_telemetry().collect()
    assert set(telemetry["node"].to_list()) == {"n1", "n2"}, "one sampler step per node"
    assert "telemetry_lost" not in manifest, "samplers stopped at the end are no loss"
    traces = sorted(p.name for p in rd.traces_dir.iterdir())
    assert traces == ["rank00000-step000003.pt.trace.json", "rank00001-step000003.pt.trace.json"], traces
    assert manifest["profile"]["traces"] == 2 and manifest["profile"]["bytes"] > 0
    # the supervisor writes the final status just before it exits itself
    wait_for(lambda: run_processes(rd.id) == [], 15, "every process of the run to exit")
    assert not list(tmp_path.rglob("PWNED")) and not list(rd.path.rglob("PWNED")), "the name ran as a command"


@pytest.mark.timeout(200)
def test_a_job_that_never_ran_the_workload_is_no_completed_run(slurm_cluster):
    """An env line that ends the job script (`exit 0`): Slurm says COMPLETED, nothing trained."""
    rd = RunDir(launch(two_nodes(4), target(env_setup="exit 0")).run_dir)
    manifest = wait_final(rd, 150)
    assert manifest["status"] == "failed" and "never logged its end" in manifest["failure"], manifest


@pytest.mark.timeout(200)
def test_a_failing_env_setup_command_stops_the_job_and_is_named(slurm_cluster):
    """Before: "module: command not found" showed only in logs/slurm-N.out, and the run said completed."""
    rd = RunDir(launch(two_nodes(4), target(env_setup="export A=1; module load cuda/12.4; echo not reached")).run_dir)
    manifest = wait_final(rd, 150)
    assert manifest["status"] == "failed", manifest
    assert manifest["failure"].startswith("env_setup stopped the job: `module load cuda/12.4` exited with status 127 "
                                          "(command not found)"), manifest["failure"]
    assert manifest["target"]["run"]["state"] == "FAILED"
    out = next(rd.logs_dir.glob("slurm-*.out")).read_text()
    assert "not reached" not in out and not (rd.logs_dir / "train.exit").exists(), out


@pytest.mark.timeout(400)
def test_runs_cancel_maps_to_scancel(slurm_cluster):
    from charllm.tui.cli import main

    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    job = rd.manifest().target["run"]["job_id"]
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    assert main(["runs", "cancel", rd.id]) == 0
    assert rd.read_manifest()["status"] == "cancelled"
    assert job not in slurm_cluster.jobs()
    assert "JobState=CANCELLED" in slurm_cluster.scontrol("show", "job", job)
    wait_for(lambda: run_processes(rd.id) == [], 15, "every step's processes to exit")


@pytest.mark.timeout(400)
def test_failing_rank_fails_the_job(slurm_cluster):
    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    rank_process(rd.id, 1).kill()
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed", logs(rd)
    assert "node n2, rank 1" in manifest["failure"] and "SIGKILL" in manifest["failure"]
    wait_for(lambda: run_processes(rd.id) == [], 15, "the other node to stop")


@pytest.mark.timeout(400)
def test_a_killed_supervisor_leaves_the_job_running_and_cancel_still_ends_it(slurm_cluster, capsys):
    """Login nodes kill user processes (logout, reapers): the job is Slurm's and goes on. A reader
    signals nothing and cancels nothing (it once scancelled the healthy job and recorded it failed);
    the run follows the job's own state, and `runs cancel` still ends it and records it."""
    from infra_cli import run
    from infra_runs import kill_and_wait, supervisor_process

    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    job = rd.manifest().target["run"]["job_id"]
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    kill_and_wait(supervisor_process(rd))
    code, out, err = run(capsys, "runs", "list")
    assert code == 0 and rd.id in out and "running" in out, out + err
    before = iterations_logged(rd)
    wait_for(lambda: iterations_logged(rd) > before, 120, "training to go on without its supervisor")
    assert job in slurm_cluster.jobs() and rd.read_manifest()["status"] == "running"
    code, out, err = run(capsys, "runs", "cancel", rd.id)
    assert code == 0 and "cancelled" in out, out + err
    assert rd.read_manifest()["status"] == "cancelled"
    wait_for(lambda: job not in slurm_cluster.jobs(), 30, "the job to leave the queue")
    wait_for(lambda: run_processes(rd.id) == [], 15, "every step's processes to exit")


@pytest.mark.timeout(400)
def test_killed_torchrun_on_a_node_fails_the_job_and_leaves_nothing(slurm_cluster):
    from infra_runs import role_process

    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    role_process(rd.id, "torch.distributed.run").kill()
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed", logs(rd)
    wait_for(lambda: run_processes(rd.id) == [], 15, "every process of the job to exit")


@pytest.mark.timeout(400)
def test_a_dead_sampler_is_told_in_the_status(slurm_cluster):
    from infra_runs import a_dead_sampler_is_told

    rd = RunDir(launch(two_nodes(60), target()).run_dir)
    manifest = a_dead_sampler_is_told(rd, "n2")
    lost = manifest["telemetry_lost"]
    assert "killed by SIGKILL" in lost[0]["reason"], lost
    assert manifest["started_ns"] < lost[0]["at_ns"] < manifest["ended_ns"]
    wait_for(lambda: run_processes(rd.id) == [], 15, "every process of the job to exit")


# A probe-only run on a compute node (`srun python -m charllm.probes --out DIR`), its directory
# on the filesystem the nodes share: the next reader finishes it, `runs cancel` stops it.
def probe_on_n2(out_dir):
    from infra_runs import recording_probe

    return recording_probe(out_dir, "n2", lambda argv: ["srun", "--nodes=1", "--nodelist=n2"] + argv)


@pytest.mark.timeout(200)
def test_a_killed_probe_only_run_is_finished_by_the_next_reader(slurm_cluster, tmp_path, capsys):
    from infra_runs import a_killed_probe_is_finished_by_the_next_reader

    proc, rd = probe_on_n2(tmp_path / "probe-run")
    a_killed_probe_is_finished_by_the_next_reader(proc, rd, capsys, lambda: run_processes(str(rd.path)) == [],
                                                  "the probe's srun and task to exit")


@pytest.mark.timeout(200)
def test_runs_cancel_stops_a_probe_only_run(slurm_cluster, tmp_path, capsys):
    from infra_runs import runs_cancel_stops_a_probe

    proc, rd = probe_on_n2(tmp_path / "probe-run")
    runs_cancel_stops_a_probe(proc, rd, capsys, lambda: run_processes(str(rd.path)) == [],
                              "the probe's srun and task to exit")


def test_which_sampler_exit_records_are_a_loss(tmp_path):
    """Without a cluster: died or failed at any time, or stopped cleanly before training ended,
    is a loss; stopped after training ended (the script's own stop) is not."""
    import os
    import time

    from charllm.engine.launch import slurm

    rd = RunDir.create(tmp_path / "run", "launch")
    rd.write_manifest({"id": "run", "kind": "train", "status": "running", "target": target().to_dict()})
    rd.logs_dir.mkdir()
    now = time.time_ns()
    (rd.logs_dir / "train.exit").write_text("0\n")
    os.utime(rd.logs_dir / "train.exit", ns=(now, now))
    for node, code, at in (("n1", 137, now - 10**9), ("n2", 0, now - 10**9), ("n3", 0, now + 10**9),
                           ("n4", 2, now + 10**9)):
        (rd.logs_dir / f"sampler-{node}.exit").write_text(f"{code} {at}\n")
    (rd.logs_dir / "sampler-n4.log").write_text("charllm-probes: error: hz = 1000: must be > 0 and at most 200\n")
    (rd.logs_dir / "sampler-n5.exit").write_text("13")  # being written
    slurm.watch_samplers(rd)
    lost = {entry["node"]: entry for entry in rd.read_manifest()["telemetry_lost"]}
    assert sorted(lost) == ["n1", "n2", "n4"]
    assert "killed by SIGKILL" in lost["n1"]["reason"] and lost["n1"]["at_ns"] == now - 10**9
    assert "exited with status 2: charllm-probes: error: hz = 1000" in lost["n4"]["reason"]
