"""The one home of formatting (sizes, durations, local times) and of atomic file writes."""

from __future__ import annotations

import os
import time

import pytest

from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.formatting import GIB, MIB, binary_scale, clock, duration, gib, local_time, size

T0_NS = 1_763_712_000_000_000_000        # 2025-11-21 08:00:00 UTC


def test_sizes_read_in_binary_units():
    assert size(1.5 * GIB) == "1.50 GiB" and size(1.5 * GIB, 1) == "1.5 GiB"
    assert size(12 * MIB) == "12.0 MiB" and size(12.4 * MIB, 1, 0) == "12 MiB"
    assert size(-2 * GIB) == "-2.00 GiB"                       # a shortfall keeps its unit
    assert gib(40 * MIB) == "0.04 GiB"                         # a fixed unit, however small
    assert binary_scale(3 * 2**40) == (3.0, "TiB") and binary_scale(512) == (512.0, "B")
    assert duration(12.345) == "12.3 s"


@pytest.fixture
def zone(monkeypatch):
    def set_zone(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()
    yield set_zone
    monkeypatch.undo()
    time.tzset()


def test_times_show_in_the_local_zone(zone):
    zone("UTC")
    assert local_time(T0_NS) == "2025-11-21 08:00:00" and clock(T0_NS) == "08:00:00"
    zone("IST-05:30")                                          # a POSIX zone (no tz database): UTC+05:30
    assert local_time(T0_NS) == "2025-11-21 13:30:00"
    assert local_time(T0_NS, "%Y-%m-%d %H:%M") == "2025-11-21 13:30" and clock(T0_NS) == "13:30:00"
    assert local_time(None) == "-" and local_time(0) == "-"


def test_an_atomic_write_is_whole_or_absent(tmp_path):
    target = tmp_path / "out.txt"
    write_atomic(target, "old\n")
    write_atomic(target, b"new\n", mode=0o755)
    assert target.read_bytes() == b"new\n" and os.stat(target).st_mode & 0o777 == 0o755

    def half_then_fail(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as failed:
        write_atomic(target, half_then_fail, sync_dir=True)
    assert failed.value.filename == str(target)                # the error names the file meant
    assert target.read_bytes() == b"new\n"                     # the old file stays whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no hidden leftover
    write_atomic(target, lambda path: path.write_text("by a writer\n"), sync_dir=True)
    assert target.read_text() == "by a writer\n"


@pytest.mark.parametrize("content", ["text\n", b"bytes\n", "writer"])
def test_an_atomic_write_never_follows_a_planted_hidden_file(tmp_path, content):
    """Issue 35: the hidden sibling's name is known (`.NAME.PID.tmp`); a link planted there is removed,
    not written through, and the file lands whole where it was asked."""
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    target = tmp_path / "out.json"
    (tmp_path / f".out.json.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(target, (lambda path: path.write_text("by a writer\n")) if content == "writer" else content)
    assert victim.read_text() == "keep me\n" and not target.is_symlink()
    assert target.read_text() == ("by a writer\n" if content == "writer" else
                                  content.decode() if isinstance(content, bytes) else content)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim"]
