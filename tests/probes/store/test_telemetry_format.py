"""Finished telemetry: compact Parquet laid out for campaign-wide scans; a damaged file costs only
itself; a full disk stops the recording cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from charllm.probes.analysis import baselines
from charllm.probes.analysis.compare import compare
from charllm.probes.analysis.summary import summarize
from charllm.probes.backends.replay import ReplayBackend
from charllm.probes.store.recorder import ChunkWriter
from charllm.probes.store.rundir import RunDir, scan_runs
from charllm.probes.store.schema import ID_COLUMNS, conform
from charllm.probes.store.synthetic import T0_NS, gpu_frame, iteration_rows, make_run, tiny_experiment
from infra_disks import tmpfs

README = Path(__file__).resolve().parents[3] / "README.md"
T = np.round(np.arange(0, 200) * 0.05, 10)  # 10 s at 20 Hz


def _recorded_run(root: Path, run_id: str, seconds_per_chunk: float = 1.0, compact_every: int = 3,
                  finished: bool = True, node: str = "n0") -> tuple[RunDir, pl.DataFrame]:
    """A run the recorder wrote: two GPUs taking turns, a chunk per second, compacted as it goes."""
    run = make_run(root, run_id=run_id, experiment=tiny_experiment(gpus_per_node=None),
                   iterations=iteration_rows(np.arange(0, 9, 1.0), 1.0, warmup=1))
    frame = pl.concat([gpu_frame(T, node=node, device=d, power_w=100.0 + 10 * i + T, temp_gpu_c=50.0)
                       for i, d in enumerate(("gpu0", "gpu1"))]).sort("ts_ns", maintain_order=True)
    writer = ChunkWriter(run.node_telemetry_dir(node), compact_every=compact_every)  # the recorder itself
    per_chunk = int(seconds_per_chunk / 0.05) * 2
    for start in range(0, frame.height, per_chunk):
        writer.write(frame.slice(start, per_chunk))
    if finished:
        writer.close()
    return run, frame


# --------------------------------------------------------------------------------------------
# The format
# --------------------------------------------------------------------------------------------
def test_a_finished_recording_is_compact_parquet_that_lost_no_row(tmp_path):
    run, written = _recorded_run(tmp_path, "r")
    node = run.node_telemetry_dir("n0")
    files = sorted(os.listdir(node))
    assert files and all(f.endswith(".parquet") for f in files)  # even the last lone chunk
    for name in files:
        stored = pl.read_parquet(node / name)
        # no all-null columns (the identity columns always stay); rows by device, each in time order
        assert set(stored.columns) == set(ID_COLUMNS) | {"power_w", "temp_gpu_c"}
        assert stored["device"].to_list() == sorted(stored["device"].to_list())
        assert all(g["ts_ns"].is_sorted() for _, g in stored.group_by("device"))
    read = run.scan_telemetry().collect()
    assert read.schema == conform(written).schema  # the dropped columns come back as nulls
    key = ["device", "ts_ns"]
    assert read.sort(key).equals(conform(written).sort(key))  # every row, exactly once, unchanged


def test_an_import_writes_the_same_format_directly(tmp_path):
    from test_import_charllm_ppt import make_results

    from charllm.probes.store.importers import import_charllm_ppt

    run = import_charllm_ppt(make_results(tmp_path / "res", ranks=2), gpus_per_node=2)
    files = [p for p in run.telemetry_dir.rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".parquet" for p in files)
    stored = [pl.read_parquet(f) for f in files]  # a file per device, so memory holds one at a time
    assert all(s["device"].n_unique() == 1 for s in stored)
    assert all(s[c].null_count() < s.height for s in stored for c in s.columns)
    assert sum(s.height for s in stored) == run.scan_telemetry().collect().height


def test_a_campaign_is_one_scan_in_polars_and_in_duckdb_as_the_readme_shows(charllm_dirs, monkeypatch):
    runs = charllm_dirs["runs"]
    _recorded_run(runs, "run-a", node="n0")
    _recorded_run(runs, "run-b", node="n1")
    RunDir(runs / "run-c").node_telemetry_dir("n0").mkdir(parents=True)  # a run with no telemetry yet
    _recorded_run(runs, ".run-d.importing")  # an import still being written: not yet a run
    campaign = scan_runs().group_by("run", "node", "device").agg(pl.len()).sort("run", "device").collect()
    assert campaign.rows() == [("run-a", "n0", "gpu0", 200), ("run-a", "n0", "gpu1", 200),
                               ("run-b", "n1", "gpu0", 200), ("run-b", "n1", "gpu1", 200)]
    assert scan_runs(runs / "run-c").collect().is_empty()

    import duckdb  # a declared test dependency: imported, never skipped

    section = README.read_text().split("### A whole campaign in one query", 1)[1]
    query = re.search(r"```sql\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(runs)  # "run from the runs directory"
    rows = duckdb.sql(query).fetchall()
    assert [r[:4] for r in rows] == [("run-a", "n0", "gpu0", 200), ("run-a", "n0", "gpu1", 200),
                                     ("run-b", "n1", "gpu0", 200), ("run-b", "n1", "gpu1", 200)]
    expected = scan_runs().filter(pl.col("run") == "run-a", pl.col("device") == "gpu0").collect()["power_w"].mean()
    assert rows[0][4] == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# Damaged files
# --------------------------------------------------------------------------------------------
def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "empty":
        path.write_bytes(b"")
    else:  # wrong-typed: a readable file whose power column holds text
        frame = pl.read_parquet(path) if path.suffix == ".parquet" else pl.read_ipc(path)
        frame = frame.with_columns(pl.col("power_w").cast(pl.String))
        frame.write_parquet(path) if path.suffix == ".parquet" else frame.write_ipc(path)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "wrong-typed"])
@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_one_damaged_file_is_skipped_and_named_everywhere(charllm_dirs, kind, how):
    # Live chunks (no compaction yet) or a finished run of compacted files.
    run, _ = _recorded_run(charllm_dirs["runs"], "damaged", compact_every=None if kind == "arrow" else 2,
                           finished=kind == "parquet")
    _recorded_run(charllm_dirs["runs"], "intact")
    files = run.telemetry_files()
    victim = files[3]
    assert victim.suffix == f".{kind}"
    lost = pl.read_parquet(victim) if kind == "parquet" else pl.read_ipc(victim)
    _damage(victim, how)

    gpus = summarize(run, "all", by="gpu")
    assert gpus["samples"].sum() == 400 - lost.height  # the rest is all there
    note = gpus["notes"][0]
    chunks = 2 if kind == "parquet" else 1
    assert note.startswith(f"1 of {len(files)} telemetry files unreadable, skipped: "
                           f"telemetry/n0/{victim.name} (")
    assert f"{'2 chunks' if chunks == 2 else '1 chunk'} lost, about {chunks:.1f} s" in note

    result = compare([run.id, "intact"], window="all")
    assert any(n.startswith(f"{run.id}: 1 of {len(files)} telemetry files unreadable") for n in result.notes)
    baselines.save(run, "with-damage", window="all")
    assert "unreadable" in baselines.show("with-damage").summary["notes"][0]
    replay = ReplayBackend(str(run.path), speed=1000)
    assert f"telemetry/n0/{victim.name}" in replay.reason and replay._frame.height == 400 - lost.height


def test_a_restarted_recorder_compacts_past_a_damaged_chunk(tmp_path):
    run, written = _recorded_run(tmp_path, "restart", compact_every=None, finished=False)
    victim = run.telemetry_files()[2]
    lost = pl.read_ipc(victim).height
    _damage(victim, "garbage")
    ChunkWriter(run.node_telemetry_dir("n0")).close()  # a writer that continues, then finishes
    assert all(f.suffix == ".parquet" for f in run.telemetry_files())
    assert run.scan_telemetry().collect().height == written.height - lost


def test_live_follows_past_a_damaged_chunk(tmp_path):
    from charllm.probes.store.tail import TelemetryTail

    run, written = _recorded_run(tmp_path, "live", compact_every=None, finished=False)
    victim = run.telemetry_files()[2]
    lost = pl.read_ipc(victim).height
    victim.write_bytes(b"not arrow")
    assert TelemetryTail(run.path).poll().height == written.height - lost


# --------------------------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB filesystem (tmpfs), so writes fail with ENOSPC as on a full disk."""
    with tmpfs(tmp_path / "disk", "256k") as mnt:
        yield mnt


def test_a_full_disk_stops_the_probe_with_one_line_and_keeps_what_was_written(small_disk):
    out = small_disk / "run"
    done = subprocess.run([sys.executable, "-m", "charllm.probes", "--backend", "sim", "--sim-gpus", "8",
                           "--hz", "100", "--out", str(out), "--duration", "60", "--node", "n0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and re.fullmatch(
        rf"charllm-probes: error: disk full: cannot write telemetry to {out}/telemetry/n0 \(filesystem "
        rf"{small_disk}, \d+ bytes free\); recording stopped, what was written before is kept", error[0])
    assert "Traceback" not in done.stderr
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    run = RunDir(out)
    manifest = run.read_manifest()
    assert manifest["status"] == "failed" and manifest["telemetry_stopped"]["node"] == "n0"
    assert "disk full" in manifest["telemetry_stopped"]["reason"]
    skipped: list[str] = []
    rows = run.scan_telemetry(skipped).collect()
    assert skipped == [] and rows.height > 0  # every file written before the disk filled is whole
    assert rows["ts_ns"].min() > T0_NS


# --------------------------------------------------------------------------------------------
# Summaries in bounded memory
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_rows", [450, 150])  # whole nodes per batch; a node's devices split
def test_a_summary_in_batches_equals_the_summary_in_one(tmp_path, monkeypatch, batch_rows):
    from charllm.probes.analysis import devices

    run = RunDir(tmp_path / "big")
    for n in range(3):
        frames = [gpu_frame(T, node=f"n{n}", device=f"gpu{g}", power_w=100.0 + 40 * g + 20 * np.sin(T * (n + 1)),
                            temp_gpu_c=50.0 + n + 3 * g, energy_j=np.cumsum(np.full(len(T), 5.0)))
                  for g in range(2)]
        frames.append(conform(gpu_frame(T, node=f"n{n}", device="host").with_columns(
            pl.lit(30.0 + n).alias("cpu_util_pct"))))
        writer = ChunkWriter(run.node_telemetry_dir(f"n{n}"), compact_every=4)
        data = pl.concat(frames).sort("ts_ns", maintain_order=True)
        for start in range(0, data.height, 60):
            writer.write(data.slice(start, 60))
        writer.close()
    run.write_manifest({"id": "big", "status": "running"})  # never cached
    whole = {by: summarize(run, "all", by=by) for by in ("gpu", "node", "run")}
    monkeypatch.setattr(devices, "BATCH_ROWS", batch_rows)
    assert len(devices.device_batches(devices.scan_devices(run.scan_telemetry()))) > (3 if batch_rows < 200 else 1)
    for by, expected in whole.items():  # the same numbers, up to the order floats are summed in
        assert_frame_equal(summarize(run, "all", by=by), expected, rel_tol=1e-12)
