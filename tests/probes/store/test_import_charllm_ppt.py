"""Import of CharLLM-PPT / Zeus CSV results: units, alignment, wraps, host files, limitations."""

from __future__ import annotations

import json
import os

import pytest

from charllm.probes.analysis.summary import summarize
from charllm.probes.core.errors import UserError
from charllm.probes.store.importers import LIMITATIONS, import_charllm_ppt
from charllm.probes.store.rundir import resolve_run
from charllm.tui.cli import main
from infra_charllm_ppt import make_results


def test_import_maps_units_and_summarizes(tmp_path):
    run = import_charllm_ppt(make_results(tmp_path / "res"), name="ppt", gpus_per_node=1)
    m = run.read_manifest()
    assert m["kind"] == "import" and m["imported_from"]["format"] == "charllm-ppt"
    assert m["limitations"] == LIMITATIONS and m["simulated"] is False
    assert sorted({p.parent.name for p in run.telemetry_files()}) == ["node0", "node1"]
    s = summarize(run, "all")
    assert s["node"].to_list() == ["node0", "node1"] and s["backend"][0] == "import:charllm-ppt"
    r0 = s.row(0, named=True)
    assert r0["power_mean_w"] == pytest.approx(400.0)            # 1 s at 300 W, 1 s at 500 W
    # trapezoid: 19 intervals at 300 W, one ramp 300->500 W (0.05 s at 400 W), 20 intervals at 500 W
    assert r0["energy_j"] == pytest.approx(285.0 + 20.0 + 500.0)
    assert r0["energy_source"] == "trapezoid"
    assert r0["temp_gpu_mean_c"] == pytest.approx(60.0) and r0["temp_mem_peak_c"] == 70.0
    assert r0["sm_clock_mean_mhz"] == pytest.approx(1980.0)
    assert r0["util_gpu_mean_pct"] == pytest.approx(90.0)        # -1 became null, not a 0 %
    assert r0["nvlink_tx_bytes"] == pytest.approx(40 * 1000 * 1024)   # KiB -> bytes, across the wrap
    assert r0["pcie_tx_bytes"] == pytest.approx(40 * 5_000_000)       # the counter wins over throughput
    assert r0["pcie_rx_bytes"] == pytest.approx(40 * 1_000_000)
    assert r0["throttle_perf_frac"] is None and r0["spikes_over_limit_count"] is None
    nodes = summarize(run, "all", by="node")
    assert nodes["node"].to_list() == ["node0", "node1"]
    assert nodes["cpu_util_mean_pct"][0] == pytest.approx(60.0)      # host files came from node0 only
    assert nodes["cpu_util_mean_pct"][1] is None
    assert nodes["energy_j"].to_list() == pytest.approx([805.0, 805.0 + 2 * 1.0])   # rank 1 is 1 W higher
    host = run.scan_telemetry().filter(device="host").collect()
    assert host["cpu_util_pct"].drop_nulls().to_list() == pytest.approx([60.0] * 40)
    assert host["ib_rx_bytes"][-1] == 40 * 150 and host["temp_cpu_c"][0] == 55.0
    assert host["host_mem_total_bytes"][0] == 1000 and host["host_mem_used_bytes"][0] == 600


def test_ranks_map_to_nodes_by_gpus_per_node(tmp_path):
    run = import_charllm_ppt(make_results(tmp_path / "res", ranks=3), gpus_per_node=2)
    s = summarize(run, "all")
    assert list(zip(s["node"], s["device"])) == [("node0", "gpu0"), ("node0", "gpu1"), ("node1", "gpu0")]


def test_bad_inputs_are_user_errors_and_leave_nothing(tmp_path, charllm_dirs):
    with pytest.raises(UserError, match="no such directory"):
        import_charllm_ppt(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .metric._.rank..csv files"):
        import_charllm_ppt(tmp_path / "empty")
    bad = make_results(tmp_path / "bad")
    (bad / "gpu_power_1.csv").write_text("time,power\nabc,def\n")
    with pytest.raises(UserError, match="gpu_power_1.csv"):
        import_charllm_ppt(bad)
    with pytest.raises(UserError, match="--gpus-per-node 0"):
        import_charllm_ppt(make_results(tmp_path / "ok"), gpus_per_node=0)
    hollow = make_results(tmp_path / "hollow")               # every CSV there, none with a sample
    for f in hollow.iterdir():
        f.write_text("")
    with pytest.raises(UserError, match="hold no samples"):
        import_charllm_ppt(hollow)
    runs = charllm_dirs["runs"]
    assert not runs.exists() or list(runs.iterdir()) == []


def test_cli_prints_the_run_id(tmp_path, capsys):
    src = make_results(tmp_path / "res")
    assert main(["import", "charllm-ppt", str(src), "--name", "old-result", "--gpus-per-node", "1"]) == 0
    run_id = capsys.readouterr().out.strip()
    assert run_id.endswith("-old-result") and resolve_run(run_id).status == "completed"
    assert main(["summarize", run_id, "--by", "run", "--format", "json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    # the one step the artifact sampled is the window; without an experiment no tokens, so no speed
    assert row["iterations"] == 1 and row["iter_time_mean_s"] == pytest.approx(2.0, rel=0.01)
    assert row["tokens_per_s"] is None
    assert main(["import", "charllm-ppt", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("charllm-tui: error: charllm-ppt directory")


def test_a_results_tree_imports_one_run_per_folder_and_a_bad_folder_costs_only_itself(tmp_path, capsys):
    """The artifact's layout, results/<sweep>/<model>/<run>/: every run folder becomes a run named
    after its path; a damaged folder is reported on stderr and the others still import."""
    root = tmp_path / "results"
    make_results(root / "power-sweep" / "gpt3-175b" / "run0")
    make_results(root / "power-sweep" / "gpt3-175b" / "run1")
    make_results(root / "base" / "llama3-70b" / "run0")
    bad = make_results(root / "base" / "llama3-70b" / "run1")
    (bad / "gpu_power_0.csv").write_text("garbage\n")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a result")
    code = main(["import", "charllm-ppt", str(root), "--gpus-per-node", "1"])
    out, err = capsys.readouterr()
    ids = out.split()
    assert code == 1 and len(ids) == 3
    assert sorted(i.split("-", 2)[2] for i in ids) == ["base-llama3-70b-run0", "power-sweep-gpt3-175b-run0",
                                                       "power-sweep-gpt3-175b-run1"]
    assert all(resolve_run(i).status == "completed" for i in ids)
    assert "llama3-70b/run1" in err and "gpu_power_0.csv" in err and "1 of 4 folders not imported" in err
    assert main(["import", "charllm-ppt", str(root / "notes")]) == 2
    assert "no result folder under it" in capsys.readouterr().err


def test_host_files_written_by_every_rank_give_one_host_stream_per_node(tmp_path):
    """ZEUS_MONITOR_SYS=1 on every rank: each rank of a node wrote the same system_* files."""
    src = make_results(tmp_path / "res", ranks=2)
    for f in list(src.glob("system_*rank_0_*.csv")):
        (src / f.name.replace("rank_0_", "rank_1_")).write_text(f.read_text())
    for f in list(src.glob("system_memory_*_0.csv")):
        (src / f.name.replace("_0.csv", "_1.csv")).write_text(f.read_text())
    run = import_charllm_ppt(src, gpus_per_node=2)          # both ranks on node0
    import polars as pl

    frame = run.scan_telemetry().collect()
    host = frame.filter(pl.col("device") == "host")
    assert host.height == host["ts_ns"].n_unique() > 0


def test_simultaneous_imports_of_one_name_both_import_under_their_own_ids(tmp_path, charllm_dirs):
    """Both want the same run id in the same second: as two launches do, the second takes the next
    name (-2), and neither removes the other's files while they are written (they once shared one
    temporary directory)."""
    import threading

    src = make_results(tmp_path / "results", ranks=4)
    for _ in range(3):
        barrier, done, failed = threading.Barrier(2), [], []

        def one():
            barrier.wait()
            try:
                done.append(import_charllm_ppt(src, name="same"))
            except Exception as exc:  # noqa: BLE001 - the test reports it
                failed.append(exc)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed and len({run.id for run in done}) == 2, (failed, done)
        for run in done:
            assert run.manifest().id == run.id and summarize(run).height > 0
            run.delete()
        assert not [p.name for p in charllm_dirs["runs"].iterdir()], "no temporary directory left"


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "1e300", "-5", "1e19"])
def test_rows_no_recording_could_hold_are_left_out_and_counted(bad, tmp_path, charllm_dirs, capsys):
    src = make_results(tmp_path / "res", ranks=1)
    lines = (src / "gpu_power_0.csv").read_text().splitlines()
    t0 = lines[5].split(",")[0]
    lines[5] = f"{t0},{bad}"                      # a value no sensor reads
    lines[6] = f"{bad},300.0"                     # a time no clock holds (or a date before 2000)
    (src / "gpu_power_0.csv").write_text("\n".join(lines) + "\n")
    code = main(["import", "charllm-ppt", str(src), "--gpus-per-node", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    run = resolve_run(out.split()[0])
    assert run.read_manifest()["rejected_rows"] == {"gpu_power_0.csv": 2}
    warning = err.strip().splitlines()
    assert len(warning) == 1 and f"2 of {len(lines)} rows rejected in gpu_power_0.csv" in warning[0], err
    assert summarize(run, by="run")["samples"][0] > 0


def test_a_pipe_under_a_result_name_is_passed_over_not_waited_on(tmp_path, charllm_dirs, capsys):
    from infra_fuzz import call

    src = make_results(tmp_path / "res", ranks=1)
    (src / "gpu_thermal_0.csv").unlink()
    os.mkfifo(src / "gpu_thermal_0.csv")                # open() would wait forever for a writer
    os.mkfifo(src / "gpu_power_7.csv")
    outcome = call(["import", "charllm-ppt", str(src), "--gpus-per-node", "1"])
    assert not outcome.hung and not outcome.crash and outcome.code == 0, outcome
    frame = resolve_run(outcome.out.split()[0]).scan_telemetry().collect()
    assert frame["temp_gpu_c"].null_count() == frame.height and frame["power_w"].null_count() < frame.height


def test_a_folder_whose_numbers_break_the_importer_costs_only_that_folder(tmp_path, capsys):
    root = tmp_path / "results"
    make_results(root / "sweep" / "m" / "good")
    bad = make_results(root / "sweep" / "m" / "bad")
    for f in bad.glob("*.csv"):
        f.write_text("nan,nan\ninf,-inf\n1e300,1e300\n")   # no row of it can be kept
    code = main(["import", "charllm-ppt", str(root), "--gpus-per-node", "1"])
    out, err = capsys.readouterr()
    assert code == 1 and len(out.split()) == 1 and "Traceback" not in err
    assert "m/bad" in err and "hold no samples that could be kept" in err and "1 of 2 folders not imported" in err


def test_a_killed_import_leaves_no_staging_directory_behind(tmp_path, charllm_dirs, capsys):
    """SIGKILL in the middle of an import leaves its hidden staging directory; the next command
    that lists runs, or creates one, removes it, and keeps one whose writer still lives."""
    import sys

    import psutil

    from infra_runs import kill_and_wait, start, wait_for

    runs = charllm_dirs["runs"]
    src = make_results(tmp_path / "res", ranks=24, gpus_per_node=8)

    def killed_import() -> None:
        proc = start([sys.executable, "-m", "charllm.tui", "import", "charllm-ppt", str(src), "--name", "big",
                      "--gpus-per-node", "8"])
        staged = wait_for(lambda: [p for p in runs.glob(f".*.{proc.pid}-*.importing") if any(p.rglob("*.parquet"))],
                          120, "the import to write its first file")
        kill_and_wait(psutil.Process(proc.pid))
        proc.communicate()
        assert staged[0].is_dir(), "left behind by the kill"

    live = runs / f".20260101-000000-other.{os.getpid()}-1.importing"  # this test's process lives
    live.mkdir(parents=True)
    killed_import()
    assert main(["runs", "list"]) == 0
    capsys.readouterr()
    assert [p.name for p in runs.iterdir()] == [live.name]
    killed_import()
    assert main(["import", "charllm-ppt", str(make_results(tmp_path / "small")), "--name", "small"]) == 0
    run_id = capsys.readouterr().out.strip()
    assert sorted(p.name for p in runs.iterdir()) == sorted([live.name, run_id])


def test_import_brings_the_newest_kineto_traces_and_summarizes_their_kernels(tmp_path):
    """The artifact's `<job>_kineto/rank-R.json` traces (one per pipeline stage) come along with the
    CSVs; the newest job's, as the artifact's figure script picks them; `summarize --kernels` reads them."""
    import shutil
    from pathlib import Path

    from charllm.probes.analysis.kernels import kernel_summary

    results = make_results(tmp_path / "res")
    artifact = Path(__file__).resolve().parents[2] / "data" / "kineto" / "charllm_ppt_run" / "4242_kineto"
    shutil.copytree(artifact, results / "4242_kineto")
    (results / "999_kineto").mkdir()                               # an older job's, left out
    (results / "999_kineto" / "rank-0.json").write_text("{}")
    (results / "4242_kineto" / "notes.txt").write_text("not a trace")
    run = import_charllm_ppt(results, name="ppt", gpus_per_node=1)
    assert run.read_manifest()["imported_from"]["traces"] == ["4242_kineto/rank-0.json", "4242_kineto/rank-8.json"]
    assert sorted(p.name for p in run.traces_dir.iterdir()) == ["rank-0.json", "rank-8.json"]
    df = kernel_summary(run, "stage")
    assert df["pp_rank"].to_list() == [0, 1] and df["ranks"].to_list() == ["0", "8"]
    assert df["busy_s"][0] == pytest.approx(790e-6) and df["SendRecv_s"][1] == pytest.approx(300e-6)
    assert main(["summarize", run.id, "--kernels", "--format", "csv"]) == 0
    plain = import_charllm_ppt(make_results(tmp_path / "plain"), name="plain", gpus_per_node=1)
    assert plain.read_manifest()["imported_from"]["traces"] == [] and not plain.traces_dir.exists()


@pytest.mark.parametrize("hostile", [
    '{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#' + "9" * 5000 + '", "ts": 0, "dur": 1}',
    '{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1' + "0" * 400 + ', "dur": 1}'])
def test_an_imported_hostile_trace_costs_only_itself(tmp_path, capsys, hostile):
    """Issue 35: a trace the artifact's folder holds is copied as it is; `summarize --kernels` leaves
    a damaged one out with a note naming it, and says so in one line when none is left."""
    import shutil
    from pathlib import Path

    artifact = Path(__file__).resolve().parents[2] / "data" / "kineto" / "charllm_ppt_run" / "4242_kineto"
    results = make_results(tmp_path / "res")
    shutil.copytree(artifact, results / "4242_kineto")
    (results / "4242_kineto" / "rank-8.json").write_text('{"traceEvents": [' + hostile + "]}")
    capsys.readouterr()
    assert main(["import", "charllm-ppt", str(results), "--name", "ppt"]) == 0
    run_id = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["summarize", run_id, "--kernels"]) == 0
    out, err = capsys.readouterr()
    assert not err and "note: 1 of 2 traces skipped: trace " in out and "rank-8.json" in out and "stage 0" in out
    (resolve_run(run_id).traces_dir / "rank-0.json").write_text('{"traceEvents": [' + hostile + "]}")
    assert main(["summarize", run_id, "--kernels"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("charllm-tui: error: run ") and "no readable profiler trace" in err
