"""Campaigns of a user's own command (issue 37 item 3): each axis fills its {placeholder} in the command
template; each member is planned from its Megatron flags where they give a layout, else "layout unknown"
and run all the same. The last test runs a real trainer charllm did not write, two members at once."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from charllm.engine.campaign import spec
from charllm.engine.campaign.spec import LAYOUT_UNKNOWN, Campaign, fill, placeholders
from charllm.engine.model.experiment import Experiment
from charllm.engine.model.megatron import export_megatron_args
from charllm.engine.model.memory import FITS, TIGHT
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir
from infra_campaign import record
from infra_cli import one_error_line, run
from infra_megatron_lm import megatron_lm_checkout, pretrain_gpt_argv  # noqa: F401 - fixture

TRAINER = Path(__file__).with_name("tiny_trainer.py")


def trainer_line(iters: int = 5) -> str:
    return f"{shlex.quote(sys.executable)} {TRAINER} --micro-batch-size {{micro_batch_size}} --train-iters {iters}"


def pretrain_gpt_template() -> str:
    """A torchrun line of Megatron-LM's pretrain_gpt.py for tiny-local, its micro batch a placeholder."""
    flags = shlex.join(export_megatron_args(Experiment.load("tiny-local")))
    flags, replaced = re.subn(r"--micro-batch-size \d+", "--micro-batch-size {micro_batch_size}", flags)
    assert replaced == 1
    return f"torchrun --nproc-per-node 2 pretrain_gpt.py {flags}"


def test_each_axis_value_fills_its_placeholder_as_one_shell_word_and_the_shells_own_are_left():
    template = "cd ${HOME} && run --mbs {mbs} --name {name} --again {mbs} {a,b}"
    assert placeholders(template) == ["mbs", "name"]
    assert fill(template, {"mbs": 4, "name": "two words"}) == \
        "cd ${HOME} && run --mbs 4 --name 'two words' --again 4 {a,b}"


def test_members_are_planned_from_their_flags_where_they_give_a_layout():
    campaign = Campaign.from_dict("gpt", {"command": pretrain_gpt_template(), "hardware": "cpu",
                                         "axes": {"micro_batch_size": [1, 2, 4]}})
    plans = campaign.plan()
    assert [p.member.experiment.training.micro_batch_size for p in plans] == [1, 2, 4]
    assert [p.member.experiment.name for p in plans] == ["pretrain_gpt-mbs1", "pretrain_gpt-mbs2", "pretrain_gpt-mbs4"]
    for p in plans:
        assert p.member.known and p.member.command.planned and p.member.layout_label == "TP1 PP1 DP2"
        # the model tiny-local's flags describe, by its preset's name: compare pairs it with tiny-local's runs
        assert p.member.experiment.model.name == Experiment.load("tiny-local").model.name
        assert f"--micro-batch-size {p.member.values['micro_batch_size']} " in p.member.command.line
        assert p.verdict in (FITS, TIGHT) and p.peak_bytes and p.reason.startswith("planned ")
    peaks = [p.peak_bytes for p in plans]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1], "a bigger micro batch is planned to need more"


def test_members_whose_flags_give_no_layout_are_layout_unknown_and_still_run():
    campaign = Campaign.from_dict("mine", {"command": trainer_line(), "axes": {"micro_batch_size": [1, 2]}})
    plans = campaign.plan()
    assert [p.verdict for p in plans] == [LAYOUT_UNKNOWN] * 2 and all(p.runnable for p in plans)
    assert all(p.member.layout_label == LAYOUT_UNKNOWN and not p.member.command.planned for p in plans)
    assert plans[0].reason.startswith("the command's flags give no layout"), plans[0].reason
    assert spec.describe(plans).startswith("2 members: 2 planned to run")


@pytest.mark.parametrize("table, says", [
    ({"command": "run --mbs {mbs}", "axes": {"mbz": [1]}}, "command: {mbs} is no axis"),
    ({"command": "run --mbs {mbs}", "axes": {"mbs": [1], "tp": [1, 2]}}, "axes.tp: the command never uses {tp}"),
    ({"command": "run", "experiments": ["tiny-local"]}, "experiments and command: give one"),
    ({"command": "run --tp {tp}", "axes": {"tp": [1]}, "layouts": [{"tensor_model_parallel_size": 2}]},
     "layouts and command: give one"),
    ({"command": "  "}, "command = '  ': give your command as one string"),
    ({"command": "run {x}", "axes": {"x": [[1, 2]]}}, "axes.x = [[1, 2]]: must be a non-empty list of numbers"),
    ({"command": "run {x}", "axes": {"x": [True]}}, "axes.x = [True]: must be a non-empty list of numbers"),
    ({"command": "run {x}", "axes": {"x": [1, 1]}}, "axes.x = [1, 1]: a value is listed twice"),
    ({"command": "run", "log_format": "(?P<loss>x)"}, "log_format: "),
    ({"experiments": ["tiny-local"], "log_format": "nemo"}, "log_format goes with command"),
    ({"command": "run", "hardware": "no-such-device"}, "member 1 (run): "),
])
def test_a_bad_command_campaign_is_one_line_naming_the_field(table, says):
    with pytest.raises(UserError) as caught:
        Campaign.from_dict("bad", table).members()
    message = str(caught.value)
    assert says in message and message.startswith("campaign 'bad': ") and "\n" not in message, message


def test_a_command_campaign_for_other_machines_needs_their_hardware(charllm_dirs):
    """On this machine without a GPU a command's plan defaults to cpu; on a target's nodes it cannot
    know their devices, so it asks, before anything is recorded or started."""
    from charllm.engine.campaign import queue, state
    from charllm.engine.launch.targets import parse_target

    campaign = Campaign.from_dict("remote", {"command": trainer_line(), "axes": {"micro_batch_size": [1]}})
    nodes = parse_target("nodes", {"kind": "ssh", "hosts": ["node1"]})
    with pytest.raises(UserError) as caught:
        queue.start(campaign, nodes)
    assert "campaign 'remote': hardware: give the nodes' device preset" in str(caught.value)
    assert "target 'nodes' runs the command on other machines" in str(caught.value)
    assert not state.directory("remote").exists()


def test_the_cli_says_a_wrong_placeholder_in_one_line(capsys, charllm_dirs):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "typo.toml").write_text('command = "run --mbs {micro_batch_sise}"\n[axes]\nmicro_batch_size = [1]\n')
    code, out, err = run(capsys, "campaign", "plan", "typo")
    assert code == 2 and "{micro_batch_sise} is no axis; did you mean 'micro_batch_size'" in one_error_line(err)
    code, out, err = run(capsys, "campaign", "keys")
    assert code == 0 and re.search(r"^command\s+instead of experiments", out, re.M), out


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_campaign_of_a_real_trainer_runs_both_members_and_reads_their_steps(capsys, charllm_dirs):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "trainer.toml").write_text(f'command = "{trainer_line(6)}"\nlog_format = "megatron"\n'
                                         '[axes]\nmicro_batch_size = [1, 2]\n[target]\nmax_parallel = 2\n')
    code, out, _ = run(capsys, "campaign", "show", "trainer")
    assert code == 0 and f"# member 2 (tiny_trainer-mbs2, {LAYOUT_UNKNOWN}) runs: {sys.executable} {TRAINER} " \
                         "--micro-batch-size 2 --train-iters 6" in out, out
    code, out, err = run(capsys, "campaign", "run", "trainer")
    assert code == 0, out + err
    rec = record("trainer")
    assert rec.data["status"] == "completed" and [m["status"] for m in rec.members] == ["completed"] * 2
    for m, mbs in zip(rec.members, (1, 2)):
        line = f"{sys.executable} {TRAINER} --micro-batch-size {mbs} --train-iters 6"
        assert m["command"] == line and m["layout"] == LAYOUT_UNKNOWN and m["micro_batch_size"] == mbs
        assert f"  {m['name']}: completed: ran: {line}" in out, out
        rd = RunDir(rec.run_dir(m).path)
        assert rd.manifest().command["line"] == line and rd.manifest().name == f"tiny_trainer-mbs{mbs}"
        steps = [r for r in rd.iteration_records() if r.get("event") == "iteration"]
        assert [s["iteration"] for s in steps] == list(range(1, 7)) and {s["samples"] for s in steps} == {mbs}
        logged = [float(x) for x in re.findall(r"lm loss: (\S+) \|", next(rd.logs_dir.glob("train-*.log")).read_text())]
        assert [s["loss"] for s in steps] == pytest.approx(logged) and len(logged) == 6
        assert [(e["status"], e["records"]) for e in rd.end_events()] == [("completed", 6)]
    code, out, _ = run(capsys, "campaign", "status", "trainer")
    assert code == 0 and out.count("ran: ") == 2, out


@pytest.mark.integration
@pytest.mark.train
@pytest.mark.timeout(900)
def test_a_campaign_of_megatron_lms_pretrain_gpt_plans_each_member_from_its_flags_and_trains_it(
        capsys, charllm_dirs, megatron_lm_checkout):
    exp = Experiment.load("tiny-local")
    exp.training.train_iters = 6
    line, replaced = re.subn(r"--micro-batch-size \d+", "--micro-batch-size {micro_batch_size}",
                             shlex.join(pretrain_gpt_argv(megatron_lm_checkout, exp)))
    assert replaced == 1
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "gpt.toml").write_text(f"command = '''{line}'''\ncwd = '{megatron_lm_checkout}'\n"
                                     "[axes]\nmicro_batch_size = [1, 2]\n")
    code, out, err = run(capsys, "campaign", "run", "gpt")
    assert code == 0, out + err
    rec = record("gpt")
    assert [(m["status"], m["layout"], m["micro_batch_size"]) for m in rec.members] == \
        [("completed", "TP1 PP1 DP2", 1), ("completed", "TP1 PP1 DP2", 2)]
    for m, mbs in zip(rec.members, (1, 2)):
        rd = RunDir(rec.run_dir(m).path)
        assert m["verdict"] in (FITS, TIGHT) and m["planned"]["step_s"] > 0
        assert rd.manifest().command["planned"] and f"--micro-batch-size {mbs} " in rd.manifest().command["line"]
        assert Experiment.load(rd.experiment_path).training.micro_batch_size == mbs   # the plan it ran against
        steps = [r for r in rd.iteration_records() if r.get("event") == "iteration"]
        assert [s["iteration"] for s in steps] == list(range(1, 7)) and {s["samples"] for s in steps} == {8}
