"""The supervisor of one run: `python -m charllm.engine.launch.supervise RUN_DIR`.

Started detached by `launch()`, it runs the target's part (`Target.supervise`) and writes the
final status. Where the supervisor owns the run's processes (samplers, torchrun, remote log tails:
local and ssh targets, whose process class says how a step runs), it records their process groups
in the manifest, stops the rest when a node or rank fails, and stops everything on SIGTERM (what
`cancel` sends). Under Slurm, which owns the processes, it follows the job (slurm.Follower), and on
SIGTERM lets go of it: the job goes on, and the next reader settles the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from charllm.engine.launch.launcher import CANCEL_GRACE_S, RESERVE_BYTES, disk_note
from charllm.engine.launch.process import NO_END, Proc, describe_exit, killed_first, last_line, training_ended
from charllm.engine.launch.target import Step
from charllm.engine.launch.targets import from_record
from charllm.engine.workload import CANCELLED_EXIT
from charllm.probes.core import procid
from charllm.probes.core.errors import UserError, disk_full_on, is_disk_full, mount_point, os_error_line
from charllm.probes.store.rundir import FINAL_STATUSES, Reserve, RunDir

POLL_S = 0.2
FAILURE_SETTLE_S = 5.0  # how long the other nodes get to exit and log their account


def stop(procs: list[Proc], grace: float) -> None:
    """SIGTERM, then SIGKILL to every group and every process below it after `grace` seconds
    (stragglers outlive leaders, and a rank stuck in a collective ignores SIGTERM).
    A step never started (a cancel came in first) has nothing to stop."""
    import psutil

    procs = [p for p in procs if p.popen is not None]
    live = [p for p in procs if p.poll() is None]
    below = [child for p in live for child in p.descendants()]
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
        if p.started.stdin:
            p.started.stdin.close()
        try:
            p.started.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Supervisor:
    """One run's supervisor. A target's `supervise(supervisor)` uses `own_steps` (its processes run
    under the supervisor) or follows them elsewhere with `rd`, `cancel_requested` and `record_final`
    (slurm.SlurmTarget.supervise)."""

    def __init__(self, rd: RunDir):
        self.rd = rd
        self.manifest = rd.manifest()
        self.target = from_record(self.manifest.target)
        self.cancel_requested = False
        self.lines_lock = threading.Lock()
        self.procs: list[Proc] = []
        self.samplers_lost: dict[str, dict] = {}  # by node
        self.reserve = Reserve(rd.path, RESERVE_BYTES)

    def record_final(self, **fields) -> None:
        """Write the final status (and what the profiler window recorded and cost, in `profile`);
        on a full disk, give back the reserve and say so."""
        fields = with_profile(self.rd, fields)
        try:
            self.rd.update_manifest(**fields)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.reserve.release()
            self.rd.update_manifest(**{"disk_full": disk_full_on(self.rd.path), **fields})

    def _on_signal(self, signum, frame) -> None:
        self.cancel_requested = True

    def _append_iteration(self, line: bytes) -> None:
        if not line.endswith(b"\n"):
            return  # the remote tail was cut mid-line
        with self.lines_lock, open(self.rd.iterations_path, "ab") as fh:
            fh.write(line)

    def run(self) -> str:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if not self.reserve.held:   # no room to be sure of recording how the run ends: start nothing
            why = f"disk full on {mount_point(self.rd.path)}: no room for the supervisor's reserve; nothing was started"
            self.record_final(status="failed", failure=why, disk_full=disk_full_on(self.rd.path),
                              ended_ns=time.time_ns())
            return "failed"
        self.rd.update_manifest(supervisor={**procid.identify(os.getpid()), "pgid": os.getpgid(0)})
        return self.target.supervise(self)

    def own_steps(self, proc_class: type[Proc]) -> str:
        """Start the steps as `proc_class` processes, wait for them to end, stop the rest."""
        steps = [Step.from_dict(s) for s in self.manifest.steps]
        helpers = [proc_class(self.rd, self.target, s, sink=self._append_iteration) for s in steps if s.role != "train"]
        trains = [proc_class(self.rd, self.target, s) for s in steps if s.role == "train"]
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
        for p in helpers:
            p.catch_up()
        if status == "completed" and not training_ended(self.rd, timeout=0):   # every line is home by now
            status, failure = "failed", NO_END
        self.bring_home()
        exits = {f"{p.step.role}@{p.step.node}": p.poll() for p in started}
        if self.cancel_requested:
            status, failure = "cancelled", None
        self.record_final(status=status, failure=failure, ended_ns=time.time_ns(), exit_codes=exits,
                          runtime=self.rd.runtime())
        return status

    def bring_home(self) -> None:
        """Copy what the nodes wrote beside the streams (profiler traces) into the run directory;
        a node that cannot give them costs only its own, said in this log."""
        try:
            self.target.bring_home(self.rd)
        except Exception as exc:  # noqa: BLE001 - the run has ended; its account must still be written
            print(f"run {self.rd.id}: files not brought home: {exc}", flush=True)

    def watch_samplers(self, helpers: list[Proc]) -> None:
        """Record a sampler that ended while training runs: the run goes on, its telemetry is lost."""
        for p in helpers:
            if p.step.role == "sampler" and p.popen is not None and p.poll() is not None:
                self.lose_sampler(p.step.node, time.time_ns(),
                                  f"sampler {describe_exit(p.exit_status())}: {last_line(p.log_path)}")

    def lose_sampler(self, node: str, at_ns: int, reason: str) -> None:
        if node not in self.samplers_lost:
            self.samplers_lost[node] = {"node": node, "at_ns": at_ns, "reason": reason}
            self.rd.update_manifest(telemetry_lost=list(self.samplers_lost.values()))

    def wait(self, trains: list[Proc], helpers: list[Proc] | None = None) -> tuple[str, str | None]:
        """Until every node finished, one failed, or a cancel came in."""
        while not self.cancel_requested:
            self.watch_samplers(helpers or [])
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
        lost = [p for p in trains if p.connection_lost()]
        by_log = {p.log_path: p for p in failed}
        culprit = (lost or [by_log[log] for log in killed_first(list(by_log))])[0]
        return culprit.describe_failure() + disk_note(self.rd.path)


def with_profile(rd: RunDir, fields: dict) -> dict:
    """A run's final fields with what its profiler window recorded and cost (`profile`), where it
    planned one; a damaged manifest or log costs only that account."""
    try:
        planned = rd.read_manifest().get("profile")
        if isinstance(planned, dict):
            return {**fields, "profile": {**planned, **rd.profile_account()}}
    except (UserError, OSError):
        pass
    return fields


def keep_summaries(rd: RunDir) -> None:
    """Summarize the finished run once, here, so that the Runs list and every compare of it read
    kept results instead of its telemetry (however it was launched, and whoever watches). A run
    whose summary cannot be kept is summarized when first looked at: say why, and go on."""
    from charllm.probes.analysis.summary import keep_summaries as keep  # deferred: loads polars (start-up time)

    try:
        keep(rd)
    except Exception as exc:  # noqa: BLE001 - the run has ended and is recorded; this is a convenience
        try:
            print(f"run {rd.id}: summaries not kept: {exc!r}", flush=True)
        except OSError:
            pass


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
                                    **({"disk_full": disk_full_on(rd.path)} if is_disk_full(exc) else {}))
        except OSError as again:  # the run directory takes nothing (made read-only): the next reader says so
            print(f"run {rd.id}: failed: {why}; not recorded: {os_error_line(again, rd.path)}", flush=True)
            return 1
        if not isinstance(exc, OSError):
            raise  # a bug: its traceback goes to supervisor.log
        status = f"failed: {why}"
    if status in FINAL_STATUSES or status.startswith("failed"):
        keep_summaries(rd)
    else:      # let go of a job its scheduler runs on (SIGTERM): the next reader settles the run
        status = f"{status}; let go of (its scheduler runs it on)"
    supervisor.reserve.release()
    try:
        print(f"run {rd.id}: {status}", flush=True)
    except OSError:
        pass  # the log is on the full disk; the manifest says it
    return 0


if __name__ == "__main__":
    sys.exit(main())
