"""The run directory contract: ids, resolution, manifest, deletion rules."""

import json
import re

import pytest

from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import (
    Manifest,
    RunDir,
    check_run_id,
    manifest_problem,
    new_run_id,
    one_per_step,
    resolve_run,
    run_id_name,
)


def _run(root, run_id, status):
    rd = RunDir.create(root / run_id, "launch")
    rd.write_manifest({"id": run_id, "status": status})
    return rd


def test_a_running_run_cannot_be_deleted_a_finished_one_can(charllm_dirs):
    running = _run(charllm_dirs["runs"], "20260101-000000-a", "running")
    with pytest.raises(
        UserError, match=r"run '20260101-000000-a' is running; cancel it first \(charllm-tui runs cancel"
    ):
        running.delete()
    assert running.path.is_dir()
    done = _run(charllm_dirs["runs"], "20260101-000001-b", "completed")
    done.delete()
    assert not done.path.exists()


def test_resolve_by_prefix_suffix_and_ambiguity(tmp_path):
    _run(tmp_path, "20260101-000000-tiny-local", "completed")
    _run(tmp_path, "20260101-000005-tiny-tp2", "failed")
    assert resolve_run("tiny-tp2", root=tmp_path).id == "20260101-000005-tiny-tp2"
    with pytest.raises(UserError, match=r"ambiguous, matches 2 runs"):
        resolve_run("20260101", root=tmp_path)
    with pytest.raises(UserError, match=r"run 'nope': no such run"):
        resolve_run("nope", root=tmp_path)


def test_run_ids_cannot_carry_shell_or_paths():
    for bad in ("../etc", "a b", "x;rm -rf /", "-rf", ".hidden"):
        with pytest.raises(UserError, match="run id"):
            check_run_id(bad)
    assert check_run_id("20260101-000000-tiny.local_2") == "20260101-000000-tiny.local_2"


def test_manifest_updates_are_whole_files(tmp_path):
    rd = _run(tmp_path, "r1", "pending")
    rd.update_manifest(status="running", started_ns=5)
    assert rd.read_manifest() == {"id": "r1", "status": "running", "started_ns": 5}
    assert not list(rd.path.glob(".*.tmp"))


def test_run_ids_are_built_and_taken_apart_in_one_place():
    made = new_run_id("llama 8b / tp2")
    assert re.fullmatch(r"\d{8}-\d{6}-llama-8b-tp2", made), made
    assert run_id_name(made) == "llama-8b-tp2"
    assert run_id_name("20251121-080000-demo-8gpu") == "demo-8gpu"
    for other in ("run-a", "imported", "20251121-demo", "20251121-080000-", "2025x121-080000-a"):
        assert run_id_name(other) is None, other


def test_an_old_manifest_s_top_level_target_fields_read_as_the_target_s_record():
    """Manifests before the target kept its own record kept a Slurm job at the top level
    (slurm_job_id, slurm_state); runs stay for months, so those read as target["run"]."""
    old = {"id": "r", "status": "failed", "target": {"name": "c", "kind": "slurm"}, "slurm_job_id": "42",
           "slurm_state": "TIMEOUT"}
    assert Manifest.from_dict(old).target == {"name": "c", "kind": "slurm", "run": {"job_id": "42", "state": "TIMEOUT"}}
    # what the target wrote itself wins; fields of another kind, empty or not text, are not its record
    both = {**old, "target": {"name": "c", "kind": "slurm", "run": {"job_id": "43"}}, "slurm_state": ""}
    assert Manifest.from_dict(both).target["run"] == {"job_id": "43"}
    assert Manifest.from_dict({**old, "slurm_job_id": 42, "slurm_state": None}).target == old["target"]
    assert Manifest.from_dict({**old, "target": {"name": "s", "kind": "ssh"}}).target == {"name": "s", "kind": "ssh"}
    assert "run" not in old["target"], "the manifest read is not changed"


def test_the_typed_manifest_reads_each_field_and_defaults_what_is_absent(tmp_path):
    rd = RunDir(tmp_path / "20260101-000000-a")
    assert rd.manifest() == Manifest(id="20260101-000000-a", status="unknown")   # none written yet
    rd.path.mkdir()
    rd.write_manifest({"id": rd.id, "kind": "train", "status": "failed", "failure": "rank 3 died",
                       "target": {"name": "lab", "kind": "ssh"}, "world_size": 4, "started_ns": 5,
                       "ended_ns": None, "slurm_state": "written by the supervisor, not modelled"})
    m = rd.manifest()
    assert (m.status, m.failure, m.world_size, m.started_ns, m.ended_ns) == ("failed", "rank 3 died", 4, 5, None)
    assert m.final and m.target_name == "lab" and m.nodes == [] and m.runtime is None
    assert rd.read_manifest()["slurm_state"] == "written by the supervisor, not modelled"  # writers keep it
    probe = Manifest.from_dict({"kind": "probe", "status": "running"})
    assert probe.target_name == "probe" and not probe.final and probe.world_size == 1
    assert Manifest().target_name == "-"   # as `runs list` and the Runs screen write it


@pytest.mark.parametrize("data, problem", [
    ({"world_size": True}, "field 'world_size' is true/false, expected an integer"),
    ({"failure": 3}, "field 'failure' is an integer, expected a string or null"),
    ({"target": "x", "nodes": 3}, "field 'target' is a string, expected an object"),
    ({"runtime": []}, "field 'runtime' is a list, expected an object or null"),
    ({"status": "done"},
     "field 'status' = 'done', expected one of pending, running, completed, failed, cancelled, unknown"),
])
def test_the_typed_manifest_refuses_a_damaged_file_as_one_line(tmp_path, data, problem):
    rd = RunDir(tmp_path / "r")
    rd.path.mkdir()
    rd.manifest_path.write_text(json.dumps(data))
    with pytest.raises(UserError) as caught:
        rd.manifest()
    assert str(caught.value) == f"{rd.manifest_path}: damaged manifest, {problem}"
    assert manifest_problem({"failure": None, "started_ns": None, "world_size": 2}) is None


def test_steps_one_row_per_step_merged_or_first_line(tmp_path):
    rows = [{"event": "start", "rank": 0},
            {"event": "iteration", "iteration": 2, "rank": 0, "start_ns": 20, "end_ns": 29, "warmup": False},
            {"event": "iteration", "iteration": 1, "rank": 0, "start_ns": 10, "end_ns": 18, "warmup": True},
            {"event": "iteration", "iteration": 1, "rank": 1, "start_ns": 11, "end_ns": 19, "loss": 2.5,
             "samples": 8, "tokens": 256},
            {"event": "iteration", "iteration": 3, "rank": 1, "start_ns": 30}]      # no end: left out
    rd = RunDir(tmp_path / "r")
    rd.path.mkdir()
    rd.iterations_path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "iter')
    steps = rd.read_steps()
    assert steps.to_dicts() == [
        {"iteration": 1, "start_ns": 10, "end_ns": 19, "samples": 8, "tokens": 256, "tflops_per_gpu": None,
         "warmup": True, "profiled": False},
        {"iteration": 2, "start_ns": 20, "end_ns": 29, "samples": None, "tokens": None, "tflops_per_gpu": None,
         "warmup": False, "profiled": False}]
    first = one_per_step([r for r in rows if r["event"] == "iteration"])
    assert [(r["iteration"], r["rank"]) for r in first] == [(1, 0), (2, 0), (3, 1)]
    assert first[0]["loss"] == 2.5          # the last rank's loss, on the step's first line


def test_runtime_line_names_what_ran_and_the_class_that_built_the_model():
    from charllm.probes.store.rundir import runtime_line

    record = {"implementation": {"transformer_impl": "local", "attention": "sdpa", "fusions": []},
              "versions": {"torch": "2.13.0", "megatron_core": "0.19.2"}, "devices": [],
              "model": {"class": "HybridModel", "hybrid_layer_pattern": "*-*-"}}
    assert runtime_line(record) == ("local layers · attention sdpa · fusions none · CPU · torch 2.13.0 · "
                                    "megatron-core 0.19.2 HybridModel")
    del record["model"]   # a run recorded before the class was
    assert runtime_line(record).endswith("megatron-core 0.19.2")


def test_the_plan_and_the_run_word_an_implementation_alike():
    from charllm.engine.model.runtime import Implementation
    from charllm.probes.store.rundir import runtime_line

    impl = Implementation("transformer_engine", "te-flash", ("bias_activation_fusion",), device="cuda",
                          optimizer="apex", notes=("a note",))
    record = {"implementation": impl.to_dict(), "versions": {"torch": "2.13.0", "megatron_core": "0.19.2"},
              "devices": [{"name": "H100"}] * 2}
    planned = impl.describe()
    assert planned == ("Transformer Engine · attention te-flash · fusions bias_activation · optimizer kernels "
                       "Apex's · a note")
    assert runtime_line(record) == f"{planned} · 2x H100 · torch 2.13.0 · megatron-core 0.19.2"
    cpu = Implementation("local", "sdpa", device="cpu")
    assert cpu.describe().endswith(" · on CPU")
    assert runtime_line({"implementation": cpu.to_dict()}).startswith(cpu.describe() + " · torch ?")
