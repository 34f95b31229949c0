"""The run directory contract: ids, resolution, manifest, deletion rules."""

import pytest

from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir, check_run_id, resolve_run


def _run(root, run_id, status):
    rd = RunDir(root / run_id)
    rd.write_manifest({"id": run_id, "status": status})
    return rd


def test_a_running_run_cannot_be_deleted_a_finished_one_can(tmp_path):
    running = _run(tmp_path, "20260101-000000-a", "running")
    with pytest.raises(UserError, match=r"run '20260101-000000-a' is running; cancel it first \(charllm-tui runs cancel"):
        running.delete()
    assert running.path.is_dir()
    done = _run(tmp_path, "20260101-000001-b", "completed")
    done.delete()
    assert not done.path.exists()


def test_resolve_by_prefix_suffix_and_ambiguity(tmp_path):
    _run(tmp_path, "20260101-000000-tiny-local", "completed")
    _run(tmp_path, "20260101-000005-tiny-tp2", "failed")
    assert resolve_run("tiny-tp2", root=tmp_path).id == "20260101-000005-tiny-tp2"
    with pytest.raises(UserError, match=r"ambiguous, matches 2 runs"):
        resolve_run("20260101", root=tmp_path)
    with pytest.raises(UserError, match=r"run 'nope': no such run"):
        resolve_run("nope", root=tmp_path)


def test_run_ids_cannot_carry_shell_or_paths():
    for bad in ("../etc", "a b", "x;rm -rf /", "-rf", ".hidden"):
        with pytest.raises(UserError, match="run id"):
            check_run_id(bad)
    assert check_run_id("20260101-000000-tiny.local_2") == "20260101-000000-tiny.local_2"


def test_manifest_updates_are_whole_files(tmp_path):
    rd = _run(tmp_path, "r1", "pending")
    rd.update_manifest(status="running", started_ns=5)
    assert rd.read_manifest() == {"id": "r1", "status": "running", "started_ns": 5}
    assert not list(rd.path.glob(".*.tmp"))
