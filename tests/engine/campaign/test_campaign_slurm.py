"""The tiny CPU campaign on a real Slurm (slurmctld and two slurmd on loopback): the queue lives in
Slurm, one job per member, each waiting for the job two places before it (at most 2 at once); it
outlives the command that started it and the campaign's supervisor; a cancel empties it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from charllm.engine.launch.slurm import job_id
from charllm.engine.launch.slurmctl import PACE_ENV
from infra_campaign import record, runs_of, tiny_campaign, wait_until
from infra_cli import run
from infra_runs import left_after, start
from infra_slurm import fault_wrappers, slurm_cluster  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.train]   # they launch training (torchrun)


def slurm_at_once(cluster, jobs: list[str]) -> int:
    """The most of `jobs` that ran at one moment, from Slurm's own start and end times."""
    events = []
    for job in jobs:
        fields = dict(word.split("=", 1) for word in cluster.scontrol("show", "job", "-o", job).split() if "=" in word)
        events += [(fields["StartTime"], 1), (fields["EndTime"], -1)]   # ISO times sort as times
    alive = best = 0
    for _, step in sorted(events):   # an end before a start at the same second: a job follows another
        alive += step
        best = max(best, alive)
    return best


def cluster_target(charllm_dirs) -> None:
    charllm_dirs["config"].mkdir(parents=True, exist_ok=True)
    (charllm_dirs["config"] / "targets.toml").write_text(
        f'[cluster]\nkind = "slurm"\npartition = "debug"\ntime = "00:10:00"\npython = "{sys.executable}"\n')


@pytest.mark.timeout(900)
def test_the_queue_lives_in_slurm_and_outlives_the_command_and_the_supervisor(slurm_cluster, charllm_dirs):
    cluster_target(charllm_dirs)
    name = tiny_campaign(charllm_dirs, target="cluster")
    starter = start([sys.executable, "-m", "charllm.tui", "campaign", "run", name])
    rec = wait_until(name, lambda r: all(m.get("run") for m in r.members), 180, "every member submitted")
    jobs = [job_id(rd.manifest()) for rd in runs_of(rec)]
    assert all(jobs) and len(set(jobs)) == 6
    lines = [rd.manifest().target.get("sbatch_lines", []) for rd in runs_of(rec)]
    assert lines[:2] == [[], []] and lines[2:] == [[f"--dependency=afterany:{jobs[i]}"] for i in range(4)], lines
    starter.send_signal(signal.SIGKILL)           # the terminal goes
    starter.communicate()
    psutil.Process(rec.data["supervisor"]["pid"]).kill()   # and the campaign's supervisor
    rec = wait_until(name, lambda r: r.data["status"] == "completed", 720, "Slurm to run the queue through")
    assert [m["status"] for m in rec.members] == ["completed"] * 6
    assert slurm_at_once(slurm_cluster, jobs) == 2, "two jobs at once, never more (Slurm's own times)"
    assert all(left_after(rd.id) == 0 for rd in runs_of(rec))


@pytest.mark.timeout(600)
def test_campaign_cancel_empties_the_slurm_queue(slurm_cluster, charllm_dirs, capsys):
    """`--detach` returns once Slurm holds every member's job (squeue shows them at once, each named
    after its run); a cancel ends them all, and a member cancelled while pending ran on no node."""
    cluster_target(charllm_dirs)
    name = tiny_campaign(charllm_dirs, target="cluster", iters=100_000)
    code, out, err = run(capsys, "campaign", "run", name, "--detach")
    assert code == 0 and f"campaign {name}: handed over" in out, out + err
    rec = record(name)
    names = subprocess.run(["squeue", "--noheader", "--format=%j"], env=slurm_cluster.env, capture_output=True,
                           text=True).stdout.split()
    assert sorted(names) == sorted(rd.id for rd in runs_of(rec)) and len(names) == 6, names
    wait_until(name, lambda r: sum(m["status"] == "running" for m in r.members) == 2, 300, "two members running")
    code, out, err = run(capsys, "campaign", "cancel", name)
    assert code == 0, err
    rec = record(name)
    assert rec.data["status"] == "cancelled" and {m["status"] for m in rec.members} == {"cancelled"}, rec.members
    said = out.splitlines()[-1]                  # issue 39: cancel said "58 cancelled", status then "58 failed"
    assert said.startswith(f"{name}: 6 members (6 cancelled)"), out
    assert run(capsys, "campaign", "status", name)[1].splitlines()[0] == said
    assert slurm_cluster.jobs() == "" or all(" RUNNING" not in j and " PENDING" not in j
                                             for j in slurm_cluster.jobs().splitlines())
    assert all(left_after(rd.id) == 0 for rd in runs_of(rec))
    never_ran = runs_of(rec)[-1]
    assert never_ran.manifest().nodes == [] and never_ran.manifest().started_ns is None
    code, out, _ = run(capsys, "runs", "show", never_ran.id)
    assert "\nnodes     -\n" in out, out


@pytest.mark.timeout(900)
def test_a_member_sbatch_refuses_keeps_max_parallel_and_the_queue_outlives_its_follower(
        slurm_cluster, charllm_dirs, capsys, tmp_path, monkeypatch):
    """sbatch refuses the third member (a policy) and loses its answer for the fourth (the job was
    taken): the refused member is refused with sbatch's own line and takes no place in the chain, the
    fourth's job is found by its name (never submitted twice), and no more than 2 ever run at once.
    The campaign's supervisor, which follows every member's job through scontrol's faults, is killed
    midway; the readers settle the rest, every status right."""
    faults = fault_wrappers(tmp_path / "faults")
    monkeypatch.setenv("PATH", f"{faults.folder / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(PACE_ENV, "0.2,1,4")
    faults.plan("sbatch", ["ok", "ok", "refuse", "lost"])
    faults.plan("scontrol", [entry for i in range(20) for entry in (("fail", "garbage", "empty", "truncate")[i % 4],
                                                                     "ok")])
    cluster_target(charllm_dirs)
    name = tiny_campaign(charllm_dirs, target="cluster")
    assert run(capsys, "campaign", "run", name, "--detach")[0] == 0
    rec = record(name)
    refused = rec.members[2]
    assert refused["status"] == "refused" and refused["run"] is None
    assert refused["failure"] == ("not started: sbatch refused the job: sbatch: error: Batch job submission failed: "
                                  "Invalid qos specification")
    rds = runs_of(rec)
    jobs = [job_id(rd.manifest()) for rd in rds]
    assert len(rds) == 5 and len(set(jobs)) == 5 and len(slurm_cluster.jobs().splitlines()) == 5, "none twice"
    lines = [rd.manifest().target.get("sbatch_lines", []) for rd in rds]
    assert lines == [[], [], [f"--dependency=afterany:{jobs[0]}"], [f"--dependency=afterany:{jobs[1]}"],
                     [f"--dependency=afterany:{jobs[2]}"]], lines
    wait_until(name, lambda r: any(m["status"] == "completed" for m in r.members), 300, "a member to complete")
    psutil.Process(rec.data["supervisor"]["pid"]).kill()
    rec = wait_until(name, lambda r: r.data["status"] == "failed", 720, "Slurm to run the queue through")
    assert [m["status"] for m in rec.members] == ["completed", "completed", "refused", "completed", "completed"] + \
        ["completed"], [(m["status"], m.get("failure")) for m in rec.members]
    assert rec.data["failure"] == "1 of 6 members did not complete (1 refused)", "never 'completed' over a refusal"
    assert slurm_at_once(slurm_cluster, jobs) == 2, "two jobs at once, never more (Slurm's own times)"
    assert {line.split()[1] for line in faults.injected()} >= {"refuse", "lost", "fail", "garbage"}


@pytest.mark.timeout(600)
def test_a_campaign_of_a_command_runs_each_member_as_a_slurm_job_and_reads_its_steps(
        slurm_cluster, charllm_dirs, capsys):
    """Issue 37: a user's command, its micro batch an axis, on the cluster: asked for the nodes' hardware
    first (the cpu default is this machine's), then one job per member, each one's steps read from its log."""
    from test_campaign_command import trainer_line

    cluster_target(charllm_dirs)
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True, exist_ok=True)
    body = f'command = "{trainer_line(5)}"\n[axes]\nmicro_batch_size = [1, 2]\n[target]\nname = "cluster"\n' \
           'max_parallel = 2\n'
    (folder / "cmd.toml").write_text(body)
    code, _, err = run(capsys, "campaign", "run", "cmd")
    assert code == 2 and "hardware: give the nodes' device preset" in err, err
    (folder / "cmd.toml").write_text('hardware = "cpu"\n' + body)
    code, out, err = run(capsys, "campaign", "run", "cmd")
    assert code == 0, out + err
    rec = record("cmd")
    assert rec.data["status"] == "completed" and [m["status"] for m in rec.members] == ["completed"] * 2, out
    jobs = {job_id(rd.manifest()) for rd in runs_of(rec)}
    assert len(jobs) == 2 and None not in jobs
    for m, rd in zip(rec.members, runs_of(rec)):
        steps = [r for r in rd.iteration_records() if r.get("event") == "iteration"]
        assert [s["iteration"] for s in steps] == [1, 2, 3, 4, 5] and {s["samples"] for s in steps} == \
            {m["micro_batch_size"]}
        assert rd.manifest().command["line"] == m["command"] and left_after(rd.id) == 0
