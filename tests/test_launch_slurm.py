"""Launching through a real Slurm (slurmctld + two slurmd fake nodes on loopback)."""

from __future__ import annotations

import sys

import pytest

from charllm.engine.catalog import load_experiment
from charllm.engine.launch import launch
from charllm.engine.targets import parse_target
from charllm.probes.rundir import RunDir
from infra_runs import iterations_logged, logs, rank_process, run_processes, wait_final, wait_for
from infra_slurm import slurm_cluster  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def target():
    return parse_target("testcluster", {"kind": "slurm", "partition": "debug", "time": "00:10:00",
                                        "python": sys.executable})


def two_nodes(iters: int):
    exp = load_experiment("tiny-local")
    exp.cluster.nodes, exp.cluster.gpus_per_node = 2, 1
    exp.training.train_iters = iters
    return exp


@pytest.mark.timeout(400)
def test_submitted_job_runs_and_completes(slurm_cluster):
    result = launch(two_nodes(4), target())
    rd = RunDir(result.run_dir)
    assert result.job_id and rd.read_manifest()["slurm_job_id"] == result.job_id
    assert (rd.path / "job.sbatch").read_text() == result.sbatch_script
    manifest = wait_final(rd, 300)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    steps = rd.read_iterations()
    steps = steps.filter(steps["event"] == "iteration")
    assert set(steps["rank"].to_list()) == {0, 1} and steps["iteration"].max() == 4
    telemetry = rd.scan_telemetry().collect()
    assert set(telemetry["node"].to_list()) == {"n1", "n2"}, "one sampler step per node"
    # the supervisor writes the final status just before it exits itself
    wait_for(lambda: run_processes(rd.id) == [], 15, "every process of the run to exit")


@pytest.mark.timeout(400)
def test_runs_cancel_maps_to_scancel(slurm_cluster):
    from charllm.tui.cli import main

    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    job = rd.read_manifest()["slurm_job_id"]
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    assert main(["runs", "cancel", rd.id]) == 0
    assert rd.read_manifest()["status"] == "cancelled"
    assert job not in slurm_cluster.jobs()
    assert "JobState=CANCELLED" in slurm_cluster.scontrol("show", "job", job)
    wait_for(lambda: run_processes(rd.id) == [], 30, "every step's processes to exit")


@pytest.mark.timeout(400)
def test_failing_rank_fails_the_job(slurm_cluster):
    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    rank_process(rd.id, 1).kill()
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed", logs(rd)
    assert "node n2, rank 1" in manifest["failure"] and "SIGKILL" in manifest["failure"]
    wait_for(lambda: run_processes(rd.id) == [], 30, "the other node to stop")


@pytest.mark.timeout(400)
def test_killed_supervisor_is_found_by_the_next_reader_which_ends_the_job(slurm_cluster, capsys):
    from infra_cli import run
    from infra_runs import kill_and_wait, supervisor_process

    rd = RunDir(launch(two_nodes(100_000), target()).run_dir)
    job = rd.read_manifest()["slurm_job_id"]
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    kill_and_wait(supervisor_process(rd))
    code, out, err = run(capsys, "runs", "list")
    assert code == 0 and "failed" in out, out + err
    assert "the supervisor died" in rd.read_manifest()["failure"]
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
