"""The one exception type for user mistakes, and the wording of messages.

Anything raised as `UserError` reaches the user as one line (`charllm-tui: error: ...`) and a
non-zero exit, never as a traceback. The message says which field, what value, what rule.
"""

import difflib
import errno
import os
import re
from pathlib import Path


class UserError(Exception):
    """A mistake in user input: a bad field, value, file or name."""


def one_line(message) -> str:
    """A message as the one line the user reads: newlines folded, and any word of more than 200
    characters (a hostile value, a path built from one) cut to its start and its length."""
    def cut(m: re.Match) -> str:
        word = m.group(0)
        tail = word[-1] if word[-1] in ":,;.'\")]" else ""   # the punctuation that ends it stays
        body = word[: len(word) - len(tail)]
        return f"{body[:80]}... ({len(body):,} characters){tail}"
    return re.sub(r"\S{201,}", cut, " ".join(str(message).split()))


def shown(value, limit: int = 80) -> str:
    """A value as a message quotes it (its repr), cut to `limit` characters with its length said:
    a hostile value of thousands of characters still gives one readable line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value)):,} characters)"


def did_you_mean(name, choices, otherwise: str = "", cutoff: float = 0.6) -> str:
    """`; did you mean 'x'?` for the closest valid name, else `otherwise` (another hint, or "")."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else otherwise


def edit_distance(a: str, b: str) -> int:
    """Levenshtein's: the fewest one-character insertions, deletions and substitutions from a to b."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ca != cb))
    return row[-1]


def closest_names(name: str, choices) -> list[str]:
    """The names `name` most likely meant, for a preset name that matches none: those it begins
    (`h100` -> the h100 parts, `llama3` -> the Llama 3 models), else the nearest by edit distance
    within a third of its length (a typo: `mixtral-8x7` -> `mixtral-8x7b`)."""
    word = name.lower()
    family = [c for c in choices if c.lower().startswith(word) and c[len(word):][:1] in ("-", "_", ".")]
    if family:
        return sorted(family)[:5]
    distance = {c: edit_distance(word, c.lower()) for c in choices}
    best = min(distance.values(), default=None)
    if best is None or best > max(1, len(word) // 3):
        return []
    return sorted(c for c, d in distance.items() if d == best)[:3]


def did_you_mean_preset(name: str, choices, otherwise: str = "") -> str:
    """`; did you mean 'x' or 'y'?` for a preset name (`closest_names`), else `otherwise`."""
    close = closest_names(name, choices)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else otherwise


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`1 micro-batch`, `2 micro-batches`: a count with its noun in agreement (`nouns` where the
    plural is not `noun` + "s")."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` says the disk is full. Python sets errno; polars raises an OSError (or its own
    error) carrying only the operating system's message."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    return getattr(exc, "errno", None) in codes or any(os.strerror(code) in str(exc) for code in codes)


def mount_point(path) -> str:
    """The mount point holding `path` (the disk a user must free space on)."""
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def disk_full_on(path) -> str:
    """What a run's status says of a full disk: "disk full on /scratch" (the disk to free)."""
    return f"disk full on {mount_point(path)}"


def os_error_line(exc: OSError, where=None) -> str:
    """One line for an operating-system error on a file (`where` when the error names none):
    a full disk names the disk."""
    path = exc.filename or where
    if is_disk_full(exc):
        return f"disk full on {mount_point(path)} (writing {path})" if path else "disk full (no space left on device)"
    return f"{path}: {exc.strerror or exc}" if path else str(exc.strerror or exc)
