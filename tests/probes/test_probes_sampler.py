"""The sampler: rate, schema, consumers, iteration markers, recording, tails, stream and replay."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import polars as pl
import pytest

from charllm.probes.backends import open_backend, open_backends
from charllm.probes.backends.sim import SimBackend
from charllm.probes.core.errors import UserError
from charllm.probes.sampler import Sampler
from charllm.probes.store.recorder import ChunkWriter
from charllm.probes.store.rundir import RunDir
from charllm.probes.store.schema import TELEMETRY_SCHEMA
from charllm.probes.store.stream import StreamWriter, read_stream
from charllm.probes.store.tail import IterationTail, TelemetryTail


def _sim(gpus: int = 2, **kw) -> SimBackend:
    return SimBackend(gpus=gpus, **kw)


def test_hz_above_100_is_refused():
    with pytest.raises(UserError, match="hz = 150: must be > 0 and at most 100"):
        Sampler([_sim()], hz=150)
    with pytest.raises(UserError, match="hz = 0"):
        Sampler([_sim()], hz=0)


@pytest.mark.timeout(30)
def test_sampler_keeps_its_rate_and_writes_schema_rows(tmp_path):
    backends, _ = open_backends("sim", gpus=2)
    sampler = Sampler(backends, hz=50, node="n1", run_dir=tmp_path / "run")
    sampler.run(duration=2.0)
    assert sampler.ticks + sampler.missed_deadlines == 100
    frame = RunDir(tmp_path / "run").scan_telemetry().collect()
    assert frame.schema == pl.Schema(TELEMETRY_SCHEMA)
    gpu = frame.filter(pl.col("device") == "gpu0").sort("mono_ns")
    assert gpu.height == sampler.ticks
    gaps = gpu["mono_ns"].diff().drop_nulls() / 1e9
    assert gaps.mean() == pytest.approx(0.02, rel=0.1)
    host = frame.filter(pl.col("device") == "host")
    # the host is sampled at most at 20 Hz: every 3rd tick at 50 Hz
    assert sampler.backend_hz(backends[-1]) == pytest.approx(50 / 3) and host.height == pytest.approx(34, abs=2)
    # CPU use is a rate: known from the second host sample on (the first may fall in the clock tick
    # of the backend's reference reading), never a 0 that was not measured
    assert host.sort("mono_ns")["cpu_util_pct"][1:].null_count() == 0
    assert set(frame["node"]) == {"n1"}
    assert frame.filter(pl.col("backend") == "sim")["simulated"].all()
    assert not frame.filter(pl.col("backend") == "host")["simulated"].any()


def test_missed_deadlines_are_counted_not_caught_up():
    class Slow(SimBackend):
        def sample(self):
            time.sleep(0.035)  # three 10 ms periods and a half per tick
            return super().sample()

    sampler = Sampler([Slow(gpus=1)], hz=100, node="n")
    seen = []
    sampler._consumers.append(seen.extend)
    sampler.run(duration=0.5)
    assert sampler.missed_deadlines >= 25
    assert sampler.ticks + sampler.missed_deadlines == pytest.approx(50, abs=4)
    counts = [r["missed_deadlines"] for r in seen]
    assert counts == sorted(counts) and counts[-1] > 0


def test_a_backend_that_raises_is_counted_not_fatal(caplog):
    class Flaky(SimBackend):
        calls = 0

        def sample(self):
            self.calls += 1
            if self.calls % 2:
                raise RuntimeError("driver hiccup")
            return super().sample()

    now = [0.0]

    class OnTime(Sampler):
        def _sleep(self, seconds):   # time passes only while it waits: on a busy machine no tick is late
            now[0] += seconds
            return False

    seen = []
    sampler = OnTime([Flaky(gpus=1)], hz=50, node="n", on_sample=seen.extend, clock=lambda: now[0])
    sampler.run(duration=0.2)   # 10 ticks, every other one raising
    assert len(seen) == 5 and [r["errors"] for r in seen] == [1, 2, 3, 4, 5]
    assert sum("driver hiccup" in r.exc_text for r in caplog.records if r.exc_text) == 1  # said once


def test_in_process_consumers_see_every_tick_at_once():
    got, times = [], []

    def on_sample(rows):
        got.append(rows)
        times.append(time.time_ns())

    sampler = Sampler([_sim(3)], hz=20, node="n", on_sample=on_sample)
    q = sampler.subscribe()
    sampler.start(duration=0.5)
    sampler.join(5)
    assert len(got) == 10 and all(len(rows) == 3 for rows in got)
    assert all(t - rows[0]["ts_ns"] < 50_000_000 for t, rows in zip(times, got))
    assert q.qsize() == 10


def test_subscribe_queue_drops_oldest_when_full():
    sampler = Sampler([_sim(1)], hz=100, node="n")
    q = sampler.subscribe(maxsize=3)
    sampler.run(duration=0.1)
    assert q.qsize() == 3
    assert q.get_nowait()[0]["mono_ns"] < q.get_nowait()[0]["mono_ns"]


def test_iteration_marker_comes_from_the_run_iteration_log(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    sampler = Sampler([_sim(1)], hz=50, node="n", run_dir=run.path)
    seen = []
    sampler._consumers.append(lambda rows: seen.append(rows[0]["iteration"]))

    def workload():
        time.sleep(0.3)
        with open(run.iterations_path, "a") as fh:
            fh.write(json.dumps({"event": "start"}) + "\n")
            fh.flush()
            time.sleep(0.3)
            for i in (1, 2):
                fh.write(json.dumps({"event": "iteration", "iteration": i, "rank": 0}) + "\n")
            fh.write('{"event": "iteration", "iter')  # a half-written line is not read yet
            fh.flush()
            time.sleep(0.3)

    writer = threading.Thread(target=workload)
    writer.start()
    sampler.run(duration=1.2)
    writer.join()
    assert seen[0] is None
    assert 1 in seen and seen[-1] == 3
    assert seen.index(1) < seen.index(3)


def test_chunks_are_atomic_numbered_and_continue(tmp_path):
    frame = pl.DataFrame({"ts_ns": [1, 2], "mono_ns": [1, 2], "node": ["n", "n"], "device": ["gpu0"] * 2,
                          "uuid": ["u"] * 2, "backend": ["sim"] * 2, "simulated": [True] * 2, "power_w": [1.0, 2.0]})
    writer = ChunkWriter(tmp_path)
    writer.write(frame)
    writer.write(frame)
    again = ChunkWriter(tmp_path)
    again.write(frame)
    names = sorted(os.listdir(tmp_path))
    assert names == ["000000.arrow", "000001.arrow", "000002.arrow"]  # no .tmp left behind
    back = pl.read_ipc(tmp_path / "000002.arrow")
    assert back.schema == pl.Schema(TELEMETRY_SCHEMA) and back["power_w"].to_list() == [1.0, 2.0]


def test_tails_return_only_new_complete_data(tmp_path):
    run = RunDir(tmp_path / "run")
    tail = TelemetryTail(run.path)
    assert tail.poll().is_empty()
    sampler = Sampler([_sim(2)], hz=20, node="n", run_dir=run.path, flush_s=0.2)
    sampler.run(duration=0.5)
    first = tail.poll()
    assert first.height == sampler.rows and first.schema == pl.Schema(TELEMETRY_SCHEMA)
    # a chunk still being written (hidden .tmp) is not read
    (run.node_telemetry_dir("n") / ".000099.arrow.tmp").write_bytes(b"half")
    assert tail.poll().is_empty()
    Sampler([_sim(2)], hz=20, node="n", run_dir=run.path).run(duration=0.2)
    second = tail.poll()
    assert second.height == 8 and second["ts_ns"].min() > first["ts_ns"].max()

    log = IterationTail(run.path)
    assert log.poll() == []
    with open(run.iterations_path, "w") as fh:
        fh.write('{"event": "start"}\n{"event": "iteration", "itera')
    assert log.poll() == [{"event": "start"}]
    with open(run.iterations_path, "a") as fh:
        fh.write('tion": 1}\n')
    assert log.poll() == [{"event": "iteration", "iteration": 1}]
    assert log.poll() == []


def test_stream_round_trip_in_process():
    buf = io.BytesIO()
    writer = StreamWriter(buf)
    sampler = Sampler([_sim(2)], hz=50, node="n", stream=buf, flush_s=0.1)
    sampler.run(duration=0.3)
    writer.write(pl.DataFrame({"device": ["x"]}))
    raw = buf.getvalue()
    batches = []
    rows = read_stream(io.BytesIO(raw[:-5]), batches.append)  # a truncated last frame is dropped
    assert rows == sampler.rows and all(b.schema == pl.Schema(TELEMETRY_SCHEMA) for b in batches)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_stream_across_processes_arrives_within_a_second(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--sim-gpus", "2",
                             "--hz", "20", "--stream", "--node", "remote"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lags, batches = [], []

    def on_batch(frame):
        lags.append(time.time_ns() - frame["ts_ns"].min())
        batches.append(frame)
        if len(batches) == 3:
            proc.terminate()

    try:
        read_stream(proc.stdout, on_batch)
        assert proc.wait(10) == 0  # SIGTERM: flush and exit 0
    finally:
        proc.kill()
    assert len(batches) >= 3
    # stream batches leave every 0.25 s: even the oldest row of a batch arrives within a second
    assert max(lags[:3]) < 1.0e9
    assert set(pl.concat(batches)["node"]) == {"remote"}


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_closes_the_last_chunk(sig, tmp_path):
    """SIGUSR1 is how a Slurm job stops its samplers (srun turns a SIGTERM into a SIGKILL)."""
    import signal

    rd = RunDir(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--hz", "20",
                             "--out", str(rd.path), "--node", "n1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not rd.telemetry_files() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(10) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert rd.read_manifest()["status"] == "completed"
    assert not list(rd.path.rglob("*.tmp")) and rd.scan_telemetry().collect().height > 0


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_kill_9_loses_at_most_about_a_second(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "charllm.tui", "probe", "--backend", "sim", "--sim-gpus", "4",
                             "--out", str(run_dir), "--node", "n1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    started = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and started is None:  # wait until sampling has begun
        files = RunDir(run_dir).telemetry_files()
        if files:
            started = pl.read_ipc(files[0])["ts_ns"].min()
        time.sleep(0.05)
    assert started is not None, proc.stderr.read().decode()
    time.sleep(max(0.0, 2.5 - (time.time_ns() - started) / 1e9))
    proc.kill()
    killed_at = time.time_ns()
    proc.wait()
    frame = RunDir(run_dir).scan_telemetry().collect()  # a half-written .tmp must not break this
    assert frame["ts_ns"].min() == started
    assert killed_at - frame["ts_ns"].max() < 1.3e9
    gpu0 = frame.filter(pl.col("device") == "gpu0")
    assert gpu0.height >= 0.9 * 20 * (frame["ts_ns"].max() - started) / 1e9
    assert json.loads((run_dir / "manifest.json").read_text())["kind"] == "probe"


def test_replay_plays_back_at_speed_with_labels(tmp_path):
    source = tmp_path / "source"
    Sampler(open_backends("sim", gpus=2)[0], hz=20, node="n1", run_dir=source).run(duration=1.0)
    recorded = RunDir(source).scan_telemetry().collect()

    replay = open_backend(f"replay:{source}", speed=4.0)
    assert replay.name == "replay"  # two recorded backends: sim and host
    assert [d.label for d in replay.devices()] == ["gpu0", "gpu1", "host"]
    out = tmp_path / "out"
    sampler = Sampler([replay], hz=50, node="n2", run_dir=out)
    start = time.monotonic()
    sampler.run(duration=10)  # ends when the recording runs out
    took = time.monotonic() - start
    assert 0.15 < took < 0.6  # 1 s recorded at 4x
    played = RunDir(out).scan_telemetry().collect()
    assert played.height == recorded.height
    assert set(played["backend"]) == {"replay:sim", "replay:host"}
    assert played.filter(pl.col("backend") == "replay:sim")["simulated"].all()
    assert set(played["node"]) == {"n1"}  # the recorded node, not the replaying one
    span = (played["ts_ns"].max() - played["ts_ns"].min()) / 1e9
    assert span == pytest.approx((recorded["ts_ns"].max() - recorded["ts_ns"].min()) / 1e9 / 4, rel=0.05)
    assert played["ts_ns"].min() > recorded["ts_ns"].max()  # re-timestamped to the replay
    cols = ["device", "power_w", "temp_gpu_c", "throttle_reasons"]
    assert played.sort("ts_ns", "device").select(cols).equals(recorded.sort("ts_ns", "device").select(cols))


def test_replay_of_an_empty_run_is_a_user_error(tmp_path):
    RunDir.create(tmp_path / "empty", "probe").write_manifest({"kind": "probe"})
    with pytest.raises(UserError, match="no telemetry recorded"):
        open_backend(f"replay:{tmp_path / 'empty'}")


def _seq_frame(start: int, n: int = 3) -> pl.DataFrame:
    """Rows numbered start..start+n-1 (in ts_ns), so a reader can tell a lost or doubled row;
    two devices take turns, as a sampler's rows do."""
    ts = list(range(start, start + n))
    return pl.DataFrame({"ts_ns": ts, "mono_ns": ts, "node": ["n"] * n, "device": [f"gpu{t % 2}" for t in ts],
                         "uuid": ["u"] * n, "backend": ["sim"] * n, "simulated": [True] * n})


def _rows(frame: pl.DataFrame) -> list[int]:
    """Row numbers in order; compacted files group rows by device, each device's in time order."""
    for _, device in frame.group_by("device"):
        assert device["ts_ns"].is_sorted()
    return sorted(frame["ts_ns"])


def test_compaction_keeps_each_row_exactly_once_for_readers_and_tails(tmp_path):
    run = RunDir(tmp_path / "run")
    writer = ChunkWriter(run.node_telemetry_dir("n"), compact_every=3)
    tail, late, tailed = TelemetryTail(run.path), TelemetryTail(run.path), []
    for k in range(8):
        writer.write(_seq_frame(3 * k))
        assert _rows(run.scan_telemetry().collect()) == list(range(3 * k + 3))
        tailed += tail.poll()["ts_ns"].to_list()
        if k == 4:
            tailed_late = late.poll()["ts_ns"].to_list()  # one compacted file, one chunk and a merged one
    assert tailed == list(range(24))
    names = sorted(os.listdir(run.node_telemetry_dir("n")))
    # chunks 0-2 were deleted at the second compaction; 3-5 still wait a compaction for late readers
    assert names == ["000000-000002.parquet", "000003-000005.parquet", "000003.arrow", "000004.arrow",
                     "000005.arrow", "000006.arrow", "000007.arrow"]
    writer.close()
    assert sorted(os.listdir(run.node_telemetry_dir("n"))) == [
        "000000-000002.parquet", "000003-000005.parquet", "000006-000007.parquet"]
    assert sorted(tailed_late + late.poll()["ts_ns"].to_list()) == list(range(24))
    assert tail.poll().is_empty()
    assert ChunkWriter(run.node_telemetry_dir("n")).write(_seq_frame(24)).name == "000008.arrow"


def test_a_crash_mid_compaction_leaves_a_consistent_set(tmp_path):
    node = tmp_path / "run" / "telemetry" / "n"
    writer = ChunkWriter(node, compact_every=None)
    for k in range(4):
        writer.write(_seq_frame(3 * k))
    # crashed after renaming the compacted file, before deleting the chunks it holds,
    pl.concat([pl.read_ipc(node / f"00000{i}.arrow") for i in range(3)]).write_parquet(node / "000000-000002.parquet")
    # and with a half-written next compaction
    (node / ".000003-000009.parquet.tmp").write_bytes(b"half")
    run = RunDir(tmp_path / "run")
    assert _rows(run.scan_telemetry().collect()) == list(range(12))
    again = ChunkWriter(node)  # a restarted writer finishes the cleanup and continues after it
    assert sorted(os.listdir(node)) == ["000000-000002.parquet", "000003.arrow"]
    again.write(_seq_frame(12))
    again.close()
    assert sorted(os.listdir(node)) == ["000000-000002.parquet", "000003-000004.parquet"]
    assert _rows(run.scan_telemetry().collect()) == list(range(15))


_WRITER_LOOP = """
import sys, time, polars as pl
from pathlib import Path
from charllm.probes.store.recorder import ChunkWriter
from charllm.probes.store.rundir import RunDir
run = RunDir(Path(sys.argv[1]))
frame = run.scan_telemetry().select(pl.col("ts_ns").max()).collect().item()
k = 0 if frame is None else frame + 1
writer = ChunkWriter(run.node_telemetry_dir("n"), compact_every=4)
print("ready", flush=True)
while True:
    writer.write(pl.DataFrame({"ts_ns": range(k, k + 5), "mono_ns": range(k, k + 5), "node": ["n"] * 5,
                               "device": [f"gpu{t % 2}" for t in range(k, k + 5)], "uuid": ["u"] * 5}))
    k += 5
    time.sleep(0.002)
"""


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_kill_9_at_any_moment_of_compaction_loses_and_doubles_nothing(tmp_path):
    """A writer compacting every 4 chunks, killed at random moments and restarted, many times:
    every reader sees rows 0..n-1 exactly once, whatever the kill interrupted, and a tail
    polling while it writes and compacts delivers each row once."""
    import random

    run = RunDir(tmp_path / "run")
    rng = random.Random(7)
    tail, tailed, seen = TelemetryTail(run.path), [], 0
    for _ in range(12):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER_LOOP, str(run.path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()
            stop = time.monotonic() + rng.uniform(0.05, 0.4)
            while time.monotonic() < stop:
                tailed += tail.poll()["ts_ns"].to_list()
        finally:
            proc.kill()
            proc.wait()
        rows = _rows(run.scan_telemetry().collect())
        assert rows == list(range(len(rows))) and len(rows) % 5 == 0  # whole chunks, no gap, no double
        assert len(rows) >= seen
        seen = len(rows)
    assert seen > 0 and any("-" in p.name for p in run.telemetry_files())  # compactions happened
    assert sorted(tailed + tail.poll()["ts_ns"].to_list()) == list(range(seen))
