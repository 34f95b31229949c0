"""The hostile inputs of issue 13, each refused in one line before it can do harm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from charllm.engine.launch.launcher import launch
from charllm.engine.launch.targets import parse_target
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.synthetic import gpu_frame, iteration_rows, make_run
from infra_campaign import forged_run, plant_record
from infra_cli import one_error_line, run
from infra_fuzz import call, tree

SLURM = {"kind": "slurm", "partition": "gpu", "account": "proj", "qos": "normal", "time": "01:00:00",
         "constraint": "H100", "env_setup": "module load cuda", "python": "python3", "description": "x"}


@pytest.mark.parametrize("field", ["partition", "account", "qos", "time", "constraint", "env_setup", "python",
                                   "description"])
@pytest.mark.parametrize("breakout", ["\n", "\r", "\x00", "\x1b"])
def test_no_configuration_field_breaks_out_of_its_line(field, breakout, tmp_path):
    table = dict(SLURM, **{field: f"gpu{breakout}srun touch {tmp_path}/PWNED"})
    with pytest.raises(UserError, match=f"{field} = .*must be one line"):
        parse_target("cluster", table)
    with pytest.raises(UserError, match="sbatch_lines"):
        parse_target("cluster", dict(SLURM, sbatch_lines=[f"--exclusive{breakout}touch x"]))


def test_a_clean_target_gives_one_sbatch_line_per_option(tmp_path):
    exp = Experiment.load("tiny-local")
    exp.cluster.nodes, exp.cluster.gpus_per_node = 2, 1
    script = launch(exp, parse_target("cluster", SLURM), dry_run=True).job_script
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for option in ("partition", "account", "qos", "time", "constraint"):
        assert sum(f"--{option}=" in line for line in header) == 1


@pytest.mark.parametrize("node", ["../../x", "/abs/path", "a\nb", "", ".hidden", "x" * 200])
def test_probe_node_is_a_plain_name(node, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run(capsys, "probe", "--backend", "sim", "--duration", "0.05", "--out", str(out), "--node", node)
    assert code == 2 and "node" in one_error_line(err)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["", "/etc/hostname", "/dev/null", "/proc/x", "missing/dir/run"])
def test_probe_out_is_a_directory_it_may_make(out, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "probe", "--backend", "sim", "--duration", "0.05", "--out", out)
    assert code == 2 and "--out" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def two_runs(runs):
    for run_id in ("run-a", "run-b"):
        make_run(runs, [gpu_frame(np.arange(0, 10, 0.05), power_w=150.0)],
                 iterations=iteration_rows(np.arange(0, 9, 1.0), 0.9), run_id=run_id)


@pytest.mark.parametrize("ref", ["", " "])
@pytest.mark.parametrize("action", ["delete", "show", "cancel", "logs"])
def test_an_empty_run_matches_no_run(ref, action, charllm_dirs, capsys):
    two_runs(charllm_dirs["runs"])
    code, _, err = run(capsys, "runs", action, ref)
    assert code == 2 and "give a run id" in one_error_line(err)
    assert sorted(p.name for p in charllm_dirs["runs"].iterdir()) == ["run-a", "run-b"]


@pytest.mark.parametrize("threshold", ["nan", "inf", "1e400", "-1"])
def test_compare_threshold_is_a_finite_percentage(threshold, charllm_dirs, capsys):
    two_runs(charllm_dirs["runs"])
    code, _, err = run(capsys, "compare", "run-a", "run-b", "--threshold", threshold)
    assert code == 2 and "--threshold" in one_error_line(err)


SWEEP = ["sweep", "--model", "tiny-dense", "--hardware", "cpu", "--gpus-per-node", "2", "--global-batch-size", "8"]
LAYOUT = "pipeline_model_parallel_layout"


@pytest.mark.parametrize(
    "argv, field",
    [
        ([*SWEEP, "--nodes", "99999999999999999999"], "nodes"),
        ([*SWEEP, "--nodes", "1000000000"], "nodes"),
        (["plan", "tiny-local", "--set", f"{LAYOUT}=E|t*9999999999|L"], LAYOUT),
        (["plan", "tiny-local", "--set", f"{LAYOUT}=(t*9999)*9999"], LAYOUT),
        (["plan", "tiny-local", "--set", "num_layers=100000000"], "num_layers"),
        (["plan", "tiny-local", "--set", "num_layers=1e23"], "num_layers"),
        (["plan", "tiny-local", "--set", "hardware.memory_bytes=-1"], "memory_bytes"),
        (["plan", "tiny-local", "--set", "lr=nan"], "lr"),
        (["plan", "tiny-local", "--set", "hz=1000"], "hz"),
        (
            [
                "sweep",
                "--model",
                "tiny-dense",
                "--hardware",
                "cpu",
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--global-batch-size",
                "100000000000000000000",
            ],
            "global_batch_size",
        ),
    ],
)
def test_bounded_before_any_loop(argv, field):
    outcome = call(argv)  # a watchdog: past 2 s of CPU time it counts as a hang
    assert not outcome.hung and not outcome.crash, str(outcome)
    assert outcome.code == 2 and outcome.one_clear_line and field in outcome.err, str(outcome)


@pytest.mark.parametrize("argv", [
    ["export", "megatron", "tiny-local", "--out", "OUT"],
    ["sweep", "tiny-local", "--parquet", "OUT"],
    ["summarize", "run-a", "--out", "OUT"],
])
@pytest.mark.parametrize("where", ["", "missing/dir/file.csv", "."])
def test_outputs_never_create_directories_silently(argv, where, charllm_dirs, capsys, tmp_path, monkeypatch):
    two_runs(charllm_dirs["runs"])
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    code, _, err = run(capsys, *[where if a == "OUT" else a for a in argv])
    assert code == 2 and one_error_line(err)
    assert sorted(tmp_path.iterdir()) == before


def test_a_deep_or_huge_file_is_one_line(tmp_path, capsys):
    for content in ("num_layers = " + "9" * 5000, "a = " + "[" * 3000 + "]" * 3000):
        path = tmp_path / "exp.toml"
        path.write_text(content)
        code, _, err = run(capsys, "plan", str(path))
        assert code == 2 and "exp.toml" in one_error_line(err)


def test_a_broken_target_table_blocks_only_itself(charllm_dirs, capsys):
    from charllm.probes.core import paths

    paths.targets_file().parent.mkdir(parents=True, exist_ok=True)
    paths.targets_file().write_text('[old]\nkind = "ftp"\n')
    code, out, _ = run(capsys, "launch", "tiny-local", "--dry-run")
    assert code == 0 and "torch.distributed.run" in out
    code, _, err = run(capsys, "launch", "tiny-local", "--target", "old", "--dry-run")
    assert code == 2 and "[old].kind = 'ftp': must be one of local, ssh, slurm" in one_error_line(err)


# Issue 24: every value written into a shell line is quoted for that shell. Names full of shell,
# run through real bash: nothing they hold may run.
SHELL_NAMES = ["x\ntouch PWNED #", "x\r\ntouch PWNED", "$(touch PWNED)", "`touch PWNED`", "; touch PWNED",
               "'; touch PWNED; '", "\"; touch PWNED; \"", "a && touch PWNED", "x\\\ntouch PWNED", "#\ntouch PWNED"]


@pytest.mark.parametrize("name", SHELL_NAMES)
def test_a_hostile_name_never_runs_in_a_script_it_is_written_into(name, tmp_path, monkeypatch):
    import subprocess

    monkeypatch.chdir(tmp_path)
    (tmp_path / "targets.toml").write_text('[hpc]\nkind = "slurm"\npartition = "gpu"\n'
                                           'env_setup = "export OMP_NUM_THREADS=1  # a note"\n')
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}   # no torchrun, srun or python of ours
    scripts = []
    for extra in ([], ["--no-validate"]):   # refused in one line, or written with the name made harmless
        outcome = call(["export", "megatron", "tiny-local", "--script", *extra, "--set", f"name={name}",
                        "--out", "train.sh"])
        if outcome.code == 0:
            scripts.append((tmp_path / "train.sh").read_text())
        else:
            assert outcome.one_clear_line and "name = " in outcome.err, outcome
    outcome = call(["launch", "tiny-local", "--target", "hpc", "--target-file", "targets.toml", "--dry-run",
                    "--set", f"name={name}", "--set", "hardware=h100-sxm-80gb"])
    if outcome.code == 0:
        scripts.append(outcome.out[outcome.out.index("#!/bin/bash"):])
    else:
        assert outcome.one_clear_line, outcome
    assert scripts, "at least the --no-validate export is written"
    for text in scripts:
        (tmp_path / "run.sh").write_text(text)
        subprocess.run(["bash", "run.sh"], cwd=tmp_path, env=clean, capture_output=True, timeout=60)
        assert not list(tmp_path.rglob("PWNED")), f"a name ran as a command:\n{text[:400]}"


@pytest.mark.parametrize("line", ["export A='x", "module load cuda &&", "echo $(", "if true; then"])
def test_an_env_line_that_would_swallow_the_rest_is_refused(line):
    with pytest.raises(UserError, match="env_setup = .*not a complete shell line"):
        parse_target("cluster", dict(SLURM, env_setup=line))
    parse_target("cluster", dict(SLURM, env_setup="module load cuda  # as users write it: a comment"))


@pytest.mark.parametrize("line", ["--comment='unbalanced", '--wrap="x'])
def test_an_sbatch_line_that_is_not_shell_words_is_refused(line):
    with pytest.raises(UserError, match="sbatch_lines: .* is not shell words"):
        parse_target("cluster", dict(SLURM, sbatch_lines=[line]))


# Issue 35: traces and iteration logs made to cost their reader, through the command line with the
# watchdog (a hang is more than 2 s of CPU time).
def _trace(events: list[dict]) -> str:
    return json.dumps({"charllm": {"rank": 1, "pp_rank": 1}, "traceEvents": events})


def _kernel(ts, dur=1.0, name="gemm", **extra) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, **extra}


def _host(name: str, ts, dur, cat="user_annotation", **extra) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, **extra}


def _many_steps(n: int) -> list[dict]:
    """n ProfilerStep spans with a kernel each, and one kernel across all of them."""
    return [e for i in range(n) for e in (_host(f"ProfilerStep#{i}", i * 100, 90), _kernel(i * 100 + 10, 50))] \
        + [_kernel(0, n * 100, "ncclDevKernel_AllGather")]


def _many_optimizer_steps(n: int) -> list[dict]:
    """n Optimizer.step spans on one thread, each launching a kernel."""
    return [_host("ProfilerStep#1", 0, n * 100)] + [e for i in range(n) for e in (
        _host("Optimizer.step#Adam.step", i * 100, 50),
        _host("cudaLaunchKernel", i * 100 + 10, 5, "cuda_runtime", args={"correlation": i + 1}),
        _kernel(i * 100 + 20, 30, "multi_tensor_apply_kernel", args={"correlation": i + 1}))]


HOSTILE_TRACES = {   # each made when its case runs
    "ts 10**400": lambda: _trace([_kernel(0)]).replace('"ts": 0', '"ts": 1' + "0" * 400),
    "ProfilerStep# and 5,000 digits": lambda: _trace([_host("ProfilerStep#" + "7" * 5000, 0, 5)]),
    "30k steps, 30k kernels": lambda: _trace(_many_steps(30_000)),
    "30k optimizer steps": lambda: _trace(_many_optimizer_steps(30_000)),
    "unhashable pid, tid and correlation": lambda: _trace([
        {**_kernel(0, 10), "pid": [1], "tid": {"a": 1}, "args": {"correlation": [2]}},
        {**_host("cudaLaunchKernel", 0, 1, "cuda_runtime"), "pid": {}, "tid": [], "args": {"correlation": {}}}]),
}


@pytest.mark.parametrize("case", list(HOSTILE_TRACES))
def test_a_hostile_trace_costs_only_itself_on_the_command_line(case, charllm_dirs):
    from pathlib import Path

    run = make_run(charllm_dirs["runs"], [], run_id="traced")
    artifact = Path(__file__).resolve().parents[1] / "data" / "kineto" / "charllm_ppt_run" / "4242_kineto"
    run.traces_dir.mkdir()
    (run.traces_dir / "rank-0.json").write_bytes((artifact / "rank-0.json").read_bytes())
    (run.traces_dir / "rank-1.json").write_text(HOSTILE_TRACES[case]())
    outcome = call(["summarize", "traced", "--kernels"])
    assert not outcome.hung and not outcome.crash and outcome.code == 0, str(outcome)
    damaged = case in ("ts 10**400", "ProfilerStep# and 5,000 digits")
    assert ("note: 1 of 2 traces skipped: trace " in outcome.out) == damaged and "stage 0" in outcome.out


def test_a_gzip_bomb_is_one_line(charllm_dirs, monkeypatch):
    """A few KB of .json.gz holding MiBs of white space: the cap counts decompressed bytes (2 GiB;
    1 MiB here: the 3 GiB case is benchmarks/bench_kernels.py's)."""
    import gzip

    from charllm.probes.analysis import kernels

    monkeypatch.setattr(kernels, "MAX_TRACE_BYTES", 2**20)
    run = make_run(charllm_dirs["runs"], [], run_id="bomb")
    run.traces_dir.mkdir()
    (run.traces_dir / "rank-0.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * 2**22 + b"]}"))
    outcome = call(["summarize", "bomb", "--kernels"])
    assert outcome.code == 2 and outcome.one_clear_line and "once decompressed" in outcome.err, str(outcome)


@pytest.mark.parametrize("iteration", ["x", None, 10**30])
def test_timer_lines_without_a_step_are_one_line(iteration, charllm_dirs):
    from infra_traces import rank_log

    rows = rank_log([0.2, 0.2, 0.6, 0.4])
    for row in rows:
        if row.get("timers"):
            row["iteration"] = iteration
    make_run(charllm_dirs["runs"], [], iterations=rows, run_id="timers")
    for by in ("rank", "stage"):
        outcome = call(["summarize", "timers", "--by", by])
        assert outcome.code == 2 and outcome.one_clear_line and "6 iteration-log lines" in outcome.err, str(outcome)


def test_timers_of_100000_ranks_are_read_in_linear_time(charllm_dirs):
    """Issue 35: still running at 60 s. Ten steps of 100,000 ranks' timers (10 s of CPU is the
    watchdog here: a Python row per (step, rank) took about 20)."""
    from infra_traces import rank_log

    rows = rank_log([0.5] * 100_000, steps=10, nodes=tuple(f"n{i}" for i in range(12_500)), pp=4)
    make_run(charllm_dirs["runs"], [], iterations=rows, run_id="wide")
    outcome = call(["summarize", "wide", "--by", "stage"], timeout=10.0)
    assert not outcome.hung and outcome.code == 0 and "stage 3" in outcome.out, str(outcome)


# Issue 35: a ten-line campaign file of eight axes of ten values is 10^8 members. The cap is
# checked by arithmetic before any member is built; before that, `campaign list` died of
# MemoryError after 29 s, and keeping the file broke the listing.
HUGE_CAMPAIGN = 'experiments = ["tiny-local"]\n[axes]\n' + "".join(
    f"{key} = {[start + step * i for i in range(10)]}\n"
    for key, start, step in (("num_layers", 1, 1), ("hidden_size", 64, 64), ("vocab_size", 1000, 1),
                             ("rotary_base", 1, 1), ("micro_batch_size", 1, 1), ("train_iters", 1, 1),
                             ("seed", 1, 1), ("lr", 0.001, 0.001)))


@pytest.mark.parametrize("action", ["plan", "show", "run"])
def test_a_campaign_of_too_many_members_is_refused_before_any_is_built(action, charllm_dirs):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "huge.toml").write_text(HUGE_CAMPAIGN)
    outcome = call(["campaign", action, "huge"])     # a watchdog: past 2 s of CPU time it counts as a hang
    assert not outcome.hung and not outcome.crash, str(outcome)
    assert outcome.code == 2 and outcome.one_clear_line, str(outcome)
    assert f"campaign 'huge' ({folder / 'huge.toml'}): 100,000,000 members, more than the 10,000" in outcome.err
    assert not charllm_dirs["runs"].exists(), "nothing recorded, nothing started"


def test_keeping_a_campaign_of_too_many_members_costs_only_its_row(charllm_dirs):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "huge.toml").write_text(HUGE_CAMPAIGN)
    outcome = call(["campaign", "list"])
    assert not outcome.hung and not outcome.crash and outcome.code == 0, str(outcome)
    rows = {line.split()[0]: line for line in outcome.out.splitlines() if line.strip()}
    assert "100,000,000 members" in " ".join(outcome.out.split())
    assert rows["huge"].split()[1] == "-" and rows["tiny-local"].split()[1] == "6", outcome.out


# Issue 35: every path a campaign record names stays inside the runs directory, by real path.
# Before: a member's run of ../elsewhere/RUN was reconciled (its manifest rewritten, the process it
# names killed), and `campaign delete` followed a linked .campaigns and deleted where it pointed.
CAMPAIGN_COMMANDS = [["list"], ["status", "tiny-local"], ["summary", "tiny-local"], ["cancel", "tiny-local"],
                     ["report", "tiny-local", "--figure", "microbatch"], ["run", "tiny-local", "--resume"],
                     ["delete", "tiny-local"]]


@pytest.mark.parametrize("argv", CAMPAIGN_COMMANDS, ids=lambda argv: argv[0])
def test_a_member_run_out_of_the_runs_dir_is_named_and_never_acted_on(argv, charllm_dirs, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    with forged_run(elsewhere / "RUN") as victim:
        plant_record(charllm_dirs["runs"], "tiny-local", [{"status": "running", "run": "../elsewhere/RUN"}])
        before = tree(elsewhere)
        outcome = call(["campaign", *argv])
        assert not outcome.hung and not outcome.crash, str(outcome)
        if argv[0] == "list":
            row = next(line for line in outcome.out.splitlines() if line.split()[0] == "tiny-local")
            assert outcome.code == 0 and row.split()[2] == "damaged:", outcome.out
        elif argv[0] == "delete":     # a damaged record is deleted, and nothing but its folder
            assert outcome.code == 0 and not (charllm_dirs["runs"] / ".campaigns" / "tiny-local").exists()
        else:
            assert outcome.code == 2 and outcome.one_clear_line, str(outcome)
            assert "member 0 names run '../elsewhere/RUN', not a run of the runs directory" in outcome.err
        assert tree(elsewhere) == before, "nothing outside the runs directory was written"
        assert victim.poll() is None, "the process it names lives"


@pytest.mark.parametrize("argv", [a for a in CAMPAIGN_COMMANDS if a[0] != "run"], ids=lambda argv: argv[0])
def test_a_member_run_linked_out_of_the_runs_dir_is_missing_and_never_acted_on(argv, charllm_dirs, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    with forged_run(elsewhere / "RUN") as victim:
        charllm_dirs["runs"].mkdir()
        (charllm_dirs["runs"] / "20260101-000000-linked").symlink_to(elsewhere / "RUN")
        plant_record(charllm_dirs["runs"], "tiny-local", [{"status": "running", "run": "20260101-000000-linked"}])
        before = tree(elsewhere)
        outcome = call(["campaign", *argv])
        assert not outcome.hung and not outcome.crash, str(outcome)
        assert outcome.code in (0, 2) and (outcome.code == 0 or outcome.one_clear_line), str(outcome)
        assert tree(elsewhere) == before, "nothing outside the runs directory was written"
        assert victim.poll() is None, "the process it names lives"
    if argv[0] == "status":
        assert "missing" in outcome.out and "1 missing" in outcome.out, outcome.out


@pytest.mark.parametrize("argv", CAMPAIGN_COMMANDS, ids=lambda argv: argv[0])
def test_a_linked_campaigns_folder_is_refused_never_followed(argv, charllm_dirs, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    plant_record(None, "tiny-local", [{"status": "completed"}], status="completed", folder=elsewhere / "tiny-local")
    charllm_dirs["runs"].mkdir()
    (charllm_dirs["runs"] / ".campaigns").symlink_to(elsewhere)
    before = tree(elsewhere)
    outcome = call(["campaign", *argv])
    assert not outcome.hung and not outcome.crash, str(outcome)
    assert outcome.code == 2 and outcome.one_clear_line, str(outcome)
    assert f"{charllm_dirs['runs'] / '.campaigns'}: a symbolic link" in outcome.err
    assert tree(elsewhere) == before, "nothing it points to was read as a record, written or deleted"
    if argv[0] == "list":
        assert "tiny-local" in outcome.out and "ppt-h100" in outcome.out, "the campaign files are still listed"


def test_a_linked_campaign_record_folder_is_refused_never_followed(charllm_dirs, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    plant_record(None, "tiny-local", [{"status": "completed"}], status="completed", folder=elsewhere)
    (charllm_dirs["runs"] / ".campaigns").mkdir(parents=True)
    (charllm_dirs["runs"] / ".campaigns" / "tiny-local").symlink_to(elsewhere)
    before = tree(elsewhere)
    for argv in CAMPAIGN_COMMANDS[1:]:
        outcome = call(["campaign", *argv])
        assert outcome.code == 2 and outcome.one_clear_line and "a symbolic link" in outcome.err, str(outcome)
    assert tree(elsewhere) == before


def test_a_campaign_file_given_by_path_never_shares_the_record_of_the_campaign_it_copies(charllm_dirs, tmp_path):
    from charllm.engine.campaign.spec import Campaign, campaigns

    shipped = campaigns()["tiny-local"]
    copy = tmp_path / "mine" / "tiny-local.toml"
    copy.parent.mkdir()
    copy.write_text(shipped.read_text())
    plant_record(charllm_dirs["runs"], "tiny-local", [{"status": "completed"}], status="completed")
    name = Campaign.load(copy).name
    assert name.startswith("tiny-local-")
    assert Campaign.load(tmp_path / "mine" / ".." / "mine" / "tiny-local.toml").name == name, "keyed by its real path"
    assert Campaign.load(shipped).name == "tiny-local", "the catalog's own file is that campaign"
    for argv in (["status", str(copy)], ["run", str(copy), "--resume"]):
        outcome = call(["campaign", *argv])
        assert outcome.code == 2 and outcome.one_clear_line and f"campaign {name!r} has not run" in outcome.err, \
            str(outcome)
    outcome = call(["campaign", "status", str(shipped)])
    assert outcome.code == 0 and "tiny-local: 1 member (1 completed)" in outcome.out, str(outcome)


def test_a_varied_value_or_description_is_shown_on_one_line_as_written(charllm_dirs):
    folder = charllm_dirs["config"] / "campaigns"
    folder.mkdir(parents=True)
    (folder / "odd.toml").write_text('experiments = ["tiny-local"]\ndescription = "[/] x"\n[axes]\n'
                                     '"model.description" = ["a\\nb [/]", "[bold]c"]\n')
    outcome = call(["campaign", "plan", "odd"])
    assert outcome.code == 0 and not outcome.crash, str(outcome)
    rows = [line for line in outcome.out.splitlines() if "model.description=" in line]
    assert len(rows) == 2 and "model.description=a\\nb [/]" in rows[0] and "model.description=[bold]c" in rows[1]
    outcome = call(["campaign", "list"])
    assert outcome.code == 0 and "[/] x" in outcome.out, str(outcome)
    plant_record(charllm_dirs["runs"], "odd", [{"status": "invalid", "verdict": "invalid", "name": "x[/]",
                                                "reason": "description = 'a\\nb [/]': must be one line"}],
                 status="completed")
    for argv in (["status", "odd"], ["summary", "odd"]):
        outcome = call(["campaign", *argv])
        assert outcome.code == 0 and "'a\\nb [/]'" in outcome.out and "x[/]" in outcome.out, str(outcome)
