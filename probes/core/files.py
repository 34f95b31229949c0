"""Reading files anyone could have put there: regular files only, and only as much as expected.

A run directory, a config directory and an imported tree are the user's to edit, and their
files may be damaged, swapped for a pipe (open() waits forever for a writer), a device
(/dev/zero never ends) or a link to one. Every read of such a file goes through here: checked to
be a regular file before anything is read, and its size checked before it is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from charllm.probes.core.errors import UserError


def open_regular(path: str | os.PathLike, what: str = "file"):
    """The file at `path` opened for binary reading, if it is a regular file (a link to one
    counts); a pipe, device, socket or directory is one UserError line. Opening never blocks: a
    pipe with no writer is found out, not waited on. Other OSErrors (missing, permission) pass."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UserError(f"{what} {str(path)!r}: is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise UserError(f"{what} {str(path)!r}: not a regular file (a pipe, a device or a socket)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular's checks first); a
    bigger one is one UserError line, found out from its size before anything is read."""
    with open_regular(path, what) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:   # (or it grew while being read)
            raise UserError(f"{what} {str(path)!r}: {max(size, len(data)):,} bytes, more than the "
                            f"{limit:,} it may have")
        return data


def is_regular(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file (following links), without opening it."""
    try:
        return stat.S_ISREG(Path(path).stat().st_mode)
    except (OSError, ValueError):
        return False
