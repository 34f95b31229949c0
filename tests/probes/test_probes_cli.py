"""`charllm-tui probe` and `python -m charllm.probes`: one parser, listing, recording, errors, signals."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import polars as pl
import pytest

from charllm.probes.store.rundir import RunDir
from charllm.tui.cli import main
from fakes_amdsmi import real_amdsmi_present
from fakes_nvml import real_nvml_present


def test_list_on_this_machine_says_why_there_is_no_gpu(capsys):
    if real_nvml_present() or real_amdsmi_present():
        pytest.skip("this machine has a GPU library")
    assert main(["probe", "--list"]) == 0
    out = capsys.readouterr().out
    assert "NVMLError_LibraryNotFound" in out and "using host only" in out
    assert "cpu_util_pct" in out and "host_mem_used_bytes" in out


def test_list_sim_marks_devices_simulated():
    out = subprocess.run([sys.executable, "-m", "charllm.probes", "--list", "--backend", "sim", "--sim-gpus", "2"],
                         capture_output=True, text=True, timeout=60, env=_wide())
    assert out.returncode == 0, out.stderr
    assert "gpu1" in out.stdout and "SIMULATED" in out.stdout and "throttle_reasons" in out.stdout


@pytest.mark.parametrize("argv, message", [
    (["--hz", "500"], "hz = 500: must be > 0 and at most 100"),
    (["--backend", "cuda"], "backend = 'cuda': must be one of"),
    (["--duration", "-1"], "duration = -1: must be > 0"),
    (["--backend", "sim", "--sim-profile", "wavy"], "sim profile = 'wavy'"),
    (["--backend", "replay:no-such-run"], "run 'no-such-run': no such run"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    out_dir = tmp_path / "run"
    assert main(["probe", *argv, "--out", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("charllm-tui: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out_dir.exists()


def test_record_for_a_duration_into_a_new_run_dir(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert main(["probe", "--backend", "sim", "--sim-gpus", "2", "--hz", "20", "--duration", "1",
                 "--out", str(out_dir), "--node", "n7"]) == 0
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["kind"] == "probe" and manifest["status"] == "completed"
    frame = RunDir(out_dir).scan_telemetry().collect()
    assert frame.filter(pl.col("device") == "gpu0").height == 20
    assert (out_dir / "telemetry" / "n7").is_dir()
    assert "0 missed deadlines" in capsys.readouterr().err


@pytest.mark.parametrize("hz", [20, 100])
def test_every_backend_keeps_the_default_rate_and_a_slower_one_says_its_rate_and_why(tmp_path, capsys, hz):
    out_dir = tmp_path / "run"
    assert main(["probe", "--backend", "sim", "--sim-gpus", "1", "--hz", str(hz), "--duration", "2",
                 "--out", str(out_dir), "--node", "n0"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    rows = RunDir(out_dir).scan_telemetry().group_by("device").len().sort("device").collect().rows()
    (_, gpu), (_, host) = rows
    ticks = int(re.search(r"rows in (\d+) ticks", err).group(1))
    assert gpu == ticks and 30 <= host <= 41  # the host at 20 Hz (it was 10 Hz when 20 Hz was asked)
    assert json.loads((out_dir / "manifest.json").read_text())["rates"] == {"sim": hz, "host": 20.0}
    slower = "host at 20 Hz (psutil reads /proc and /sys, ~0.3 ms a sample, and host counters change slowly)"
    assert (slower in err) == (hz > 20)
    assert re.search(rf"{gpu + host} rows in {ticks} ticks at [\d.]+ Hz \({hz} Hz asked, \d+ missed deadline", err)


def test_existing_manifest_is_left_to_its_owner(tmp_path):
    run = RunDir.create(tmp_path / "run", "launch")
    run.write_manifest({"id": "run", "status": "running", "target": {"name": "local", "kind": "local"}})
    assert main(["probe", "--backend", "sim", "--sim-gpus", "1", "--duration", "0.2", "--out", str(run.path)]) == 0
    assert run.read_manifest() == {"id": "run", "status": "running", "target": {"name": "local", "kind": "local"}}


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "damaged"])
def test_a_launched_run_that_has_ended_is_refused_untouched(tmp_path, capsys, status):
    """Issue 35: `probe --out` onto a completed launch run exited 0 and wrote telemetry into it long
    after it ended. A launched run takes samplers only while it runs, one per node."""
    from charllm.probes.store.synthetic import gpu_frame, write_telemetry
    from infra_fuzz import tree

    run = RunDir.create(tmp_path / "run", "launch")
    if status == "damaged":
        run.manifest_path.write_text('{"status": ')
    else:
        run.write_manifest({"id": "run", "status": status, "target": {"name": "local", "kind": "local"}})
    write_telemetry(run, [gpu_frame([0.0, 0.1, 0.2], node="n0")])
    before = tree(tmp_path)
    code = main(["probe", "--backend", "sim", "--sim-gpus", "1", "--duration", "0.2", "--out", str(run.path),
                 "--node", "n1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("charllm-tui: error: ")
    assert ("damaged manifest" if status == "damaged" else f"a launched run that has ended ({status})") in err
    assert tree(tmp_path) == before


def test_a_running_launch_takes_one_sampler_per_node(tmp_path, capsys):
    run = RunDir.create(tmp_path / "run", "launch")
    run.write_manifest({"id": "run", "status": "running", "target": {"name": "local", "kind": "local"}})
    probe = ["probe", "--backend", "sim", "--sim-gpus", "1", "--duration", "0.2", "--out", str(run.path)]
    assert main([*probe, "--node", "n0"]) == 0
    capsys.readouterr()
    assert main([*probe, "--node", "n0"]) == 2
    assert "node 'n0' already records telemetry into this launched run" in capsys.readouterr().err
    assert main([*probe, "--node", "n1"]) == 0
    assert sorted(p.name for p in run.telemetry_dir.iterdir()) == ["n0", "n1"]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_sigint_flushes_and_exits_0(tmp_path):
    out_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--sim-gpus", "1",
                             "--out", str(out_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not RunDir(out_dir).telemetry_files():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    sent = time.time_ns()
    assert proc.wait(10) == 0, proc.stderr.read().decode()
    frame = RunDir(out_dir).scan_telemetry().collect()
    assert sent - frame["ts_ns"].max() < 0.2e9  # the last partial second was flushed too


def test_follow_shows_a_live_table(capsys):
    assert main(["probe", "--backend", "sim", "--sim-gpus", "2", "--duration", "0.5", "--follow"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED DATA" in out and "gpu1" in out and "host" in out


def test_follow_piped_ends_its_table_with_a_newline():
    """The summary line on stderr starts a line of its own when both go to one pipe (2>&1)."""
    out = subprocess.run([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--sim-gpus", "1",
                          "--duration", "0.5", "--follow"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=60, env=_wide())
    assert out.returncode == 0, out.stdout
    last = out.stdout.splitlines()[-1]
    assert last.startswith("probe: ") and "rows in" in last, out.stdout[-400:]


def _wide() -> dict:
    import os

    return {**os.environ, "COLUMNS": "250"}


def test_node_entry_point_needs_no_tui():
    code = ("import sys\nfrom charllm.probes.__main__ import main\n"
            "print(sorted(m for m in ('charllm.tui', 'textual', 'polars') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"  # polars too loads only once sampling starts
    helped = subprocess.run([sys.executable, "-m", "charllm.probes", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and "replay:RUN" in helped.stdout and "--sim-profile" in helped.stdout


def test_gpm_counters_through_list_run_files_and_summary(tmp_path, capsys, monkeypatch):
    """A Hopper GPU with GPM beside one without: `probe --list` names what the second cannot report,
    the recording holds the counters for the first and nulls (never zeros) for the second, the probe
    says so once, and `summarize` gives the counters' means for the first alone."""
    from charllm.probes.analysis.summary import summarize
    from charllm.probes.backends import inventory, open_backends
    from fakes_nvml import FakeGpu, FakeNvml

    FakeNvml([FakeGpu(0, gpm=True), FakeGpu(1, name="NVIDIA A100-SXM4-80GB")]).install(monkeypatch)
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["probe", "--list", "--backend", "nvml"]) == 0
    assert "not supported" in capsys.readouterr().out
    backends, _ = open_backends("nvml")
    listed = {d["device"]: d for d in inventory(backends)}
    gpm = {"sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_bw_util_pct", "nvlink_tx_bytes_s"}
    assert gpm <= set(listed["gpu0"]["metrics"]) and listed["gpu0"]["not_supported"] == []
    assert gpm.isdisjoint(listed["gpu1"]["metrics"]) and gpm <= set(listed["gpu1"]["not_supported"])

    out_dir = tmp_path / "run"
    assert main(["probe", "--backend", "nvml", "--hz", "20", "--duration", "1", "--out", str(out_dir)]) == 0
    err = capsys.readouterr().err
    assert err.count("not supported here, recorded as null") == 1
    assert re.search(r"gpu1: .*sm_active_pct", err) and not re.search(r"gpu0: .*sm_active_pct", err)
    frame = RunDir(out_dir).scan_telemetry().collect()
    gpu0, gpu1 = (frame.filter(pl.col("device") == d) for d in ("gpu0", "gpu1"))
    assert gpu0["sm_active_pct"].drop_nulls().unique().to_list() == [62.5] and gpu0.height == 20
    assert 1 <= gpu0["sm_active_pct"].null_count() <= 2     # the first 100 ms: one GPM sample only
    assert gpu1["sm_active_pct"].null_count() == gpu1.height and gpu1["tensor_active_pct"].null_count() == gpu1.height
    assert (frame["violation_power_ns"].drop_nulls() == 5_000_000_000).all()
    s = summarize(RunDir(out_dir), "all").sort("device")
    assert s["sm_active_mean_pct"].to_list() == [pytest.approx(62.5), None]
    assert s["tensor_active_mean_pct"].to_list() == [pytest.approx(44.0), None]
    assert s["violation_power_frac"].to_list() == [0.0, 0.0]           # the counter did not move
