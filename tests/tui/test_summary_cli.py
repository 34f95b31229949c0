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
        assert row[2:5] == [f"{steady['tokens_per_s']:,.0f}", f"{steady['power_peak_w']:.0f}",
                            f"{steady['energy_per_token_j']:.3g}"]
    assert "steady window" in lines[-1]
