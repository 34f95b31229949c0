"""A tiny CPU campaign on this machine (2 layouts x 3 micro batches, 2 at once), for real: its
supervisor owns the queue, outlives the command that started it, takes every member run with it
when it dies, resumes what is missing and cancels everything."""

from __future__ import annotations

import contextlib
import json
import signal
import sys

import psutil
import pytest

from charllm.engine.campaign import state
from charllm.engine.campaign.report import KINDS, figure, values_of
from charllm.engine.campaign.summary import campaign_summary
from charllm.probes.analysis.summary import summarize
from infra_campaign import most_at_once, record, runs_of, tiny_campaign, wait_until
from infra_cli import run
from infra_runs import finish, left_after, run_processes, start, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.train]   # they launch training (torchrun)


def supervisor(name: str) -> psutil.Process:
    rec = wait_until(name, lambda r: r.data.get("supervisor"), 60, "its supervisor to start")
    return psutil.Process(rec.data["supervisor"]["pid"])


def supervisor_alive(rec) -> bool:
    from charllm.probes.core import procid

    return procid.live(rec.data.get("supervisor") or {}, None) is not None


def lock_holders(name: str) -> set[int]:
    """The processes holding campaign `name`'s lock file open (from /proc/PID/fd)."""
    lock = str(state.directory(name) / state.LOCK)
    found = set()
    for proc in psutil.process_iter():
        try:
            if any(f.path == lock for f in proc.open_files()):
                found.add(proc.pid)
        except psutil.Error:
            pass
    return found


def nothing_left(rec) -> bool:
    return all(left_after(str(rd.path), timeout=30) == 0 for rd in runs_of(rec))


@pytest.mark.timeout(600)
def test_a_tiny_campaign_runs_two_at_a_time_and_reads_as_one(charllm_dirs, capsys, tmp_path):
    name = tiny_campaign(charllm_dirs)
    code, out, err = run(capsys, "campaign", "run", name)
    assert code == 0, out + err
    rec = record(name)
    assert rec.data["status"] == "completed" and [m["status"] for m in rec.members] == ["completed"] * 6
    assert most_at_once(rec) == 2, "two members at once, never more"
    assert nothing_left(rec)
    summary = campaign_summary(rec)
    assert summary.height == 6 and summary["tokens_per_s"].null_count() == 0
    assert summary["micro_batch_size"].to_list() == ["1", "2", "4", "1", "2", "4"]
    for kind in KINDS:
        code, out, err = run(capsys, "campaign", "report", name, "--figure", kind, "--metric",
                             "tokens_per_s" if kind != "heatmap" else "power_mean_w")
        assert code == 0 and "Traceback" not in err, err
        for suffix in (".svg", ".png"):
            code, _, err = run(capsys, "campaign", "report", name, "--figure", kind, "--out",
                               str(tmp_path / f"{kind}{suffix}"))
            assert code == 0 and (tmp_path / f"{kind}{suffix}").stat().st_size > 1000, err
    # every plotted value is what summarize gives for that member
    fig = figure(rec, "microbatch", "tokens_per_s")
    plotted = values_of(fig)
    assert len(plotted) == 6
    for m in rec.members:
        expected = summarize(rec.run_dir(m), "steady", by="run")["tokens_per_s"][0]
        label = next(s.label for s in fig.panels[0].series if m["layout"] in s.label)
        assert plotted[("tokens_per_s", label, str(m["micro_batch_size"]))] == pytest.approx(expected)
    code, out, _ = run(capsys, "campaign", "summary", name, "--format", "csv")
    assert code == 0 and len(out.strip().splitlines()) == 7
    # beside the shipped tiny-local campaign (its plans, never run here): the fastest member measured
    code, out, err = run(capsys, "campaign", "compare", name, "tiny-local", "--format", "json")
    assert code == 0, err
    found = json.loads(out)
    assert [(r["source"], r["campaign"]) for r in found] == \
        [("predicted", name), ("predicted", "tiny-local"), ("measured", name), ("measured", "tiny-local")]
    fastest = summary.sort("tokens_per_s", descending=True).row(0, named=True)
    measured = found[2]
    assert measured["member"] == fastest["member"]
    assert measured["tokens_per_s"] == pytest.approx(fastest["tokens_per_s"])
    assert measured["gpus"] == 2 and measured["tokens_per_s_per_gpu"] == pytest.approx(fastest["tokens_per_s"] / 2)
    assert found[3]["why"] == "not run" and found[0]["tokens_per_s"] > 0


@pytest.mark.timeout(600)
def test_killing_the_command_that_started_it_leaves_the_queue_going(charllm_dirs):
    name = tiny_campaign(charllm_dirs)
    starter = start([sys.executable, "-m", "charllm.tui", "campaign", "run", name])
    wait_until(name, lambda r: any(m.get("run") for m in r.members), 120, "a member to start")
    starter.send_signal(signal.SIGKILL)
    starter.communicate()
    rec = wait_until(name, lambda r: r.data["status"] == "completed", 480, "the queue to run through")
    assert [m["status"] for m in rec.members] == ["completed"] * 6 and most_at_once(rec) <= 2


@pytest.mark.timeout(600)
def test_killing_its_supervisor_stops_every_member_and_resume_runs_only_what_is_missing(charllm_dirs, capsys):
    name = tiny_campaign(charllm_dirs, max_parallel=1)
    code, out, err = run(capsys, "campaign", "run", name, "--detach")
    assert code == 0, err
    rec = wait_until(name, lambda r: sum(m["status"] == "completed" for m in r.members) >= 2 and
                     any(m["status"] == "running" for m in r.members), 300, "two members done, a third running")
    supervisor(name).kill()
    rec = wait_until(name, lambda r: r.data["status"] == "failed", 60, "the next reader to finish it")
    assert "the campaign supervisor died" in rec.data["failure"]
    code, out, _ = run(capsys, "campaign", "status", name)
    assert code == 0 and "failed at" in out.splitlines()[0] and "left" not in out.splitlines()[0], "no time left"
    assert nothing_left(rec), "its members' runs were stopped with it"
    done = {m["key"]: m["run"] for m in rec.members if m["status"] == "completed"}
    stopped = [m for m in rec.members if m.get("run") and m["status"] != "completed"]
    assert len(done) >= 2 and stopped and all(m["status"] == "cancelled" for m in stopped)
    code, out, err = run(capsys, "campaign", "run", name, "--resume")
    assert code == 0, out + err
    rec = record(name)
    assert [m["status"] for m in rec.members] == ["completed"] * 6
    assert {m["key"]: m["run"] for m in rec.members if m["key"] in done} == done, "completed members kept their runs"
    assert all(m["runs"] for m in rec.members if m["key"] in {s["key"] for s in stopped}), "earlier runs remembered"
    code, _, err = run(capsys, "campaign", "run", name, "--resume")
    assert code == 2 and "no member left to run" in err


@pytest.mark.timeout(600)
def test_campaign_cancel_stops_every_member_and_the_queue(charllm_dirs, capsys):
    name = tiny_campaign(charllm_dirs, iters=100_000)
    assert run(capsys, "campaign", "run", name, "--detach")[0] == 0
    wait_until(name, lambda r: sum(m["status"] == "running" for m in r.members) == 2, 300, "two members running")
    code, out, err = run(capsys, "campaign", "cancel", name)
    assert code == 0, err
    rec = record(name)
    assert rec.data["status"] == "cancelled" and {m["status"] for m in rec.members} == {"cancelled"}
    said = out.splitlines()[-1]
    assert said.startswith(f"{name}: 6 members (6 cancelled)"), out
    assert run(capsys, "campaign", "status", name)[1].splitlines()[0] == said, "status then says what cancel said"
    assert nothing_left(rec) and not supervisor_alive(rec)
    code, _, err = run(capsys, "campaign", "cancel", name)
    assert code == 2 and "already cancelled" in err


@pytest.mark.timeout(300)
def test_campaign_cancel_settles_a_campaign_whose_supervisor_dies_without_a_word(charllm_dirs, capsys):
    """The supervisor dies (SIGKILL) while cancel waits for it: cancel notices at once, stops the
    members itself and records the campaign cancelled (it once waited 120 s, then raised NoSuchProcess)."""
    import threading
    import time

    from charllm.engine.campaign import queue

    name = tiny_campaign(charllm_dirs, iters=100_000)
    assert run(capsys, "campaign", "run", name, "--detach")[0] == 0
    wait_until(name, lambda r: sum(m["status"] == "running" for m in r.members) == 2, 240, "two members running")
    sup = supervisor(name)
    sup.send_signal(signal.SIGSTOP)          # it cannot answer the SIGTERM cancel sends ...
    outcome: list = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: outcome.append(queue.cancel(name)))
    thread.start()
    time.sleep(2)
    sup.kill()                               # ... and dies without recording anything
    thread.join(timeout=90)
    assert not thread.is_alive() and outcome, "cancel returned"
    assert time.monotonic() - started < 60
    rec = record(name)
    assert rec.data["status"] == "cancelled", rec.data["status"]
    assert not any(m["status"] in ("running", "pending", "queued") for m in rec.members), rec.progress()
    assert nothing_left(rec)


@pytest.mark.timeout(300)
def test_a_member_past_its_time_limit_is_stopped_and_recorded_with_its_cause(charllm_dirs, capsys):
    name = tiny_campaign(charllm_dirs, iters=100_000, max_parallel=2, extra="time_limit = 20\n", micro_batches=(1,))
    code, out, err = run(capsys, "campaign", "run", name)
    rec = record(name)
    assert code == 1 and [m["status"] for m in rec.members] == ["failed", "failed"], out + err
    assert all("time limit (20 s) reached" in m["failure"] for m in rec.members)
    assert rec.data["status"] == "failed" and rec.data["failure"] == "2 of 2 members did not complete (2 failed)"
    assert out.splitlines()[-1] == f"campaign {name}: failed (2 failed)", "never 'completed' over failed members"
    assert nothing_left(rec)
    wait_for(lambda: not supervisor_alive(rec), 30, "the supervisor to exit")


@pytest.mark.timeout(600)
def test_two_campaign_runs_at_once_start_one_supervisor_and_the_other_says_who_runs_it(charllm_dirs, capsys):
    """Issue 35: both used to succeed: two supervisors, a member run twice at once against max_parallel = 1."""
    name = tiny_campaign(charllm_dirs, max_parallel=1, micro_batches=(1, 2), layouts=(1,))
    argv = [sys.executable, "-m", "charllm.tui", "campaign", "run", name, "--detach"]
    starters = [start(argv), start(argv)]
    (won, out, _), (lost, _, err) = sorted(finish(p, 120) for p in starters)
    assert won == 0 and "queued on local" in out, out
    rec = wait_until(name, lambda r: any(m["status"] == "running" for m in r.members), 300, "a member running")
    boss = supervisor(name)
    assert lost == 2 and len(err.strip().splitlines()) == 1 and "is already being run, by process " in err, err
    assert any(f"by process {pid} on " in err for pid in (boss.pid, *(p.pid for p in starters))), err
    assert lock_holders(name) == {boss.pid}, "the supervisor alone holds the lock: no member run inherits it"
    assert state.supervisor_alive(name)
    rec = wait_until(name, lambda r: r.data["status"] == "completed", 480, "the queue to run through")
    assert [m["status"] for m in rec.members] == ["completed"] * 2 and most_at_once(rec) == 1
    assert len([p for p in charllm_dirs["runs"].iterdir() if not p.name.startswith(".")]) == 2, "each member ran once"
    wait_for(lambda: not state.supervisor_alive(name), 30, "the lock to go with the supervisor")
    # A completed member whose run was deleted since is missing, one whose run was damaged since is
    # damaged (issue 39: it said "completed", naming the deleted run), and --resume runs both again.
    damaged, deleted = rec.members[0]["run"], rec.members[1]["run"]
    assert run(capsys, "runs", "delete", deleted)[0] == 0
    rec.run_dir(rec.members[0]).manifest_path.write_text("{")
    code, out, _ = run(capsys, "campaign", "status", name)
    rows = {run_id: next(line for line in out.splitlines() if run_id in line) for run_id in (damaged, deleted)}
    assert code == 0 and "(1 missing, 1 damaged)" in out.splitlines()[0], out
    assert " damaged " in rows[damaged] and "its run was damaged; --resume runs it again" in rows[damaged], out
    assert " missing " in rows[deleted] and "its run was deleted; --resume runs it again" in rows[deleted], out
    code, out, err = run(capsys, "campaign", "run", name, "--resume")
    rec = record(name)
    assert code == 0 and "2 of 2 members queued" in out and [m["status"] for m in rec.members] == ["completed"] * 2
    assert [m["runs"] for m in rec.members] == [[damaged], [deleted]], "the lost runs remembered"


@pytest.mark.timeout(600)
def test_a_member_whose_run_vanishes_is_missing_the_queue_goes_on_and_cancel_settles_every_member(
        charllm_dirs, capsys):
    """Issue 35: the member stayed running, the queue never went on, the supervisor polled forever, and
    `campaign cancel` left a "cancelled" record counting "1 running"."""
    import shutil

    name = tiny_campaign(charllm_dirs, iters=100_000, max_parallel=1, micro_batches=(1, 2, 4), layouts=(1,))
    assert run(capsys, "campaign", "run", name, "--detach")[0] == 0
    rec = wait_until(name, lambda r: r.members[0]["status"] == "running", 300, "the first member running")
    vanished, path = rec.members[0]["run"], rec.run_dir(rec.members[0]).path
    # Its processes are held still while it is deleted, so none of them writes it again before the
    # queue has seen it gone (a sampler makes its telemetry folder again, parents and all).
    held = run_processes(str(path))
    for proc in held:
        proc.suspend()
    try:
        shutil.rmtree(path)
        rec = wait_until(name, lambda r: r.members[1]["status"] in ("pending", "running"), 120, "the queue to go on")
    finally:
        for proc in held:
            with contextlib.suppress(psutil.Error):
                proc.resume()
    assert rec.members[0]["status"] == "missing" and "is gone; --resume runs it again" in rec.members[0]["failure"]
    assert "1 missing" in rec.progress()
    code, out, err = run(capsys, "campaign", "cancel", name)
    rec = record(name)
    assert code == 0 and rec.data["status"] == "cancelled", out + err
    assert [m["status"] for m in rec.members] == ["missing", "cancelled", "cancelled"]
    assert "running" not in out and "missing" in out, out
    assert nothing_left(rec) and not state.supervisor_alive(name)
    code, out, err = run(capsys, "campaign", "run", name, "--resume", "--detach")
    assert code == 0 and "3 of 3 members queued" in out, out + err
    rec = wait_until(name, lambda r: r.members[0]["status"] == "running", 300, "the missing member running again")
    assert rec.members[0]["run"] != vanished and rec.members[0]["runs"] == [vanished]
    assert run(capsys, "campaign", "cancel", name)[0] == 0
    assert nothing_left(record(name))
