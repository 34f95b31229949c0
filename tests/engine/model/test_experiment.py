"""The experiment model: TOML round trip, --set key resolution, typed values."""

import tomllib

import pytest

from charllm.engine.model.experiment import Experiment
from charllm.probes.core.errors import UserError


def test_toml_round_trip_is_lossless():
    exp = Experiment.load("tiny-moe-ep2")
    again = Experiment.from_dict(tomllib.loads(exp.to_toml()))
    assert again == exp


def test_bare_names_shared_by_sections_mean_the_megatron_flag():
    exp = Experiment.load("tiny-local")
    exp.apply(["seq_length=64", "fp8=hybrid"])
    assert exp.training.seq_length == 64 and exp.seq_length == 64
    assert exp.model.seq_length == 32          # the preset's default is untouched
    assert exp.training.fp8 == "hybrid"
    assert exp.hardware.fp8 is False           # the hardware's capability is not a setting
    exp.apply(["model.seq_length=128", "hardware.fp8=true"])
    assert exp.model.seq_length == 128 and exp.hardware.fp8 is True


def test_set_parses_toml_values_and_checks_types():
    exp = Experiment.load("tiny-local")
    exp.apply(["moe_layer_freq=[1, 0, 1, 0]", "recompute_granularity=full", "lr=3e-4"])
    assert exp.model.moe_layer_freq == [1, 0, 1, 0]
    assert exp.training.recompute_granularity == "full"
    assert exp.training.lr == pytest.approx(3e-4)
    with pytest.raises(UserError, match=r"micro_batch_size: expected an integer, got 'many'"):
        exp.apply(["micro_batch_size=many"])
    with pytest.raises(UserError, match=r"unknown key 'tensor_parallel_size'.*'tensor_model_parallel_size'"):
        exp.apply(["tensor_parallel_size=2"])
    with pytest.raises(UserError, match=r"expected key=value"):
        exp.apply(["tensor_model_parallel_size"])


def test_set_model_or_hardware_takes_a_preset_name_as_a_toml_file_does():
    exp = Experiment.load("tiny-local").apply(["model=tiny-moe", "hardware=h100-sxm-80gb"])
    assert exp.model == Experiment.load("tiny-moe-ep2").model
    assert exp.hardware.name == "h100-sxm-80gb"
    with pytest.raises(UserError, match=r"model 'llama3-8bb': no such preset; did you mean 'llama3-8b'"):
        exp.apply(["model=llama3-8bb"])
    with pytest.raises(UserError, match=r"model = 3: expected a model preset name"):
        exp.apply(["model=3"])
    with pytest.raises(UserError, match=r"unknown key 'modle'; did you mean 'model'"):
        exp.apply(["modle=llama3-8b"])


def test_a_count_agrees_with_its_noun(capsys):
    from charllm.probes.core.errors import plural
    from infra_cli import run

    assert (plural(1, "micro-batch", "micro-batches"), plural(2, "micro-batch", "micro-batches")) == \
        ("1 micro-batch", "2 micro-batches")
    assert (plural(1, "node"), plural(0, "node"), plural(4096, "GPU")) == ("1 node", "0 nodes", "4,096 GPUs")
    code, out, _ = run(capsys, "plan", "tiny-local", "--set", "global_batch_size=2", "--set", "micro_batch_size=1")
    assert code == 0 and "micro batch 1, 1 micro-batch," in out
    code, out, _ = run(capsys, "presets", "show", "tiny-local", "--kind", "experiments")
    assert code == 0 and "2 micro-batches per iteration" in out


def test_unknown_section_key_in_a_file_names_the_file_and_suggests(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text('model = "tiny-dense"\nhardware = "cpu"\n[parallel]\npipeline_parallel_size = 2\n')
    with pytest.raises(
        UserError,
        match=r"\[parallel\]: unknown key 'pipeline_parallel_size'; did you mean 'pipeline_model_parallel_size'",
    ):
        Experiment.load(path)


def test_copy_is_deep_per_section():
    exp = Experiment.load("tiny-local")
    other = exp.copy()
    other.set("tensor_model_parallel_size", 2)
    assert exp.parallel.tensor_model_parallel_size == 1


def test_a_missing_or_broken_file_is_one_line_naming_it(tmp_path):
    with pytest.raises(UserError, match=r"experiment file '.*/nope.toml': no such file"):
        Experiment.load(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[parallel\n")
    with pytest.raises(UserError, match=r"experiment file '.*/broken.toml': invalid TOML"):
        Experiment.load(broken)


def test_the_layout_record_and_label_come_from_the_fields_marked_layout():
    from charllm.engine.model.experiment import declared, layout_label
    from charllm.tui.commands.launch import _iteration_line

    exp = Experiment.load("ppt-h100-llama3-70b-1-01000")
    record = exp.layout_record()
    assert list(record) == [name for _, name, _ in declared("layout")] + ["data_parallel_size", "num_microbatches"]
    assert record["expert_tensor_parallel_size"] == exp.parallel.tensor_model_parallel_size   # resolved
    assert exp.layout_label == layout_label(record) == "TP8 PP4 DP2"
    started = _iteration_line({"event": "start", "world_size": 64, "layout": {**record, "device": "cuda"}})
    assert started == "training started: world size 64 (TP8 PP4 DP2) on cuda"
    fsdp = exp.apply(["use_torch_fsdp2=true", "virtual_pipeline_model_parallel_size=2"])
    assert fsdp.layout_label == "TP8 PP4 VP2 FSDP DP2"
    assert layout_label({"tensor_model_parallel_size": 2}) == "TP2 PP1 DP1"   # a sweep row, an older record
