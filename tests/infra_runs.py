"""Helpers for launch tests: starting and finishing test processes, waiting on a run, finding its
processes, stopping test daemons."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from charllm.probes.store.rundir import FINAL_STATUSES, RunDir


def run_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains `marker` (a run id or run directory) as a whole
    name: run `X`'s marker does not match run `X-2`'s processes (two runs launched in one second)."""
    whole = re.compile(re.escape(marker) + r"(?![A-Za-z0-9._-])")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if whole.search(" ".join(proc.info["cmdline"] or [])) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def rank_process(marker: str, rank: int) -> psutil.Process:
    """The training worker with global rank `rank` (torchrun sets RANK in its environment)."""
    for proc in run_processes(marker):
        try:
            cmdline = proc.cmdline()
            if "charllm.engine.workload.train" in cmdline and "torch.distributed.run" not in cmdline \
                    and proc.environ().get("RANK") == str(rank):
                return proc
        except psutil.Error:
            pass
    raise AssertionError(f"no rank {rank} process for {marker}")


def start(cmd: list[str], **kw) -> subprocess.Popen:
    """A process in its own session (so a test can signal its whole tree), output captured."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); past `timeout` the whole session is killed and the test fails."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return proc.returncode, out, err


def stop_process(proc: subprocess.Popen, grace: float = 10) -> None:
    """Terminate a daemon we started, killing it if it ignores SIGTERM for `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_final(rd: RunDir, timeout: float = 240) -> dict:
    wait_for(lambda: rd.status in FINAL_STATUSES, timeout, f"run {rd.id} to end (status {rd.status})")
    return rd.read_manifest()


def iterations_logged(rd: RunDir) -> int:
    frame = rd.read_iterations()
    return frame.filter(frame["event"] == "iteration").height


def logs(rd: RunDir) -> str:
    """Every log's tail, for assertion messages."""
    if not rd.logs_dir.is_dir():
        return ""
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(rd.logs_dir.iterdir()))


def a_dead_sampler_is_told(rd: RunDir, node: str) -> dict:
    """Kill `node`'s sampler once training runs: the run still completes, and its manifest and
    status line tell the loss. Returns the final manifest."""
    wait_for(lambda: iterations_logged(rd) >= 1, 300, f"the first iteration\n{logs(rd)}")
    sampler_process(rd.id, node).kill()
    manifest = wait_final(rd, 300)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    lost = manifest["telemetry_lost"]
    assert [entry["node"] for entry in lost] == [node] and "SIGKILL" in lost[0]["reason"], lost
    line = rd.manifest().status_line
    assert line.startswith("completed, telemetry lost at ") and f"(node {node})" in line, line
    return manifest


def recording_probe(out_dir, node: str, wrap=lambda argv: argv) -> tuple[subprocess.Popen, RunDir]:
    """A probe-only run (`python -m charllm.probes --out DIR`) on `node`, started by `wrap(argv)`
    (ssh, srun), once it recorded its sampler and a first chunk."""
    import sys

    argv = [sys.executable, "-m", "charllm.probes", "--backend", "host", "--hz", "5", "--out", str(out_dir),
            "--node", node]
    proc = start(wrap(argv))
    rd = RunDir(out_dir)
    wait_for(lambda: rd.manifest().sampler and rd.telemetry_files(), 60, "the probe to record")
    return proc, rd


def a_killed_probe_is_finished_by_the_next_reader(proc: subprocess.Popen, rd: RunDir, capsys, gone, what: str):
    """Kill a probe-only run's sampler where it runs (`proc` started it there); once `gone()`,
    `runs show` finds the run failed, saying why, and what it recorded stays readable."""
    from infra_cli import run

    psutil.Process(rd.manifest().sampler["pid"]).kill()
    wait_for(gone, 15, what)
    finish(proc, 30)
    code, out, err = run(capsys, "runs", "show", str(rd.path))
    assert code == 0 and "status    failed" in out and "the sampler died" in out, out + err
    assert rd.scan_telemetry().collect().height > 0, "what was recorded stays readable"


def runs_cancel_stops_a_probe(proc: subprocess.Popen, rd: RunDir, capsys, gone, what: str):
    """`runs cancel` stops a probe-only run where it runs (`proc` started it there): once `gone()`,
    the run is cancelled and its last chunk closed."""
    from infra_cli import run

    code, out, err = run(capsys, "runs", "cancel", str(rd.path))
    assert code == 0 and "cancelled" in out, out + err
    wait_for(gone, 15, what)
    finish(proc, 30)
    assert rd.read_manifest()["status"] == "cancelled"
    assert rd.scan_telemetry().collect().height > 0, "the sampler closed its last chunk"


def role_process(marker: str, module: str) -> psutil.Process:
    """The run's process running `python -m module` (torch.distributed.run, charllm.probes, ...)."""
    for proc in run_processes(marker):
        try:
            cmdline = proc.cmdline()
            if module in cmdline and cmdline[cmdline.index(module) - 1] == "-m":
                return proc
        except (psutil.Error, ValueError):
            pass
    raise AssertionError(f"no {module} process for {marker}")


def sampler_process(marker: str, node: str) -> psutil.Process:
    """The run's sampler on `node` (`python -m charllm.probes ... --node NODE`)."""
    def find():
        for proc in run_processes(marker):
            try:
                cmdline = proc.cmdline()
                if "charllm.probes" in cmdline and cmdline[cmdline.index("--node") + 1] == node:
                    return proc
            except (psutil.Error, ValueError, IndexError):
                pass
        return None
    return wait_for(find, 30, f"the sampler of {marker} on {node}")


def supervisor_process(rd: RunDir) -> psutil.Process:
    record = wait_for(lambda: rd.read_manifest().get("supervisor"), 30, "the supervisor to start")
    return psutil.Process(record["pid"])


def kill_and_wait(proc: psutil.Process, timeout: float = 15) -> None:
    """SIGKILL `proc` and wait until it is dead: gone, or a zombie its parent has not reaped yet
    (a kill is delivered asynchronously; on a loaded machine the next command could still see it)."""
    def dead() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    proc.kill()
    wait_for(dead, timeout, f"process {proc.pid} to die")


def left_after(marker: str, timeout: float = 15) -> int:
    """How many of the run's processes are still alive `timeout` seconds from now (0 as soon as none)."""
    deadline = time.monotonic() + timeout
    while run_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(run_processes(marker))
