"""The log parsers (probes.store.trainlogs), on log text the programs themselves printed.

tests/data/trainlogs/ holds whole logs of Megatron-LM's own pretrain_gpt.py (see its README); the
other formats' lines come from their projects' own repositories, each cited, or are printed by the
format string of the project's code with the values said."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from charllm.probes.core.errors import UserError
from charllm.probes.store.trainlogs import LogReader, check_format, parser
from infra_megatron_lm import logged_steps

DATA = Path(__file__).resolve().parents[2] / "data" / "trainlogs"


@pytest.mark.parametrize("name", ["megatron-lm-core_v0.16.1-cpu.log", "megatron-lm-core_v0.16.1-cpu-interval3.log"])
def test_megatron_lm_logs_every_step_line_parsed_and_none_misparsed(name):
    text = (DATA / name).read_text()
    lines = text.splitlines()
    reader = LogReader("megatron", node="n1", seq_length=32)
    logged = logged_steps(text)
    expected = [{"iteration": i, **logged[i]} for i in sorted(logged)]
    got, memory = [], []
    for i, line in enumerate(lines):
        record = reader.read(line, now_ns=1_000_000_000 * (i + 1))
        if record and record["event"] == "iteration":
            got.append(record)
        elif record:
            memory.append(record)
    assert len(expected) >= 4
    assert [r["iteration"] for r in got] == [e["iteration"] for e in expected]   # all parsed, in order
    for record, truth in zip(got, expected):
        assert record["loss"] == pytest.approx(truth["loss"])
        assert record["grad_norm"] > 0
        assert record["samples"] == truth["samples"] == 8
        assert record["tokens"] == 8 * 32
        assert (record["end_ns"] - record["start_ns"]) / 1e9 == pytest.approx(truth["step_s"], abs=1e-6)
        assert record["skipped_iterations"] == 0 and record["nan_iterations"] == 0
        assert record["loss_scale"] == 1.0 and record["node"] == "n1" and record["source"] == "megatron"
        assert record["warmup"] == (record["iteration"] <= 2)
    # Megatron reports memory after the first steps, from each data-parallel group's first rank
    assert memory and {m["iteration"] for m in memory} <= {1, 2, 3, 6}
    assert all(m["rank"] == 0 and m["mem_peak_bytes"] >= 0 for m in memory)


def test_megatron_throughput_field_when_logged():
    lines = (DATA / "megatron-lm-core_v0.16.1-cpu-interval3.log").read_text().splitlines()
    steps = [r for r in map(parser("megatron"), lines) if r and r["event"] == "iteration"]
    # --log-interval 3: the first step, then every third (training.py logs iteration 1 always)
    assert [s["iteration"] for s in steps] == [1, 3, 6, 9, 12]
    assert all(isinstance(s["tflops_per_gpu"], float) for s in steps)


def test_megatron_bridge_lines():
    # Megatron-Bridge v0.4.2 docs/training/multi-token-prediction.md line 127: a step of its training_log
    step = ("iteration      100/  300000 | consumed samples:         3200 | elapsed time per iteration (ms): 3738.6 | "
            "learning rate: 6.000000E-05 | global batch size:    32 | lm loss: 7.968678E+00 | load_balancing_loss: "
            "1.329517E+00 | mtp_1 loss: 7.925096E+00 | loss scale: 1.0 | grad norm: 1.040 | number of skipped "
            "iterations:   0 | number of nan iterations:   0 |")
    record = parser("megatron")(step)
    assert record == {"event": "iteration", "iteration": 100, "train_iters": 300000, "step_s": pytest.approx(3.7386),
                      "learning_rate": 6e-05, "samples": 32, "loss": pytest.approx(7.968678), "loss_scale": 1.0,
                      "grad_norm": 1.04, "skipped_iterations": 0, "nan_iterations": 0}
    # Its memory report, as train_utils.py training_log prints it (MEMORY_KEYS order, 10^9 bytes), with
    # torchrun's rank prefix in front
    memory = ("[default3]:[Rank 3] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 51.072 | "
              "mem-active-gigabytes: 51.072 | mem-inactive-gigabytes: 10.971 | mem-reserved-gigabytes: 216.89 | "
              "mem-max-allocated-gigabytes: 194.41 | mem-max-active-gigabytes: 195.46 | mem-max-inactive-gigabytes: "
              "14.369 | mem-max-reserved-gigabytes: 216.89 | mem-alloc-retires: 0 | mem-allocated-count: 571")
    assert parser("megatron")(memory) == {"event": "memory", "rank": 3, "iteration": 2,
                                          "allocated_bytes": 51_072_000_000, "reserved_bytes": 216_890_000_000,
                                          "mem_peak_bytes": 194_410_000_000, "mem_reserved_bytes": 216_890_000_000}


def test_megatron_lms_first_line_is_taken_out_of_the_next():
    """Megatron-LM logs its first iteration without resetting its sums (training.py, core_v0.16.1:
    `should_reset = not is_first_iteration`): in the tiny run's log (tests/data/trainlogs), line 2's loss
    6.944687 is the mean of steps 1 and 2, so step 2's own is 2 x 6.944687 - 6.942921; and our workload,
    trained on the same data and seed, logged step 2's own (tests/engine/launch/test_runners.py)."""
    lines = (DATA / "megatron-lm-core_v0.16.1-cpu.log").read_text().splitlines()
    reader = LogReader("megatron", node="n1")
    records = [reader.read(line, 10**12) for line in lines]
    steps = {r["iteration"]: r for r in records if r and r["event"] == "iteration"}
    assert steps[1]["loss"] == pytest.approx(6.942921) and steps[2]["loss"] == pytest.approx(2 * 6.944687 - 6.942921)
    assert steps[3]["loss"] == pytest.approx(6.930740)      # reset from then on
    # Megatron-Bridge stamps its lines to the second and resets every time: nothing is taken out
    bridge = LogReader("megatron", node="n1")
    line = (" [2026-01-01 00:00:00] iteration {:8d}/      20 | consumed samples: 8 | elapsed time per iteration (ms): "
            "100.0 | global batch size:     8 | lm loss: {} | loss scale: 1.0 |")
    bridge.read(line.format(1, "7.000000E+00"), 10**12)
    assert bridge.read(line.format(2, "6.000000E+00"), 2 * 10**12)["loss"] == 6.0


def test_megatron_memory_peak_carried_by_later_steps():
    reader = LogReader("megatron", node="n1")
    reader.read("[Rank 0] (after 1 iterations) memory (MB) | allocated: 10.00 | max allocated: 20.00 | "
                "reserved: 30.00 | max reserved: 40.00")
    reader.read("[Rank 1] (after 1 iterations) memory (MB) | allocated: 10.00 | max allocated: 25.50 | "
                "reserved: 30.00 | max reserved: 32.00")
    step = reader.read(" [2026-11-28 19:41:42.753183] iteration        2/      20 | consumed samples:           16 | "
                       "elapsed time per iteration (ms): 252.3 | learning rate: 9.000000E-05 | global batch size:"
                       "     8 | lm loss: 6.944687E+00 | loss scale: 1.0 | grad norm: 1.502 | number of skipped "
                       "iterations:   0 | number of nan iterations:   0 |", now_ns=10**12)
    assert step["mem_peak_bytes"] == round(25.5 * 2**20) and step["mem_reserved_bytes"] == 40 * 2**20
    assert step["end_ns"] - step["start_ns"] == 252_300_000


def test_megatron_never_takes_other_lines_for_steps():
    parse = parser("megatron")
    for line in ("  log_interval .................................... 1",
                 "  train_iters ..................................... 20",
                 "Overwriting rerun_state_machine.current_iteration from -1 to 0...",
                 " iteration        3/      20 | consumed samples:  24 |",      # cut before its time: not a step
                 "[Rank 0] (after 1 iterations) memory (MB) | total device memory used: 3.00"):
        assert parse(line) is None, line


# torchtitan's MetricsProcessor.log format (torchtitan/components/metrics.py, v0.2.2), with its colours
# (torchtitan/tools/utils.py Color) and its logger's prefix (torchtitan/tools/logging.py) and torchrun's
# --tee rank prefix, as run_train.sh runs it
TITAN_COLOURED = ("[rank0]:[titan] 2025-06-10 12:00:03,481 - root - INFO - \x1b[31mstep: 10  \x1b[32mloss:  7.91234  "
                  "\x1b[38;2;180;60;0mgrad_norm:  1.2345  \x1b[38;2;54;234;195mmemory: 42.90GiB(45.16%)  "
                  "\x1b[34mtps: 1,126  \x1b[36mtflops: 65.22  \x1b[35mmfu: 20.90%\x1b[39m")
# torchtitan's own experiments/graph_trainer/.claude/CLAUDE.md (line 264 at b5bcd76): a logged step
TITAN_DOCUMENTED = ("step: 20  loss: 11.83506  grad_norm:  9.6669  memory: 48.87GiB(51.44%)  tps: 4,376  "
                    "tflops: 253.41  mfu: 25.62%")


def test_torchtitan_steps():
    parse = parser("torchtitan")
    assert parse(TITAN_COLOURED) == {"event": "iteration", "iteration": 10, "loss": 7.91234, "grad_norm": 1.2345,
                                     "tokens_per_s_per_device": 1126.0, "tflops_per_gpu": 65.22, "mfu_pct": 20.9,
                                     "mem_reserved_bytes": round(42.90 * 2**30)}
    documented = parse(TITAN_DOCUMENTED)
    assert documented["iteration"] == 20 and documented["tokens_per_s_per_device"] == 4376
    # v0.1.0 logged no grad_norm; validation steps are no training steps
    old = parse("step:  5  loss:  9.1234  memory: 12.00GiB(15.00%)  tps: 2,000  tflops: 10.00  mfu: 3.00%")
    assert old["iteration"] == 5 and old["grad_norm"] is None
    assert parse("validate step: 20  loss:  7.5000  memory: 12.00GiB(15.00%)  tps: 9,000") is None


def test_torchtitan_step_time_from_the_time_between_lines():
    reader = LogReader("torchtitan", node="n1")
    first = reader.read(TITAN_DOCUMENTED.replace("step: 20", "step: 10"), now_ns=5 * 10**9)
    later = reader.read(TITAN_DOCUMENTED, now_ns=7 * 10**9)
    assert first["start_ns"] is None                   # nothing to time the first logged step by
    assert later["end_ns"] - later["start_ns"] == 2 * 10**9 // 10   # 2 s over steps 11..20


# NeMo's examples/llm/resiliency/resiliency-in-pretraining-demo.ipynb (output cells, lines 669-670 at
# 8cfedd7): NeMo 2's ProgressPrinter under NeMo-Run's launcher prefix
NEMO = ["ining-demo/0 [default0]:Training epoch 0, iteration 0/19 | lr: 1.499e-07 | global_batch_size: 512 | "
        "global_step: 0 | reduced_train_loss: 11.03 | train_step_timing in s: 10.31",
        "ining-demo/0 [default0]:Training epoch 0, iteration 1/19 | lr: 2.999e-07 | global_batch_size: 512 | "
        "global_step: 1 | reduced_train_loss: 11.03 | train_step_timing in s: 7.549 | consumed_samples: 1024"]


def test_nemo_progress_printer_lines():
    reader = LogReader("nemo", node="n1", seq_length=2048)
    first, second = (reader.read(line, now_ns=100 * 10**9) for line in NEMO)
    assert (first["iteration"], second["iteration"]) == (1, 2)    # printed from 0
    assert second["loss"] == 11.03 and second["samples"] == 512 and second["tokens"] == 512 * 2048
    assert second["end_ns"] - second["start_ns"] == 7_549_000_000
    assert parser("nemo")("Validation epoch 0, iteration 3/9") is None


def test_user_regex():
    reader = LogReader(r"it (?P<iteration>\d+) loss=(?P<loss>[\d.]+) took (?P<step_ms>[\d.]+)ms", node="n1")
    record = reader.read("[worker] it 7 loss=2.5 took 120.0ms", now_ns=10**10)
    assert record["iteration"] == 7 and record["loss"] == 2.5 and record["end_ns"] - record["start_ns"] == 120_000_000
    assert reader.read("it x loss=1 took 3ms") is None


@pytest.mark.parametrize("bad, says", [("(unclosed", "nor a regular expression"),
                                       (r"loss=(?P<loss>\d+)", "needs a named group (?P<iteration>"),
                                       (r"(?P<iteration>\d+) (?P<speed>\d+)", "unknown group 'speed'")])
def test_bad_formats_are_one_line(bad, says):
    with pytest.raises(UserError, match=re.escape(says)):
        check_format(bad)
    assert check_format("megatron") == "megatron"


def test_format_none_keeps_the_log_and_reads_no_steps():
    """`none` (an attach to a job whose format is not known): every line is kept as it is, none read."""
    lines = (DATA / "megatron-lm-core_v0.16.1-cpu.log").read_text().splitlines()
    reader = LogReader(check_format("none"), node="n1")
    assert [reader.read(line, 10**12) for line in lines] == [None] * len(lines) and reader.records == 0
    assert any(LogReader("megatron", node="n1").read(line, 10**12) for line in lines)   # (lines it would read)
