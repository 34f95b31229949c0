"""Slurm without a cluster: what Slurm's clients print, read strictly; the job's own records in the
run directory and the outcome they decide; the resources a target asks for. The loopback cluster's
tests (test_launch_slurm.py, test_slurm_faults.py) run the same code against a real controller."""

from __future__ import annotations

import time

import pytest

from charllm.engine.launch import slurm, slurmctl
from charllm.engine.launch.slurmctl import FORGOTTEN, Job, Pace, parse_jobs
from charllm.engine.launch.targets import parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir

# `scontrol show job --oneliner` on the loopback Slurm (22.05), a running and a completed job.
RUNNING = ("JobId=7 JobName=20261128-191446-tiny-local UserId=root(0) GroupId=root(0) MCS_label=N/A "
           "Priority=4294901759 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) "
           "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:01 TimeLimit=00:10:00 "
           "NodeList=n[1-2] BatchHost=n1 NumNodes=2 WorkDir=/runs/20261128-191446-tiny-local Power= ")
COMPLETED = RUNNING.replace("JobId=7", "JobId=8").replace("JobState=RUNNING", "JobState=COMPLETED")


def test_scontrol_s_answer_is_read_strictly():
    jobs = parse_jobs(RUNNING + "\n" + COMPLETED + "\n")
    assert jobs is not None and sorted(jobs) == ["7", "8"]
    assert jobs["7"].state == "RUNNING" and not jobs["7"].final and jobs["8"].final
    assert jobs["7"].uid == 0 and jobs["7"].get("NodeList") == "n[1-2]" and jobs["7"].get("Missing") == "?"
    assert parse_jobs("No jobs in the system\n") == {}
    # Anything else is no answer, never "the job is gone": random bytes, nothing at all, an answer
    # cut short before its state, a state Slurm has no name for.
    assert parse_jobs("bm90IGEgam9iCg==\nxx\n") is None
    assert parse_jobs("") is None and parse_jobs("\n\n") is None
    assert parse_jobs(RUNNING[:120]) is None
    assert parse_jobs(RUNNING.replace("RUNNING", "EXPLODED")) is None
    assert parse_jobs(RUNNING + "\n" + "garbage") is None


def test_the_pace_is_slurm_s_unless_the_tests_set_theirs(monkeypatch):
    monkeypatch.delenv(slurmctl.PACE_ENV, raising=False)
    assert Pace.current() == Pace(10.0, 120.0, 60.0)
    monkeypatch.setenv(slurmctl.PACE_ENV, "0.5,4,8")
    assert Pace.current() == Pace(0.5, 4.0, 8.0)
    monkeypatch.setenv(slurmctl.PACE_ENV, "fast")
    assert Pace.current() == Pace()


def test_a_client_that_hangs_is_no_answer_and_leaves_nothing_behind(tmp_path):
    """A wrapper script that forks the client and hangs: its whole session goes at the time limit."""
    script = tmp_path / "scontrol"
    script.write_text("#!/bin/bash\nsleep 300 &\nsleep 300\n")
    script.chmod(0o755)
    started = time.monotonic()
    assert slurmctl.call([str(script)], timeout=1) is None
    assert time.monotonic() - started < 10
    assert slurmctl.call([str(tmp_path / "absent")], timeout=1) is None
    done = slurmctl.call(["bash", "-c", "echo out; echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1"])
    assert done is not None and done.returncode == 1 and slurmctl.no_answer(done)
    refused = slurmctl.Done(1, "", "sbatch: error: Batch job submission failed: Invalid partition name specified\n")
    assert not slurmctl.no_answer(refused) and refused.said.endswith("Invalid partition name specified")


def _run(tmp_path) -> RunDir:
    rd = RunDir.create(tmp_path / "20260101-000000-r", "launch")
    rd.logs_dir.mkdir()
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "running", "created_ns": 1,
                       "target": {"name": "c", "kind": "slurm", "run": {"job_id": "7"}}})
    return rd


def _trained(rd: RunDir) -> None:
    with open(rd.iterations_path, "a") as fh:
        fh.write('{"event": "end", "status": "completed", "rank": 0}\n')


def test_the_job_s_own_records_decide_its_outcome(tmp_path):
    rd = _run(tmp_path)
    records = slurm.JobRecords.read(rd)
    assert records == slurm.JobRecords() and slurm.decide(rd, records, None, end_wait=0) is None
    (rd.logs_dir / slurm.START).write_text(f"{10**18} n1 n2 \n")
    records = slurm.JobRecords.read(rd)
    assert records.started_ns == 10**18 and records.nodes == ("n1", "n2")
    # Slurm's word while the job runs, or no word at all: nothing decided
    assert slurm.decide(rd, records, Job("7", "RUNNING"), end_wait=0) is None
    (rd.logs_dir / slurm.END).write_text(f"0 {10**18 + 5}\n")
    records = slurm.JobRecords.read(rd)
    assert records.exit == 0 and records.train_end_ns == 10**18 + 5
    assert slurm.decide(rd, records, None, end_wait=0)["failure"] == slurm.NO_END   # exited 0, never trained
    _trained(rd)
    assert slurm.decide(rd, records, None, end_wait=0) == {"status": "completed", "failure": None}
    # a node's training failed: its own exit record names it
    (rd.logs_dir / slurm.END).write_text(f"137 {10**18 + 5}\n")
    (rd.logs_dir / "train-n1.exit").write_text("0 1\n")
    (rd.logs_dir / "train-n2.exit").write_text("137 2\n")
    fields = slurm.decide(rd, slurm.JobRecords.read(rd), None, end_wait=0)
    assert fields == {"status": "failed", "failure": "node n2: training was killed by SIGKILL"}
    assert slurm.node_exits(rd) == {"train@n1": 0, "train@n2": 137}
    rd.cancel_request_path.touch()   # the user cancelled it: no failure
    assert slurm.decide(rd, slurm.JobRecords.read(rd), None, end_wait=0)["status"] == "cancelled"


def test_an_env_setup_failure_is_named(tmp_path):
    rd = _run(tmp_path)
    (rd.logs_dir / slurm.ENV_FAILED).write_text("127 module load cuda/12.4\n")
    fields = slurm.decide(rd, slurm.JobRecords.read(rd), Job("7", "RUNNING"), end_wait=0)
    assert fields["status"] == "failed"
    assert fields["failure"].startswith("env_setup stopped the job: `module load cuda/12.4` exited with status 127 "
                                        "(command not found)")


def test_without_its_own_end_record_slurm_s_confirmed_state_decides(tmp_path):
    rd = _run(tmp_path)
    records = slurm.JobRecords.read(rd)
    failed = Job("7", "FAILED", {"ExitCode": "1:0", "Reason": "NonZeroExitCode", "NodeList": "n1"})
    assert slurm.decide(rd, records, failed, end_wait=0)["failure"] == \
        "slurm job failed (exit code 1:0, reason NonZeroExitCode) on n1"
    assert slurm.decide(rd, records, Job("7", "TIMEOUT"), end_wait=0)["status"] == "failed"
    assert slurm.decide(rd, records, Job("7", "CANCELLED"), end_wait=0)["status"] == "cancelled"
    assert slurm.decide(rd, records, Job("7", "COMPLETED"), end_wait=0)["failure"] == slurm.NO_END
    unknown = slurm.decide(rd, records, Job("7", FORGOTTEN), end_wait=0)
    assert unknown["status"] == "unknown" and "how it ended is unknown" in unknown["failure"]
    _trained(rd)
    assert slurm.decide(rd, records, Job("7", "COMPLETED"), end_wait=0)["status"] == "completed"


def test_a_reader_s_line_says_when_slurm_stopped_answering():
    record = {"name": "c", "kind": "slurm", "run": {"job_id": "7", "state": "RUNNING",
                                                   "silent_since_ns": 1_700_000_000 * 10**9}}
    assert slurm.SlurmTarget.describe_job(record) == "slurm job 7, RUNNING, no answer from Slurm since 22:13:20"


def _script(tmp_path, gpus: bool = True, **fields) -> list[str]:
    target = parse_target("c", {"kind": "slurm", **fields})
    exp = Experiment.load("tiny-local")
    exp.cluster.gpus_per_node = 8
    exp.hardware.vendor = "nvidia" if gpus else "cpu"
    _, text = target.plan(exp, tmp_path / "20260101-000000-r", 1234)
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]


def test_a_job_asks_for_cpus_and_memory_for_its_gpus(tmp_path):
    """Whole nodes by default (a characterization wants no neighbour); CPUs and memory per GPU where
    the target gives them; the job is named after the run."""
    lines = _script(tmp_path)
    assert "--gpus-per-node=8" in lines and "--exclusive" in lines and "--mem=0" in lines
    assert "--job-name=20260101-000000-r" in lines
    lines = _script(tmp_path, cpus_per_gpu=12, mem_per_gpu="96G")
    assert {"--cpus-per-gpu=12", "--mem-per-gpu=96G"} <= set(lines) and "--exclusive" not in lines
    lines = _script(tmp_path, cpus_per_gpu=12, mem_per_gpu="96G", exclusive=True)
    assert "--exclusive" in lines and "--mem=0" not in lines      # (sbatch takes one of --mem, --mem-per-gpu)
    lines = _script(tmp_path, gpus=False, exclusive=False)
    assert "--cpus-per-task=8" in lines and "--exclusive" not in lines
    with pytest.raises(UserError, match=r"^target 'c': exclusive = false without cpus_per_gpu: the job's 8 GPUs"):
        _script(tmp_path, exclusive=False)


@pytest.mark.parametrize("fields, message", [
    ({"exclusive": "yes"}, "c].exclusive = 'yes': must be true or false"),
    ({"mem_per_gpu": "lots"}, "mem_per_gpu = 'lots': must be a size as sbatch takes it"),
    ({"cpus_per_gpu": 0}, "cpus_per_gpu = 0: must be between 1 and 4096"),
])
def test_bad_resources_are_one_line(fields, message):
    with pytest.raises(UserError) as err:
        parse_target("c", {"kind": "slurm", **fields})
    assert message in str(err.value) and "\n" not in str(err.value)
