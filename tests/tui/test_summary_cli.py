"""`charllm-tui summarize` end to end through main([...])."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from charllm.probes.store.synthetic import gpu_frame, make_run
from charllm.tui.cli import main

T = np.round(np.arange(0, 101) * 0.1, 10)


def _run(charllm_dirs):
    return make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=150.0)], run_id="20261121-000000-demo")


def test_summarize_table_by_run(charllm_dirs, capsys):
    _run(charllm_dirs)
    assert main(["summarize", "demo", "--by", "run", "--window", "all"]) == 0
    out = capsys.readouterr().out
    assert "power_mean_w" in out and "150" in out
    assert out.splitlines()[0] == "figures over all samples"                     # its window, in words


def test_summarize_json_and_parquet(charllm_dirs, capsys, tmp_path):
    _run(charllm_dirs)
    assert main(["summarize", "demo", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["energy_j"] == pytest.approx(1500.0) and rows[0]["window"] == "all"
    out = tmp_path / "s.parquet"
    assert main(["summarize", "demo", "--out", str(out)]) == 0
    assert pl.read_parquet(out)["power_mean_w"][0] == pytest.approx(150.0)


def test_summarize_errors_are_one_line(charllm_dirs, capsys):
    _run(charllm_dirs)
    assert main(["summarize", "nope"]) == 2
    assert main(["summarize", "demo", "--window", "5"]) == 2
    assert main(["summarize", "demo", "--window", "50:60"]) == 2
    assert main(["summarize", "demo", "--format", "parquet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("charllm-tui: error: ") for line in err)
    assert "Traceback" not in "".join(err)


def test_summarize_table_fits_the_terminal_and_says_shared_rows_once(charllm_dirs, capsys, monkeypatch):
    """Per GPU, on an 80-column terminal: what every GPU shares (run, window, backend) is one line
    above the table, the figures carry units, and the GPUs come in blocks no wider than 80."""
    frames = [gpu_frame(T, device=f"gpu{i}", power_w=150.0 + 10 * i) for i in range(4)]
    make_run(charllm_dirs["runs"], frames, run_id="20261121-000000-wide")
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["summarize", "wide", "--window", "all"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "run: 20261121-000000-wide" in lines and "window: all" in lines
    assert max(map(len, lines)) <= 80
    table = [line for line in lines if line.startswith("│ power_mean_w")]
    assert len(table) >= 2                                          # the GPUs did not fit one block
    assert [cell.strip() for line in table for cell in line.strip("│").split("┆")[1:]] == \
        ["150.0 W", "160.0 W", "170.0 W", "180.0 W"]
    assert not any(line.startswith("│ run ") for line in lines)    # said once, above


def test_runs_show_counts_agree_with_their_nouns(charllm_dirs, capsys):
    from charllm.probes.store.synthetic import iteration_rows

    make_run(charllm_dirs["runs"], [gpu_frame(T, power_w=150.0)], run_id="20261121-000000-one",
             iterations=iteration_rows([0.0], 0.5), chunks=1)
    assert main(["runs", "show", "one"]) == 0
    out = capsys.readouterr().out
    assert "iterations 1 step logged" in out and "telemetry 1 chunk\n" in out


def test_runs_list_is_newest_first_with_headline_figures(charllm_dirs, capsys):
    """As the Runs screen lists them: newest first, each with its steady window's figures."""
    from charllm.probes.analysis.summary import summarize
    from charllm.tui.demo import make_demo_run

    old = make_demo_run(charllm_dirs["runs"], "20251121-080000-demo-old", seconds=6)
    new = make_demo_run(charllm_dirs["runs"], "20251121-090000-demo-new", seconds=6, power_limit_w=450.0, seed=3)
    assert main(["runs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:5] == ["run", "status", "tokens/s", "peak", "W"] and "J/token" in header
    rows = [line.split() for line in lines[1:3]]
    assert [row[0] for row in rows] == [new.name, old.name]
    for row, run in zip(rows, (new, old)):
        steady = summarize(run, "steady", by="run").row(0, named=True)
        assert row[1:3] == ["completed", "SIMULATED"]            # the demo's telemetry is the simulator's
        assert row[3:6] == [f"{steady['tokens_per_s']:,.0f}", f"{steady['power_peak_w']:.0f}",
                            f"{steady['energy_per_token_j']:.3g}"]
    assert "steady window" in lines[-1]


def _ranked_run(charllm_dirs, run_id="20261121-000000-ranked", traces=True):
    """Two GPUs, every rank's timers (rank 1 slow), and the artifact fixture's two stage traces."""
    import shutil

    from infra_traces import ARTIFACT_TRACES, rank_log

    frames = [gpu_frame(T, device=f"gpu{g}", power_w=100.0 + 50 * g, temp_gpu_c=40.0 + 10 * g,
                        sm_clock_mhz=1500.0, throttle_reasons=np.where(T < 5, 0x4, 0) if g else 0,
                        nvlink_tx_bytes=(T * 1e9).astype(np.int64), nvlink_rx_bytes=0) for g in (0, 1)]
    run = make_run(charllm_dirs["runs"], frames, run_id=run_id, iterations=rank_log([0.1, 0.3], pp=1, nodes=("n0",)))
    if traces:
        shutil.copytree(ARTIFACT_TRACES, run.traces_dir)
    return run


def test_summarize_ranks_kernels_and_matrices(charllm_dirs, capsys):
    _ranked_run(charllm_dirs)
    assert main(["summarize", "ranked", "--by", "rank"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step timers per rank, medians over the steady steps") and "stragglers: rank 1" in out
    assert "│ metric " in out and "┆ rank 1 " in out and "┆ rank 0 " in out      # one column per rank, slowest first
    assert main(["summarize", "ranked", "--kernels", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["pp_rank"] for r in rows] == [0, 1] and rows[0]["busy_s"] == pytest.approx(790e-6)
    assert main(["summarize", "ranked", "--kernels", "--by", "rank"]) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and "rank 8" in out and "device kernels; 2 traces" in out
    assert main(["summarize", "ranked", "--matrix", "throttle", "--buckets", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "time throttled for power or heat per GPU (%), over time (seconds after the window's first sample)"
    gpu1 = next(line for line in out if "n0/gpu1" in line).split("┆")
    assert gpu1[1].strip() == "98.04%" and gpu1[2].strip("│ ") == "0%"   # the first 5 s of the first 5.05 s
    assert main(["summarize", "ranked", "--matrix", "link", "--buckets", "2", "--format", "csv"]) == 0
    link = pl.read_csv(capsys.readouterr().out.encode())
    assert link.columns[:2] == ["gpu", "simulated"] and link.row(0)[2] == pytest.approx(5e9, rel=0.02)


@pytest.mark.parametrize("argv, message", [
    (["--kernels", "--by", "gpu"], "--kernels gives a table per pipeline stage or per rank"),
    (["--kernels", "--window", "all"], "--kernels covers the profiled steps"),
    (["--matrix", "heat"], "--matrix 'heat': expected one of temperature, power, clock, throttle, link"),
    (["--matrix", "power", "--buckets", "0"], "--buckets 0: must be from 1 to 200"),
])
def test_summarize_new_views_refuse_bad_input_in_one_line(charllm_dirs, capsys, argv, message):
    _ranked_run(charllm_dirs)
    assert main(["summarize", "ranked", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_run_without_timers_or_traces_says_so(charllm_dirs, capsys):
    _run(charllm_dirs)
    assert main(["summarize", "demo", "--by", "rank"]) == 2
    assert "no per-rank step timers" in capsys.readouterr().err
    assert main(["summarize", "demo", "--kernels"]) == 2
    assert "no profiler traces under" in capsys.readouterr().err


def test_compare_kernels_and_gpu_matrix_side_by_side(charllm_dirs, capsys):
    _ranked_run(charllm_dirs)
    _ranked_run(charllm_dirs, "20261121-010000-plain", traces=False)
    assert main(["compare", "ranked", "plain", "--kernels"]) == 0
    out = capsys.readouterr().out
    assert "mean over its pipeline stages" in out and "20261121-000000-ranked" in out
    assert "note: run 20261121-010000-plain: no profiler traces" in out
    assert main(["compare", "ranked", "plain", "--matrix", "temperature", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["gpu"] for r in rows] == ["n0/gpu0", "n0/gpu1"] and rows[1]["20261121-010000-plain"] == pytest.approx(
        50.0
    )
    assert main(["compare", "ranked", "plain", "--kernels", "--matrix", "power"]) == 2
