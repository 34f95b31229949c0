"""Following a run directory while it is written (probes.store.follow): the status, every
telemetry row, iteration-log line and log line exactly once, in order, and the end of the run."""

import itertools
import json
import threading
import time

import polars as pl
import pytest

from charllm.probes.core.errors import UserError
from charllm.probes.store.follow import NewIterations, NewLogLines, NewTelemetry, RunFollower, StatusChanged, follow
from charllm.probes.store.recorder import ChunkWriter
from charllm.probes.store.rundir import RunDir
from charllm.probes.store.synthetic import gpu_frame, iteration_rows


def _start(root) -> RunDir:
    rd = RunDir.create(root / "20260101-000000-followed", "launch")
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "pending", "world_size": 2,
                       "target": {"name": "local", "kind": "local"}})
    rd.logs_dir.mkdir()
    return rd


def _append(path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def _by_kind(events):
    out = {StatusChanged: [], NewIterations: [], NewTelemetry: [], NewLogLines: []}
    for e in events:
        out[type(e)].append(e)
    return out


def test_each_pass_gives_what_was_written_since_the_last_once(tmp_path):
    rd = _start(tmp_path)
    follower = RunFollower(rd.path)
    first = follower.poll()
    assert first == [StatusChanged("pending", rd.manifest())]          # nothing else written yet
    assert follower.poll() == [] and not follower.ended                  # no change, no event

    writer = ChunkWriter(rd.node_telemetry_dir("n0"), compact_every=3)
    lines = [json.dumps(r).encode() + b"\n" for r in iteration_rows([0.0, 1.0, 2.0], 0.9)]
    rd.update_manifest(status="running")
    writer.write(gpu_frame([0.0, 0.5], power_w=[100.0, 110.0]))
    _append(rd.iterations_path, b"".join(lines[:3]) + lines[3][:10])     # a half-written line waits
    _append(rd.logs_dir / "rank0.log", b"step 1\nstep 2 half")
    got = _by_kind(follower.poll())
    assert [e.status for e in got[StatusChanged]] == ["running"]
    assert got[StatusChanged][0].manifest.target_name == "local"
    assert [e["event"] for e in got[NewIterations][0].events] == ["start", "iteration", "iteration"]
    assert got[NewTelemetry][0].rows["power_w"].to_list() == [100.0, 110.0]
    assert got[NewLogLines][0].lines == ["rank0: step 1"]

    # two more chunks: the third write compacts all three into one Parquet file, whose rows the
    # follower has partly read already; the half lines are completed
    writer.write(gpu_frame([1.0, 1.5], power_w=[120.0, 130.0]))
    got = _by_kind(follower.poll())
    assert got[NewTelemetry][0].rows["power_w"].to_list() == [120.0, 130.0]
    writer.write(gpu_frame([2.0], power_w=[140.0]))
    assert (rd.node_telemetry_dir("n0") / "000000-000002.parquet").is_file()
    _append(rd.iterations_path, lines[3][10:] + b"".join(lines[4:]))
    _append(rd.logs_dir / "rank0.log", b"\n")
    got = _by_kind(follower.poll())
    assert got[StatusChanged] == []
    assert got[NewTelemetry][0].rows["power_w"].to_list() == [140.0]      # each row once
    assert [(e["iteration"], e["rank"]) for e in got[NewIterations][0].events] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert got[NewLogLines][0].lines == ["rank0: step 2 half"]

    rd.update_manifest(status="completed")
    got = _by_kind(follower.poll())
    assert [e.status for e in got[StatusChanged]] == ["completed"] and follower.ended


def test_follow_reads_a_run_written_beside_it_to_its_end(tmp_path):
    rd = _start(tmp_path)
    rows = iteration_rows([float(i) for i in range(20)], 0.9)

    def write():
        writer = ChunkWriter(rd.node_telemetry_dir("n0"), compact_every=4)
        rd.update_manifest(status="running")
        for i, row in enumerate(rows):
            _append(rd.iterations_path, json.dumps(row).encode() + b"\n")
            writer.write(gpu_frame([float(i)], power_w=[float(i)]))
            _append(rd.logs_dir / "supervisor.log", f"line {i}\n".encode())
            time.sleep(0.005)
        writer.close()
        rd.update_manifest(status="completed")      # everything above is written before this

    thread = threading.Thread(target=write)
    thread.start()
    try:
        got = _by_kind(follow(rd.path, interval=0.01))
    finally:
        thread.join()
    statuses = [e.status for e in got[StatusChanged]]
    assert statuses[-1] == "completed" and statuses[0] in ("pending", "running"), statuses
    assert [e for batch in got[NewIterations] for e in batch.events] == rows
    power = pl.concat([e.rows for e in got[NewTelemetry]])["power_w"].to_list()
    assert power == [float(i) for i in range(len(rows))]                  # every row once, in order
    assert [line for e in got[NewLogLines] for line in e.lines] == [f"supervisor: line {i}" for i in range(len(rows))]


def test_follow_settles_the_run_before_each_read_and_stops_at_its_end(tmp_path):
    rd = _start(tmp_path)
    settled = []

    def settle(run):   # as the launcher's reconcile: the owner died, so the run is finished here
        settled.append(run.id)
        run.update_manifest(status="failed", failure="the supervisor died")

    events = list(itertools.islice(follow(rd, settle=settle, interval=0.01), 5))
    assert settled == [rd.id]                                   # one pass: it found the run ended
    assert [(e.status, e.manifest.failure) for e in events] == [("failed", "the supervisor died")]


def test_a_damaged_manifest_is_one_error_naming_the_file(tmp_path):
    rd = _start(tmp_path)
    rd.manifest_path.write_text('{"status": "running", "world_size": "two"}')
    with pytest.raises(UserError, match=r"manifest.json: damaged manifest, field 'world_size' is a string"):
        next(follow(rd.path))
