"""Hostile input to every command and every file the product reads: one clear line and a
non-zero exit, or a clean success; never a traceback, never a hang past 2 s of CPU time, never a write
outside the intended place. The inputs are generated lists (deterministic: a fixed seed), run
in-process; the suite prints its counts. Telemetry files are fuzzed with the storage format
(tests/test_summary*.py); manifests and iteration logs also in tests/probes/store/test_damaged_runs.py.
Profiler traces, iteration logs with every rank's timers and campaign files: FUZZ_EXAMPLES mutations
of each in CI, more with CHARLLM_FUZZ_EXAMPLES=N (350 gives over 3,000 inputs in that test alone)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from charllm.engine.model.experiment import Experiment
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run
from infra_fuzz import BLOCKED_S, HANG_S, Outcome, call, tree

SEED = 13
MAX_LINE = 2000   # one clear line is also a readable one: a hostile value is quoted cut short
# One usage or input error: ours ("charllm-tui: error: ...") or argparse's ("charllm-tui CMD: error: ...").
ONE_LINE = re.compile(r"^charllm-tui( [a-z-]+)*: error: \S")

HOSTILE = ["", " ", "-1", "0", "1e23", "1e400", "nan", "inf", "-inf", "99999999999999999999", "-5e-324",
           "abc", "../../x", "/etc/passwd", "/dev/null", "/proc/x", "a\nb", "x" * 300, "é☃", "\x7f\x1b[2J",
           "--", "1.5", "0x10", "true", "[1, 2]", "{a=1}", "E|t*9999999999|L", "100000000", "1e-300"]
SET_KEYS = ["num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "pipeline_model_parallel_layout", "micro_batch_size",
            "global_batch_size", "seq_length", "train_iters", "lr", "hz", "backend", "hardware.memory_bytes",
            "cluster.nodes", "gpus_per_node", "recompute_granularity", "num_moe_experts", "moe_layer_freq",
            "hidden_dropout", "nope", "model", ""]


@pytest.fixture
def sandbox(charllm_dirs, tmp_path, monkeypatch):
    """cwd and every charllm location inside one directory, with one good run in it."""
    root = tmp_path / "fuzz"
    dirs = {k: root / k for k in ("config", "data", "runs", "out", "inputs")}
    for d in dirs.values():
        d.mkdir(parents=True)
    monkeypatch.setenv("CHARLLM_CONFIG_DIR", str(dirs["config"]))
    monkeypatch.setenv("CHARLLM_DATA_DIR", str(dirs["data"]))
    monkeypatch.setenv("CHARLLM_RUNS_DIR", str(dirs["runs"]))
    monkeypatch.chdir(root)
    exp = Experiment.load("tiny-local")
    exp.save(dirs["inputs"] / "experiment.toml")
    make_run(dirs["runs"], [gpu_frame(np.arange(0, 10, 0.05), power_w=150.0)],
             experiment=(dirs["inputs"] / "experiment.toml").read_text(),
             iterations=iteration_rows(np.arange(0, 9, 1.0), 0.9), run_id="good-run")
    return root, dirs


class Tally:
    """Counts per outcome kind; the failures (with their input) for the assertion message."""

    def __init__(self, name: str):
        self.name, self.counts, self.failures = name, Counter(), []

    def check(self, outcome: Outcome, root: Path, before: dict, allowed: tuple[Path, ...]) -> None:
        after = tree(root)
        changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
        changed = {p for p in changed if "/summaries" not in p}  # summary caches are the run's own
        if outcome.code == 0:
            changed = {p for p in changed if not any(p == str(a) or p.startswith(str(a) + os.sep)
                                                     for a in allowed)}
        self.counts["inputs"] += 1
        if outcome.hung:
            self.counts["hangs"] += 1
            self.failures.append(f"HANG > {HANG_S} s of CPU (or {BLOCKED_S} s waiting): {outcome}")
        elif outcome.crash:
            self.counts["tracebacks"] += 1
            self.failures.append(f"TRACEBACK: {outcome}")
        elif outcome.argv[:1] == ["plan"] and outcome.code in (1, 3) and not outcome.err.strip():
            self.counts["accepted"] += 1   # plan's verdict: 1 does not fit, 3 tight (its output says why)
        elif outcome.code != 0:
            lines = outcome.err.strip().splitlines()
            if (
                len(lines) != 1
                or not ONE_LINE.match(lines[0])
                or "Traceback" in outcome.err
                or len(lines[0]) > MAX_LINE
            ):
                self.counts["unclear"] += 1
                self.failures.append(f"NOT ONE CLEAR LINE: {outcome}")
            else:
                self.counts["refused in one line"] += 1
        else:
            self.counts["accepted"] += 1
        if changed:
            self.counts["stray writes"] += 1
            self.failures.append(f"WROTE {sorted(changed)[:3]}: {outcome}")

    def report(self) -> None:
        print(f"\nfuzz {self.name}: " + ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())))
        for kind in ("hangs", "tracebacks", "unclear", "stray writes"):
            self.counts.setdefault(kind, 0)
        assert not self.failures, f"{len(self.failures)} of {self.counts['inputs']}:\n" + \
            "\n\n".join(self.failures[:8])


def run_all(name: str, sandbox, argvs, prepare=None) -> Tally:
    root, dirs = sandbox
    tally = Tally(name)
    allowed = (dirs["out"], dirs["data"], dirs["runs"])
    for argv in argvs:
        if prepare:
            prepare(argv)
        before = tree(root.parent)  # the sandbox and around it: ../x escapes show
        tally.check(call(argv), root.parent, before, allowed)
        for made in dirs["out"].iterdir():  # what a successful call wrote: gone before the next
            shutil.rmtree(made) if made.is_dir() else made.unlink()
        shutil.rmtree(dirs["data"] / "baselines", ignore_errors=True)
        for made in dirs["runs"].iterdir():
            if made.name not in ("good-run", "link-out"):
                shutil.rmtree(made)
    tally.report()
    return tally


# --------------------------------------------------------------------------------------------
# Every command, each option given each hostile value
# --------------------------------------------------------------------------------------------
def command_inputs(out: Path) -> list[list[str]]:
    argvs = []
    for key in SET_KEYS:
        for value in HOSTILE:
            argvs.append(["plan", "tiny-local", "--set", f"{key}={value}"])
    fifo = out.parent / "inputs" / "fifo"
    os.mkfifo(fifo)
    for bad_output in (str(out), str(fifo), str(out / "missing" / "x.csv"), str(out / "a\nb.csv")):
        argvs += [["export", "megatron", "tiny-local", "--out", bad_output],
                  ["sweep", "tiny-local", "--parquet", bad_output], ["summarize", "good-run", "--out", bad_output],
                  ["probe", "--backend", "sim", "--duration", "0.05", "--out", bad_output]]
    for value in HOSTILE:
        # Outputs stay inside the sandbox (the tests run as root: "/etc/passwd" would be replaced);
        # the hostile paths themselves are tried where a command only reads.
        target = str(out / value.replace("/", "_")) if value.strip() else value
        argvs += [
            ["plan", value], ["plan", "tiny-local", "--world-size", value], ["plan", "tiny-local", "--hardware", value],
            ["plan", "--megatron-args", f"--num-layers {value} --hidden-size 64", "--world-size", "2"],
            ["sweep", "tiny-local", "--top", value], ["sweep", "tiny-local", "--recompute", value],
            ["sweep", "tiny-local", "--parquet", target],
            ["sweep", "--model", "tiny-dense", "--hardware", "cpu", "--nodes", value, "--gpus-per-node", "2",
             "--global-batch-size", "8", "--top", "1"],
            ["sweep", "--model", value, "--hardware", "cpu", "--nodes", "1", "--gpus-per-node", "2",
             "--global-batch-size", value, "--top", "1"],
            ["sweep", "tiny-local", "--set", f"num_layers={value}", "--top", "1"],
            ["export", "megatron", "tiny-local", "--out", target], ["export", "toml", value],
            ["export", "megatron", "tiny-local", "--set", f"seq_length={value}"],
            ["presets", "show", value], ["presets", "list", value],
            ["probe", "--backend", "sim", "--duration", "0.05", "--hz", value],
            ["probe", "--backend", "sim", "--duration", value, "--hz", "100"],
            ["probe", "--backend", "sim", "--duration", "0.05", "--out", target, "--node", value],
            ["probe", "--backend", "sim", "--duration", "0.05", "--out", target],
            ["probe", "--backend", value, "--duration", "0.05"],
            ["probe", "--backend", "sim", "--sim-gpus", value, "--duration", "0.05"],
            ["probe", "--backend", "sim", "--sim-profile", value, "--duration", "0.05"],
            ["summarize", value], ["summarize", "good-run", "--window", value],
            ["summarize", "good-run", "--out", target], ["summarize", "good-run", "--format", value],
            ["compare", value, "good-run"], ["compare", "good-run", "good-run", "--threshold", value],
            ["compare", "good-run", "good-run", "--window", value], ["compare", "good-run", "--baseline", value],
            ["baseline", "save", "good-run", "--name", value], ["baseline", "show", value],
            ["baseline", "delete", value],
            ["import", "charllm-ppt", value], ["import", "charllm-ppt", str(out), "--name", value],
            ["launch", value, "--dry-run"], ["launch", "tiny-local", "--target", value, "--dry-run"],
            ["launch", "tiny-local", "--dry-run", "--set", f"hz={value}"],
            ["launch", "tiny-local", "--dry-run", "--nproc", value],
            ["launch", "tiny-local", "--dry-run", "--target-file", value],
            ["runs", "show", value], ["runs", "logs", value], ["runs", "cancel", value], ["runs", "delete", value],
            ["doctor", "--show", value], ["doctor", "--target", value], ["doctor", "--nodes", value, "--show"],
            ["campaign", "plan", value], ["campaign", "show", value], ["campaign", "status", value],
            ["campaign", "summary", value], ["campaign", "cancel", value], ["campaign", "delete", value],
            ["campaign", "report", value, "--figure", "microbatch"],
            ["campaign", "report", "tiny-local", "--figure", value],
            ["campaign", "run", "tiny-local", "--max-parallel", value, "--detach", "--target", "nowhere"],
            ["campaign", "run", value, "--detach"],
            ["campaign", "compare", value, "tiny-local"], ["campaign", "compare", "tiny-local", value],
            ["campaign", "compare", "tiny-local", "ppt-h100", "--metric", value],
            ["campaign", "compare", "tiny-local", "ppt-h100", "--variant", value],
        ]
    return argvs


# Issue 24: names full of shell, and paths that lead out of the runs directory (inside the sandbox
# only: a regression must not be able to delete more than the sandbox).
SHELL_HOSTILE = ["x\ntouch PWNED #", "$(touch PWNED)", "`touch PWNED`", "; touch PWNED", "'; touch PWNED; '",
                 "\"; touch PWNED; \"", "a && touch PWNED", "x\\", "#", "-rf", "*", "~root", "%s%n", "\u202etxt.exe",
                 "x" * 5000, "9" * 5000, "[" * 3000, "{" * 3000]


def escape_inputs(root: Path, dirs: dict) -> list[list[str]]:
    """Names for every place a name is written, and paths out of the runs directory for every
    command that deletes or writes in a run."""
    victim = dirs["out"].parent / "victim"
    (victim / "telemetry").mkdir(parents=True, exist_ok=True)
    (victim / "thesis.tex").write_text("years of work")
    (victim / "manifest.json").write_text('{"status": "completed"}')
    (dirs["runs"] / "link-out").symlink_to(victim)
    argvs = []
    for value in SHELL_HOSTILE:
        for key in ("name", "model.name", "hardware.name", "data_path", "backend"):
            argvs += [["plan", "tiny-local", "--set", f"{key}={value}"],
                      ["launch", "tiny-local", "--dry-run", "--set", f"{key}={value}"],
                      ["export", "megatron", "tiny-local", "--script", "--set", f"{key}={value}"],
                      ["export", "megatron", "tiny-local", "--script", "--no-validate", "--set", f"{key}={value}"]]
        argvs += [["import", "charllm-ppt", str(victim), "--name", value],
                  ["baseline", "save", "good-run", "--name", value],
                  ["runs", "show", value], ["summarize", value], ["compare", "good-run", value],
                  ["probe", "--backend", "sim", "--duration", "0.05", "--node", value, "--out", str(dirs["out"] / "p")],
                  ["probe", "--backend", "replay:good-run", "--duration", "0.05", "--speed", value]]
    for path in (victim, root, dirs["out"].parent, dirs["runs"], dirs["runs"] / "link-out", "link-out",
                 dirs["runs"] / ".." / "victim", dirs["runs"] / "good-run" / ".." / ".." / "victim"):
        argvs += [["runs", "delete", str(path)], ["summarize", str(path)], ["runs", "show", str(path)],
                  ["runs", "cancel", str(path)], ["baseline", "save", str(path), "--name", "b"]]
        if Path(path).is_absolute():   # (a relative --out is a new directory where the user is: fine)
            argvs.append(["probe", "--backend", "sim", "--duration", "0.05", "--out", str(path)])
    return argvs


def test_every_command_on_hostile_values(sandbox):
    root, dirs = sandbox
    argvs = command_inputs(dirs["out"]) + escape_inputs(root, dirs)
    assert len(argvs) >= 2500
    tally = run_all("commands", sandbox, argvs)
    assert not list(root.parent.rglob("PWNED")), "a name ran as a command"
    victim = dirs["out"].parent / "victim"
    assert (victim / "thesis.tex").read_text() == "years of work" and not (victim / "summaries").exists(), \
        "a command deleted or wrote outside the runs directory"
    assert tally.counts["inputs"] >= 2500


# --------------------------------------------------------------------------------------------
# Every file the product reads, mutated
# --------------------------------------------------------------------------------------------
HOSTILE_VALUES = [v.encode() for v in ('"x"', "-1", "0", "1e400", "nan", "inf", "[]", "{}", "true", '"a\\nb"',
                                         "99999999999999999999", '"' + "x" * 300 + '"', '"../../x"', "1.5")]
# JSON's own (traces, iteration logs): what json.loads takes that no field should hold.
JSON_VALUES = HOSTILE_VALUES + [v.encode() for v in (
    "null", "NaN", "Infinity", "-Infinity", "1" + "0" * 400, "1e308", "-5e-324", "2.5", "[1, \"x\"]",
    '"ProfilerStep#' + "9" * 5000 + '"', '"ProfilerStep#3"', '"Optimizer.step#Adam.step"', '"kernel"',
    '"cpu_op"', '"X"', "[" * 3000 + "]" * 3000, '{"rank": 100000000000000000000}')]


def mutations(valid: bytes, rng: random.Random, n: int, json: bool = False) -> list[bytes]:
    """Truncations, flipped bytes, hostile values swapped in, binary, huge and deep content: of a
    TOML file (`key = value` lines), or of JSON (`json`: `"key": value`, a value ending at , } ] or
    the line's end)."""
    out = [b"", b"\x00\xff\xfe" * 50, valid[: len(valid) // 2], valid + b"\n[[[[", b"[" * 5000,
           b"a = " + b"[" * 3000 + b"]" * 3000, valid.replace(b"\n", b"\r"), valid * 2,
           b"x = " + b"9" * 5000, b"\xef\xbb\xbf" + valid]
    values = JSON_VALUES if json else HOSTILE_VALUES
    assignments = [m.start(1) for m in re.finditer(rb'": *(\S)' if json else rb"= *(\S)", valid)]
    value_end = re.compile(rb"[,}\]\n]" if json else rb"\n")
    while len(out) < n:
        kind = rng.randrange(4)
        data = bytearray(valid)
        if kind == 0 and assignments:  # one value replaced by a hostile one
            start = rng.choice(assignments)
            found = value_end.search(valid, start + 1)
            end = found.start() if found else len(valid)
            data[start:end] = rng.choice(values)
        elif kind == 1:  # bytes flipped
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 2:  # truncated
            data = data[: rng.randrange(len(data))]
        else:  # a line duplicated (duplicate keys, sections)
            lines = bytes(data).split(b"\n")
            i = rng.randrange(len(lines))
            data = bytearray(b"\n".join(lines[: i + 1] + [lines[i]] + lines[i + 1:]))
        out.append(bytes(data))
    return out


def test_every_file_the_product_reads_mutated(sandbox):
    root, dirs = sandbox
    rng = random.Random(SEED)
    inputs = dirs["inputs"]
    experiment = (inputs / "experiment.toml").read_bytes()
    targets = (b'[lab]\nkind = "ssh"\nhosts = ["n1", "n2"]\nuser = "me"\nport = 22\nworkdir = "charllm"\n'
               b'env_setup = "module load cuda"\n\n[cluster]\nkind = "slurm"\npartition = "gpu"\n'
               b'account = "proj"\nqos = "normal"\ntime = "01:00:00"\nconstraint = "H100"\n'
               b'sbatch_lines = ["--exclusive"]\ngpus_per_node = 8\n')
    settings = b'theme = "gruvbox"\n[keymap]\n"screen.live" = "f9"\n'
    campaign = (b'description = "x"\nexperiments = ["tiny-local"]\n[axes]\nmicro_batch_size = [1, 2]\n'
                b'[[layouts]]\ntensor_model_parallel_size = 1\n[target]\nmax_parallel = 2\ntime_limit = "00:10:00"\n')
    good = dirs["runs"] / "good-run"
    manifest = (good / "manifest.json").read_bytes()
    iterations = (good / "iterations.jsonl").read_bytes()
    csv = "".join(f"{1.7e9 + i * 0.1!r},{300.0 + i!r}\n" for i in range(40)).encode()
    damaged_run = dirs["runs"] / "zz-damaged"
    csv_dir = inputs / "ppt"

    cases: list[tuple[list[str], str, bytes]] = []   # (argv, which file, its content)
    for data in mutations(experiment, rng, 150):
        cases += [(["plan", str(inputs / "fuzzed.toml")], "experiment", data),
                  (["launch", str(inputs / "fuzzed.toml"), "--dry-run"], "experiment", data)]
    for data in mutations(targets, rng, 120):
        cases += [(["launch", "tiny-local", "--target", "cluster", "--dry-run"], "targets", data),
                  (["launch", "tiny-local", "--target", "lab", "--dry-run"], "targets", data)]
    for data in mutations(settings, rng, 60):
        cases.append((["tui-settings"], "tui", data))
    for data in mutations(manifest, rng, 60):
        cases += [(["runs", "list"], "manifest", data), (["summarize", "zz-damaged"], "manifest", data)]
    for data in mutations(iterations, rng, 60):
        cases += [
            (["summarize", "zz-damaged"], "iterations", data),
            (["runs", "show", "zz-damaged"], "iterations", data),
        ]
    for data in mutations(csv, rng, 60):
        cases.append((["import", "charllm-ppt", str(csv_dir), "--name", "imported"], "csv", data))
    for data in mutations(campaign, rng, 80):
        cases.append((["campaign", "plan", "fuzzed"], "campaign", data))

    shutil.copytree(good, damaged_run)
    csv_dir.mkdir()
    for metric in ("gpu_power", "gpu_thermal", "sm_clock"):
        (csv_dir / f"{metric}_1.csv").write_bytes(csv)
    tally = Tally("files")
    allowed = (dirs["out"], dirs["data"], dirs["runs"])
    from charllm.tui.cli import main as cli_main

    for argv, which, data in cases:
        path = {"experiment": inputs / "fuzzed.toml", "targets": dirs["config"] / "targets.toml",
                "tui": dirs["config"] / "tui.toml", "manifest": damaged_run / "manifest.json",
                "iterations": damaged_run / "iterations.jsonl", "csv": csv_dir / "gpu_power_0.csv",
                "campaign": dirs["config"] / "campaigns" / "fuzzed.toml"}[which]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        before = tree(root.parent)  # the sandbox and around it: ../x escapes show
        if which == "tui":
            outcome = call_settings(path)
        else:
            outcome = call(argv)
        if argv == ["runs", "list"] and outcome.code == 0:
            assert "good-run" in outcome.out and "zz-damaged" in outcome.out, "a damaged run costs only itself"
        tally.check(outcome, root.parent, before, allowed)
        shutil.rmtree(dirs["runs"] / "imported", ignore_errors=True)
        shutil.rmtree(damaged_run / "summaries", ignore_errors=True)
    (dirs["config"] / "targets.toml").unlink()
    (dirs["config"] / "tui.toml").unlink()
    assert cli_main is not None
    tally.report()


# Issue 35: profiler traces, iteration logs with every rank's timers, and campaign files. CI runs a
# deterministic subset (FUZZ_EXAMPLES mutations of each); CHARLLM_FUZZ_EXAMPLES=350 runs over 3,000.
FUZZ_EXAMPLES = int(os.environ.get("CHARLLM_FUZZ_EXAMPLES") or 40)
ARTIFACT_TRACES = Path(__file__).resolve().parents[1] / "data" / "kineto" / "charllm_ppt_run" / "4242_kineto"
SHIPPED_CAMPAIGN = Path(__file__).resolve().parents[2] / "presets" / "campaigns" / "tiny-local.toml"


def host_trace() -> bytes:
    """A CPU run's trace, one event a line: nested ops, gloo's thread, an optimizer step."""
    events = [{"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": float(ts), "dur": float(dur)}
              for cat, name, tid, ts, dur in (
                  ("user_annotation", "ProfilerStep#3", 1, 0, 1000), ("cpu_op", "aten::linear", 1, 0, 100),
                  ("cpu_op", "aten::mm", 1, 10, 80), ("cpu_op", "aten::layer_norm", 1, 100, 50),
                  ("user_annotation", "gloo:all_reduce", 2, 50, 200),
                  ("user_annotation", "Optimizer.step#AdamW.step", 1, 700, 100),
                  ("cpu_op", "aten::_fused_adamw_", 1, 740, 50))]
    return ("{\n\"charllm\": {\"rank\": 1, \"pp_rank\": 1},\n\"traceEvents\": [\n"
            + ",\n".join(json.dumps(e) for e in events) + "\n]\n}\n").encode()


DEEP = "@deep@"   # stands for 3,000 nested lists (json.dumps would recurse past Python's limit)
FIELD_VALUES = ["x", None, -1, 0, 10**30, 10**400, float("nan"), float("inf"), -1e308, 1.5, True, [], {}, [1, "x"],
                {"a": [None]}, "ProfilerStep#" + "9" * 5000, "ProfilerStep#7", "Optimizer.step#Adam.step", "9" * 5000,
                "x" * 100_000, "a\nb", "../../x", "kernel", "cpu_op", "cuda_runtime", "X", DEEP]


def record_mutations(records: list[dict], rng: random.Random, n: int) -> list[list]:
    """Records (trace events, iteration-log lines) with hostile fields: one field of one record, the
    same field of every record, a nested field (args, timers, ranks), a record dropped, doubled or
    made a hostile value itself."""
    out = []
    while len(out) < n:
        mutated = json.loads(json.dumps(records))
        target = rng.choice(mutated)
        key = rng.choice(sorted(target))
        value = rng.choice(FIELD_VALUES)
        kind = rng.randrange(5)
        if kind == 0:
            target[key] = value
        elif kind == 1:
            for record in mutated:
                if key in record:
                    record[key] = value
        elif kind == 2 and any(isinstance(v, (dict, list)) and v for v in target.values()):
            nested = rng.choice([v for v in target.values() if isinstance(v, (dict, list)) and v])
            if isinstance(nested, dict):
                nested[rng.choice(sorted(nested))] = value
            else:
                nested[rng.randrange(len(nested))] = value
        elif kind == 3:
            mutated.insert(rng.randrange(len(mutated) + 1), rng.choice([value, dict(target)]))
        else:
            mutated.remove(target)
        out.append(mutated)
    return out


def dumped(value) -> bytes:
    return json.dumps(value).replace(json.dumps(DEEP), "[" * 3000 + "]" * 3000).encode()


def test_traces_iteration_logs_and_campaign_files_mutated(sandbox):
    """Each mutation of a GPU trace (summarize --kernels, by stage and by rank), a CPU run's gzipped
    trace, an iteration log carrying every rank's timers (summarize, by rank and by stage, runs show)
    and a campaign file (in <config>/campaigns: by path and by name, and the listing): one clear
    line or a clean result, never a traceback or a hang, never a write outside its place."""
    import gzip

    from infra_traces import rank_log

    root, dirs = sandbox
    rng = random.Random(SEED + 35)
    traced = make_run(dirs["runs"], [], run_id="traced")
    shutil.copytree(ARTIFACT_TRACES, traced.traces_dir)
    t = np.arange(0, 8, 0.05)
    timed = make_run(dirs["runs"], [gpu_frame(t, node=f"n{n}", device=f"gpu{g}") for n in (0, 1) for g in (0, 1)],
                     experiment=(dirs["inputs"] / "experiment.toml").read_text(),
                     iterations=rank_log([0.2, 0.2, 0.6, 0.4]), run_id="timed")
    campaign = dirs["config"] / "campaigns" / "fuzzed.toml"
    campaign.parent.mkdir(parents=True, exist_ok=True)
    places = {"trace": traced.traces_dir / "rank-0.json", "gz": traced.traces_dir / "rank-5.json.gz",
              "log": timed.iterations_path, "campaign": campaign}
    originals = {which: path.read_bytes() for which, path in places.items() if path.exists()}

    half = FUZZ_EXAMPLES // 2     # of the bytes, and of the records they hold
    trace = json.loads(originals["trace"])
    traces = mutations(originals["trace"], rng, half, json=True) + [
        dumped({**trace, "traceEvents": events}) for events in record_mutations(trace["traceEvents"], rng, half)]
    host = json.loads(host_trace())
    host_traces = mutations(host_trace(), rng, half // 2, json=True) + [
        dumped({**host, "traceEvents": events}) for events in record_mutations(host["traceEvents"], rng, half // 2)]
    log = [json.loads(line) for line in originals["log"].splitlines()]
    logs = mutations(originals["log"], rng, half, json=True) + [
        b"".join(dumped(line) + b"\n" for line in lines) for lines in record_mutations(log, rng, half)]

    cases: list[tuple[list[str], str, bytes]] = []
    for data in traces:
        cases += [(["summarize", "traced", "--kernels"], "trace", data),
                  (["summarize", "traced", "--kernels", "--by", "rank", "--format", "json"], "trace", data)]
    for data in host_traces:
        cases.append((["summarize", "traced", "--kernels"], "gz", gzip.compress(data)))
    for data in logs:
        cases += [(["summarize", "timed"], "log", data), (["summarize", "timed", "--by", "rank"], "log", data),
                  (["summarize", "timed", "--by", "stage", "--format", "csv"], "log", data),
                  (["runs", "show", "timed"], "log", data)]
    for data in mutations(SHIPPED_CAMPAIGN.read_bytes(), rng, FUZZ_EXAMPLES):
        cases += [(["campaign", "plan", str(campaign)], "campaign", data),
                  (["campaign", "show", str(campaign)], "campaign", data),
                  (["campaign", "plan", "fuzzed", "--json"], "campaign", data),
                  (["campaign", "list"], "campaign", data)]

    tally = Tally("traces, iteration logs, campaign files")
    allowed = (dirs["out"], dirs["data"], dirs["runs"])
    for argv, which, data in cases:
        places[which].write_bytes(data)
        before = tree(root.parent)
        outcome = call(argv)
        if argv == ["campaign", "list"] and outcome.code == 0:
            assert "tiny-local" in outcome.out, "a damaged campaign file costs only itself"
        tally.check(outcome, root.parent, before, allowed)
        for kind, path in places.items():   # as it was for the next input
            path.write_bytes(originals[kind]) if kind in originals else path.unlink(missing_ok=True)
        for run in (traced, timed):
            shutil.rmtree(run.path / "summaries", ignore_errors=True)
    tally.report()
    assert tally.counts["inputs"] == len(cases) >= 10 * FUZZ_EXAMPLES


def call_settings(path: Path) -> Outcome:
    """tui.toml is read when the workbench starts: load_settings is that read, with the CLI's rule
    (a UserError is printed as one line)."""
    from charllm.probes.core.errors import UserError
    from charllm.tui.app import load_settings
    from infra_fuzz import Hang, watchdog

    try:
        with watchdog():
            load_settings(path)
        return Outcome(["tui.toml"], 0, "", "")
    except UserError as exc:
        return Outcome(["tui.toml"], 2, "", f"charllm-tui: error: {exc}\n")
    except Hang:
        return Outcome(["tui.toml"], None, "", "", hung=True)
    except BaseException:  # noqa: BLE001 - what the test counts
        import traceback

        return Outcome(["tui.toml"], None, "", "", crash=traceback.format_exc())


def test_the_suite_counts_are_printed(capsys):
    """The tallies above print one line each (`pytest -s` shows them); this keeps that format."""
    tally = Tally("self-check")
    tally.check(Outcome(["x"], 2, "", "charllm-tui: error: x = 1: must be 2\n"), Path("/nonexistent"), {}, ())
    tally.report()
    assert "fuzz self-check: inputs 1, refused in one line 1" in capsys.readouterr().out
    assert json.dumps(dict(tally.counts))
