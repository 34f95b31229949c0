"""Kernel time per category: Kineto traces with known answers (the artifact's layout, real NCCL and
compute kernel names, a CPU run's nesting), and the run-level summary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from charllm.probes.analysis import kernels
from charllm.probes.analysis.kernels import (
    CATEGORIES,
    breakdown,
    breakdowns,
    by_group,
    classify_kernel,
    classify_op,
    kernel_summary,
    kernel_table,
    read_trace,
)
from charllm.probes.core.errors import UserError
from charllm.probes.store.synthetic import make_run
from infra_traces import check_sums_to_busy

DATA = Path(__file__).resolve().parents[2] / "data" / "kineto"
ARTIFACT = DATA / "charllm_ppt_run" / "4242_kineto"


def us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def test_artifact_trace_splits_into_the_expected_categories():
    """The README's timeline of rank 0: each category's time with nothing ahead of it running,
    adding up to the busy time; the artifact's sum of kernel durations beside it."""
    b = breakdown(read_trace(ARTIFACT / "rank-0.json"))
    assert b["source"] == "device" and us(b["step_s"]) == 1000
    expected = {"matmul": 200, "attention": 100, "norm": 50, "elementwise": 70, "other": 20, "optimizer": 110,
                "memcpy": 30, "SendRecv": 0, "AllGather": 30, "ReduceScatter": 30, "AllReduce": 150, "AllToAll": 0,
                "OtherComm": 0}
    assert {c: us(b[f"{c}_s"]) for c in CATEGORIES} == expected
    assert us(b["busy_s"]) == 790 and us(b["idle_s"]) == 210
    assert us(b["SendRecv_kernel_s"]) == 100 and us(b["ReduceScatter_kernel_s"]) == 60   # hidden, yet counted
    assert us(b["compute_s"]) == 550 and us(b["comm_s"]) == 340 and us(b["overlap_s"]) == 130
    assert b["overlap_frac"] == pytest.approx(130 / 340)
    assert b["matmul_count"] == 1                                                        # the gemm after the step: out


def test_artifact_traces_take_their_stage_from_the_rank_order():
    per_trace = breakdowns(kernels.trace_files(ARTIFACT))
    assert per_trace.select("file", "rank", "pp_rank").rows() == [("rank-0.json", 0, 0), ("rank-8.json", 8, 1)]
    stage = by_group(per_trace, "stage").with_columns()
    one = stage.row(1, named=True)
    assert us(one["matmul_s"]) == 600 and us(one["SendRecv_s"]) == 300 and us(one["idle_s"]) == 100
    assert one["matmul_frac"] == pytest.approx(0.6) and one["busy_frac"] == pytest.approx(0.9)


NCCL_EXPECTED = ["SendRecv", "AllReduce", "AllReduce", "ReduceScatter", "AllGather", "SendRecv", "AllToAll", "SendRecv",
                 "AllReduce", "matmul", "matmul", "matmul", "attention", "attention", "norm", "norm", "elementwise",
                 "elementwise", "optimizer", "other"]


def test_real_kernel_names_classify_as_expected():
    """As Holistic Trace Analysis tells them apart (NCCL: communication, Memcpy/Memset: memory), the
    collective from the name or the profiler's `Collective name`, compute by library and op."""
    trace = read_trace(DATA / "nccl_kernels.json")
    kernels_ = [e for e in json.loads((DATA / "nccl_kernels.json").read_text())["traceEvents"] if e["cat"] == "kernel"]
    assert [classify_kernel(e["name"], e["args"]) for e in kernels_] == NCCL_EXPECTED
    b = breakdown(trace)
    for category in CATEGORIES:   # the i-th kernel lasts 10·i µs, one after another
        want = sum(10.0 * (i + 1) for i, c in enumerate(NCCL_EXPECTED) if c == category) + 7.0 * (category == "memcpy")
        assert us(b[f"{category}_s"]) == want and us(b[f"{category}_kernel_s"]) == want, category
    assert b["overlap_s"] == 0 and trace.rank == 3


@pytest.mark.parametrize(
    "name, category",
    [
        ("aten::mm", "matmul"),
        ("aten::linear", "matmul"),
        ("LinearWithGradAccumulationAndAsyncCommunication", "matmul"),
        ("autograd::engine::evaluate_function: AddmmBackward0", "matmul"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::native_layer_norm", "norm"),
        ("autograd::engine::evaluate_function: NativeLayerNormBackward0", "norm"),
        ("aten::add_", "elementwise"),
        ("aten::gelu", "elementwise"),
        ("torch::autograd::AccumulateGrad", "elementwise"),
        ("aten::linalg_vector_norm", "elementwise"),
        ("aten::copy_", "memcpy"),
        ("aten::_to_copy", "memcpy"),
        ("Optimizer.step#AdamW.step", "optimizer"),
        ("aten::_fused_adamw_", "optimizer"),
        ("gloo:all_reduce", "AllReduce"),
        ("gloo:send", "SendRecv"),
        ("gloo:recv", "SendRecv"),
        ("c10d::recv_", "SendRecv"),
        ("c10d::_allgather_base_", "AllGather"),
        ("c10d::_reduce_scatter_base_", "ReduceScatter"),
        ("gloo:broadcast", "SendRecv"),
        ("c10d::barrier", "OtherComm"),
        ("aten::embedding_dense_backward", "other"),
        ("aten::view", None),
        ("aten::empty", None),
        ("aten::t", None),
    ],
)
def test_host_ops_classify_by_name(name, category):
    assert classify_op(name) == category


def _cpu_trace(tmp_path: Path, events: list[dict], name: str = "rank00001-step000003.pt.trace.json") -> Path:
    path = tmp_path / name
    rows = [{"ph": "X", "cat": cat, "name": n, "pid": 1, "tid": tid, "ts": float(ts), "dur": float(dur)}
            for cat, n, tid, ts, dur in events]
    path.write_text(json.dumps({"charllm": {"rank": 1, "pp_rank": 1, "node": "n0", "step": 3}, "traceEvents": rows}))
    return path


def test_host_trace_nesting_threads_and_optimizer(tmp_path):
    """A CPU run: each instant goes to the innermost op with a category (else the one around it),
    communication is itself wherever it runs, everything in the optimizer step is optimizer, and a
    gloo thread's all-reduce under the main thread's compute is overlap."""
    main, gloo = 1, 2
    path = _cpu_trace(tmp_path, [
        ("user_annotation", "ProfilerStep#3", main, 0, 1000),
        ("cpu_op", "aten::linear", main, 0, 100),            # 0-10 own, 10-90 mm, 90-100 own: all matmul
        ("cpu_op", "aten::t", main, 2, 5),                   # a view inside: matmul too
        ("cpu_op", "aten::mm", main, 10, 80),
        ("cpu_op", "aten::layer_norm", main, 100, 50),
        ("cpu_op", "aten::add", main, 150, 50),
        ("cpu_op", "c10d::recv_", main, 200, 10),            # issued, then gloo's annotation outlasts it
        ("user_annotation", "gloo:recv", main, 205, 95),     # 205-300
        ("user_annotation", "Optimizer.step#AdamW.step", main, 700, 100),
        ("cpu_op", "aten::mul", main, 710, 20),              # elementwise by name, optimizer by where
        ("cpu_op", "aten::_fused_adamw_", main, 740, 50),
        ("user_annotation", "gloo:all_reduce", gloo, 50, 200),   # 50-250: under matmul, norm, add; then recv
        ("cpu_op", "aten::view", gloo, 60, 5),                    # inside the all-reduce: AllReduce
        ("cpu_op", "aten::empty", main, 900, 10),                 # says nothing, nothing around it: other
    ])
    b = breakdown(read_trace(path))
    assert b["source"] == "host" and us(b["step_s"]) == 1000
    got = {c: us(b[f"{c}_s"]) for c in CATEGORIES if b[f"{c}_s"]}
    assert got == {"matmul": 100, "norm": 50, "elementwise": 50, "SendRecv": 100, "optimizer": 100, "other": 10}
    assert us(b["busy_s"]) == 410 and us(b["idle_s"]) == 590
    # the all-reduce on gloo's thread ran 50-250: compute 50-200 hid it, the recv 200-250 ran beside it
    assert us(b["AllReduce_kernel_s"]) == 200 and b["AllReduce_s"] == 0
    assert us(b["comm_s"]) == 250 and us(b["overlap_s"]) == 150 and b["overlap_frac"] == pytest.approx(0.6)
    assert sum(b[f"{c}_s"] for c in CATEGORIES) == pytest.approx(b["busy_s"])


def test_categories_sum_to_busy_time_on_the_fixtures():
    check_sums_to_busy([*kernels.trace_files(ARTIFACT), DATA / "nccl_kernels.json"])


def test_run_summary_keeps_its_result_and_says_when_there_are_no_traces(tmp_path):
    run = make_run(tmp_path, [])
    with pytest.raises(UserError, match="no profiler traces under .*profile_steps"):
        kernel_summary(run)
    shutil.copytree(ARTIFACT, run.path / "traces")
    df = kernel_summary(run, "stage")
    assert df["pp_rank"].to_list() == [0, 1] and df["level"][0] == "stage" and df["run"][0] == run.id
    assert (run.path / "summaries" / "kernels-by-stage.parquet").is_file()
    assert kernel_summary(run, "stage").equals(df)                         # kept: read back
    (run.path / "traces" / "rank-8.json").unlink()                         # the traces changed: made again
    assert kernel_summary(run, "stage")["pp_rank"].to_list() == [0]
    assert kernel_summary(run, "rank")["rank"].to_list() == [0]
    table = kernel_table(df)
    assert table.columns == ["time per step", "stage 0", "stage 1"]
    rows = dict(zip(table["time per step"], table["stage 0"]))
    assert rows["matmul"] == "200.0 µs (20.0%)" and rows["overlap"].endswith("(38% of comm.)")
    assert "AllToAll" not in rows                                          # no stage had any
    with pytest.raises(UserError, match="per stage or per rank"):
        kernel_summary(run, "gpu")


@pytest.mark.parametrize("content, why", [
    (b"{not json", "not a readable Kineto JSON trace"),
    (b"[1, 2]", "no traceEvents list"),
    (b"\x1f\x8b garbage", "not a readable Kineto JSON trace"),
])
def test_a_damaged_trace_is_one_line(tmp_path, content, why):
    path = tmp_path / ("t.json.gz" if content.startswith(b"\x1f") else "t.json")
    path.write_bytes(content)
    with pytest.raises(UserError, match=why):
        read_trace(path)


# -- issue 35: a trace is read within bounds, and a damaged one costs only itself ------------------
def _trace_text(events: list[dict], **top) -> str:
    return json.dumps({"charllm": {"rank": 0, "pp_rank": 0}, **top, "traceEvents": events})


HOSTILE_TRACES = {
    "ts = a number of about 401 digits: out of range": '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", '
                                                       '"ts": 1' + "0" * 400 + ', "dur": 1}]}',
    "dur = inf: out of range": '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": Infinity}]}',
    "ts = nan: out of range": '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "k", "ts": NaN, "dur": 1}]}',
    "a step number of 5,000 digits": _trace_text([{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#"
                                                   + "9" * 5000, "ts": 0, "dur": 10}]),
    "not a readable Kineto JSON trace (Expecting": '{"traceEvents": [{"ph": "X"}, {"ph": ]}',
    "extra data": '{"traceEvents": []} {}',
    "nested too deeply|maximum recursion": '{"traceEvents": [' + "[" * 100_000 + "]" * 100_000 + "]}",
    "expecting ',' or ']'": '{"traceEvents": [{"ph": "X"} {"ph": "X"}]}',
}


@pytest.mark.parametrize("why", list(HOSTILE_TRACES))
def test_a_hostile_trace_is_one_line_naming_it(tmp_path, why):
    path = tmp_path / "rank-1.json"
    path.write_text(HOSTILE_TRACES[why])
    with pytest.raises(UserError, match=f"^trace '{path}': .*({why.replace('(', '[(]')})") as caught:
        read_trace(path)
    assert "\n" not in str(caught.value)


def test_a_damaged_trace_costs_only_itself(tmp_path, capsys):
    """The run's other traces are still summarized, and a note names the one left out; when none is
    left, the summary is one line."""
    from infra_cli import one_error_line, run

    runs = tmp_path / "runs"
    good = make_run(runs, [], run_id="good")
    shutil.copytree(ARTIFACT, good.traces_dir)
    (good.traces_dir / "rank-3.json").write_text(HOSTILE_TRACES["a step number of 5,000 digits"])
    df = kernel_summary(good, "stage")
    assert df["pp_rank"].to_list() == [0, 1] and us(df["busy_s"][0]) == 790
    assert df["notes"][0].startswith("1 of 3 traces skipped: trace ") and "rank-3.json" in df["notes"][0]
    code, out, err = run(capsys, "summarize", str(good.path), "--kernels")
    assert code == 0 and not err and "note: 1 of 3 traces skipped" in out and "stage 1" in out
    bad = make_run(runs, [], run_id="bad")
    bad.traces_dir.mkdir()
    (bad.traces_dir / "rank-0.json").write_text(HOSTILE_TRACES["ts = a number of about 401 digits: out of range"])
    code, _, err = run(capsys, "summarize", str(bad.path), "--kernels")
    assert code == 2 and "no readable profiler trace (1 of 1 trace skipped: trace " in one_error_line(err)


def test_decompressed_bytes_events_and_one_value_are_bounded(tmp_path, monkeypatch):
    """The caps count what the JSON holds once decompressed (a few KB of gzip can hold GiBs of white
    space), its events, and the text of one event; each is one line. (The real caps, 2 GiB and
    10 million events, are the benchmark's: benchmarks/bench_kernels.py.)"""
    import gzip

    monkeypatch.setattr(kernels, "MAX_TRACE_BYTES", 2**20)
    monkeypatch.setattr(kernels, "_READ_BYTES", 2**16)
    bomb = tmp_path / "rank-0.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (3 * 2**20) + b"]}"))
    assert bomb.stat().st_size < 2**14
    with pytest.raises(UserError, match=r"rank-0.json.gz': more than 1.0 MiB of JSON once decompressed"):
        read_trace(bomb)
    spaced = tmp_path / "rank-1.json.gz"          # white space within the cap is read through, and skipped
    spaced.write_bytes(gzip.compress(b'{"traceEvents": [' + b" \n" * 2**18 + b'{"ph": "X", "cat": "kernel", '
                                     b'"name": "gemm", "ts": 0, "dur": 5}]}'))
    assert breakdown(read_trace(spaced))["matmul_s"] == pytest.approx(5e-6)
    monkeypatch.setattr(kernels, "MAX_TRACE_EVENTS", 100)
    many = tmp_path / "many.json"
    many.write_text(_trace_text([{"ph": "X", "cat": "kernel", "name": "k", "ts": i, "dur": 1} for i in range(101)]))
    with pytest.raises(UserError, match="more than 100 events"):
        read_trace(many)
    monkeypatch.setattr(kernels, "MAX_VALUE_CHARS", 1000)
    monkeypatch.setattr(kernels, "_READ_BYTES", 100)
    big = tmp_path / "big.json"
    big.write_text(_trace_text([{"ph": "X", "cat": "kernel", "name": "k" * 5000, "ts": 0, "dur": 1}]))
    with pytest.raises(UserError, match="a value of more than 1,000 characters at character 55$"):
        read_trace(big)
    corrupt = tmp_path / "corrupt.json.gz"
    packed = gzip.compress(b'{"traceEvents": []}' * 100)
    corrupt.write_bytes(packed[:20] + bytes(b ^ 0x5A for b in packed[20:40]) + packed[40:])
    with pytest.raises(UserError, match="not a readable Kineto JSON trace"):
        read_trace(corrupt)


def test_pieces_cut_anywhere_read_the_same(monkeypatch):
    """The text is read a piece at a time: a value cut by a piece's end (a number, a string, an
    event) reads as it would whole."""
    whole = breakdown(read_trace(ARTIFACT / "rank-0.json"))
    for size in (1, 7, 100):
        monkeypatch.setattr(kernels, "_READ_BYTES", size)
        assert breakdown(read_trace(ARTIFACT / "rank-0.json")) == whole


def test_many_steps_and_optimizer_spans_give_the_plain_answer(tmp_path):
    """Thousands of ProfilerStep spans (each kernel inside one, one kernel across all) and of
    optimizer steps (each launching a kernel): each interval's time in the steps is looked up, not
    scanned for (issue 35: 30k of each took minutes); overlapping steps count once."""
    n = 3000
    events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 0, "dur": n * 100}]
    for i in range(n):
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1,
                    "ts": i * 100, "dur": 90},
                   {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#Adam.step", "pid": 1, "tid": 1,
                    "ts": i * 100 + 50, "dur": 20},
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                    "ts": i * 100 + 60, "dur": 2, "args": {"correlation": i + 1}},
                   {"ph": "X", "cat": "kernel", "name": "gemm" if i % 2 else "multi_tensor_apply_kernel",
                    "ts": i * 100 + 10, "dur": 40, "args": {"correlation": i + 1}}]
    events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "ts": 5, "dur": 10})   # inside #0
    path = tmp_path / "many.json"
    path.write_text(_trace_text(events))
    b = breakdown(read_trace(path))
    assert b["steps"] == n and us(b["step_s"]) == 90
    assert us(b["optimizer_s"]) == 40 and b["matmul_s"] == 0 and us(b["optimizer_count"]) == 1e6
    assert us(b["AllGather_s"]) == 50 and us(b["AllGather_kernel_s"]) == 90 and us(b["overlap_s"]) == 40
