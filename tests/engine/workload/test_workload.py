"""The Megatron-Core workload, trained for real on CPU through torchrun (gloo + cpu_compat).

Each test starts real rank processes; two cores are shared, so keep iteration counts small.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest

from charllm.engine.model import runtime
from charllm.engine.model.experiment import Experiment
from charllm.engine.workload import CANCELLED_EXIT, model_builder, timers
from charllm.probes.store.schema import COMMAND_FIELDS, ITERATION_FIELDS, RANK_TIMERS
from infra_runs import finish, start

pytestmark = [pytest.mark.integration, pytest.mark.train]

TRAIN_MODULE = "charllm.engine.workload.train"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def make_run(tmp_path: Path, preset: str, *assignments: str) -> Path:
    exp = Experiment.load(preset).apply(list(assignments))
    run_dir = tmp_path / "run"
    exp.save(run_dir / "experiment.toml")
    return run_dir


def torchrun_cmd(run_dir: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", TRAIN_MODULE, "--run-dir", str(run_dir)]


def train(run_dir: Path, nproc: int, timeout: float = 240) -> tuple[str, str]:
    rc, out, err = finish(start(torchrun_cmd(run_dir, nproc)), timeout)
    assert rc == 0, f"torchrun exited {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    return out, err


def read_log(run_dir: Path) -> list[dict]:
    path = run_dir / "iterations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_iterations(run_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["event"] == "iteration" for r in read_log(run_dir)) >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before {count} iterations: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no {count} iterations within {timeout} s")


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The rank processes torchrun started."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        parents = {}
        for kid in psutil.Process(proc.pid).children(recursive=True):
            try:
                if TRAIN_MODULE in " ".join(kid.cmdline()):
                    parents[kid] = kid.ppid()
            except psutil.Error:        # ended meanwhile
                pass
        # a process a rank forks (torch.compile's workers) inherits its command line and may end any time:
        # the ranks are the matching processes whose parent is not one of them
        ranks = [kid for kid, parent in parents.items() if parent not in {k.pid for k in parents}]
        if ranks:
            return ranks
        time.sleep(0.2)
    pytest.fail("torchrun started no rank process")


def assert_all_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def check_log(run_dir: Path, world: int, iters: int, *, loss_falls: bool = True) -> list[dict]:
    """The iteration log of a completed run: schema, ranks, warm-up marks, a falling loss."""
    exp = Experiment.load(run_dir / "experiment.toml")
    records = read_log(run_dir)
    writers = sorted({0, world - 1})
    starts = [r for r in records if r["event"] == "start"]
    assert sorted(r["rank"] for r in starts) == writers
    assert all(r["world_size"] == world for r in starts)
    assert starts[0]["layout"]["tensor_model_parallel_size"] == exp.parallel.tensor_model_parallel_size
    # What ran, as engine.model.runtime resolved it on this (CPU) node, with the versions behind it.
    ran = starts[0]["runtime"]
    pp = exp.parallel.pipeline_model_parallel_size
    assert ran["implementation"] == runtime.resolve(exp, runtime.detect()).to_dict()
    assert ran["stack"]["cuda"] is False and ran["implementation"]["fusions"] == []
    assert ran["versions"]["torch"] and ran["versions"]["megatron_core"] == metadata.version("megatron-core")
    # Which megatron-core class built the model: HybridModel, two layers per GPT layer, where this
    # megatron-core prefers it.
    model = ran["model"]
    if model_builder.hybrid_preferred():
        assert model["class"] == "HybridModel"
        layers = model["hybrid_layer_pattern"].replace("|", "")
        assert len(layers) == 2 * exp.model.num_layers and set(layers[::2]) == {"*"}
        assert model["hybrid_layer_pattern"].count("|") == pp * exp.virtual_stages - 1
    else:
        assert model["class"] == "GPTModel" and model["hybrid_layer_pattern"] is None
    # Megatron-LM's seeds: each pipeline stage its own.
    for r in starts:
        assert r["seed"] == exp.training.seed + 100 * (r["rank"] * pp // world)
    steps = [r for r in records if r["event"] == "iteration"]
    for r in steps:
        workload_fields = set(ITERATION_FIELDS) - set(COMMAND_FIELDS)
        assert set(r) == workload_fields, set(r) ^ workload_fields
        for name, kind in ITERATION_FIELDS.items():
            if r.get(name) is not None:
                assert isinstance(r[name], (int, float) if kind is float else kind), (name, r[name])
        assert r["end_ns"] > r["start_ns"]
        assert r["samples"] == exp.training.global_batch_size
        assert r["tokens"] == exp.training.global_batch_size * exp.seq_length
        assert r["mem_peak_bytes"] > 100 * 2**20          # RSS with torch + megatron loaded
        assert r["mem_reserved_bytes"] is None            # no caching allocator on CPU
        assert r["tflops_per_gpu"] > 0 and r["grad_norm"] > 0
        assert r["warmup"] == (r["iteration"] <= exp.training.warmup_iters)
    for rank in writers:
        assert [r["iteration"] for r in steps if r["rank"] == rank] == list(range(1, iters + 1))
    # Every rank's step timers, on rank 0's lines; every rank's place, in rank 0's start record.
    assert RANK_TIMERS == (*timers.FIELDS, "step_s")
    places = next(r["ranks"] for r in starts if r["rank"] == 0)
    assert [p["rank"] for p in places] == list(range(world))
    assert [p["pp_rank"] for p in places] == [r * pp // world for r in range(world)]
    for r in steps:
        assert r["profiled"] is False
        if r["rank"] != 0:
            assert r["timers"] is None
            continue
        assert set(r["timers"]) == set(RANK_TIMERS) and all(len(v) == world for v in r["timers"].values())
        for rank in range(world):
            got = {name: r["timers"][name][rank] for name in RANK_TIMERS}
            assert all(isinstance(v, float) and v >= 0 for v in got.values()), got
            assert got["compute_s"] + got["pipeline_wait_s"] <= got["forward_backward_s"] * 1.01 + 1e-3, got
            assert got["forward_backward_s"] <= got["step_s"] and got["compute_s"] > 0
    last = [r["loss"] for r in steps if r["rank"] == world - 1]
    assert all(isinstance(x, float) for x in last)
    if loss_falls:
        assert sum(last[-3:]) / 3 < last[0], f"loss did not fall: {last}"
    ends = [r for r in records if r["event"] == "end"]
    assert sorted(r["rank"] for r in ends) == writers and {r["status"] for r in ends} == {"completed"}
    # Every stage's peak, gathered from all ranks (not only the two that write the log).
    assert [s["pp_rank"] for s in ends[0]["memory"]] == list(range(pp))
    assert all(s["allocated_bytes"] > 100 * 2**20 for s in ends[0]["memory"])
    return records


# --------------------------------------------------------------------------------------------
# layouts that train
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset, assignments", [
    ("tiny-tp2", []),
    ("tiny-pp2", []),
    ("tiny-local", ["use_distributed_optimizer=true", "overlap_grad_reduce=true"]),   # DP2
    ("tiny-moe-ep2", ["moe_aux_loss_coeff=0.01"]),                                    # EP2, alltoall
], ids=["tp2", "pp2", "dp2-distopt", "moe-ep2-alltoall"])
def test_layout_trains_and_logs(tmp_path, preset, assignments):
    run_dir = make_run(tmp_path, preset, "train_iters=12", *assignments)
    out, _ = train(run_dir, nproc=2)
    check_log(run_dir, world=2, iters=12)
    progress = [line for line in out.splitlines() if line.startswith("iter ")]
    assert len(progress) == 12 and progress[-1].startswith("iter 12/12 loss ")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("assignments", [
    ["pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2"],        # interleaved 1F1B
    ["tensor_model_parallel_size=2", "normalization=RMSNorm", "swiglu=true",
     "position_embedding_type=rope", "untie_embeddings_and_output_weights=true", "num_query_groups=2",
     "recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=1", "bf16=true"],
    # torch's deterministic algorithms on, as Megatron-LM's --deterministic-mode sets them (an op without a
    # deterministic implementation raises)
    ["tensor_model_parallel_size=2", "deterministic_mode=true"],
], ids=["pp2-vp2", "tp2-llama-like-recompute-bf16", "tp2-deterministic"])
def test_more_layouts_train(tmp_path, assignments):
    run_dir = make_run(tmp_path, "tiny-local", "train_iters=8", *assignments)
    train(run_dir, nproc=2)
    check_log(run_dir, world=2, iters=8)


def trajectory(run_dir: Path, nproc: int = 1) -> tuple[list, list]:
    """Train, then (loss, grad norm) per iteration as the last rank logged them."""
    train(run_dir, nproc=nproc)
    steps = [r for r in read_log(run_dir) if r["event"] == "iteration" and r["rank"] == nproc - 1]
    return [r["loss"] for r in steps], [r["grad_norm"] for r in steps]


@pytest.mark.timeout(300)
def test_sdpa_attention_trains_like_megatrons_own(tmp_path):
    """The local path's SDPA core attention (engine/workload/attention.py) against megatron-core's
    DotProductAttention, the same GQA model under TP2 in fp32: the same losses and gradients."""
    common = ("tensor_model_parallel_size=2", "num_query_groups=2", "train_iters=4")
    sdpa = make_run(tmp_path / "sdpa", "tiny-tp2", *common)
    unfused = make_run(tmp_path / "unfused", "tiny-tp2", *common, "attention_backend=unfused")
    sdpa_loss, sdpa_norm = trajectory(sdpa, 2)
    ref_loss, ref_norm = trajectory(unfused, 2)
    ran = {r["runtime"]["implementation"]["attention"] for d in (sdpa, unfused)
           for r in read_log(d) if r["event"] == "start"}
    assert ran == {"sdpa", "megatron-unfused"}
    assert sdpa_loss == pytest.approx(ref_loss, rel=1e-5)
    assert sdpa_norm == pytest.approx(ref_norm, rel=1e-4)


FORCED_CLASS = '''
import sys
from charllm.engine.workload import model_builder, train

name = sys.argv.pop()
model_builder.choose = lambda exp: model_builder.ModelBuilder(name, "chosen by the test")
raise SystemExit(train.main(sys.argv[1:]))
'''


@pytest.mark.timeout(300)
@pytest.mark.skipif(not model_builder.hybrid_preferred(),
                    reason="the installed megatron-core does not prefer HybridModel (or none is installed)")
def test_hybrid_model_trains_exactly_as_gpt_model(tmp_path):
    """The same experiment built as GPTModel and as HybridModel (pipeline chunks as "|", dense and
    MoE layers as "-" and "E"): the same initial weights, so the same losses and gradient norms."""
    script = tmp_path / "forced_class.py"
    script.write_text(FORCED_CLASS)
    runs = {}
    for name in ("GPTModel", "HybridModel"):
        run_dir = make_run(tmp_path / name, "tiny-pp2", "model=tiny-moe", "moe_layer_freq=[0,1,1,1]", "train_iters=4")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
               "--run-dir", str(run_dir), name]
        rc, out, err = finish(start(cmd), timeout=240)
        assert rc == 0, err[-3000:]
        steps = [r for r in read_log(run_dir) if r["event"] == "iteration" and r["rank"] == 1]
        runs[name] = [(r["loss"], r["grad_norm"]) for r in steps]
        start_record = next(r for r in read_log(run_dir) if r["event"] == "start")
        assert start_record["runtime"]["model"]["class"] == name
    assert len(runs["GPTModel"]) == 4 and runs["HybridModel"] == runs["GPTModel"]


@pytest.mark.timeout(300)
def test_fp16_scales_the_loss_so_its_gradients_match_fp32(tmp_path):
    """fp16 needs the optimizer's loss scale applied in the backward (config.grad_scale_func, as
    Megatron-LM sets it); without it, unscaling divides every gradient by the scale (64 here)."""
    fp32_loss, fp32_norm = trajectory(make_run(tmp_path / "fp32", "tiny-local", "gpus_per_node=1", "train_iters=3"))
    for name, scale in (("static", "loss_scale=64.0"), ("dynamic", "initial_loss_scale=256.0")):
        loss, norm = trajectory(make_run(tmp_path / name, "tiny-local", "gpus_per_node=1", "train_iters=3",
                                         "fp16=true", scale))
        assert norm == pytest.approx(fp32_norm, rel=1e-2), name
        assert loss == pytest.approx(fp32_loss, rel=1e-3), name


@pytest.mark.timeout(300)
def test_indexed_dataset(tmp_path):
    """A tiny Megatron indexed dataset built with megatron's own IndexedDatasetBuilder."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "corpus"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(40):
        doc = rng.integers(0, 1000, size=int(rng.integers(20, 90)), dtype=np.int32)
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")

    run_dir = make_run(tmp_path, "tiny-local", "gpus_per_node=1", "train_iters=2", f"data_path={prefix}")
    train(run_dir, nproc=1)
    check_log(run_dir, world=1, iters=2, loss_falls=False)


# --------------------------------------------------------------------------------------------
# cancel and failure
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_group_cancels_cleanly(tmp_path):
    run_dir = make_run(tmp_path, "tiny-tp2", "train_iters=500")
    proc = start(torchrun_cmd(run_dir, 2))
    ranks = workers_of(proc)
    wait_for_iterations(run_dir, 4, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    finish(proc, timeout=120)
    assert_all_gone(ranks)
    records = read_log(run_dir)
    ends = [r for r in records if r["event"] == "end"]
    assert sorted(r["rank"] for r in ends) == [0, 1]
    assert {r["status"] for r in ends} == {"cancelled"}
    done = max(r["iteration"] for r in records if r["event"] == "iteration")
    assert done < 500 and all(r["iteration"] == done for r in ends)   # every rank stopped at one step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_stops_every_rank_with_cancelled_exit(tmp_path):
    """Ranks started as a launcher would without torchrun, so their exit codes are visible here."""
    run_dir = make_run(tmp_path, "tiny-pp2", "train_iters=500")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "CHARLLM_NODE": "node-a"}
    cmd = [sys.executable, "-m", TRAIN_MODULE, "--run-dir", str(run_dir)]
    procs = [start(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        wait_for_iterations(run_dir, 4, procs[0])
        procs[1].send_signal(signal.SIGTERM)            # only one rank hears it
        codes = [finish(p, timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes == [CANCELLED_EXIT, CANCELLED_EXIT]
    records = read_log(run_dir)
    assert {r["status"] for r in records if r["event"] == "end"} == {"cancelled"}
    assert {r["node"] for r in records} == {"node-a"}                # the launcher's name for the node


@pytest.mark.timeout(300)
def test_killed_rank_fails_the_run_and_stops_the_others(tmp_path):
    run_dir = make_run(tmp_path, "tiny-tp2", "train_iters=500")
    proc = start(torchrun_cmd(run_dir, 2))
    ranks = workers_of(proc)
    wait_for_iterations(run_dir, 3, proc)
    ranks[-1].kill()                                     # kill -9 one rank
    rc, _, err = finish(proc, timeout=180)
    assert rc != 0
    assert_all_gone(ranks)
    records = read_log(run_dir)                          # still one whole JSON object per line
    assert not any(r["event"] == "end" and r["status"] == "completed" for r in records)


@pytest.mark.timeout(200)
def test_exception_in_a_rank_is_failed_with_traceback_and_exit_1(tmp_path):
    prefix = tmp_path / "broken"
    Path(f"{prefix}.bin").write_bytes(b"\0" * 64)
    Path(f"{prefix}.idx").write_bytes(b"not an index")
    run_dir = make_run(tmp_path, "tiny-local", "gpus_per_node=1", f"data_path={prefix}")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-m", TRAIN_MODULE, "--run-dir", str(run_dir)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert [r["status"] for r in read_log(run_dir) if r["event"] == "end"] == ["failed"]


# --------------------------------------------------------------------------------------------
# refused before any collective: one line, exit 2
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("assignments, message", [
    (["context_parallel_size=2"], "context_parallel_size = 2: context parallelism needs Transformer Engine on a "
                                  "CUDA GPU, and this node has no CUDA"),
    (["training.fp8='e4m3'", "hardware.fp8=true"], "fp8 = 'e4m3': FP8 needs Transformer Engine on a CUDA GPU"),
    (["tensor_model_parallel_size=2", "sequence_parallel=true"],
     "sequence_parallel = True: sequence parallelism needs Transformer Engine on a CUDA GPU"),
    (["transformer_impl=transformer_engine"], "transformer_impl = 'transformer_engine': needs Transformer Engine"),
    (["num_layers=3", "pipeline_model_parallel_size=2"], "num_layers = 3: must be divisible by pipeline"),
    (["gpus_per_node=4"], "cluster: the experiment needs 4 processes"),
    (["num_moe_experts=4", "moe_grouped_gemm=true", "bf16=true"],
     "moe_grouped_gemm = True: the grouped GEMM needs Transformer Engine"),
    (["cuda_graph_impl=local"], "cuda_graph_impl = 'local': CUDA graphs are not supported by the training workload"),
], ids=["cp2-without-te", "fp8-without-cuda", "sp-without-te", "te-without-te", "invalid-layout",
        "world-size-mismatch", "grouped-gemm-without-te", "cuda-graphs"])
def test_unsupported_experiment_is_one_line(tmp_path, assignments, message):
    run_dir = make_run(tmp_path, "tiny-local", *assignments)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-m", TRAIN_MODULE, "--run-dir", str(run_dir)], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"charllm-tui: error: {message}"), out.stderr
    assert [r["status"] for r in read_log(run_dir) if r["event"] == "end"] == ["failed"]


# --------------------------------------------------------------------------------------------
# the log writer
# --------------------------------------------------------------------------------------------
def test_two_writers_never_interleave_within_a_line(tmp_path):
    from charllm.engine.workload.train import IterationLog

    path = tmp_path / "iterations.jsonl"
    logs = [IterationLog(path, rank, "n1") for rank in (0, 1)]
    for i in range(200):
        for log in logs:
            log.write("iteration", iteration=i, pad="x" * 5000)
    for log in logs:
        log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 400 and {r["rank"] for r in records} == {0, 1}


# --------------------------------------------------------------------------------------------
# How a rank is set up, as Megatron-LM sets it up (checked inside two real ranks)
# --------------------------------------------------------------------------------------------
SETUP_CHECK = '''
import os, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import torch
from charllm.engine.model import runtime
from charllm.engine.model.experiment import Experiment
from charllm.engine.workload import cpu_compat, train
from megatron.core import parallel_state as ps

exp = Experiment.load(Path(sys.argv[1]))
stack = runtime.detect()
cpu_compat.apply()
train.define_te_general_gemm()
trainer = train.Trainer(exp, runtime.resolve(exp, stack), cuda=False, local_rank=int(os.environ["LOCAL_RANK"]))
pp = ps.get_pipeline_model_parallel_rank()
# Megatron-LM's _set_random_seed: seed + 100 x the pipeline rank.
assert torch.initial_seed() == exp.training.seed + 100 * pp == trainer.seed, torch.initial_seed()
# No gloo copies of the process groups: the workload saves no distributed-optimizer checkpoint.
for getter in (ps.get_data_parallel_group_gloo, ps.get_expert_data_parallel_group_gloo):
    try:
        getter()
    except AssertionError:
        pass
    else:
        raise SystemExit(f"{getter.__name__}: a gloo group was created")
# Every parameter of every chunk on the (virtual) device, as megatron's optimizer requires.
params = [p for chunk in trainer.model for p in chunk.parameters()]
# Each chunk (under DDP, and Float16Module for bf16/fp16) is the class model_builder chose.
assert {type(chunk.module).__name__ for chunk in trainer.model} == {trainer.builder.name}
assert params and all(p.type().startswith("torch.cuda.") for p in params), {p.type() for p in params}
config = trainer.model[0].config
# Without TE or Apex: Adam fused, the gradient norm on the device (train.use_torch_fast_paths).
from megatron.core.optimizer import clip_grads
assert clip_grads.l2_norm_impl is train.device_l2_norm
assert all(group["fused"] for inner in trainer.optimizer.chained_optimizers for group in inner.optimizer.param_groups)
# Megatron-LM's NaN checks of the loss and gradients, on by default, stop the run at once.
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
assert get_rerun_state_machine().mode == RerunMode.DISABLED
assert all(chunk.ddp_config.check_for_nan_in_grad for chunk in trainer.model)
assert config.grad_scale_func == trainer.optimizer.scale_loss                # fp16 loss scaling
assert config.overlap_p2p_comm and not config.batch_p2p_comm                # the interleaved schedule
assert config.no_sync_func is None                                          # no overlapped grad reduce
os.write(1, f"setup ok {torch.distributed.get_rank()}\\n".encode())
# End as the workload's ranks end (train.py's __main__): leave the process groups, then skip the
# interpreter's teardown, where threads torch still runs may abort the process.
train.teardown()
os._exit(0)
'''


@pytest.mark.timeout(200)
def test_ranks_are_set_up_as_megatron_lm_sets_them_up(tmp_path):
    run_dir = make_run(tmp_path, "tiny-pp2", "virtual_pipeline_model_parallel_size=2")
    script = tmp_path / "setup_check.py"
    script.write_text(SETUP_CHECK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(run_dir / "experiment.toml")]
    rc, out, err = finish(start(cmd), timeout=180)
    assert rc == 0, err[-3000:]
    assert sorted(line for line in out.splitlines() if line.startswith("setup ok")) == ["setup ok 0", "setup ok 1"]


# --------------------------------------------------------------------------------------------
# Megatron-LM's NaN checks (--check-for-nan-in-loss-and-grad, on by default)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("assignments, checks", [
    ([], True),
    (["check_for_nan_in_loss_and_grad=false"], False),
    (["bf16=false", "fp16=true"], False),                      # dynamic loss scaling: an Inf is its signal
    (["bf16=false", "fp16=true", "loss_scale=64.0"], True),
])
def test_the_nan_checks_follow_megatron_lm(assignments, checks):
    from charllm.engine.workload import train

    e = Experiment.load("tiny-local").apply(assignments)
    assert train.checks_for_nan(e) is checks
    assert train.ddp_settings(e, 1)["check_for_nan_in_grad"] is checks


def test_a_nan_loss_stops_the_step_with_megatrons_message(monkeypatch):
    import torch
    from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

    from charllm.engine.workload.train import loss_func

    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)   # the message names the device (cpu_compat's answer)
    mask, losses = torch.ones(1, 4), torch.tensor([[1.0, float("nan"), 2.0, 3.0]])
    with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
        loss_func(mask, losses, check_nan=True)
    loss, tokens, _ = loss_func(mask, losses, check_nan=False)        # unchecked, it goes on
    assert torch.isnan(loss) and int(tokens) == 4
