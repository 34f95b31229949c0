"""SSH targets: nodes reached with the OpenSSH client (honours ~/.ssh/config, agents, jump hosts).

Every remote command starts in its own process group and first prints that group's id, because
closing an SSH channel does not stop a remote process (and OpenSSH ignores signal requests for
root): to stop it we kill the group over a second connection. Arguments are joined with
`shlex.quote`, so run names and paths cannot inject shell.
"""

from __future__ import annotations

import io
import re
import shlex
import signal
import subprocess
import tarfile
import threading
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from charllm.engine.launch.command import Command
from charllm.engine.launch.nodes import ArgvFor, Collect, NodeOutput, read_streams, wait_then_stop
from charllm.engine.launch.process import Proc, shell_status
from charllm.engine.launch.target import Say, Step, Target, number, sampler_argv, train_argv
from charllm.probes.core import lifeline, procid
from charllm.probes.core.errors import UserError, plural
from charllm.probes.store.rundir import MARKER, TRACES

_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:-]*$")  # names and addresses; never an ssh option

# Reads the connection's stdin until it closes (the local client or its parent died, or the
# caller closed it), then stops the group: TERM, up to 10 s for its leader to end, KILL. It ignores TERM
# itself, and its output goes nowhere so it never holds the channel open after the command ends.
_STOP_WITH_CONNECTION = ('{ trap "" TERM; cat >/dev/null; kill -TERM -- -$$; '
                         'for _ in $(seq 20); do kill -0 $$ || break; sleep 0.5; done; kill -KILL -- -$$; } '
                         '<&0 >/dev/null 2>&1 & exec </dev/null; ')


def host_of(step: Step) -> str:
    """The host an ssh step runs on (SshTarget.plan names one for every step)."""
    assert step.host is not None, f"ssh step {step.node}/{step.role} has no host"
    return step.host


@dataclass(frozen=True)
class SshTarget(Target):
    kind: ClassVar[str] = "ssh"
    nodes_help: ClassVar[str] = "every host, at once"

    hosts: tuple[str, ...] = ()      # the first host is the torchrun rendezvous master
    user: str | None = None
    port: int = number(22, 1, 65535)
    identity_file: str | None = None
    known_hosts: str | None = None    # None: OpenSSH's default (~/.ssh/known_hosts)
    workdir: str = "charllm"          # remote; relative paths are under the remote home
    connect_timeout: int = number(10, 1, 3600)

    @classmethod
    def validate(cls, values: dict, where: str) -> None:
        hosts = values.get("hosts", ())
        if not hosts:
            raise UserError(f"{where}.hosts: an ssh target needs at least one host")
        for host in hosts:
            if not _HOST.match(host):
                raise UserError(f"{where}.hosts: {host!r} is not a host name or address")
        if len(set(hosts)) != len(hosts):
            raise UserError(f"{where}.hosts = {list(hosts)!r}: a host is listed twice")
        user = values.get("user")
        if user is not None and (user.startswith("-") or "@" in user or any(c.isspace() for c in user)):
            raise UserError(f"{where}.user = {user!r}: not a user name")

    # -- planning ------------------------------------------------------------------------------
    def check_nodes(self, nodes: int) -> None:
        if nodes > len(self.hosts):
            raise UserError(f"cluster.nodes = {nodes}: target {self.name!r} lists only "
                            f"{plural(len(self.hosts), 'host')}")

    def plan(self, exp, run_dir: Path, port, command: Command | None = None) -> tuple[list[Step], None]:
        python, hosts = self.python_path, self.hosts[: exp.cluster.nodes]
        steps = []
        for rank, host in enumerate(hosts):
            # One remote run directory per node, so nodes sharing a filesystem never collide.
            remote = self.remote_path("runs", run_dir.name, host)
            steps.append(Step(host, "sampler", sampler_argv(python, exp, remote, host, stream=True), host))
            steps.append(Step(host, "tail", ["tail", "-n", "+1", "-F", remote + "/iterations.jsonl"], host))
            steps.append(Step(host, "train", train_argv(python, exp, remote, node=host, node_rank=rank,
                                                        master_addr=hosts[0], master_port=port, command=command),
                              host))
        return steps, None

    def display_command(self, step: Step) -> str:
        return shlex.join(self.remote_argv(step))

    def remote_argv(self, step: Step) -> list[str]:
        """The local command that runs `step` on its host, in a process group of its own."""
        return self.ssh_argv(host_of(step)) + [self.in_process_group(step.argv)]

    # -- launching -----------------------------------------------------------------------------
    def check_ready(self, steps: list[Step], say: Say) -> None:
        for host in dict.fromkeys(host_of(s) for s in steps):  # in node order: the first bad host is named
            say(f"checking ssh to {host}")
            self.run_on(host)

    def prepare(self, rd, steps: list[Step], script: str | None, say: Say) -> dict:
        for host in sorted({host_of(s) for s in steps}):
            say(f"preparing {host}")
            remote = self.remote_path("runs", rd.id, host)
            marker = (rd.path / MARKER).read_text()   # the node's sampler writes into it as a launched run's
            line = f"mkdir -p {shlex.quote(remote)} && printf %s {shlex.quote(marker)} > " \
                   f"{shlex.quote(remote + '/' + MARKER)}"
            experiment = rd.experiment_path.read_bytes() if rd.experiment_path.is_file() else None
            if experiment is not None:   # (a user's command whose layout is unknown has none)
                line += f" && cat > {shlex.quote(remote + '/experiment.toml')}"
            self.run_on(host, line, stdin=experiment)
        return {}

    def supervise(self, supervisor) -> str:
        return supervisor.own_steps(SshProc)

    def bring_home(self, rd) -> None:
        """Each node's profiler traces (traces/ in its remote run directory), as a tar stream over
        a connection of its own, unpacked into the run's traces/ by Python's data filter (plain files
        under traces/ only: no links, devices or paths out of it). Whole traces only: the workload
        renames each into place once written."""
        used = {step.get("host") for step in rd.manifest().steps}
        for host in (h for h in self.hosts if h in used):
            remote = self.remote_path("runs", rd.id, host)
            command = (f"cd {shlex.quote(remote)} 2>/dev/null && [ -d {TRACES} ] && "
                       f"tar -cf - --exclude='.*' {TRACES} || true")
            with subprocess.Popen(self.ssh_argv(host) + [command], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL) as proc:
                try:
                    with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
                        for member in archive:
                            if member.isfile() and Path(member.name).parent == Path(TRACES):
                                archive.extract(member, rd.path, filter="data")
                except tarfile.ReadError:   # an empty stream: the node recorded no traces
                    pass

    def run_on_nodes(self, argv_for: ArgvFor, nodes: int | None, *, wait: float, say: Say) -> list[NodeOutput]:
        """On every host at once, each in a remote process group of its own (in_process_group)."""
        self.no_node_count(nodes)
        running: dict[str, tuple] = {}   # host -> (its ssh client, that client's stdout)

        def one(host: str) -> NodeOutput:
            try:
                self.run_on(host)
            except UserError as exc:
                return NodeOutput(host, failure=str(exc))
            proc = subprocess.Popen(self.ssh_argv(host) + [self.in_process_group(argv_for(host))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, text=True,   # its end stops the remote group
                                    preexec_fn=lifeline.killed_with_parent)
            give_token(proc, token)
            reader, err, out = read_streams(proc, say)
            running[host] = (proc, out)

            def stop() -> None:
                self._stop_remote(host, proc, out, token)
                running.pop(host, None)

            failure = wait_then_stop(proc, wait, stop, reader, out)
            if failure is None and proc.returncode == 255:   # ssh's own status: the connection failed
                failure = f"lost the ssh connection ({err[-1] if err else 'exit status 255'})"
            first, _, rest = out.text.partition("\n")
            # Output counts only after the group's identity line: before it, the command never ran.
            return NodeOutput(host, rest if procid.parse_remote_identity(first) else "", err, proc.returncode,
                              failure)

        token = procid.new_token()   # what proves the commands' groups ours when they are stopped
        pool = ThreadPoolExecutor(max_workers=min(16, len(self.hosts)))
        try:
            return list(pool.map(one, self.hosts))
        except BaseException:   # Ctrl-C or SIGTERM here: stop every node's command, then leave
            for host, (proc, out) in list(running.items()):
                self._stop_remote(host, proc, out, token)
            raise
        finally:
            pool.shutdown(wait=True)

    def _stop_remote(self, host: str, proc: subprocess.Popen, out: Collect, token: str | None) -> None:
        """Stop a command run_on_nodes started: its remote process group (closing the channel does not
        stop it; the group's identity is the first line it printed), then the ssh client."""
        if proc.poll() is not None:
            return
        group = procid.parse_remote_identity(out.first_line(timeout=1))
        if group:
            self.kill_group(host, group, token)
        proc.kill()
        proc.wait()

    def signal_recorded(self, proc: dict, sig: str, token: str | None) -> bool:
        remote = proc.get("remote_host") in self.hosts and \
            self.kill_group(proc["remote_host"], proc, token, sig)   # one of this target's nodes, never another
        return super().signal_recorded(proc, sig, token) or remote   # (and the local ssh client)

    # -- the OpenSSH client --------------------------------------------------------------------
    def ssh_argv(self, host: str) -> list[str]:
        """The local `ssh` command line up to (not including) the remote command."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"ConnectTimeout={self.connect_timeout}",
                # A node that dies is noticed within ~15 s instead of at the TCP timeout.
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
                "-o", "LogLevel=ERROR", "-p", str(self.port)]
        if self.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={Path(self.known_hosts).expanduser()}"]
        if self.identity_file:
            argv += ["-i", str(Path(self.identity_file).expanduser()), "-o", "IdentitiesOnly=yes"]
        if self.user:
            argv += ["-l", self.user]
        return argv + ["--", host]

    def remote_path(self, *parts: str) -> str:
        """A path on the node: relative workdirs are under the remote home (where ssh starts)."""
        base = self.workdir[2:] if self.workdir.startswith("~/") else self.workdir
        return "/".join([base.rstrip("/") or "."] + list(parts))

    def in_process_group(self, argv: list[str]) -> str:
        """Run `argv` in a new session (pgid = its leader shell's pid), printing first that pgid, the
        node's boot id and the leader's start (procid.REMOTE_IDENTITY: what a later signal checks).
        The first line of the connection's stdin is the run's token (give_token), which the leader
        carries in its environment (procid.TOKEN_FROM_STDIN); the group lives as long as the rest of
        stdin stays open: callers keep it open as a pipe.

        The leader shell waits for `argv` (on SIGTERM too: a trap runs only once it ended) and exits
        with its status, 128+N when signal N killed it; `setsid -w` would report a killed leader as N."""
        line = self.shell_line(argv, replace_shell=False)
        script = procid.REMOTE_IDENTITY + "; " + _STOP_WITH_CONNECTION + "trap : TERM\n" + line + "\nexit $?"
        return f"setsid -w bash -c {shlex.quote(procid.TOKEN_FROM_STDIN)} {shlex.quote(script)}"

    def offered_fingerprints(self, host: str) -> list[str]:
        """The fingerprints of the host keys `host` offers now ("SHA256:... (ED25519)"): shown, never trusted."""
        try:
            scan = subprocess.run(["ssh-keyscan", "-T", "5", "-p", str(self.port), "--", host],
                                  capture_output=True, timeout=15)
            keys = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=scan.stdout, capture_output=True,
                                  timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return []
        out = []
        for line in keys.stdout.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1].startswith("SHA256:"):
                out.append(f"{parts[1]} {parts[-1]}")
        return out

    def trust_hint(self, host: str) -> str:
        """How to trust a host key safely: compare what the host offers with a fingerprint obtained
        over a trusted channel, and only then record it (never trust a scan blindly)."""
        known = self.known_hosts or "~/.ssh/known_hosts"
        offered = self.offered_fingerprints(host)
        seen = f"it offers {', '.join(offered)}" if offered else "its key could not be read now"
        where = ("known_hosts is /dev/null, so no key is ever kept: set known_hosts in targets.toml"
                 if str(Path(known).expanduser()) == "/dev/null" else f"add that key to {known}")
        return (f"{seen}; compare with the fingerprint from the node's administrator or console "
                f"(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub there) and, only if they match, {where}")

    def run_on(self, host: str, remote: str = "true", stdin: bytes | None = None) -> str:
        """Run a short command on `host`; a refused host key or login is a UserError naming the fix."""
        try:
            done = subprocess.run(self.ssh_argv(host) + [remote], input=stdin, capture_output=True,
                                  timeout=self.connect_timeout + 30)
        except subprocess.TimeoutExpired:
            raise UserError(f"target {self.name!r}: host {host!r} did not answer within "
                            f"{self.connect_timeout + 30} s") from None
        err = done.stderr.decode(errors="replace").strip()
        if done.returncode == 255:
            if "host key" in err.lower() or "Host key verification failed" in err:
                raise UserError(f"target {self.name!r}: host {host!r} has an unknown or changed host key; "
                                f"{self.trust_hint(host)}")
            last = err.splitlines()[-1] if err else "connection failed"
            raise UserError(f"target {self.name!r}: cannot reach {host!r} over ssh: {last}")
        if done.returncode != 0:
            last = err.splitlines()[-1] if err else f"exit status {done.returncode}"
            raise UserError(f"target {self.name!r}: on {host!r}, {remote!r} failed: {last}")
        return done.stdout.decode(errors="replace")

    def kill_group(self, host: str, record: dict, token: str | None, signal: str = "TERM") -> bool:
        """Signal a remote process group over a fresh connection, if it is still the one `record`
        names there and carries the run's `token` (procid.remote_signal_line, the token on its stdin;
        best effort: the node may be gone); True if the node says it sent it."""
        remote = procid.remote_signal_line(record, signal)
        if remote is None or not procid.is_token(token):
            return False
        try:
            done = subprocess.run(self.ssh_argv(host) + [remote], input=f"{token}\n".encode(), capture_output=True,
                                  timeout=self.connect_timeout + 10)
        except subprocess.TimeoutExpired:
            return False
        return procid.SIGNALLED in done.stdout.decode(errors="replace").split()


def give_token(proc: subprocess.Popen, token: str | None) -> None:
    """Write the first line of a remote step's stdin: the token its group's leader will carry
    (SshTarget.in_process_group); the rest of its stdin stays open as its lifeline."""
    assert proc.stdin is not None, "a remote step's stdin is a pipe"
    line = f"{token or ''}\n"
    try:
        proc.stdin.write(line if isinstance(proc.stdin, io.TextIOBase) else line.encode())
        proc.stdin.flush()
    except BrokenPipeError:
        pass   # the client ended at once: the step fails on its own (its log says why)


class SshProc(Proc):
    """One step on its node, run through a local ssh client whose stdin stays open while the step
    should run: its end (the client's death included) is the remote group's end
    (SshTarget.in_process_group). The client's stdout brings the remote group's id, then the
    step's output: the telemetry stream, iteration lines or the log."""

    def __init__(self, rd, target: SshTarget, step: Step, sink=None):
        super().__init__(rd, target, step, sink)
        self.remote: dict | None = None   # the remote group's identity (procid.parse_remote_identity)
        self.pgid_known = threading.Event()
        self.delivered = 0   # bytes of whole lines a tail brought home

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.target.remote_argv(self.step), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                      preexec_fn=lifeline.killed_with_parent)
        give_token(self.popen, self.token)
        self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.reader.start()

    def wait_started(self) -> None:
        """Until the remote group's id came over the connection."""
        self.pgid_known.wait(timeout=self.target.connect_timeout + 20)

    def catch_up(self) -> None:
        """A tail stopped with its node's training ended may not have brought everything home (a
        slow connection, one that was lost, a node that ran for less than tail's first look): read
        the rest of its file once, from where the tail stopped."""
        if self.step.role != "tail" or self.popen is None or (self.reader and self.reader.is_alive()):
            return
        remote = f"tail -c +{self.delivered + 1} {shlex.quote(self.step.argv[-1])} 2>/dev/null || true"
        try:
            rest = self.target.run_on(self.step.host, remote)
        except UserError:   # the node is gone: its failure is said elsewhere, and its lines with it
            return
        for line in rest.encode().splitlines(keepends=True):
            if line.endswith(b"\n"):
                self.sink(line)

    def _read(self, log) -> None:
        """Remote stdout: the pgid line, then the log, the telemetry stream or iteration lines."""
        out = typing.cast(io.BufferedReader, self.started.stdout)   # start() made it a pipe: Popen buffers it
        first = out.readline()
        self.remote = procid.parse_remote_identity(first)
        if self.remote is None:
            log.write(first)
        self.pgid_known.set()
        role = self.step.role
        if role == "sampler":
            from charllm.probes.store.recorder import ChunkWriter  # deferred: loads polars (start-up time)
            from charllm.probes.store.stream import read_stream  # deferred: loads polars (start-up time)

            writer = ChunkWriter(self.rd.node_telemetry_dir(self.step.node))
            try:
                read_stream(out, writer.write)
            except Exception as exc:  # noqa: BLE001 - a cut connection ends the stream mid-batch, any way
                log.write(f"telemetry stream ended: {exc}\n".encode())
                log.flush()
            finally:
                writer.close()
        elif role == "tail":
            for line in out:
                if line.endswith(b"\n"):   # (the last line of a cut connection is read again by catch_up)
                    self.delivered += len(line)
                    self.sink(line)
        else:
            for chunk in iter(lambda: out.read1(65536), b""):
                log.write(chunk)
                log.flush()

    def exit_status(self) -> int:
        """The remote leader shell's status, carried home by ssh (SshTarget.in_process_group)."""
        status = self.poll()
        assert status is not None, "exit_status of a step still running"
        return shell_status(status)

    def connection_lost(self) -> bool:
        return self.poll() == 255   # ssh's own status: the connection failed, not the command

    def how_ended(self) -> str:
        if self.connection_lost():
            return "lost the ssh connection (the node died or is unreachable)"
        return super().how_ended()   # torchrun's own status, as exit_status reads it here

    def signal(self, sig: signal.Signals) -> None:
        """Signal the remote group over a second connection; a KILL also ends the local client."""
        if self.remote:
            self.target.kill_group(self.step.host, self.remote, self.token, sig.name.removeprefix("SIG"))
        if sig == signal.SIGKILL:
            super().signal(sig)

    def descendants(self) -> list:
        return []   # the step's processes live on its node: the remote group is signalled instead

    def record(self) -> dict:
        return {**super().record(), "remote_host": self.step.host, **(self.remote or {})}
