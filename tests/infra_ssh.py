"""Real sshd "nodes" for tests: two network namespaces joined by a bridge, each running its own
sshd (as RECIPES describes); without network namespaces, two sshd on 127.0.0.2 / 127.0.0.3.

Everything is stopped by PID and removed afterwards (namespaces, bridge, temp files).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import infra_daemons as daemons
from infra_runs import stop_process

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@dataclass
class SshNodes:
    hosts: list[str]
    port: int
    identity_file: Path
    known_hosts: Path
    root: Path
    netns: list[str] = field(default_factory=list)
    ifname: str | None = None      # the nodes' interface (GLOO_SOCKET_IFNAME) under netns
    host_keys: dict[str, str] = field(default_factory=dict)

    def target_table(self, name: str = "nodes", **extra) -> dict:
        """A targets.toml table for these nodes."""
        import sys

        env = f"export GLOO_SOCKET_IFNAME={self.ifname}" if self.ifname else "export GLOO_SOCKET_IFNAME=lo"
        table = {"kind": "ssh", "hosts": self.hosts, "user": "root", "port": self.port,
                 "identity_file": str(self.identity_file), "known_hosts": str(self.known_hosts),
                 "workdir": str(self.root / "remote"), "env_setup": env, "python": sys.executable}
        table.update(extra)
        return table

    def pids(self) -> list[int]:
        """Every process inside the nodes' namespaces (netns mode only)."""
        out = []
        for ns in self.netns:
            done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            out += [int(p) for p in done.stdout.split()]
        return out


def _wait_port(host: str, port: int, ns: str | None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"sshd on {host}:{port} did not come up")


def _netns_available() -> bool:
    name = f"chk{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def _pid_namespaces() -> bool:
    return shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (sshd with its own config, network namespaces)"
    for binary in (SSHD, shutil.which("ssh"), shutil.which("ssh-keygen"), shutil.which("setsid")):
        if not binary or not os.path.exists(binary):
            return "needs openssh-server, openssh-client and util-linux (sshd, ssh, ssh-keygen, setsid)"
    return None


def start_nodes(root: Path, cleanups: list, count: int = 2) -> SshNodes:
    """Start the nodes, appending to `cleanups` what undoes each step (run them in reverse)."""
    root.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key"))
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    use_netns = shutil.which("ip") is not None and _netns_available()
    tag = f"{os.getpid() % 10000}{random.randint(0, 99)}"
    if use_netns:
        subnet = f"10.{random.randint(200, 250)}.{random.randint(1, 250)}"
        hosts = [f"{subnet}.{i + 2}" for i in range(count)]
        bridge = f"cbr{tag}"
        _run("ip", "link", "add", bridge, "type", "bridge")
        cleanups.append(lambda: subprocess.run(["ip", "link", "del", bridge], capture_output=True))
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        namespaces = []
        for i, host in enumerate(hosts):
            ns, veth = f"cnode{tag}-{i}", f"cv{tag}{i}"
            _run("ip", "netns", "add", ns)
            cleanups.append(lambda ns=ns: subprocess.run(["ip", "netns", "del", ns], capture_output=True))
            namespaces.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", bridge, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{host}/24", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        port = 22
    else:
        hosts = [f"127.0.0.{i + 2}" for i in range(count)]
        namespaces = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    nodes = SshNodes(hosts=hosts, port=port, identity_file=root / "client_key", known_hosts=root / "known_hosts",
                     root=root, netns=namespaces, ifname="eth0" if use_netns else None)
    known = []
    for i, host in enumerate(hosts):
        key = root / f"host_key_{i}"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        nodes.host_keys[host] = (root / f"host_key_{i}.pub").read_text().split()[1]
        known.append(f"{host} ssh-ed25519 {nodes.host_keys[host]}")
        config = root / f"sshd_{i}.conf"
        config.write_text("\n".join([
            f"Port {port}", f"ListenAddress {host}", f"HostKey {key}", f"PidFile {root}/sshd_{i}.pid",
            f"AuthorizedKeysFile {root}/authorized_keys", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PermitRootLogin yes",
            "LogLevel ERROR", ""]))
        prefix = ["ip", "netns", "exec", namespaces[i]] if use_netns else []
        # Each node has a PID namespace of its own, as a real node has its own pids: a pid or
        # group read on one means nothing on another (and `kill -- -1` there would stay there).
        # unshare --kill-child: stopping this process stops the node's sshd, and with it the node.
        prefix += ["unshare", "--pid", "--kill-child", "--mount-proc"] if _pid_namespaces() else []
        log = open(root / f"sshd_{i}.log", "ab")
        proc = subprocess.Popen(prefix + [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
        cleanups.append(lambda proc=proc: stop_process(proc, grace=5))
        _wait_port(host, port, None)
    nodes.known_hosts.write_text("\n".join(known) + "\n")
    if use_netns:
        # Session processes left in the namespaces (ours, by PID) go before the namespaces do.
        cleanups.append(lambda: [_kill(pid) for pid in nodes.pids()])
    return nodes


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def ssh_nodes(tmp_path_factory):
    reason = skip_reason()
    if reason:
        daemons.missing(reason)
    cleanups = []
    try:
        nodes = start_nodes(tmp_path_factory.mktemp("sshnodes"), cleanups)
        yield nodes
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
