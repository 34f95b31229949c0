"""The supervisor of one run: `python -m charllm.engine.launch.supervise RUN_DIR`.

Started detached by `launch()`, it owns the run's processes (samplers, torchrun, remote log
tails), records their process groups in the manifest, stops the rest when a node or rank fails,
stops everything on SIGTERM (what `cancel` sends), and writes the final status. Under Slurm it
only follows the job, since Slurm owns the processes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from charllm.probes.core import lifeline

from charllm.engine.launch import slurm
from charllm.engine.launch.launcher import CANCEL_GRACE_S
from charllm.engine.launch.target import Step, Target
from charllm.engine.launch.targets import from_record
from charllm.engine.workload import CANCELLED_EXIT
from charllm.probes.core.errors import is_disk_full, mount_point, os_error_line
from charllm.probes.store.rundir import RunDir


POLL_S = 0.2
FAILURE_SETTLE_S = 5.0  # how long the other nodes get to exit and log their account


class Proc:
    """One step's process: local (its own process group) or remote through ssh."""

    def __init__(self, rd: RunDir, target: Target, step: Step, sink=None):
        self.rd, self.target, self.step = rd, target, step
        self.sink = sink                      # tail: receives each remote iteration line
        self.log_path = rd.logs_dir / f"{step.role}-{step.node}.log"
        self.remote_pgid: int | None = None
        self.pgid_known = threading.Event()
        self.reader: threading.Thread | None = None
        self.popen: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        # Each step dies with the supervisor: the sampler is asked to stop (it closes its last
        # chunk), torchrun is killed (its ranks follow it, see probes.core.lifeline), and an ssh
        # client's death closes the connection, which stops its remote group (SshTarget.in_process_group).
        with_parent = lifeline.terminated_with_parent if self.step.role == "sampler" else lifeline.killed_with_parent
        if self.step.host is None:
            self.popen = subprocess.Popen(self.step.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=self.rd.path, start_new_session=True,
                                          preexec_fn=with_parent)
            self.pgid_known.set()
        else:
            # stdin stays open while the step should run: its end is the remote group's end.
            self.popen = subprocess.Popen(self.target.remote_argv(self.step), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                          preexec_fn=lifeline.killed_with_parent)
            self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
            self.reader.start()

    def wait_started(self) -> None:
        """Until the step's process group is known: a remote one's comes over its connection."""
        if self.step.host is not None:
            self.pgid_known.wait(timeout=self.target.connect_timeout + 20)

    def _read(self, log) -> None:
        """Remote stdout: the pgid line, then the log, the telemetry stream or iteration lines."""
        out = self.popen.stdout
        first = out.readline()
        try:
            self.remote_pgid = int(first)
        except ValueError:
            log.write(first)
        self.pgid_known.set()
        role = self.step.role
        if role == "sampler":
            from charllm.probes.store.recorder import ChunkWriter  # deferred: loads polars (start-up time)
            from charllm.probes.store.stream import read_stream  # deferred: loads polars (start-up time)

            writer = ChunkWriter(self.rd.node_telemetry_dir(self.step.node))
            try:
                read_stream(out, writer.write)
            except Exception as exc:  # a cut connection ends the stream mid-batch
                log.write(f"telemetry stream ended: {exc}\n".encode())
                log.flush()
            finally:
                writer.close()
        elif role == "tail":
            for line in out:
                self.sink(line)
        else:
            for chunk in iter(lambda: out.read1(65536), b""):
                log.write(chunk)
                log.flush()

    def poll(self) -> int | None:
        return self.popen.poll()

    def exit_status(self) -> int:
        """How the step ended, as Popen says (-N: killed by signal N); remotely, the leader shell's
        status carried home by ssh (SshTarget.in_process_group)."""
        return shell_status(self.poll()) if self.step.host else self.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Signal the whole process group (a dead leader can leave ranks behind in it)."""
        if self.step.host is not None and self.remote_pgid:
            self.target.kill_group(self.step.host, self.remote_pgid, sig.name.removeprefix("SIG"))
        if self.step.host is None or sig == signal.SIGKILL:
            try:
                os.killpg(self.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def record(self) -> dict:
        out = {"node": self.step.node, "role": self.step.role, "pid": self.popen.pid, "pgid": self.popen.pid}
        if self.step.host:
            out.update(host=self.step.host, remote_pgid=self.remote_pgid)
        return out


def descendants(procs: list[Proc]) -> list:
    """Every local process below the steps (torchrun's ranks live in sessions of their own)."""
    import psutil

    found = []
    for p in procs:
        if p.step.host is None:
            try:
                found += psutil.Process(p.popen.pid).children(recursive=True)
            except psutil.Error:
                pass
    return found


def stop(procs: list[Proc], grace: float) -> None:
    """SIGTERM, then SIGKILL to every group and every process below it after `grace` seconds
    (stragglers outlive leaders, and a rank stuck in a collective ignores SIGTERM).
    A step never started (a cancel came in first) has nothing to stop."""
    import psutil

    procs = [p for p in procs if p.popen is not None]
    live = [p for p in procs if p.poll() is None]
    below = descendants(live)
    with ThreadPoolExecutor(max_workers=8) as pool:  # remote signals are one ssh connection each
        list(pool.map(lambda p: p.signal(signal.SIGTERM), live))
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        list(pool.map(lambda p: p.signal(signal.SIGKILL), procs))
    for child in below:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(below, timeout=5)
    for p in procs:
        if p.popen.stdin:
            p.popen.stdin.close()
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# One failure entry of torchrun's ChildFailedError summary ("Failures:" and "Root Cause" alike).
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def shell_status(code: int) -> int:
    """A shell's exit status as Popen's: 128+N (a command killed by signal N) becomes -N."""
    return 128 - code if 128 < code < 128 + signal.NSIG else code


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def root_cause(log_path: Path) -> tuple[int, int, int] | None:
    """(rank, local rank, exit code) of the cause in torchrun's error summary in a node's log.

    torchrun's "first observed failure" can be a peer that exited 1 because the killed rank
    vanished; a rank killed by a signal is the cause whenever the summary lists one."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    summary = text[text.rfind("ChildFailedError"):] if "ChildFailedError" in text else ""
    failures = [tuple(int(g) for g in m.groups()) for m in _FAILED_RANK.finditer(summary)]
    return min(failures, key=lambda f: f[2] >= 0) if failures else None


def describe_failure(step: Step, rc: int, log_path: Path) -> str:
    """Name the node and, from torchrun's error summary, the rank that failed first."""
    cause = root_cause(log_path)
    if cause:
        rank, local_rank, code = cause
        return f"node {step.node}, rank {rank} (local rank {local_rank}) {describe_exit(code)}"
    if step.host and rc == 255:
        return f"node {step.node}: lost the ssh connection (the node died or is unreachable)"
    return f"node {step.node}: torchrun {describe_exit(shell_status(rc) if step.host else rc)}"


def last_line(log_path: Path) -> str:
    """The last non-empty line of a log (a step's own account of why it ended)."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def disk_note(path: Path) -> str:
    """'; disk full on /x' when the run's disk has no room left (the likely cause of a failure)."""
    import shutil

    try:
        full = shutil.disk_usage(path).free < Reserve.SIZE
    except OSError:
        return ""
    return f"; disk full on {mount_point(path)}" if full else ""


def killed_first(logs: list[Path]) -> list[Path]:
    """Order node logs so a rank killed by a signal comes before the peers that merely exited
    non-zero because it vanished (they fail too, and may report first)."""
    def key(log: Path) -> int:
        cause = root_cause(log)
        return 0 if cause and cause[2] < 0 else 1 if cause else 2
    return sorted(logs, key=key)


class Supervisor:
    def __init__(self, rd: RunDir):
        self.rd = rd
        self.manifest = rd.read_manifest()
        self.target = from_record(self.manifest["target"])
        self.cancel_requested = False
        self.lines_lock = threading.Lock()
        self.procs: list[Proc] = []
        self.samplers_lost: dict[str, dict] = {}  # by node
        self.reserve = Reserve(rd.path / ".reserve")

    def record_final(self, **fields) -> None:
        """Write the final status; on a full disk, give back the reserve and say so."""
        try:
            self.rd.update_manifest(**fields)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.reserve.release()
            self.rd.update_manifest(**{"disk_full": os_error_line(exc, self.rd.path), **fields})

    def _on_signal(self, signum, frame) -> None:
        self.cancel_requested = True

    def _append_iteration(self, line: bytes) -> None:
        if not line.endswith(b"\n"):
            return  # the remote tail was cut mid-line
        with self.lines_lock, open(self.rd.iterations_path, "ab") as fh:
            fh.write(line)

    def run(self) -> str:
        import psutil

        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        me = psutil.Process()
        self.rd.update_manifest(supervisor={"pid": me.pid, "create_time": me.create_time(), "pgid": os.getpgid(0)})
        return self.target.supervise(self)

    def own_steps(self) -> str:
        """Start the steps, wait for them to end, stop the rest: local and ssh targets."""
        steps = [Step.from_dict(s) for s in self.manifest["steps"]]
        helpers = [Proc(self.rd, self.target, s, sink=self._append_iteration) for s in steps if s.role != "train"]
        trains = [Proc(self.rd, self.target, s) for s in steps if s.role == "train"]
        everything = self.procs = helpers + trains
        for p in everything:  # samplers first, so telemetry covers the whole run
            if not self.cancel_requested:
                p.start()
        started = [p for p in everything if p.popen]
        for p in started:
            p.wait_started()
        self.rd.update_manifest(status="running", started_ns=time.time_ns(),
                                processes=[p.record() for p in started])

        status, failure = self.wait(trains, helpers)
        self.watch_samplers(helpers)
        stop(trains, CANCEL_GRACE_S)
        stop(helpers, CANCEL_GRACE_S / 2)
        for p in started:
            if p.reader:
                p.reader.join(timeout=10)
        exits = {f"{p.step.role}@{p.step.node}": p.poll() for p in started}
        if self.cancel_requested:
            status, failure = "cancelled", None
        self.record_final(status=status, failure=failure, ended_ns=time.time_ns(), exit_codes=exits,
                          runtime=self.rd.runtime())
        return status

    def watch_samplers(self, helpers: list[Proc]) -> None:
        """Record a sampler that ended while training runs: the run goes on, its telemetry is lost."""
        for p in helpers:
            if p.step.role == "sampler" and p.popen is not None and p.poll() is not None:
                self.lose_sampler(p.step.node, time.time_ns(),
                                  f"sampler {describe_exit(p.exit_status())}: {last_line(p.log_path)}")

    def watch_slurm_samplers(self) -> None:
        """The same under Slurm, from each node's sampler exit record (slurm.SAMPLER_EXIT): a
        sampler that died or failed, or that stopped before training ended. One stopped with the
        job (a cancel, a time limit) is no separate loss: the job's own status says it."""
        train_exit = self.rd.logs_dir / "train.exit"
        for record in self.rd.logs_dir.glob(slurm.SAMPLER_EXIT.format(node="*")):
            try:
                code, at_ns = (int(word) for word in record.read_text().split())
                train_end = train_exit.stat().st_mtime_ns if train_exit.is_file() else None
            except (OSError, ValueError):
                continue  # being written; read again at the next poll
            if code != 0 or (train_end is not None and at_ns < train_end):
                node = record.name.removeprefix("sampler-").removesuffix(".exit")
                log = self.rd.logs_dir / f"sampler-{node}.log"
                self.lose_sampler(node, at_ns, f"sampler {describe_exit(shell_status(code))}: {last_line(log)}")

    def lose_sampler(self, node: str, at_ns: int, reason: str) -> None:
        if node not in self.samplers_lost:
            self.samplers_lost[node] = {"node": node, "at_ns": at_ns, "reason": reason}
            self.rd.update_manifest(telemetry_lost=list(self.samplers_lost.values()))

    def wait(self, trains: list[Proc], helpers: list[Proc] = ()) -> tuple[str, str | None]:
        """Until every node finished, one failed, or a cancel came in."""
        while not self.cancel_requested:
            self.watch_samplers(helpers)
            codes = [p.poll() if p.popen else 0 for p in trains]
            if CANCELLED_EXIT in codes:
                return "cancelled", None
            if any(rc not in (None, 0) for rc in codes):
                return "failed", self.first_failure(trains)
            if all(rc == 0 for rc in codes):
                return "completed", None
            time.sleep(POLL_S)
        return "cancelled", None

    def first_failure(self, trains: list[Proc]) -> str:
        """The cause, not the echo: a lost or killed rank makes its peers fail too, and a peer's
        node may report first. So give every node a moment to end, then prefer a node whose
        connection was lost, then one whose rank was killed by a signal, then any."""
        deadline = time.monotonic() + FAILURE_SETTLE_S
        while any(p.poll() is None for p in trains) and time.monotonic() < deadline:
            time.sleep(POLL_S)  # the killed rank's node may write its summary after a peer's
        failed = [p for p in trains if p.poll() not in (None, 0)]
        lost = [p for p in trains if p.step.host and p.poll() == 255]
        by_log = {p.log_path: p for p in failed}
        culprit = (lost or [by_log[log] for log in killed_first(list(by_log))])[0]
        return describe_failure(culprit.step, culprit.poll(), culprit.log_path) + disk_note(self.rd.path)

    def follow_slurm(self) -> str:
        """Follow the Slurm job, which owns the processes, until it ends."""
        job = self.manifest["slurm_job_id"]
        running = False
        while True:
            info = slurm.job_info(job)
            state = info.get("JobState", "UNKNOWN")
            if state == "RUNNING" and not running:
                running = True
                self.rd.update_manifest(status="running", started_ns=time.time_ns(),
                                        nodes=slurm.hostnames(info.get("NodeList", "")))
            self.watch_slurm_samplers()
            if state in slurm.FINAL_STATES or state == "UNKNOWN":
                break
            time.sleep(0.5)
        if state == "UNKNOWN":  # purged from the controller: the job's own exit record decides
            exit_file = self.rd.logs_dir / "train.exit"
            state = "COMPLETED" if exit_file.is_file() and exit_file.read_text().strip() == "0" else "FAILED"
        failure = None
        if state == "COMPLETED":
            status = "completed"
        elif state == "CANCELLED" or self.cancel_requested:
            status = "cancelled"
        else:
            status = "failed"
            failure = self._slurm_failure(state, info)
        self.record_final(status=status, failure=failure, ended_ns=time.time_ns(), slurm_state=state,
                          runtime=self.rd.runtime())
        return status

    def _slurm_failure(self, state: str, info: dict) -> str:
        for log in killed_first(sorted(self.rd.logs_dir.glob("train-*.log"))):
            if root_cause(log):
                return describe_failure(Step(log.stem.removeprefix("train-"), "train", []), 1, log)
        details = f"exit code {info.get('ExitCode', '?')}, reason {info.get('Reason', '?')}"
        return f"slurm job {state.lower()} ({details}) on {info.get('NodeList', '?')}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m charllm.engine.launch.supervise RUN_DIR", file=sys.stderr)
        return 2
    rd = RunDir(Path(argv[0]))
    supervisor = Supervisor(rd)
    try:
        status = supervisor.run()
    except BaseException as exc:
        # Never leave a run "running" forever, nor its processes orphaned.
        stop([p for p in supervisor.procs if p.popen], CANCEL_GRACE_S)
        why = os_error_line(exc, rd.path) if isinstance(exc, OSError) else f"supervisor error: {exc!r}"
        try:
            supervisor.record_final(status="failed", failure=why, ended_ns=time.time_ns(),
                                    **({"disk_full": why} if is_disk_full(exc) else {}))
        except OSError as again:  # the run directory takes nothing (made read-only): the next reader says so
            print(f"run {rd.id}: failed: {why}; not recorded: {os_error_line(again, rd.path)}", flush=True)
            return 1
        if not isinstance(exc, OSError):
            raise  # a bug: its traceback goes to supervisor.log
        status = f"failed: {why}"
    supervisor.reserve.release()
    try:
        print(f"run {rd.id}: {status}", flush=True)
    except OSError:
        pass  # the log is on the full disk; the manifest says it
    return 0


class Reserve:
    """A little disk space held from the start, given back when the final status must be written
    on a full disk."""

    SIZE = 256 * 1024

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "wb") as fh:
                fh.write(b"\0" * self.SIZE)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            path.unlink(missing_ok=True)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
