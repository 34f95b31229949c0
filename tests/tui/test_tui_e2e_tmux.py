"""End to end in a real terminal: tmux runs `charllm-tui`, keys pick the tiny-local preset and launch
it locally, the screen shows the live view with iterations, and quitting leaves no process behind;
keys sent in one go (as a paste or a fast typist) all arrive."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time

import psutil
import pytest

import infra_daemons as daemons
from charllm.probes.store.rundir import FINAL_STATUSES, list_runs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(shutil.which("tmux") is None and not daemons.REQUIRED, reason="tmux is not installed"),
    pytest.mark.skipif(shutil.which("charllm-tui") is None, reason="charllm-tui is not on PATH (pip install -e .)"),
]


class Tmux:
    """One tmux server on a private socket, stopped by its PID."""

    def __init__(self, socket_path):
        self.socket = str(socket_path)

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=30)
        return out.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "tui")

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if re.search(pattern, text):
                return text
            time.sleep(0.3)
        raise AssertionError(f"{pattern!r} never appeared; the screen was:\n{self.screen()}")

    def keys(self, *keys: str) -> None:
        for key in keys:
            self("send-keys", "-t", "tui", key)
            time.sleep(0.4)


def start(tmux: Tmux, charllm_dirs, width: int = 160, height: int = 48) -> None:
    env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (
        ("CHARLLM_CONFIG_DIR", charllm_dirs["config"]), ("CHARLLM_DATA_DIR", charllm_dirs["data"]),
        ("CHARLLM_RUNS_DIR", charllm_dirs["runs"]), ("TERM", "xterm-256color")))
    tmux("new-session", "-d", "-s", "tui", "-x", str(width), "-y", str(height), f"env {env} charllm-tui")


def test_keys_sent_in_one_go_all_arrive(tmp_path, charllm_dirs):
    """Tab to "global batch" and replace 8 by 16 with one send-keys each: the field and the experiment
    both say 16 (Textual ran a field's ctrl+a/ctrl+k after the digits typed behind them)."""
    tmux = Tmux(tmp_path / "tmux.sock")
    start(tmux, charllm_dirs, 120, 40)
    server = psutil.Process(int(tmux("display-message", "-p", "-t", "tui", "#{pid}").strip()))
    try:
        tmux.wait_for(r"FITS", timeout=60)
        tmux("send-keys", "-t", "tui", *["Tab"] * 14)          # preset, model, ... micro batch, global batch
        tmux.wait_for(r"sequences per optimizer step", timeout=10)     # its hint line
        tmux("send-keys", "-t", "tui", "C-a", "C-k", "1", "6", "Tab")
        # 16 sequences of 2 on 2 data-parallel ranks: 4 micro-batches (8 made 2)
        tmux.wait_for(r"4 micro-batches of", timeout=30)
        time.sleep(1.0)
        screen = tmux.screen()
        assert re.search(r"global batch\s+16\b", screen), screen
        assert "expected an integer" not in screen
    finally:
        server.kill()


@pytest.mark.train
def test_compose_launch_watch_and_quit(tmp_path, charllm_dirs):
    tmux = Tmux(tmp_path / "tmux.sock")
    start(tmux, charllm_dirs)
    server = psutil.Process(int(tmux("display-message", "-p", "-t", "tui", "#{pid}").strip()))
    app = psutil.Process(int(tmux("display-message", "-p", "-t", "tui", "#{pane_pid}").strip()))
    try:
        tmux.wait_for(r"Compose F2", timeout=60)
        # Compose: the preset list has the focus; open it, type to find tiny-local, pick it.
        tmux.keys("Enter")
        tmux.wait_for(r"tiny-local", timeout=10)
        tmux.keys("t", "i", "n", "y", "-", "l", "Enter")
        tmux.wait_for(r"FITS", timeout=60)
        # Launch: the dry run, then launch on this machine.
        tmux.keys("F4")
        tmux.wait_for(r"torch\.distributed\.run", timeout=60)
        tmux.keys("l")
        screen = tmux.wait_for(r"iteration \d+", timeout=240)
        assert "Live F5" in screen and "host CPU utilization" in screen
        runs = list_runs(charllm_dirs["runs"])
        assert len(runs) == 1
        deadline = time.monotonic() + 240
        while runs[0].status not in FINAL_STATUSES and time.monotonic() < deadline:
            time.sleep(0.5)
        assert runs[0].status == "completed"
        tmux.wait_for(r"iteration 20\b", timeout=30)
        run_pids = [p["pid"] for p in runs[0].read_manifest().get("processes", []) if p.get("pid")]
        # Quit: the app, its threads' work and the tmux server all end.
        tree = [app, *app.children(recursive=True)]
        tmux.keys("C-q")
        gone, alive = psutil.wait_procs(tree + [server], timeout=20)
        assert not alive, f"still running after quit: {alive}"
        assert not [pid for pid in run_pids if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    finally:
        if server.is_running():
            server.kill()
        assert not os.path.exists(tmp_path / "tmux.sock") or not server.is_running()


def test_at_80x24_a_zero_a_dropdown_and_quitting_with_a_run_going(tmp_path, charllm_dirs):
    """In a real 80x24 terminal: 0 in TP is said beside it and the workbench stays; the hardware dropdown
    opens with Space, moves with Down and chooses with Enter; ctrl+q with a run going asks first, and the
    command that stops the run is left in the terminal (issue 36, items 7, 8 and 13)."""
    from charllm.probes.core import procid
    from charllm.probes.store.rundir import RunDir
    from charllm.tui.demo import make_demo_run

    run = RunDir(make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-going", seconds=4, gpus=2))
    run.update_manifest(status="running", ended_ns=None, supervisor=procid.identify(os.getpid()))  # ours: not ended
    tmux = Tmux(tmp_path / "tmux.sock")
    start(tmux, charllm_dirs, 80, 24)
    tmux("set-option", "-t", "tui", "remain-on-exit", "on")        # the terminal after the workbench, to read
    server = psutil.Process(int(tmux("display-message", "-p", "-t", "tui", "#{pid}").strip()))
    app = psutil.Process(int(tmux("display-message", "-p", "-t", "tui", "#{pane_pid}").strip()))
    try:
        tmux.wait_for(r"Compose F2", timeout=60)
        tmux.keys("Tab", "Tab", "Tab", "Tab", "Tab")                 # preset, model, hardware, nodes, GPUs: TP
        tmux.wait_for(r"tensor parallel: each layer", timeout=10)
        tmux("send-keys", "-t", "tui", "C-a", "C-k", "0")
        tmux.wait_for(r"tensor_model_parallel_size = 0:.*\n\s+must be at least 1", timeout=30)   # under TP
        tmux.keys("BTab", "BTab", "BTab")                            # back to hardware
        tmux.wait_for(r"the hardware preset", timeout=10)
        before = re.search(r"hardware\s+(\S+)", tmux.screen()).group(1)
        tmux.keys("Space", "Down", "Enter")
        after = re.search(r"hardware\s+(\S+)", tmux.wait_for(r"hardware\s+(?!" + re.escape(before) + r"\s)\S+",
                                                              timeout=10)).group(1)
        assert after != before
        tmux.keys("C-q")
        tmux.wait_for(r"These keep running", timeout=10)
        tmux.keys("y")
        # exited once its process is gone or a zombie: a busy tmux can take a minute to reap it and say
        # "Pane is dead" (seen on a loaded 2-core machine)
        deadline = time.monotonic() + 30
        while app.is_running() and app.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not app.is_running() or app.status() == psutil.STATUS_ZOMBIE, "the workbench did not exit"
        left = tmux("capture-pane", "-p", "-J", "-t", "tui")       # -J: the lines the terminal wrapped, whole
        assert f"run {run.id} (running, on local) · stop it: charllm-tui runs cancel {run.id}" in left, left
        assert run.manifest().status == "running"
    finally:
        server.kill()
