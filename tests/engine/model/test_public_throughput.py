"""The step-time model against NVIDIA's published H100 throughput (tests/data/public_dev/: NeMo's 24.07
performance summary and Megatron-Bridge's performance archive, each layout with its recipe's settings as
Megatron-LM flags, rebuilt by tools/build_public_dev.py; see its README).

Each row is imported from its flags and planned (`speed.estimate`, `memory.estimate`); the error of
tokens/s per GPU is printed per row and per class (dense/MoE, the FP8 recipe, the source), beside the
model FLOPs per token NVIDIA's table implies (its TFLOP/s over its tokens/s) against Megatron's count,
and the memory verdict. The thresholds sit just above what the model achieves today, so a regression
fails; issue 41's targets (mean at most 8%, each within 20%) are what they move towards. Run with `-s`.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from charllm.engine.model import memory
from charllm.engine.model.flops import flops_per_iteration
from charllm.engine.model.megatron import import_megatron_args
from charllm.engine.model.speed import estimate

REPO = Path(__file__).parents[3]
DATA = REPO / "tests" / "data" / "public_dev" / "public_dev.json"
TOOL = REPO / "tools" / "build_public_dev.py"

# Achieved (mean and largest absolute relative error of tokens/s per GPU), just above
MEAN, EACH = 0.10, 0.85


def _rows() -> list[dict]:
    return json.loads(DATA.read_text())


def planned(row: dict):
    return import_megatron_args(f"pretrain_gpt.py {row['megatron_args']}", world_size=row["world_size"],
                                gpus_per_node=row["gpus_per_node"], hardware=row["hardware"]).experiment


def classes(exp, row: dict) -> list[str]:
    p, t = exp.parallel, exp.training
    tags = ["moe" if exp.model.is_moe else "dense", f"fp8 {t.fp8_recipe}" if t.fp8 else "bf16",
            "NeMo 24.07" if row["source"]["table"]["repository"] == "NVIDIA/NeMo" else "Megatron-Bridge"]
    tags += [tag for tag, on in (
        ("PP/VP", p.pipeline_model_parallel_size > 1), ("CP", p.context_parallel_size > 1),
        ("TP 8", p.tensor_model_parallel_size == 8), ("EP", p.expert_model_parallel_size > 1),
        ("fsdp", p.use_megatron_fsdp), ("world > 64", exp.world_size > 64)) if on]
    return tags


@pytest.fixture(scope="module")
def errors():
    rows = []
    for row in _rows():
        exp = planned(row)
        speed = estimate(exp)
        tokens = exp.training.global_batch_size * exp.seq_length
        predicted = speed.tokens_per_s / exp.world_size
        measured = row["measured_tokens_per_s_per_gpu"]
        ours = speed.flops_per_iteration / tokens
        theirs = row["measured_tflops_per_gpu"] * 1e12 / measured if row["measured_tflops_per_gpu"] else None
        worst = max(memory.estimate(exp).stages, key=lambda stage: stage.total_bytes)
        rows.append(dict(name=row["name"], measured=measured, predicted=predicted, error=predicted / measured - 1,
                         flops=ours / theirs if theirs else None, verdict=worst.verdict,
                         peak=worst.total_bytes / 2**30, tags=classes(exp, row)))
    print(f"\n{'row':42s} {'measured':>9s} {'planned':>9s} {'error':>7s} {'FLOPs/NV':>8s}  {'memory':17s} classes")
    for r in rows:
        flops = f"{r['flops']:8.3f}" if r["flops"] else f"{'-':>8s}"
        print(f"{r['name'][:42]:42s} {r['measured']:9.0f} {r['predicted']:9.0f} {100 * r['error']:+6.1f}% {flops}  "
              f"{r['verdict']:12s}{r['peak']:5.1f}G {', '.join(r['tags'])}")
    by_class: dict[str, list[float]] = {}
    for r in rows:
        for tag in ["all", *r["tags"]]:
            by_class.setdefault(tag, []).append(r["error"])
    print(f"\n{'class':18s} {'rows':>4s} {'mean |err|':>10s} {'max |err|':>9s} {'mean err':>9s}")
    for tag, errs in sorted(by_class.items(), key=lambda kv: (kv[0] != "all", kv[0])):
        print(f"{tag:18s} {len(errs):4d} {statistics.mean(map(abs, errs)):10.1%} {max(map(abs, errs)):9.1%} "
              f"{statistics.mean(errs):+9.1%}")
    return rows


def test_the_set_holds_h100_rows_of_both_sources():
    rows = _rows()
    assert len(rows) >= 20
    assert {r["source"]["table"]["repository"] for r in rows} == {"NVIDIA/NeMo", "NVIDIA-NeMo/Megatron-Bridge"}
    assert all(r["hardware"] == "h100-sxm-80gb" and r["measured_tokens_per_s_per_gpu"] > 0 for r in rows)
    # issue 41 keeps these for the acceptance check
    assert not [r for r in rows if "deepseek" in r["name"] or r["source"]["table"]["release"] == "26.04"]


def test_tokens_per_gpu_do_not_regress(errors):
    errs = [abs(r["error"]) for r in errors]
    print(f"public dev set: {len(errs)} rows, mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%}")
    assert statistics.mean(errs) <= MEAN and max(errs) <= EACH


def _tool():
    spec = importlib.util.spec_from_file_location("build_public_dev", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_shipped_set_is_what_the_tool_builds():
    from infra_paths import mirror, mirrors_missing

    tool = _tool()
    if missing := mirrors_missing(*tool.REPOSITORIES.values()):
        pytest.skip(missing)
    items, left_out = tool.build({key: mirror(name) for key, name in tool.REPOSITORIES.items()})
    assert items == _rows()
    reasons = dict(left_out)
    assert any("Mamba" in why for why in reasons.values())
    assert not [label for label in reasons if "DeepSeek" in label or label.startswith("26.04 ")]


def test_the_tool_refuses_a_row_whose_layout_is_not_the_tables():
    tool = _tool()
    spec = dict(next(s for s in tool.ROWS if s["name"] == "nemo-24.07-llama2-70b"))
    table_row = {"gpus": 64, "gbs": 128, "mbs": 1, "seq": 4096, "tp": 4, "pp": 4, "cp": 1, "vp": 20}
    tool._check_layout(spec, table_row)
    with pytest.raises(ValueError, match="vp = 10"):
        tool._check_layout(spec, {**table_row, "vp": 10})


def test_nvidias_model_flops_are_megatrons_count_or_the_whole_attention_square():
    """The FLOPs per token each table implies (its TFLOP/s over its tokens/s): Megatron-Bridge's are
    Megatron's count (causal attention), NeMo 24.07's count attention's whole square."""
    for row in _rows():
        if not row["measured_tflops_per_gpu"]:
            continue
        exp = planned(row)
        tokens = exp.training.global_batch_size * exp.seq_length
        theirs = row["measured_tflops_per_gpu"] * 1e12 / row["measured_tokens_per_s_per_gpu"]
        nemo = row["source"]["table"]["repository"] == "NVIDIA/NeMo"
        ours = flops_per_iteration(exp, causal=not nemo) / tokens
        assert ours == pytest.approx(theirs, rel=0.025), row["name"]     # the tables round to 3-4 digits
