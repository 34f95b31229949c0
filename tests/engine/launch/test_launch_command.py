"""`launch --command`: a user's own command under the supervisor and the probes, its log read live into
the iteration log; Megatron-LM's own pretrain_gpt.py (a program charllm did not write) trained that way
on CPU, locally and through a real Slurm on loopback."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

from charllm.engine.launch.command import plan_command
from charllm.engine.launch.launcher import cancel, launch
from charllm.engine.launch.targets import LOCAL, parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir
from infra_megatron_lm import logged_steps, megatron_lm_checkout, pretrain_gpt_argv  # noqa: F401 - fixture
from infra_runs import logs, run_processes, wait_final, wait_for
from infra_slurm import slurm_cluster  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration]

# A command that logs steps its own way (a regular expression reads them), reports its environment,
# and runs until stopped.
LOOP = ("echo \"token=$CHARLLM_RUN_TOKEN run=$CHARLLM_RUN_ID master=$MASTER_ADDR:$MASTER_PORT nodes=$NNODES "
        "rank=$NODE_RANK pet=$PET_MASTER_ADDR:$PET_MASTER_PORT\"; i=0; "
        "while true; do i=$((i+1)); echo \"step $i loss 2.$i took 50 ms\"; sleep 0.05; done")
LOOP_FORMAT = r"step (?P<iteration>\d+) loss (?P<loss>[\d.]+) took (?P<step_ms>\d+) ms"


def _launch(line: str, target=LOCAL, **options):
    exp, command, notes = plan_command(line, on_this_machine=target.on_this_machine, **options)
    exp.telemetry.backend = "host"
    return launch(exp, target, command=command, notes=notes)


@pytest.mark.timeout(120)
def test_a_command_carries_the_runs_token_and_rendezvous_and_is_cancelled_with_its_group():
    result = _launch(LOOP, log_format=LOOP_FORMAT, name="loop")
    rd = RunDir(result.run_dir)
    assert rd.manifest().command["line"] == LOOP and not rd.experiment_path.exists()   # no layout: nothing planned
    assert any(n.startswith("not planned: the command's flags give no layout") for n in result.notes)
    wait_for(lambda: sum(1 for _ in rd.iteration_records()) >= 20, 60, "twenty parsed steps")
    log = next(rd.logs_dir.glob("train-*.log"))
    said = log.read_text().splitlines()[0]
    port = int(said.split("master=127.0.0.1:")[1].split()[0])
    assert said == (f"token={rd.token} run={rd.id} master=127.0.0.1:{port} nodes=1 rank=0 "
                    f"pet=127.0.0.1:{port}"), said
    assert cancel(rd) == "cancelled"
    wait_for(lambda: run_processes(str(rd.path)) == [], 20, "every process of the run to end")
    records = list(rd.iteration_records())
    steps = [r for r in records if r.get("event") == "iteration"]
    assert [s["iteration"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(s["loss"] == float(f"2.{s['iteration']}") and s["end_ns"] - s["start_ns"] == 50_000_000 for s in steps)
    ends = [r for r in records if r.get("event") == "end"]
    assert len(ends) == 1 and ends[0]["status"] == "cancelled"
    logged = sum(1 for line in log.read_text().splitlines() if line.startswith("step "))
    assert ends[0]["records"] == len(steps) == logged     # every step line read, and each once


def test_a_command_that_fails_fails_the_run_with_its_status():
    rd = RunDir(_launch("echo 'iteration 1 starting'; exit 3", log_format="megatron", name="fails").run_dir)
    manifest = wait_final(rd, 60)
    assert manifest["status"] == "failed" and "status 3" in manifest["failure"], manifest["failure"]
    assert [r["status"] for r in rd.end_events()] == ["failed"]


@pytest.mark.parametrize("line, options, says", [
    ("  ", {}, "no command in it"),
    ("echo", {"log_format": "(?P<loss>x)"}, "(?P<iteration>"),
    ("echo 'unbalanced", {}, "cannot split the command line"),
    ("echo", {"on_this_machine": False}, "give --hardware NAME"),
])
def test_bad_commands_are_one_line(line, options, says, charllm_dirs):
    with pytest.raises(UserError, match=re.escape(says)):
        plan_command(line, **{"log_format": "megatron", **options})
    assert not charllm_dirs["runs"].exists() or not any(charllm_dirs["runs"].iterdir())


def test_the_cli_refuses_a_mix_of_experiment_and_command(capsys):
    from charllm.tui.cli import main

    assert main(["launch", "tiny-local", "--command", "echo"]) == 2
    assert main(["launch", "tiny-local", "--log-format", "nemo", "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "--hardware goes with --command" in err


def test_the_megatron_lm_runner_says_what_it_lacks_in_one_line_and_dry_runs_pretrain_gpt(
        capsys, tmp_path, monkeypatch, charllm_dirs):
    from charllm.tui.cli import main

    monkeypatch.delenv("MEGATRON_LM", raising=False)
    for argv, says in ((["launch", "tiny-local", "--runner", "megatron-lm"], "give --megatron-lm DIR"),
                       (["launch", "tiny-local", "--runner", "megatron-lm", "--megatron-lm", str(tmp_path)],
                        "no pretrain_gpt.py there"),
                       (["launch", "--command", "echo", "--runner", "megatron-lm"], "--command runs your own line")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    (tmp_path / "pretrain_gpt.py").write_text("")      # (a dry run only names it)
    assert main(["launch", "tiny-local", "--runner", "megatron-lm", "--megatron-lm", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    line = next(word for word in out.splitlines() if "charllm.engine.workload.megatron_lm" in word)
    flags = line.split(str(tmp_path / "pretrain_gpt.py"), 1)[1]
    assert "--nproc-per-node=2" in line and "--tensor-model-parallel-size 1" in flags and "--log-interval 1" in flags
    assert "--lr-decay-style constant" in flags     # (what the workload trains with: megatron.runtime_flags)
    assert not charllm_dirs["runs"].exists() or not any(charllm_dirs["runs"].iterdir())


# --------------------------------------------------------------------------------------------
# Megatron-LM's own pretrain_gpt.py, a real training program charllm did not write
# --------------------------------------------------------------------------------------------
@pytest.fixture
def checkout(megatron_lm_checkout):
    return megatron_lm_checkout


def pretrain_gpt(checkout, exp: Experiment) -> str:
    return shlex.join(pretrain_gpt_argv(checkout, exp))


def parse_rate(rd: RunDir) -> tuple[int, int, int]:
    """(step lines the command logged, of them parsed into the iteration log, misparsed)."""
    text = "".join(p.read_text(errors="replace") for p in sorted(rd.logs_dir.glob("train-*.log")))
    logged = logged_steps(text)
    parsed = {r["iteration"]: r for r in rd.iteration_records() if r.get("event") == "iteration"}
    wrong = [i for i, r in parsed.items() if i not in logged or r["loss"] != pytest.approx(logged[i]["loss"])
             or (r["end_ns"] - r["start_ns"]) / 1e9 != pytest.approx(logged[i]["step_s"], abs=1e-6)
             or r["samples"] != logged[i]["samples"]]
    return len(logged), len(set(parsed) & set(logged)), len(wrong)


def check_real_run(rd: RunDir, exp: Experiment) -> None:
    manifest = wait_final(rd, 400)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd)[-3000:])
    logged, parsed, misparsed = parse_rate(rd)
    print(f"\n{rd.id}: {logged} step lines logged, {parsed} parsed, {misparsed} misparsed")
    assert logged == exp.training.train_iters and parsed >= 0.95 * logged and misparsed == 0
    # The layout came from the command's flags: the run is planned, and the plan meets the measurement
    assert rd.experiment_path.is_file() and rd.manifest().command["planned"]
    from charllm.probes.analysis.predicted import predicted_vs_measured

    table = predicted_vs_measured(rd)
    assert {"step time", "tokens/s", "MFU"} <= set(table["metric"].to_list())
    steady = rd.read_steps().filter(~rd.read_steps()["warmup"])
    assert steady.height >= 0.95 * (exp.training.train_iters - 2)
    telemetry = rd.scan_telemetry().collect()
    tagged = telemetry.filter(telemetry["iteration"].is_not_null())
    assert tagged.height > 0, "the sampler tags rows with the parsed iteration in progress"


@pytest.mark.train
@pytest.mark.timeout(600)
def test_megatron_lms_pretrain_gpt_trains_under_launch_command_locally(checkout, monkeypatch):
    monkeypatch.chdir(checkout)      # where it runs: the command's own directory (its default)
    exp = Experiment.load("tiny-local")
    line = pretrain_gpt(checkout, exp)
    planned, command, notes = plan_command(line, log_format="megatron", cwd=str(checkout))
    assert planned.layout_label == exp.layout_label and planned.world_size == 2 and command.planned, notes
    result = _launch(line, log_format="megatron", cwd=str(checkout))
    check_real_run(RunDir(result.run_dir), exp)


@pytest.mark.train
@pytest.mark.timeout(600)
def test_megatron_lms_pretrain_gpt_trains_under_launch_command_on_slurm(checkout, slurm_cluster, monkeypatch):
    monkeypatch.chdir(checkout)
    exp = Experiment.load("tiny-local")
    target = parse_target("testcluster", {"kind": "slurm", "partition": "debug", "time": "00:10:00",
                                          "python": sys.executable})
    result = _launch(pretrain_gpt(checkout, exp), target, log_format="megatron", hardware="cpu", cwd=str(checkout))
    rd = RunDir(result.run_dir)
    check_real_run(rd, exp)
    assert rd.manifest().target["run"]["state"] == "COMPLETED"
    ends = list(rd.end_events())
    assert [(e["node"], e["status"]) for e in ends] == [("n1", "completed")]
    assert json.loads((rd.path / "manifest.json").read_text())["command"]["cwd"] == str(checkout)
