"""The ppt-* presets against the CharLLM-PPT artifact's configurations, as tabled in
tests/data/charllm_ppt/configs.md (the presets are written by tools/generate_ppt_experiments.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from charllm.engine.model import catalog
from charllm.engine.model.experiment import Experiment

TABLES = Path(__file__).parents[2] / "data" / "charllm_ppt" / "configs.md"
VARIANTS = ("00000", "10000", "01000", "11000")
NUM_LAYERS = {"gpt3-175b": 96, "llama3-70b": 80, "mixtral-8x7b": 32, "mixtral-8x22b": 56}


def _rows(header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with `header`."""
    rows, inside = [], False
    for line in TABLES.read_text().splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("|") and cells[:len(header.split("|"))] == [h.strip() for h in header.split("|")]:
            inside = True
        elif inside and line.startswith("|") and not set(line) <= set("|-"):
            rows.append(cells)
        elif inside and not line.startswith("|"):
            break
    return rows


def _layouts() -> dict[tuple[str, str, int], dict]:
    out = {}
    for gpu, model, nodes, layouts in _rows("gpu | model | nodes | layouts"):
        for item in layouts.split(";"):
            index, shape = (s.strip() for s in item.split(":"))
            if shape == "fsdp":
                out[gpu, model, int(index)] = {"fsdp": True}
            else:
                tp, pp, ep, dp = map(int, re.fullmatch(r"(\d+)-(\d+)-(\d+) \((\d+)\)", shape).groups())
                out[gpu, model, int(index)] = {"fsdp": False, "nodes": int(nodes), "tp": tp, "pp": pp, "ep": ep,
                                               "dp": dp}
    return out


def _fsdp_runs() -> dict[tuple[str, str], dict]:
    out = {}
    for gpu, model, _yaml_nodes, nodes, batch, steps, seq in _rows("gpu | model | nodes (yaml)"):
        seq_length, positions = map(int, seq.split("/"))
        out[gpu, model] = {"nodes": int(nodes), "global_batch_size": int(batch), "train_iters": int(steps),
                           "seq_length": seq_length, "max_position_embeddings": positions}
    return out


def _splits() -> dict[tuple[str, str, int], tuple[str, int]]:
    """Our uneven splits: (gpu, model, layout) -> (Megatron's pipeline layout, the most layers on a stage)."""
    return {(gpu, model, int(index)): (split, int(most))
            for gpu, model, index, split, most in _rows("gpu | model | layout | split (ours)")}


LAYOUTS, FSDP, SPLITS = _layouts(), _fsdp_runs(), _splits()
PRESETS = sorted(n for n in catalog.entries("experiments") if n.startswith("ppt-"))


def test_every_layout_of_the_tables_has_its_four_variants():
    assert len(LAYOUTS) == 32 and len(FSDP) == 4 and len(SPLITS) == 1
    expected = {f"ppt-{gpu}-{model}-{index}-{code}" for gpu, model, index in LAYOUTS for code in VARIANTS}
    assert set(PRESETS) == expected


@pytest.mark.parametrize("name", PRESETS)
def test_preset_matches_the_artifact(name):
    gpu, model, index, code = re.fullmatch(r"ppt-(h\d+)-(.+)-(\d)-(\d{5})", name).groups()
    exp = Experiment.load(name)
    m, p, t = exp.model, exp.parallel, exp.training
    layout = LAYOUTS[gpu, model, int(index)]
    overlap, recompute = code[0] == "1", code[1] == "1"
    assert (exp.cluster.gpus_per_node, t.micro_batch_size, t.bf16, p.context_parallel_size) == (8, 1, True, 1)
    assert p.virtual_pipeline_model_parallel_size is None
    if layout["fsdp"]:
        run = FSDP[gpu, model]
        assert (p.use_torch_fsdp2, p.use_megatron_fsdp, p.use_distributed_optimizer, p.sequence_parallel) == (
            True, False, False, False)                      # PyTorch FSDP full sharding, fused Adam, no SP
        assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 1)
        assert exp.cluster.nodes == run["nodes"]
        assert (t.global_batch_size, t.train_iters) == (run["global_batch_size"], run["train_iters"])
        assert (exp.seq_length, m.max_position_embeddings) == (run["seq_length"], run["max_position_embeddings"])
        assert t.grad_reduce_in_bf16                        # fsdp_grad_reduce_dtype: bf16
        assert not (t.tp_comm_overlap or t.overlap_grad_reduce or t.overlap_param_gather)
        assert m.untie_embeddings_and_output_weights        # what --use-torch-fsdp2 requires
    else:
        assert exp.cluster.nodes == layout["nodes"]
        assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size) == (
            layout["tp"], layout["pp"], layout["ep"])
        assert exp.data_parallel_size == layout["dp"]
        assert p.use_distributed_optimizer and not (p.use_torch_fsdp2 or p.use_megatron_fsdp)
        assert p.sequence_parallel == (layout["tp"] > 1)
        assert (t.global_batch_size, t.train_iters) == (128, 11)
        moe = m.is_moe
        assert t.tp_comm_overlap == (overlap and layout["tp"] > 1)
        assert t.overlap_grad_reduce == t.overlap_param_gather == (overlap and not moe)
        if moe:
            assert (exp.seq_length, m.max_position_embeddings) == (4096, 4096)
            assert (t.moe_token_dispatcher_type, t.moe_expert_capacity_factor, t.moe_pad_expert_input_to_capacity,
                    t.moe_aux_loss_coeff) == ("alltoall", 1.0, True, 0.01)
    assert t.warmup_iters == t.train_iters - 2                  # the second-to-last step is the sampled one
    split, most = SPLITS.get((gpu, model, int(index)), (None, NUM_LAYERS[model] // p.pipeline_model_parallel_size))
    assert p.pipeline_model_parallel_layout == split
    assert (p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers) == (None, None)
    if split:
        assert NUM_LAYERS[model] % p.pipeline_model_parallel_size, "a split only where the layers do not divide"
        assert "is ours, as the artifact gives none" in exp.description
    if recompute:                                   # every layer of a stage: block over the most one holds
        assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == ("full", "block", most)
    else:
        assert t.recompute_granularity is None
