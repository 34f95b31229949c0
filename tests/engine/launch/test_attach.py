"""`attach`: recording what already runs. A real local trainer (Megatron-LM's own pretrain_gpt.py) and a
job of a real Slurm on loopback, each attached to while it runs; cancelling an attach leaves the job
running, and an attach that follows it to its end completes with it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from charllm.engine.launch.attach import attach
from charllm.engine.launch.launcher import cancel
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir
from infra_megatron_lm import logged_steps, megatron_lm_checkout, pretrain_gpt_argv  # noqa: F401 - fixture
from infra_runs import logs, run_processes, wait_final, wait_for
from infra_slurm import slurm_cluster  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration]
HOST = ["telemetry.backend=host"]


def steps_of(rd: RunDir) -> dict[int, dict]:
    return {r["iteration"]: r for r in rd.iteration_records() if r.get("event") == "iteration"}


def check_parsed(rd: RunDir, log_text: str) -> int:
    """Every parsed step agrees with the line the job logged (0 misparsed); how many were parsed. An
    attach that came after iteration 1's line could not take it back out of the next line's means
    (logged_steps): the log is read as it read it, without that line."""
    if 1 not in steps_of(rd):
        log_text = "\n".join(line for line in log_text.splitlines() if not re.search(r" iteration\s+1/", line))
    logged = logged_steps(log_text)
    for iteration, record in steps_of(rd).items():
        assert iteration in logged and record["loss"] == pytest.approx(logged[iteration]["loss"])
        assert (record["end_ns"] - record["start_ns"]) / 1e9 == pytest.approx(logged[iteration]["step_s"], abs=1e-6)
    return len(steps_of(rd))


@pytest.mark.train
@pytest.mark.timeout(600)
def test_attach_pid_to_a_real_trainer_cancel_leaves_it_running_and_a_second_follows_it_to_its_end(
        megatron_lm_checkout, tmp_path):
    exp = Experiment.load("tiny-local")
    exp.training.train_iters = 60
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        trainer = subprocess.Popen(pretrain_gpt_argv(megatron_lm_checkout, exp), stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=megatron_lm_checkout, start_new_session=True)
    try:
        wait_for(lambda: " iteration        1/" in log.read_text(errors="replace"), 300, "the trainer's first step")
        first = RunDir(attach("pid", str(trainer.pid), log_format="megatron", assignments=HOST).run_dir)
        assert first.manifest().command["attached"].startswith(f"pid {trainer.pid} (")
        wait_for(lambda: len(steps_of(first)) >= 3, 120, "three steps read from the trainer's stdout")
        assert cancel(first) == "cancelled"
        wait_for(lambda: run_processes(str(first.path)) == [], 20, "every process of the attach to end")
        assert trainer.poll() is None, "cancelling the attach left the trainer running"
        second = RunDir(attach("pid", str(trainer.pid), log_format="megatron", assignments=HOST).run_dir)
        manifest = wait_final(second, 400)
        assert manifest["status"] == "completed", (manifest.get("failure"), logs(second)[-2000:])
        assert trainer.wait(timeout=60) == 0, "the trainer ended on its own, successfully"
        text = log.read_text(errors="replace")
        parsed = check_parsed(first, text) + check_parsed(second, text)
        assert max(steps_of(second)) == 60 and parsed >= 10
        telemetry = second.scan_telemetry().collect()
        assert telemetry.height > 0 and telemetry["iteration"].drop_nulls().len() > 0
        assert "ended: exited" in (next(second.logs_dir.glob("train-*.log"))).read_text()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_attach_refuses_what_it_cannot_attach_to(charllm_dirs):
    for kind, ident, says in (("pid", "x1", "a process id is a number"), ("pid", "999999999", "no such process"),
                              ("slurm", "12a", "a job id is a number"), ("nodes", "1", "attach slurm JOBID")):
        with pytest.raises(UserError, match=says):
            attach(kind, ident)
    assert not charllm_dirs["runs"].exists() or not any(charllm_dirs["runs"].iterdir())


def test_the_cli_says_what_it_cannot_attach_to_in_one_line(capsys, charllm_dirs):
    from charllm.tui.cli import main

    for argv, says in ((["attach", "pid", "x1"], "attach pid 'x1': a process id is a number"),
                       (["attach", "slurm", "12a"], "attach slurm '12a': a job id is a number"),
                       (["attach", "pid", "1", "--log-format", "(?P<loss>x)"], "(?P<iteration>")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not charllm_dirs["runs"].exists() or not any(charllm_dirs["runs"].iterdir())


JOB = textwrap.dedent("""\
    #!/bin/bash
    #SBATCH --job-name=users-own
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --output={out}
    srun --nodes=2 --ntasks=2 bash -c 'if [ "$SLURM_PROCID" = 1 ]; then {python} {printer}; else sleep {seconds}; fi'
    """)
# The job's last task logs steps as Megatron-LM's training_log formats them (training.py, core_v0.16.1).
PRINTER = textwrap.dedent("""\
    import time
    for i in range(1, {steps} + 1):
        line = " iteration {{:8d}}/{{:8d}} |".format(i, {steps})
        line += " consumed samples: {{:12d}} |".format(8 * i)
        line += " elapsed time per iteration (ms): {{:.1f}} |".format(250.0)
        line += f" learning rate: {{1e-4:.6E}} | global batch size: {{8:5d}} |"
        line += " lm loss: {{:.6E}} |".format(7.0 - i / 1000)
        line += f" loss scale: {{1.0:.1f}} | grad norm: {{1.5:.3f}} |"
        line += " number of skipped iterations: {{:3d}} | number of nan iterations: {{:3d}} |".format(0, 0)
        print(line, flush=True)
        time.sleep(0.25)
    """)


@pytest.mark.timeout(400)
def test_attach_slurm_records_every_node_and_leaves_the_job_running(slurm_cluster, tmp_path):
    out, script, printer = tmp_path / "job.out", tmp_path / "job.sbatch", tmp_path / "printer.py"
    printer.write_text(PRINTER.format(steps=120))
    script.write_text(JOB.format(out=out, python=sys.executable, printer=printer, seconds=120 // 4 + 2))
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         env=slurm_cluster.env, check=True).stdout.strip().split(";")[0]
    state = lambda: slurm_cluster.scontrol("show", "job", job)   # noqa: E731
    wait_for(lambda: "JobState=RUNNING" in state(), 60, "the job to run")
    first = RunDir(attach("slurm", job, log_format="megatron", assignments=HOST).run_dir)
    manifest = first.manifest()
    assert manifest.nodes == ["n1", "n2"] and manifest.command["attached"].startswith(f"slurm job {job} (users-own)")

    def nodes_recorded(rd: RunDir) -> set:
        try:
            return set(rd.scan_telemetry().select("node").collect()["node"].to_list())
        except Exception:   # noqa: BLE001 - no chunk yet
            return set()

    wait_for(lambda: nodes_recorded(first) == {"n1", "n2"} and len(steps_of(first)) >= 3, 120,
             "telemetry from both nodes and three steps from the job's stdout")
    assert cancel(first) == "cancelled"
    wait_for(lambda: run_processes(str(first.path)) == [], 20, "every process of the attach to end")
    assert "JobState=RUNNING" in state(), "cancelling the attach left the job running"
    second = RunDir(attach("slurm", job, log_format="megatron", assignments=HOST).run_dir)
    final = wait_final(second, 300)
    assert final["status"] == "completed", (final.get("failure"), logs(second)[-2000:])
    assert "JobState=COMPLETED" in state() or "Invalid job id" in state() or not state()
    text = out.read_text()
    assert check_parsed(first, text) + check_parsed(second, text) >= 10 and max(steps_of(second)) == 120
    assert nodes_recorded(second) == {"n1", "n2"}
    assert f"slurm {job} ended: COMPLETED" in next(second.logs_dir.glob("train-*.log")).read_text()


@pytest.mark.timeout(120)
def test_runs_show_of_an_attach_says_once_what_it_is_attached_to(tmp_path, capsys):
    from charllm.tui.cli import main

    log = tmp_path / "job.log"
    with open(log, "wb") as out:
        job = subprocess.Popen([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"],
                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rd = RunDir(attach("pid", str(job.pid), log_format="megatron", assignments=HOST).run_dir)
        assert main(["runs", "show", rd.id]) == 0
        out = capsys.readouterr().out
        said = [line for line in out.splitlines() if "attached to" in line]
        assert len(said) == 1 and said[0].startswith(f"ran:      attached to pid {job.pid} ("), out
        assert "not planned: an attached job's layout is not known" in out   # (the other notes are still said)
        assert cancel(rd) == "cancelled"
        wait_for(lambda: run_processes(str(rd.path)) == [], 20, "every process of the attach to end")
        assert job.poll() is None, "cancelling the attach left the job running"
    finally:
        job.kill()
        job.wait()
