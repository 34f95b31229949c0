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
