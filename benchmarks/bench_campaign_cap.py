"""Benchmark: a 10^8-member campaign refused, by each command that reads a campaign file.

    python benchmarks/bench_campaign_cap.py

Writes the ten-line campaign file of tests/tui/test_hostile_input.py (eight axes of ten values) into
a private config directory, then runs `campaign list`, `plan`, `show` and `run` on it, each in a fresh
process, and prints its wall time, CPU time (user + system: what counts on a loaded machine), peak
RSS (both from wait4) and what it said. Each is started by a bare
Python process: a child's peak RSS counts its parent's pages until its exec, and this one has
imported the test module.

Target (issue 35): each refuses it in one line (list: in its row, the others listed) within 2 s and
200 MB, start-up included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = (["list"], ["plan", "huge"], ["show", "huge"], ["run", "huge", "--detach"])


def measure(argv: list[str]) -> tuple[float, float, float, int, str]:
    """(wall seconds, CPU seconds, peak RSS in MB, exit code, what it said of the campaign) of one
    fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "charllm.tui", "campaign", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    said = " ".join(line for line in out.splitlines() if "huge" in line or "error" in line)
    cpu = usage.ru_utime + usage.ru_stime
    return seconds, cpu, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), " ".join(said.split())


def main() -> int:
    if sys.argv[1:2] == ["--measure"]:          # (the bare process's part)
        print(json.dumps(measure(sys.argv[2:])))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tui.test_hostile_input import HUGE_CAMPAIGN  # deferred: the file the test refuses (imports numpy)

    with tempfile.TemporaryDirectory() as private:   # the bench never touches the user's config or runs
        env = {**os.environ, "CHARLLM_CONFIG_DIR": f"{private}/config", "CHARLLM_DATA_DIR": f"{private}/data",
               "CHARLLM_RUNS_DIR": f"{private}/runs"}
        folder = Path(private) / "config" / "campaigns"
        folder.mkdir(parents=True)
        (folder / "huge.toml").write_text(HUGE_CAMPAIGN)
        print(f"campaign file: {len(HUGE_CAMPAIGN.splitlines())} lines, 10^8 members (target: refused within "
              "2 s and 200 MB)")
        for argv in COMMANDS:
            done = subprocess.run([sys.executable, __file__, "--measure", *argv], env=env, capture_output=True,
                                  text=True, check=True)
            seconds, cpu, rss, code, said = json.loads(done.stdout)
            print(f"campaign {' '.join(argv):<22} {seconds:5.2f} s ({cpu:4.2f} s CPU)  {rss:4.0f} MB  exit {code}  "
                  f"{said[:100]}")
        assert not (Path(private) / "runs").exists(), "a refused campaign recorded nothing"
    return 0


if __name__ == "__main__":
    sys.exit(main())
