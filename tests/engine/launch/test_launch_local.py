"""Launching on the local target: real torchrun, the real workload and the real host sampler."""

from __future__ import annotations

import json
import re

import pytest

from charllm.engine.launch.launcher import cancel, launch
from charllm.engine.launch.targets import LOCAL
from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir
from infra_runs import iterations_logged, logs, rank_process, run_processes, wait_final, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.train]   # they launch training (torchrun)


def tiny(iters: int = 5):
    exp = Experiment.load("tiny-local")
    exp.training.train_iters = iters
    return exp


@pytest.mark.timeout(300)
def test_dp2_trains_and_records_iterations_and_host_telemetry():
    result = launch(tiny(20), LOCAL)   # a steady window long enough to summarize
    rd = RunDir(result.run_dir)
    manifest = wait_final(rd)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    assert manifest["target"]["kind"] == "local" and manifest["started_ns"] <= manifest["ended_ns"]
    assert any("torch.distributed.run" in c and "--nproc-per-node=2" in c for c in manifest["commands"])
    assert any(re.search(r"--master-port=\d+ ", c) for c in manifest["commands"])  # picked at launch
    steps = rd.read_iterations()
    steps = steps.filter(steps["event"] == "iteration")
    assert sorted(set(steps["iteration"].to_list())) == list(range(1, 21))
    assert set(steps["rank"].to_list()) == {0, 1}
    telemetry = rd.scan_telemetry().collect()
    host = telemetry.filter(telemetry["device"] == "host")
    assert host.height > 0 and host["cpu_util_pct"].drop_nulls().len() > 0
    # the supervisor writes the final status just before it exits itself
    wait_for(lambda: run_processes(str(rd.path)) == [], 15, "every process of the run to exit")
    # ... after keeping the run's summaries, so that lists and compares need not read its telemetry
    from charllm.probes.analysis.summary import cached_summary

    assert (
        cached_summary(rd, "steady", by="run") is not None
        and (rd.path / "summaries" / "per-iteration.parquet").is_file()
    )
    check_cli_on_finished_run(rd)


def check_cli_on_finished_run(rd: RunDir):
    """`runs list/show/logs/delete` on a real finished run (the CLI prints, exits 0)."""
    import contextlib
    import io

    from charllm.tui.cli import main

    for argv, expected in ((["runs", "list"], rd.id), (["runs", "show", rd.id], "completed"),
                           (["runs", "logs", rd.id], "==> train-"), (["runs", "logs", rd.id, "-f"], "iter     5")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0
        assert expected in out.getvalue(), (argv, out.getvalue())
    assert main(["runs", "delete", rd.id]) == 0 and not rd.path.exists()


def test_refused_layout_leaves_no_run_directory(charllm_dirs):
    exp = tiny()
    exp.parallel.tensor_model_parallel_size = 3  # does not divide the 2 processes
    with pytest.raises(UserError, match="multiple of tensor"):
        launch(exp, LOCAL)
    exp = tiny()
    exp.hardware.usable_bytes = 1 << 20  # 1 MiB: nothing fits
    with pytest.raises(UserError, match="--force"):
        launch(exp, LOCAL)
    assert not charllm_dirs["runs"].exists() or not any(charllm_dirs["runs"].iterdir())


@pytest.mark.timeout(120)
def test_force_launches_a_refused_layout_and_records_why():
    exp = tiny(100_000)
    exp.hardware.usable_bytes = 1 << 20
    rd = RunDir(launch(exp, LOCAL, force=True).run_dir)
    forced = rd.read_manifest()["forced"]
    assert forced and forced[0].startswith("memory: peak")
    assert cancel(rd) == "cancelled"  # right after launch: nothing may be left starting up
    wait_for(lambda: run_processes(str(rd.path)) == [], 15, "every process to exit")


def test_cli_dry_run_prints_commands_and_touches_nothing(charllm_dirs, capsys):
    from charllm.tui.cli import main

    assert main(["launch", "tiny-local", "--target", "local", "--dry-run", "--nproc", "1",
                 "--set", "global_batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node=1" in out and "dry run" in out
    assert not charllm_dirs["runs"].exists()
    assert main(["launch", "tiny-local", "--target", "nowhere"]) == 2
    assert "charllm-tui: error: --target 'nowhere'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["local", "ssh", "slurm"])
def test_the_rendezvous_port_is_picked_at_launch_and_a_dry_run_says_so(kind, tmp_path):
    """A dry run and the launch after it are two plans: a port shown in the first would not be
    the one the second uses, so a dry run shows PORT and the launch a number."""
    from charllm.engine.launch.launcher import PORT_AT_LAUNCH, display_commands, plan
    from charllm.engine.launch.targets import parse_target

    target = LOCAL if kind == "local" else parse_target("t", {"kind": kind, "hosts": ["n1"]} if kind == "ssh"
                                                         else {"kind": kind})
    exp = tiny()
    dry, dry_script = plan(exp, target, tmp_path / "run", dry_run=True)
    real, real_script = plan(exp, target, tmp_path / "run")
    train = [" ".join(s.argv) for s in dry if s.role == "train"]
    assert train and all(f"--master-port={PORT_AT_LAUNCH} " in c for c in train)
    assert all(re.search(r"--master-port=\d+ ", " ".join(s.argv)) for s in real if s.role == "train")
    if kind == "slurm":
        assert f"--master-port={PORT_AT_LAUNCH}" in dry_script and re.search(r"--master-port=\d+", real_script)
    assert f"--master-port={PORT_AT_LAUNCH}" in "\n".join(display_commands(dry, target))


def test_cli_dry_run_names_the_port_it_leaves_to_the_launch(capsys):
    from charllm.tui.cli import main

    assert main(["launch", "tiny-local", "--target", "local", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--master-port=PORT " in out and "PORT: torchrun's rendezvous port, picked at launch" in out


def test_dry_run_prints_commands_and_touches_nothing(charllm_dirs):
    result = launch(tiny(), LOCAL, dry_run=True)
    assert result.run_dir is None and result.dry_run
    assert any("charllm.engine.workload.train" in c for c in result.commands)
    assert any("charllm.probes" in c and "--backend host" in c for c in result.commands)
    assert not charllm_dirs["runs"].exists()


@pytest.mark.timeout(300)
def test_cancel_stops_every_process_and_records_cancelled():
    rd = RunDir(launch(tiny(100_000), LOCAL).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 240, "the first iteration")
    assert run_processes(str(rd.path))
    assert cancel(rd) == "cancelled"
    manifest = rd.read_manifest()
    assert manifest["status"] == "cancelled" and manifest["ended_ns"]
    wait_for(lambda: run_processes(str(rd.path)) == [], 10, "every process to exit")
    with pytest.raises(UserError, match="already cancelled"):
        cancel(rd)


@pytest.mark.timeout(300)
def test_killed_rank_fails_the_run_naming_node_and_rank():
    rd = RunDir(launch(tiny(100_000), LOCAL).run_dir)
    wait_for(lambda: iterations_logged(rd) >= 1, 240, "the first iteration")
    rank_process(str(rd.path), 1).kill()
    manifest = wait_final(rd, 120)
    assert manifest["status"] == "failed"
    node = manifest["nodes"][0]
    assert f"node {node}, rank 1" in manifest["failure"] and "SIGKILL" in manifest["failure"]
    wait_for(lambda: run_processes(str(rd.path)) == [], 15, "the other rank and the sampler to stop")
    assert rd.experiment_path.is_file() and rd.iterations_path.is_file() and rd.telemetry_files()


def test_stopping_steps_skips_one_a_cancel_kept_from_starting(tmp_path):
    """A cancel between the samplers' start and torchrun's: the supervisor stops what started and
    records "cancelled" (it once died on the step that never started and recorded "failed")."""
    import sys

    from charllm.engine.launch.process import Proc
    from charllm.engine.launch.supervise import stop
    from charllm.engine.launch.target import Step

    rd = RunDir(tmp_path / "run")
    rd.logs_dir.mkdir(parents=True)
    started = Proc(rd, LOCAL, Step("n0", "sampler", [sys.executable, "-c", "import time; time.sleep(60)"]))
    started.start()
    never = Proc(rd, LOCAL, Step("n0", "train", ["true"]))
    stop([started, never], grace=5)
    assert started.poll() is not None and never.popen is None


@pytest.mark.timeout(400)
def test_pp2_profile_window_kernel_time_per_stage_and_a_slowed_rank_named(monkeypatch, capsys):
    """A PP2 run with a profiler window (step 3) and rank 1 slowed on purpose (the workload's test-only
    hook): a trace per stage, said and accounted for in the manifest; their categories add up to
    each trace's busy time; every rank's step timers are in the run, and rank 1 is the straggler."""
    from charllm.engine.model.profiling import plan as profile_plan
    from charllm.probes.analysis.kernels import CATEGORIES, kernel_summary, run_traces
    from charllm.probes.analysis.ranks import rank_summary
    from charllm.tui.cli import main
    from infra_traces import check_sums_to_busy

    monkeypatch.setenv("CHARLLM_TEST_ONLY_SLOW_RANK", "1:0.05")   # 50 ms in each of its 4 micro-batches
    exp = tiny(6).apply(["pipeline_model_parallel_size=2", "warmup_iters=1", "profile_steps=[3]"])
    result = launch(exp, LOCAL)
    assert result.profile.startswith("profiler: 1 step (3) on the first rank of each pipeline stage (ranks 0, 1)")
    rd = RunDir(result.run_dir)
    manifest = wait_final(rd)
    assert manifest["status"] == "completed", (manifest.get("failure"), logs(rd))
    # the traces: one per stage, named as the plan said, each logged with its size
    files = run_traces(rd)
    assert [f.name for f in files] == [f"rank{r:05d}-step000003.pt.trace.json" for r in profile_plan(exp).ranks]
    assert all(json.loads(f.read_text())["traceName"] == str(f) for f in files), "named as kept, not as written"
    profile = manifest["profile"]
    assert profile["steps"] == [3] and profile["ranks"] == [0, 1] and profile["traces"] == 2
    assert profile["bytes"] == sum(f.stat().st_size for f in files) and profile["cost"] == result.profile
    assert profile["profiled_step_s"] > 0 and profile["other_step_s"] > 0 and profile["slowdown"] > 0
    steps = rd.read_steps()
    assert steps.filter(steps["profiled"])["iteration"].to_list() == [3]
    check_sums_to_busy(files)
    by_stage = kernel_summary(rd, "stage")
    assert by_stage["pp_rank"].to_list() == [0, 1] and set(by_stage["source"]) == {"host"}
    for row in by_stage.iter_rows(named=True):
        assert sum(row[f"{c}_s"] for c in CATEGORIES) == pytest.approx(row["busy_s"], rel=0.01)
        assert row["matmul_s"] > 0 and row["attention_s"] > 0 and row["norm_s"] > 0 and row["optimizer_s"] > 0
        assert row["SendRecv_kernel_s"] > 0      # the pipeline's gloo sends and receives
    # every rank's timers, and the slowed rank named, the other not
    timed = rd.rank_steps()
    assert sorted(set(timed["rank"])) == [0, 1] and timed.height == 2 * 6
    assert timed["compute_s"].null_count() == 0 and (timed["compute_s"] <= timed["forward_backward_s"]).all()
    ranks = rank_summary(rd)
    assert ranks.filter(ranks["straggler"])["rank"].to_list() == [1], ranks
    assert main(["summarize", rd.id, "--by", "rank"]) == 0
    out = capsys.readouterr().out
    assert "stragglers: rank 1 (node " in out and "stage 1): compute" in out and "rank 0 (" not in out.split("\n")[0]
    assert main(["summarize", rd.id, "--kernels"]) == 0
    out = capsys.readouterr().out
    assert "host ops: a CPU run; 2 traces" in out and "stage 0" in out and "stage 1" in out and "SendRecv" in out
    assert main(["runs", "show", rd.id]) == 0
    out = capsys.readouterr().out
    assert f"profiler  {result.profile}" in out and "2 traces written" in out
