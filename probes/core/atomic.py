"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from charllm.probes.core.errors import is_disk_full


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[Path], object], *,
                 mode: int | None = None, sync_dir: bool = False) -> Path:
    """Write `content` to `path` through a hidden sibling (`.NAME.PID.tmp`: one per process, so
    two writers never share it), fsynced, then renamed over `path`; `sync_dir` also fsyncs the
    directory, so the rename itself survives a crash. `content` is text, bytes, or a function that
    writes the file at the path it is given (polars' writers); `mode` sets its permissions. The
    hidden file is made anew, never followed: whatever has its name (a leftover, a planted link) is
    removed first, so nothing is written through it.

    A failure (a full disk) removes the hidden file, leaves the old one, and raises; an OSError
    with an errno that names no file is made to name `path`, since the user needs to know which."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with open(fd, "w" if isinstance(content, str) else "wb") as fh:
            if not callable(content):
                fh.write(content)
        if callable(content):
            content(tmp)   # (it opens the file just made)
        if mode is not None:
            tmp.chmod(mode)
        _fsync(tmp)
        os.replace(tmp, path)
        if sync_dir:
            _fsync(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None and not exc.filename:
            exc.filename = str(path)  # (one made of a message alone would lose it: polars raises those)
        elif isinstance(exc, Exception) and not isinstance(exc, OSError) and _full(path, exc):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise
    return path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _full(path: Path, exc: Exception) -> bool:
    """Whether a writer's own error (polars says "Invalid thrift: transport error" when its
    write fails) came from a full disk: it says so, or the disk has (almost) no room left."""
    if is_disk_full(exc):
        return True
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024
