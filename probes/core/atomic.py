"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[Path], object], *,
                 mode: int | None = None, sync_dir: bool = False) -> Path:
    """Write `content` to `path` through a hidden sibling (`.NAME.PID.tmp`: one per process, so
    two writers never share it), fsynced, then renamed over `path`; `sync_dir` also fsyncs the
    directory, so the rename itself survives a crash. `content` is text, bytes, or a function that
    writes the file at the path it is given (polars' writers); `mode` sets its permissions.

    A failure (a full disk) removes the hidden file, leaves the old one, and raises; an OSError
    with an errno that names no file is made to name `path`, since the user needs to know which."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "wb" if isinstance(content, bytes) else "w") as fh:
                fh.write(content)
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
        raise
    return path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
