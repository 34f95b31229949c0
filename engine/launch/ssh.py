"""Running commands on SSH nodes with the OpenSSH client (honours ~/.ssh/config, agents, jump hosts).

Every remote command starts in its own process group and first prints that group's id, because
closing an SSH channel does not stop a remote process (and OpenSSH ignores signal requests for
root): to stop it we kill the group over a second connection. Arguments are joined with
`shlex.quote`, so run names and paths cannot inject shell.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from charllm.engine.launch.targets import Target
from charllm.probes.core.errors import UserError


def ssh_argv(target: Target, host: str) -> list[str]:
    """The local `ssh` command line up to (not including) the remote command."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={target.connect_timeout}",
            # A node that dies is noticed within ~15 s instead of at the TCP timeout.
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR", "-p", str(target.port)]
    if target.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={Path(target.known_hosts).expanduser()}"]
    if target.identity_file:
        argv += ["-i", str(Path(target.identity_file).expanduser()), "-o", "IdentitiesOnly=yes"]
    if target.user:
        argv += ["-l", target.user]
    return argv + ["--", host]


def remote_path(target: Target, *parts: str) -> str:
    """A path on the node: relative workdirs are under the remote home (where ssh starts)."""
    base = target.workdir[2:] if target.workdir.startswith("~/") else target.workdir
    return "/".join([base.rstrip("/") or "."] + list(parts))


def shell_line(target: Target, argv: list[str], cwd: str | None = None, *, replace_shell: bool = True) -> str:
    """`cd DIR && ENV_SETUP; exec ARGV` — the env line is the user's own shell, the rest is quoted."""
    parts = []
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} &&")
    if target.env_setup:
        parts.append(f"{target.env_setup};")
    parts.append(("exec " if replace_shell else "") + shlex.join(argv))
    return " ".join(parts)


# Reads the connection's stdin until it closes (the local client or its parent died, or the
# caller closed it), then stops the group: TERM, up to 10 s for its leader to end, KILL. It ignores TERM itself, and its
# output goes nowhere so it never holds the channel open after the command ends.
_STOP_WITH_CONNECTION = ('{ trap "" TERM; cat >/dev/null; kill -TERM -- -$$; '
                         'for _ in $(seq 20); do kill -0 $$ || break; sleep 0.5; done; kill -KILL -- -$$; } '
                         '<&0 >/dev/null 2>&1 & exec </dev/null; ')


def in_process_group(target: Target, argv: list[str]) -> str:
    """Run `argv` in a new session (pgid = its leader shell's pid), printing that pgid first. The
    group lives as long as the connection's stdin stays open: callers keep it open as a pipe.

    The leader shell waits for `argv` (on SIGTERM too: a trap runs only once it ended) and exits
    with its status, 128+N when signal N killed it; `setsid -w` would report a killed leader as N."""
    line = shell_line(target, argv, replace_shell=False)
    return "setsid -w bash -c " + shlex.quote("echo $$; " + _STOP_WITH_CONNECTION + "trap : TERM; " + line
                                              + "; exit $?")


def offered_fingerprints(target: Target, host: str) -> list[str]:
    """The fingerprints of the host keys `host` offers now ("SHA256:... (ED25519)"): shown, never trusted."""
    try:
        scan = subprocess.run(["ssh-keyscan", "-T", "5", "-p", str(target.port), "--", host],
                              capture_output=True, timeout=15)
        keys = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=scan.stdout, capture_output=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return []
    out = []
    for line in keys.stdout.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1].startswith("SHA256:"):
            out.append(f"{parts[1]} {parts[-1]}")
    return out


def trust_hint(target: Target, host: str) -> str:
    """How to trust a host key safely: compare what the host offers with a fingerprint obtained
    over a trusted channel, and only then record it (never trust a scan blindly)."""
    known = target.known_hosts or "~/.ssh/known_hosts"
    offered = offered_fingerprints(target, host)
    seen = f"it offers {', '.join(offered)}" if offered else "its key could not be read now"
    where = ("known_hosts is /dev/null, so no key is ever kept: set known_hosts in targets.toml"
             if str(Path(known).expanduser()) == "/dev/null" else f"add that key to {known}")
    return (f"{seen}; compare with the fingerprint from the node's administrator or console "
            f"(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub there) and, only if they match, {where}")


def check(target: Target, host: str, remote: str = "true", stdin: bytes | None = None) -> str:
    """Run a short command on `host`; a refused host key or login is a UserError naming the fix."""
    try:
        done = subprocess.run(ssh_argv(target, host) + [remote], input=stdin, capture_output=True,
                              timeout=target.connect_timeout + 30)
    except subprocess.TimeoutExpired:
        raise UserError(f"target {target.name!r}: host {host!r} did not answer within "
                        f"{target.connect_timeout + 30} s") from None
    err = done.stderr.decode(errors="replace").strip()
    if done.returncode == 255:
        if "host key" in err.lower() or "Host key verification failed" in err:
            raise UserError(f"target {target.name!r}: host {host!r} has an unknown or changed host key; "
                            f"{trust_hint(target, host)}")
        last = err.splitlines()[-1] if err else "connection failed"
        raise UserError(f"target {target.name!r}: cannot reach {host!r} over ssh: {last}")
    if done.returncode != 0:
        last = err.splitlines()[-1] if err else f"exit status {done.returncode}"
        raise UserError(f"target {target.name!r}: on {host!r}, {remote!r} failed: {last}")
    return done.stdout.decode(errors="replace")


def kill_group(target: Target, host: str, pgid: int, signal: str = "TERM") -> None:
    """Signal a remote process group over a fresh connection (best effort: the node may be gone)."""
    remote = f"kill -{signal} -- -{int(pgid)} 2>/dev/null; true"
    try:
        subprocess.run(ssh_argv(target, host) + [remote], capture_output=True,
                       timeout=target.connect_timeout + 10)
    except subprocess.TimeoutExpired:
        pass


def group_alive(target: Target, host: str, pgid: int) -> bool:
    remote = f"kill -0 -- -{int(pgid)} 2>/dev/null && echo alive; true"
    try:
        done = subprocess.run(ssh_argv(target, host) + [remote], capture_output=True,
                              timeout=target.connect_timeout + 10)
    except subprocess.TimeoutExpired:
        return False
    return b"alive" in done.stdout
