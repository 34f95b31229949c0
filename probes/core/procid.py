"""Which process a recorded pid is, and whether it is ours to signal.

A pid names a process only on its host, in its boot and in its PID namespace, and only while
that process lives: pids are reused, across a reboot at once. A run directory often lives in a
home directory that several login nodes (or containers) share, and users keep runs for months,
so every pid a run records comes with where it was taken (`place()`: host, boot id, PID
namespace) and the process's start time.

That identity says which process a record means, not that the process is the run's: anyone can
read a process's start time, boot id and namespace from /proc and write them into a manifest.
So a signal also needs proof: the run's token. Every run (and campaign) has a random token, kept
in a file only its user can read (rundir.TOKEN), and every process the run starts carries it in
its environment (TOKEN_ENV), which only that process's user can read (/proc/PID/environ). A
process is signalled only if it is this user's and carries the token: copying a victim's
identity into a manifest gives the victim no token. A run without a token (recorded before
tokens) is judged by its identity for reading, and nothing of it is ever signalled.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
from pathlib import Path

BOOT_ID = "/proc/sys/kernel/random/boot_id"
# psutil's create_time is the boot time plus the start in clock ticks (1/100 s): a reused pid reads at
# least a tick later. The boot time it adds is /proc/stat's whole seconds, worked out from the wall
# clock: a clock stepped or slewed across a second moves it, so records carry the ticks themselves
# (start_ticks), and create_time decides only for records made before them.
START_TOLERANCE_S = 0.005
_BOOT_ID = re.compile(r"^[0-9a-f-]{8,64}$")

# The run's token in the environment of every process it starts, beside its id (which a user's
# own commands under the run may read; only the token is proof).
TOKEN_ENV = "CHARLLM_RUN_TOKEN"
RUN_ID_ENV = "CHARLLM_RUN_ID"
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
MAX_ENVIRON_BYTES = 4 << 20   # the kernel caps argv and environment together at ARG_MAX (2 MiB by default)


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


def new_token() -> str:
    """A fresh run token: 128 random bits, as 32 hex digits."""
    return secrets.token_hex(16)


def is_token(token) -> bool:
    return isinstance(token, str) and _TOKEN.match(token) is not None


def run_environment(token: str, run_id: str | None = None) -> dict:
    """The environment a run's (or a campaign's) processes start with: this one, plus its token
    and, for a run, its id."""
    return {**os.environ, TOKEN_ENV: token, **({RUN_ID_ENV: run_id} if run_id else {})}


# The file that keeps a run's (or a campaign's) token in its directory, readable by its user only.
TOKEN_FILE = ".charllm-token"


def write_token(directory: Path) -> str:
    """Give the run (or campaign) in `directory` a new token, kept in TOKEN_FILE (mode 0600, never
    through a link; an earlier token is replaced): the value its processes' environment must carry."""
    token = new_token()
    path = Path(directory) / TOKEN_FILE
    if path.is_symlink() or path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def read_token(directory: Path) -> str | None:
    """The token kept in `directory`, if it is a regular file of this user's that nobody else may
    write (not a link); None otherwise (a run recorded before tokens, or one not to be trusted)."""
    try:
        fd = os.open(Path(directory) / TOKEN_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        token = fh.read(64).decode(errors="replace").strip()
    return token if is_token(token) else None


def trust_problem(directory: Path, record: Path) -> str | None:
    """Why nothing a record names may be acted on (signalled, or settled in the record), or None:
    the record and its directory must be this user's, and neither the directory nor the one that
    holds it writable by others (unless sticky, like /tmp: others cannot then replace what is
    ours), so nobody else can have planted or swapped what it says."""
    me = os.geteuid()
    try:
        held, holder = os.lstat(directory), os.stat(Path(directory).absolute().parent)
        mine = os.lstat(record)
    except FileNotFoundError:
        return None          # nothing recorded yet, nothing to act on
    except OSError as exc:
        return f"{directory}: cannot check who owns it ({exc.strerror})"
    if stat.S_ISLNK(held.st_mode) or stat.S_ISLNK(mine.st_mode):
        return f"{record if stat.S_ISLNK(mine.st_mode) else directory} is a symbolic link"
    for path, st in ((record, mine), (directory, held)):
        if st.st_uid != me:
            return f"{path} belongs to uid {st.st_uid}, not to you (uid {me})"
    for path, st in ((directory, held), (Path(directory).absolute().parent, holder)):
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{path} may be written by {'others' if st.st_mode & 0o002 else 'its group'} "
                    f"(chmod go-w {path})")
    return None


def carries(pid: int, token: str | None) -> bool:
    """Whether process `pid` here is this user's and was started with the run's `token` in its
    environment (Linux: /proc/PID/environ, readable by the process's own user only)."""
    if not is_token(token):
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read(MAX_ENVIRON_BYTES)
    except (OSError, ValueError, OverflowError):
        return False
    return f"{TOKEN_ENV}={token}".encode() in environ.split(b"\0")


def place() -> dict:
    """Where a pid taken here means something."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace()}


def start_ticks(pid: int) -> int | None:
    """Process `pid`'s start in clock ticks since boot (field 22 of /proc/PID/stat, after the command
    name), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def identify(pid: int) -> dict:
    """A record of process `pid` as it is now: pid, start time and place (empty if it is gone)."""
    import psutil

    try:
        record = {"pid": pid, "create_time": psutil.Process(pid).create_time(), **place()}
    except psutil.Error:
        return {}
    ticks = start_ticks(pid)
    return record if ticks is None else {**record, "start_ticks": ticks}


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


def live(record: dict, token: str | None):
    """The psutil process a record names, if it is here and still that process (same start time,
    not a zombie) and, where the run has a `token`, it carries it (carries()); else None. Records
    without a place are taken as taken here (older manifests), the start time still deciding. A run
    without a token (None: recorded before tokens) is judged by identity alone: enough to read
    whether it lives, never to signal (signal() and signal_group() refuse it)."""
    import psutil

    if where(record) not in ("here", "unknown"):
        return None
    pid, started = record.get("pid"), record.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 1 or not isinstance(started, (int, float)):
        return None
    ticks = record.get("start_ticks")
    try:
        proc = psutil.Process(pid)
        same = start_ticks(pid) == ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else \
            abs(proc.create_time() - started) < START_TOLERANCE_S
        if not same or proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except (psutil.Error, OverflowError, ValueError):
        return None
    return proc if token is None or carries(pid, token) else None


def signal(record: dict, sig: int, token: str | None) -> bool:
    """Signal the process a record names, only if it is the run's (live() with the run's token);
    True if sent."""
    proc = live(record, token) if is_token(token) else None
    if proc is None:
        return False
    try:
        proc.send_signal(sig)
        return True
    except Exception:  # noqa: BLE001 - psutil.Error: it ended just now
        return False


def group_leader(record: dict, token: str | None):
    """The leader of the process group a record names, if the group is still the run's: recorded
    here with its leader's start time, the leader alive with that start time, carrying the run's
    token and still leading it. Never a group below 2 (0 is the caller's own group, 1 init's;
    `kill -- -1` is everyone)."""
    pgid = record.get("pgid") if isinstance(record, dict) else None
    if not isinstance(pgid, int) or isinstance(pgid, bool) or pgid < 2 or where(record) != "here":
        return None
    if not is_token(token):
        return None
    leader = live({**record, "pid": pgid}, token)
    try:
        return leader if leader is not None and os.getpgid(pgid) == pgid else None
    except OSError:
        return None


def signal_group(record: dict, sig: int, token: str | None) -> bool:
    """Signal the process group a record names, only if group_leader() vouches for it; True if sent."""
    if group_leader(record, token) is None:
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
# How a remote step gets the run's token: the first line of its stdin (an argument would be on its
# command line, which anyone on the node can read), put into the environment of the shell that
# then becomes the script `$0` (exec keeps the pid: the group's leader carries the token).
TOKEN_FROM_STDIN = f'read -r {TOKEN_ENV} && [ -n "${TOKEN_ENV}" ] && export {TOKEN_ENV} && exec bash -c "$0"'
SIGNALLED = "signalled"   # what remote_signal_line prints when it sent the signal


def parse_remote_identity(line: bytes | str) -> dict | None:
    """{"remote_pgid", "remote_boot_id", "remote_start"} from REMOTE_IDENTITY's line, or None."""
    words = (line.decode(errors="replace") if isinstance(line, bytes) else line).split()
    if len(words) != 3 or not words[0].isdigit() or not words[2].isdigit() or not _BOOT_ID.match(words[1]):
        return None
    return {"remote_pgid": int(words[0]), "remote_boot_id": words[1], "remote_start": int(words[2])}


def remote_signal_line(record: dict, sig: str) -> str | None:
    """The shell line that signals a recorded remote group on its node only if it is still the
    run's there: same boot, same leader start, the leader this user's and carrying the run's token,
    which the line reads from its stdin (the caller writes it there, never on a command line); it
    prints SIGNALLED when it sent the signal. None when the record cannot vouch for a group."""
    pgid, boot, start = (record.get(k) if isinstance(record, dict) else None
                         for k in ("remote_pgid", "remote_boot_id", "remote_start"))
    if (not isinstance(pgid, int) or isinstance(pgid, bool) or pgid < 2 or not isinstance(boot, str)
            or not _BOOT_ID.match(boot) or not isinstance(start, int) or isinstance(start, bool)
            or sig not in ("TERM", "KILL", "INT", "USR1")):
        return None
    return ('read -r t && [ -n "$t" ] && '
            f'[ "$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)" = {boot} ] && '
            f'[ "$(sed "s/.*) //" /proc/{pgid}/stat 2>/dev/null | cut -d" " -f20)" = {start} ] && '
            f'[ -O /proc/{pgid} ] && tr "\\0" "\\n" < /proc/{pgid}/environ 2>/dev/null | '
            f'grep -qxF "{TOKEN_ENV}=$t" && kill -{sig} -{pgid} 2>/dev/null && echo {SIGNALLED}; true')
