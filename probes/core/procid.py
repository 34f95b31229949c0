"""Which process a recorded pid is, and whether it is ours to signal.

A pid names a process only on its host, in its boot and in its PID namespace, and only while
that process lives: pids are reused, across a reboot at once. A run directory often lives in a
home directory that several login nodes (or containers) share, and users keep runs for months,
so every pid a run records comes with where it was taken (`place()`: host, boot id, PID
namespace) and the process's start time. Nothing is signalled unless all of them still match.
"""

from __future__ import annotations

import os
import re
import socket

BOOT_ID = "/proc/sys/kernel/random/boot_id"
# psutil's create_time is the boot time plus the start in clock ticks (1/100 s): the same process
# always reads the same, a reused pid reads at least a tick later.
START_TOLERANCE_S = 0.005
_BOOT_ID = re.compile(r"^[0-9a-f-]{8,64}$")


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def boot_id() -> str:
    """This boot's id (Linux); "" where the system has none."""
    return _read(BOOT_ID)


def pid_namespace() -> str:
    """The PID namespace this process sees pids in ("pid:[4026531836]"); "" where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def place() -> dict:
    """Where a pid taken here means something."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace()}


def identify(pid: int) -> dict:
    """A record of process `pid` as it is now: pid, start time and place (empty if it is gone)."""
    import psutil

    try:
        return {"pid": pid, "create_time": psutil.Process(pid).create_time(), **place()}
    except psutil.Error:
        return {}


def where(record: dict) -> str:
    """Where a recorded process is, seen from here:
    "here"      this host, boot and PID namespace: its pid can be looked up;
    "elsewhere" another host, or this host's other PID namespace (a container): it cannot be seen;
    "gone"      this host before a reboot: it has ended, and its pid means nothing now;
    "unknown"   recorded without a place (an older manifest, or not a record at all)."""
    if not isinstance(record, dict) or not isinstance(record.get("host"), str) or not record["host"]:
        return "unknown"
    now = place()
    if record["host"] != now["host"]:
        return "elsewhere"
    if record.get("boot_id") != now["boot_id"]:
        return "gone"
    return "here" if record.get("pid_ns") == now["pid_ns"] else "elsewhere"


def described(record: dict) -> str:
    """Where a process that is not here runs, for a status line: "n2", or "n1 in another PID
    namespace" (a container on this host)."""
    host = record.get("host", "?") if isinstance(record, dict) else "?"
    return f"{host} in another PID namespace" if host == socket.gethostname() else str(host)


def live(record: dict):
    """The psutil process a record names, if it is here and still that process (same start time,
    not a zombie); else None. Records without a place are taken as taken here (older manifests),
    the start time still deciding."""
    import psutil

    if where(record) not in ("here", "unknown"):
        return None
    pid, started = record.get("pid"), record.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 1 or not isinstance(started, (int, float)):
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) < START_TOLERANCE_S and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (psutil.Error, OverflowError, ValueError):
        pass
    return None


def group_leader(record: dict):
    """The leader of the process group a record names, if the group is still the run's: recorded
    here with its leader's start time, the leader alive with that start time and still leading
    it. Never a group below 2 (0 is the caller's own group, 1 init's; `kill -- -1` is everyone)."""
    pgid = record.get("pgid") if isinstance(record, dict) else None
    if not isinstance(pgid, int) or isinstance(pgid, bool) or pgid < 2 or where(record) != "here":
        return None
    leader = live({**record, "pid": pgid})
    try:
        return leader if leader is not None and os.getpgid(pgid) == pgid else None
    except OSError:
        return None


def signal_group(record: dict, sig: int) -> bool:
    """Signal the process group a record names, only if group_leader() vouches for it; True if sent."""
    if group_leader(record) is None:
        return False
    try:
        os.killpg(record["pgid"], sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# -- a process group on another host, reached over ssh ----------------------------------------
# What a remote step prints first (engine.launch.ssh): its group id, the node's boot id and the
# group leader's start in clock ticks since boot (field 22 of /proc/PID/stat, after the command name).
REMOTE_IDENTITY = ('echo "$$ $(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo -) '
                   '$(sed "s/.*) //" /proc/$$/stat 2>/dev/null | cut -d" " -f20)"')


def parse_remote_identity(line: bytes | str) -> dict | None:
    """{"remote_pgid", "remote_boot_id", "remote_start"} from REMOTE_IDENTITY's line, or None."""
    words = (line.decode(errors="replace") if isinstance(line, bytes) else line).split()
    if len(words) != 3 or not words[0].isdigit() or not words[2].isdigit() or not _BOOT_ID.match(words[1]):
        return None
    return {"remote_pgid": int(words[0]), "remote_boot_id": words[1], "remote_start": int(words[2])}


def remote_signal_line(record: dict, sig: str) -> str | None:
    """The shell line that signals a recorded remote group on its node only if it is still the
    run's there (same boot, same leader start); None when the record cannot vouch for one."""
    pgid, boot, start = (record.get(k) if isinstance(record, dict) else None
                         for k in ("remote_pgid", "remote_boot_id", "remote_start"))
    if (not isinstance(pgid, int) or isinstance(pgid, bool) or pgid < 2 or not isinstance(boot, str)
            or not _BOOT_ID.match(boot) or not isinstance(start, int) or isinstance(start, bool)
            or sig not in ("TERM", "KILL", "INT", "USR1")):
        return None
    return (f'[ "$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)" = {boot} ] && '
            f'[ "$(sed "s/.*) //" /proc/{pgid}/stat 2>/dev/null | cut -d" " -f20)" = {start} ] && '
            f"kill -{sig} -- -{pgid} 2>/dev/null; true")
