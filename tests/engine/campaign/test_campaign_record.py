"""A campaign's record on disk, without training: one supervisor per campaign (its lock, held by a
real second process here), members whose run vanished, and what the record says once it has ended."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from charllm.engine.campaign import state
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir
from infra_campaign import plant_record
from infra_cli import one_error_line, run

HOLD = ("import sys, time; from charllm.engine.campaign import state; state.take_lock(sys.argv[1]); "
        "print('held', flush=True); time.sleep(600)")


@pytest.fixture
def holder(charllm_dirs):
    """A real second process holding campaign 'tiny-local''s lock, as a supervisor does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, "tiny-local"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_campaign_whose_lock_another_process_holds_is_refused_saying_who(holder):
    assert state.supervisor_alive("tiny-local")
    with pytest.raises(UserError, match=rf"campaign 'tiny-local' is already being run, by process {holder.pid} on "):
        state.take_lock("tiny-local")
    holder.kill()
    holder.wait()
    assert not state.supervisor_alive("tiny-local"), "the lock ends with the process that held it"
    os.close(state.take_lock("tiny-local"))


def test_a_supervisor_started_by_hand_beside_a_running_one_is_refused_and_writes_nothing(holder, charllm_dirs):
    folder = plant_record(charllm_dirs["runs"], "tiny-local", [{"status": "queued"}])
    before = (folder / "campaign.json").read_bytes()
    done = subprocess.run([sys.executable, "-m", "charllm.engine.campaign.queue", "tiny-local"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"already being run, by process {holder.pid}" in done.stderr, done.stderr
    assert (folder / "campaign.json").read_bytes() == before


@pytest.mark.parametrize("action", ["run", "delete"])
def test_campaign_run_and_delete_wait_for_no_supervisor(action, holder, charllm_dirs, capsys):
    folder = plant_record(charllm_dirs["runs"], "tiny-local", [{"status": "completed"}], status="completed")
    code, _, err = run(capsys, "campaign", action, "tiny-local", *(["--resume"] if action == "run" else []))
    assert code == 2 and f"already being run, by process {holder.pid}" in one_error_line(err)
    assert (folder / "campaign.json").is_file()


def test_a_damaged_record_can_be_deleted_and_only_its_folder_goes(charllm_dirs, capsys, tmp_path):
    from infra_fuzz import tree

    folder = plant_record(charllm_dirs["runs"], "tiny-local", [])
    (folder / "campaign.json").write_text("{not json")
    (charllm_dirs["runs"] / "20260101-000000-kept").mkdir()
    code, out, err = run(capsys, "campaign", "run", "tiny-local")
    assert code == 2 and "damaged campaign record" in one_error_line(err), "never overwritten by a new run"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "inside").mkdir(parents=True)
    (elsewhere / "inside" / "file").write_text("theirs")
    (folder / "link").symlink_to(elsewhere)                 # a link in the record's folder is removed, not followed
    (folder / "supervisor.log").unlink(missing_ok=True)
    (folder / "supervisor.log").symlink_to(elsewhere / "inside" / "file")
    before = tree(elsewhere)
    code, out, err = run(capsys, "campaign", "run", "tiny-local")
    assert code == 2 and "supervisor.log: a symbolic link" in one_error_line(err), "nothing written through it"
    code, out, err = run(capsys, "campaign", "delete", "tiny-local")
    assert code == 0 and "record deleted" in out, err
    assert sorted(p.name for p in charllm_dirs["runs"].iterdir()) == [".campaigns", "20260101-000000-kept"]
    assert list((charllm_dirs["runs"] / ".campaigns").iterdir()) == []
    assert tree(elsewhere) == before


def test_a_member_whose_run_vanished_or_is_damaged_is_missing(charllm_dirs):
    runs = charllm_dirs["runs"]
    damaged = RunDir.create(runs / "20260101-000000-damaged", "launch")
    damaged.manifest_path.write_text("{")
    done = RunDir.create(runs / "20260101-000000-done", "launch")
    done.write_manifest({"id": done.id, "status": "completed"})
    plant_record(runs, "c", [{"status": "running", "run": "20260101-000000-gone"},
                             {"status": "running", "run": damaged.id},
                             {"status": "completed", "run": "20260101-000000-deleted"},
                             {"status": "completed", "run": done.id},
                             {"status": "completed", "run": damaged.id}])
    record = state.Record.load("c")
    statuses = [state.member_status(record, m) for m in record.members]
    assert statuses == ["missing", "damaged", "missing", "completed", "damaged"]
    assert [state.member_note(m, s) for m, s in zip(record.members, statuses)][2:] == [
        "its run was deleted; --resume runs it again", "", "its run was damaged; --resume runs it again"]


def test_an_ended_campaign_has_no_time_left():
    """Before: after its supervisor was killed, `campaign status` of a failed campaign said "about 14 s left"."""
    second = 10**9
    members = [{"status": "completed", "started_ns": 0, "ended_ns": 10 * second},
               {"status": "completed", "started_ns": 10 * second, "ended_ns": 20 * second}, {"status": "queued"}]
    record = state.Record(None, {"name": "c", "status": "running", "max_parallel": 1, "members": members})
    assert "about 10 s left" in record.progress(now_ns=20 * second)
    record.data.update(status="failed", ended_ns=20 * second)
    assert "left" not in record.progress(now_ns=20 * second) and "failed at" in record.progress()


def test_members_waiting_in_a_scheduler_s_queue_count_as_left():
    """Before: a Slurm campaign with members pending (submitted long ago, waiting for their turn) said
    "about 0 s left": a member's submission was taken for its start."""
    second = 10**9
    members = [{"status": "completed", "started_ns": 5 * second, "ended_ns": 15 * second},
               {"status": "running", "started_ns": 96 * second},
               *({"status": "pending", "submitted_ns": 0} for _ in range(4))]
    record = state.Record(None, {"name": "c", "status": "running", "max_parallel": 2, "members": members})
    assert "about 23 s left" in record.progress(now_ns=100 * second)   # (10 - 4) / 2 + 4 * 10 / 2
    members[1]["started_ns"] = 80 * second   # the running one is past the pace, nothing else left
    del members[2:]
    assert record.progress(now_ns=100 * second).endswith("; the members left run past the current pace")
