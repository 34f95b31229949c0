"""Write the CharLLM-PPT experiment presets (presets/experiments/ppt-*.toml).

Source: the public artifact of Go et al., "Characterizing the Efficiency of Distributed Training: A Power,
Performance, and Thermal Perspective" (MICRO'25), sitar-lab/CharLLM-PPT `scripts/experiments/**`, as
summarised in the team's shared/charllm-ppt-configs.md. One file per layout and variant, named
`ppt-<gpu>-<model>-<layout index>-<variant code>.toml`:

    00000 base      10000 communication overlap      01000 activation recomputation      11000 both

The fields the presets take from the artifact are tabled in tests/data/charllm_ppt/configs.md, which
tests/engine/model/test_ppt_presets.py compares every preset with. Model-parallel runs: bf16, global batch 128, micro
batch 1, CP 1, no virtual pipeline, sequence parallel when TP>1, 8 GPUs per node. Dense layouts use the
distributed optimizer; MoE layouts too, with the alltoall dispatcher, capacity factor 1.0 with padding and
aux-loss coefficient 0.01, and max position embeddings 4096 as the artifact's Mixtral runs have. FSDP layouts
(5) are NeMo's PyTorch FSDP with full sharding: here torch FSDP2 (--use-torch-fsdp2), fused Adam without the
distributed optimizer, sequence parallel off, gradients reduced in bf16, each run's own batch and steps
(FSDP), on 8 H100 nodes (the sbatch script's count; its YAML says 4). Overlap: dense model-parallel turns on
grad-reduce, param-gather and TP communication overlap (TP overlap needs TP>1); MoE only TP communication
overlap; FSDP none (its TP overlap without sequence parallelism is turned off again by the artifact's NeMo).
Recomputation: full, block method, every layer of a stage. The artifact sampled the second-to-last step, so
all but the last two steps are marked warm-up. The micro-batch sweep (1/2/4/8, recompute on) is
`--set micro_batch_size=N` on the 01000 presets rather than more files.

Left out: H100 llama3-70b layout 4 (TP1 PP32): 80 layers do not split evenly over 32 stages, and the
summary gives no uneven split, so no file would be both faithful and valid.

Run from the repository root: `python presets/generate_ppt_experiments.py` (rewrites the ppt-* files).
"""

from __future__ import annotations

from pathlib import Path

import tomli_w

OUT = Path(__file__).resolve().parent / "experiments"
NUM_LAYERS = {"gpt3-175b": 96, "llama3-70b": 80, "mixtral-8x7b": 32, "mixtral-8x22b": 56}
MOE = {"mixtral-8x7b", "mixtral-8x22b"}
HARDWARE = {"h200": ("h200-141gb", 4), "h100": ("h100-sxm-80gb", 8)}   # preset, nodes of 8 GPUs
# (gpu, model) -> (global batch, steps) of the FSDP runs (the others: 128, 11)
FSDP_RUNS = {("h200", "gpt3-175b"): (128, 11), ("h200", "llama3-70b"): (128, 11),
             ("h100", "gpt3-175b"): (32, 3), ("h100", "llama3-70b"): (128, 11)}
MIXTRAL_MAX_POSITIONS = 4096

# (gpu, model) -> {layout index: (TP, PP, EP) or "fsdp"}
LAYOUTS: dict[tuple[str, str], dict[int, tuple[int, int, int] | str]] = {
    ("h200", "gpt3-175b"): {1: (2, 16, 1), 2: (4, 8, 1), 3: (8, 4, 1), 4: (1, 32, 1), 5: "fsdp"},
    ("h200", "llama3-70b"): {1: (8, 2, 1), 2: (4, 4, 1), 3: (2, 8, 1), 4: (1, 16, 1), 5: "fsdp"},
    ("h200", "mixtral-8x7b"): {1: (1, 1, 8), 2: (2, 1, 4)},
    ("h200", "mixtral-8x22b"): {1: (1, 4, 8), 2: (2, 2, 8), 3: (4, 1, 8)},
    ("h100", "gpt3-175b"): {1: (2, 32, 1), 2: (4, 16, 1), 3: (8, 8, 1), 5: "fsdp"},
    ("h100", "llama3-70b"): {1: (8, 4, 1), 2: (4, 8, 1), 3: (2, 16, 1), 5: "fsdp"},
    ("h100", "mixtral-8x7b"): {1: (1, 2, 8), 2: (4, 1, 4), 3: (2, 2, 4), 4: (1, 4, 4)},
    ("h100", "mixtral-8x22b"): {1: (8, 1, 8), 2: (4, 2, 8), 3: (2, 4, 8), 4: (1, 8, 8)},
}
VARIANTS = {"00000": "base", "10000": "communication overlap", "01000": "activation recomputation",
            "11000": "overlap and recomputation"}


def experiment(gpu: str, model: str, index: int, layout, code: str) -> dict:
    hardware, nodes = HARDWARE[gpu]
    fsdp = layout == "fsdp"
    tp, pp, ep = (8, 1, 1) if fsdp else layout
    world = nodes * 8
    overlap, recompute = code[0] == "1", code[1] == "1"
    kind = "FSDP" if fsdp else "MoE" if model in MOE else "dense"

    parallel = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": 1,
        "expert_model_parallel_size": ep,
        "sequence_parallel": tp > 1 and not fsdp,
        "use_distributed_optimizer": not fsdp,
    }
    if fsdp:
        parallel["use_torch_fsdp2"] = True
    global_batch, steps = FSDP_RUNS[gpu, model] if fsdp else (128, 11)
    training = {
        "micro_batch_size": 1, "global_batch_size": global_batch, "bf16": True,
        "train_iters": steps, "warmup_iters": steps - 2,
        "overlap_grad_reduce": overlap and kind == "dense",
        "overlap_param_gather": overlap and kind == "dense",
        "tp_comm_overlap": overlap and tp > 1 and not fsdp,
    }
    if fsdp:
        training["grad_reduce_in_bf16"] = True            # fsdp_grad_reduce_dtype: bf16
    if recompute:
        training |= {"recompute_granularity": "full", "recompute_method": "block",
                     "recompute_num_layers": NUM_LAYERS[model] // pp}
    if model in MOE:
        training |= {"moe_token_dispatcher_type": "alltoall", "moe_expert_capacity_factor": 1.0,
                     "moe_pad_expert_input_to_capacity": True, "moe_aux_loss_coeff": 0.01}
    model_entry: str | dict = model
    if model in MOE:
        model_entry = {"preset": model, "max_position_embeddings": MIXTRAL_MAX_POSITIONS}
    elif fsdp:
        # Megatron-LM's --use-torch-fsdp2 requires an untied output layer (validate_args); GPT-3 ties it.
        model_entry = {"preset": model, "untie_embeddings_and_output_weights": True}
    shape = "TP8 + FSDP2 full sharding" if fsdp else f"TP{tp} PP{pp}" + (f" EP{ep}" if ep > 1 else "")
    dp = world // (tp * pp)
    variant = VARIANTS[code] + (" (TP overlap asked, off as in NeMo without sequence parallelism)"
                                if fsdp and overlap else "")
    return {
        "name": f"ppt-{gpu}-{model}-{index}-{code}",
        "description": f"CharLLM-PPT {gpu.upper()} {nodes}x8: {model} layout {index} ({shape}, DP{dp}), "
                       f"{variant} ({code})",
        "model": model_entry,
        "hardware": hardware,
        "cluster": {"nodes": nodes, "gpus_per_node": 8},
        "parallel": parallel,
        "training": training,
        "telemetry": {"backend": "auto", "hz": 20.0},
    }


def main() -> None:
    for old in OUT.glob("ppt-*.toml"):
        old.unlink()
    count = 0
    for (gpu, model), layouts in LAYOUTS.items():
        for index, layout in layouts.items():
            for code in VARIANTS:
                data = experiment(gpu, model, index, layout, code)
                header = "# Generated by presets/generate_ppt_experiments.py; edit that script, not this file.\n"
                (OUT / f"{data['name']}.toml").write_text(header + tomli_w.dumps(data))
                count += 1
    print(f"wrote {count} presets to {OUT}")


if __name__ == "__main__":
    main()
