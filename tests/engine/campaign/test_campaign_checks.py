"""A campaign is checked whole before anything starts (issue 39): every member it would run must pass
what `launch` checks on its target, and the target must be ready; otherwise one line per reason, exit
2, and nothing started or recorded. Once through, its status says what happened, never "completed"
over members that did not complete. No training here."""

from __future__ import annotations

import pytest

from charllm.engine.campaign import state
from infra_campaign import plant_record, tiny_campaign
from infra_cli import run


def nothing_recorded(charllm_dirs) -> bool:
    """No campaign record, no run, not even the folder of campaign records."""
    runs = charllm_dirs["runs"]
    return state.recorded() == [] and (not runs.is_dir() or list(runs.iterdir()) == [])


def error_lines(err: str) -> list[str]:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[0].startswith("charllm-tui: error: "), err
    return lines


def test_a_four_node_campaign_on_the_local_target_is_refused_with_nothing_started(charllm_dirs, capsys):
    """Before: all 15 members failed one by one, then "completed"."""
    code, out, err = run(capsys, "campaign", "run", "ppt-parallelism", "--target", "local")
    lines = error_lines(err)
    assert code == 2 and out == "", out
    assert lines[0] == ("charllm-tui: error: campaign 'ppt-parallelism' cannot run on target 'local'; nothing was "
                        "started (1 reason)")
    assert len(lines) == 2 and lines[1].startswith("  cluster.nodes = 4: the local target is one node")
    assert "(15 members: ppt-h200-gpt3-175b-1-01000, " in lines[1] and lines[1].endswith("and 12 more)")
    assert nothing_recorded(charllm_dirs)


def test_each_reason_is_one_line_naming_its_members(charllm_dirs, capsys):
    """The node count, and what the hardware's software stack cannot run (launch's layout check)."""
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "mixed.toml").write_text('experiments = ["tiny-local"]\n[axes]\nnodes = [1, 2]\n'
                                       'transformer_impl = ["local", "transformer_engine"]\n')
    code, _, err = run(capsys, "campaign", "run", "mixed")
    lines = error_lines(err)
    assert code == 2 and "(2 reasons)" in lines[0] and len(lines) == 3, err
    assert lines[1].startswith("  transformer_impl = 'transformer_engine': needs Transformer Engine on a CUDA GPU")
    assert "--force" not in lines[1]
    assert lines[1].endswith("(1 member: tiny-local-nodes1-transformer_impltransformerengine)")
    assert lines[2].startswith("  cluster.nodes = 2: the local target is one node")
    assert lines[2].endswith("(2 members: tiny-local-nodes2-transformer_impllocal, "
                             "tiny-local-nodes2-transformer_impltransformerengine)")
    assert nothing_recorded(charllm_dirs)


def test_a_slurm_target_without_sbatch_is_refused_as_launch_refuses_it(charllm_dirs, capsys, monkeypatch, tmp_path):
    """Before: "6 of 6 members queued", exit 0, then every member failed."""
    charllm_dirs["config"].mkdir(parents=True, exist_ok=True)
    (charllm_dirs["config"] / "targets.toml").write_text('[cluster]\nkind = "slurm"\npartition = "debug"\n')
    name = tiny_campaign(charllm_dirs, target="cluster")
    monkeypatch.setenv("PATH", str(tmp_path))          # no Slurm command here
    code, _, err = run(capsys, "campaign", "run", name)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 2, err
    assert lines[1] == "  target 'cluster': `sbatch` is not on PATH (run from a Slurm login node) (every member)"
    code, _, launch_err = run(capsys, "launch", "tiny-local", "--target", "cluster")
    assert code == 2 and "`sbatch` is not on PATH" in launch_err, "the same check as launch's"
    assert nothing_recorded(charllm_dirs)


@pytest.mark.parametrize("statuses, ended, failure", [
    (["completed", "skipped", "invalid"], "completed", None),
    (["completed", "failed", "skipped"], "failed", "1 of 3 members did not complete (1 failed)"),
    (["failed", "missing", "cancelled", "completed"], "failed",
     "3 of 4 members did not complete (1 failed, 1 cancelled, 1 missing)"),
])
def test_a_campaign_through_its_queue_ends_as_its_members_did(statuses, ended, failure, charllm_dirs):
    plant_record(charllm_dirs["runs"], "c", [{"status": s} for s in statuses])
    outcome = state.outcome(state.Record.load("c"))
    assert outcome["status"] == ended and outcome.get("failure") == failure


def test_a_member_whose_launch_is_refused_after_the_check_counts_as_refused(charllm_dirs, monkeypatch, tmp_path):
    """The target changed between the check and the member's turn (here: sbatch gone): the member is
    refused, with launch's reason, the queue goes on, and the campaign cannot end completed."""
    from charllm.engine.campaign.queue import Queue
    from charllm.engine.campaign.spec import Campaign
    from charllm.engine.launch.targets import get_target

    charllm_dirs["config"].mkdir(parents=True, exist_ok=True)
    (charllm_dirs["config"] / "targets.toml").write_text('[cluster]\nkind = "slurm"\npartition = "debug"\n')
    name = tiny_campaign(charllm_dirs, target="cluster")
    campaign = Campaign.load(name)
    state.Record.new(campaign, campaign.plan(), get_target("cluster").to_dict(), include_oom=False,
                     max_parallel=2).save()
    queue = Queue(name)
    monkeypatch.setenv("PATH", str(tmp_path))
    member = queue.record.members[0]
    assert queue.start_member(member, queue.target, tied=False) is None
    assert member["status"] == "refused" and member["failure"] == (
        "not started: target 'cluster': `sbatch` is not on PATH (run from a Slurm login node)")
    record = state.Record.load(name)
    assert "(5 queued, 1 refused)" in record.progress()
    for m in record.members[1:]:
        m["status"] = "completed"
    assert state.outcome(record) == {"status": "failed", "failure": "1 of 6 members did not complete (1 refused)"}
