"""Rebuild the public throughput development set (tests/data/public_dev/public_dev.json) from git mirrors
of NVIDIA's repositories.

    python tools/build_public_dev.py --nemo NEMO --launcher LAUNCHER --bridge BRIDGE [--out FILE]

NEMO, LAUNCHER and BRIDGE are git checkouts (or bare mirrors) of NVIDIA/NeMo,
NVIDIA/NeMo-Framework-Launcher and NVIDIA-NeMo/Megatron-Bridge; everything is read with `git show` at the
commits named below, so nothing in them is written and a newer mirror builds the same set.

What a row is (issue 41): one layout NVIDIA trained on DGX-H100s and published the throughput of, planned
from the Megatron-LM flags its recipe amounts to.
- The measurement (tokens/s and model TFLOP/s per GPU) and the layout (GPUs, GBS, MBS, sequence, TP, PP,
  CP, VP, EP, FSDP) are parsed from the published table at its commit (TABLES); the layout written in ROWS
  must equal the table's, so a row cannot drift from what NVIDIA reported.
- Every other setting (precision and FP8 recipe, gradient-reduce dtype, overlaps, recompute, CUDA graphs,
  the MoE dispatcher) is read from the recipe code of the release that ran it, at that release's commit
  (RECIPES); each row names the files, and the tool checks that each file exists there and holds the lines
  (`evidence`) the setting was read from.
- Where one layout was published by several releases, the newest release whose own recipe gives that
  layout is kept (Megatron-Bridge's tables sometimes repeat an older layout beside a newer recipe:
  26.02.01 prints Qwen3 30B at PP 2 VP 12 EP 8 while its recipe runs EP 16).

Left out, and never parsed past their names: every DeepSeek-V3 row, every row of the 26.04 container, and
every system but DGX-H100 (issue 41 keeps them for the acceptance check), with Megatron-LM's README scaling
table, which this tool does not read. Also left out: fine-tuning rows (LoRA and SFT on packed sequences),
hybrid Mamba models (Nemotron 3 Nano: the speed model has no Mamba layer) and GPT-OSS (sliding-window
attention on half its layers and attention sinks, which the model does not have). `build` returns what it
left out and why.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from devset import build_and_write, git  # tools/ (a script's own folder is on sys.path; pytest adds it too)

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "public_dev" / "public_dev.json"
GPUS_PER_NODE = 8
HARDWARE = "h100-sxm-80gb"

REPOSITORIES = {"nemo": "NVIDIA/NeMo", "launcher": "NVIDIA/NeMo-Framework-Launcher",
                "bridge": "NVIDIA-NeMo/Megatron-Bridge"}

# The published tables: repository, commit, path.
TABLES = {
    "nemo-24.07": ("nemo", "9c5c5e9709407d3511005fc966e45374998bb478",
                   "docs/source/performance/performance_summary.md"),
    "bridge": ("bridge", "4ab94dfad36641cabdeb96452b21bf676aac4772", "docs/performance-summary-archive.md"),
}
# The releases whose rows are kept for acceptance (issue 41), and the words that mark a left-out model.
LEFT_OUT_RELEASES = {"26.04"}
LEFT_OUT_MODELS = ("deepseek",)

# Each release's recipe code: repository and commit (the release tag, or branch for 25.09).
RECIPES = {
    "24.07": ("launcher", "8325688d8345a5513660f0f8390f0482a721c009", "tag 24.07"),
    "25.09": ("bridge", "684a68616597c8097b17e089f91f86383d9e7b74", "branch r0.1.0"),
    "25.11": ("bridge", "7af9601c9da746d21481194356295bfe23df3737", "tag v0.2.0"),
    "26.02": ("bridge", "21b02e0cfb2f8ff907e0d8baee0c5205876c6812", "tag v0.3.0"),
    "26.04.01": ("bridge", "f9b6319e58494b9a655b4789724df715aebabaef", "tag v0.4.1"),
    "26.06": ("bridge", "fcbb6031103d0ca845c1a54d4fee55ecfcca17b6", "tag v0.5.0"),
}

# --------------------------------------------------------------------------------------------
# Models: the Megatron-LM flags of each shape (from the recipe's model config, cited per row)
# --------------------------------------------------------------------------------------------
_GPT3 = ("--normalization LayerNorm --position-embedding-type learned_absolute --hidden-dropout 0.1 "
         "--attention-dropout 0.1 --vocab-size 50257 --make-vocab-size-divisible-by 128")
_LLAMA = ("--normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear "
          "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
          "--make-vocab-size-divisible-by 128")
_NEMOTRON = ("--normalization LayerNorm --position-embedding-type rope --squared-relu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --vocab-size 256000 "
             "--make-vocab-size-divisible-by 128")
_QWEN3_MOE = ("--normalization RMSNorm --position-embedding-type rope --rotary-base 1000000 --swiglu "
              "--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
              "--qk-layernorm --group-query-attention --num-query-groups 4 --kv-channels 128 --vocab-size 151936 "
              "--make-vocab-size-divisible-by 128 --num-experts 128 --moe-router-topk 8 --moe-grouped-gemm "
              "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-permute-fusion")
MODELS = {
    "gpt3-5b": f"--num-layers 24 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16384 {_GPT3}",
    "gpt3-20b": f"--num-layers 44 --hidden-size 6144 --num-attention-heads 48 --ffn-hidden-size 24576 {_GPT3}",
    "gpt3-175b": f"--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 49152 {_GPT3}",
    "llama2-7b": f"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 "
                 f"--vocab-size 32000 {_LLAMA}",
    "llama2-13b": f"--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --ffn-hidden-size 13824 "
                  f"--vocab-size 32000 {_LLAMA}",
    "llama2-70b": f"--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention "
                  f"--num-query-groups 8 --ffn-hidden-size 28672 --vocab-size 32000 {_LLAMA}",
    "llama3-8b": f"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
                 f"--num-query-groups 8 --ffn-hidden-size 14336 --vocab-size 128256 --rotary-base 500000 {_LLAMA}",
    "llama3-70b": f"--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention "
                  f"--num-query-groups 8 --ffn-hidden-size 28672 --vocab-size 128256 --rotary-base 500000 {_LLAMA}",
    "llama3.1-405b": f"--num-layers 126 --hidden-size 16384 --num-attention-heads 128 --group-query-attention "
                     f"--num-query-groups 8 --ffn-hidden-size 53248 --vocab-size 128256 --rotary-base 500000 {_LLAMA}",
    "nemotron3-8b": f"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16384 {_NEMOTRON}",
    "nemotron3-22b": f"--num-layers 40 --hidden-size 6144 --num-attention-heads 48 --ffn-hidden-size 24576 "
                     f"{_NEMOTRON}",
    "nemotron4-340b": f"--num-layers 96 --hidden-size 18432 --num-attention-heads 96 --group-query-attention "
                      f"--num-query-groups 8 --ffn-hidden-size 73728 {_NEMOTRON}",
    "qwen3-30b-a3b": f"--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 6144 "
                     f"--moe-ffn-hidden-size 768 {_QWEN3_MOE}",
    "qwen3-235b-a22b": f"--num-layers 94 --hidden-size 4096 --num-attention-heads 64 --ffn-hidden-size 12288 "
                       f"--moe-ffn-hidden-size 1536 {_QWEN3_MOE}",
}

# --------------------------------------------------------------------------------------------
# Recipes: the flags each recipe family sets, and where they were read
# --------------------------------------------------------------------------------------------
# NeMo 24.07 (NeMo-Framework-Launcher, Megatron-core GPT with Apex's distributed fused Adam, which
# shards the optimizer like Megatron's distributed optimizer and overlaps its gradient reduce-scatter
# and parameter all-gather: overlap_grad_sync / overlap_param_sync). FP8: fp8 hybrid, delayed scaling.
# Its optimizer state, as NeMo sets it up (nemo/collections/nlp/models/language_modeling/megatron_base_model.py,
# NVIDIA/NeMo v2.0.0, setup_optimization): with fp32 state and a bf16 model, store_params=False and
# store_param_remainders=True: the master weight is the bf16 weight plus a 16-bit remainder, 2 bytes per
# parameter (sharded) where Megatron's distributed optimizer keeps 4, planned as Megatron's precision-aware
# optimizer with 2-byte main parameters (in _NEMO1). Nemotron-4 340B's config sets `dtype: bf16`: bf16
# moments and no master copy (the bf16 weights are the master), planned with bf16 moments and the 2-byte main
# parameters, 2 bytes per parameter (sharded) more than Apex holds (_NEMO1_ADAM_BF16). Gradients are reduced
# in fp32 unless `grad_sync_dtype=bf16` (Apex's default is the state's dtype).
_LAUNCHER_YAML = "launcher_scripts/conf/training/{}.yaml"
_LAUNCHER_FP8 = "examples/training/{}.sh"
_NEMO1 = "--bf16 --fp8-format hybrid --fp8-recipe delayed --use-distributed-optimizer --overlap-grad-reduce " \
         "--overlap-param-gather --use-precision-aware-optimizer --main-params-dtype fp16"
_BF16_GRADS = "--grad-reduce-in-bf16 --main-grads-dtype bf16"
_NEMO1_ADAM_BF16 = f"{_BF16_GRADS} --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
# Megatron-Bridge performance recipes: bf16_with_fp8_current_scaling_mixed (fp8 hybrid, tensorwise, FP8
# parameter gather; the performance scripts switch its BF16 first and last layers off), the distributed
# optimizer with overlapped gradient reduce and parameter gather, gradients reduced in BF16
# (grad_reduce_in_fp32 = False), Transformer Engine's fused cross-entropy.
_BRIDGE_FP8CS = "--bf16 --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --grad-reduce-in-bf16 " \
                "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather " \
                "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te"
_MIXED_PRECISION = ("src/megatron/bridge/training/mixed_precision.py",
                    ['cfg.fp8_recipe = "tensorwise"', "cfg.fp8_param_gather = True"])


# What the rows' linears run in: the recipe's FP8 recipe (24.07: fp8_hybrid with delayed scaling; Megatron-Bridge:
# per-tensor current scaling, which its tables call FP8-CS, or FP8 from 26.02 on).
PRECISION = {"nemo-24.07": "FP8 delayed", "bridge": "FP8 current scaling"}


def launcher(model_yaml: str, fp8_script: str | None, evidence: list[str], fp8_evidence: list[str] = ()):
    """The NeMo-Framework-Launcher files of a 24.07 row: its training config and its FP8 example."""
    files = [(_LAUNCHER_YAML.format(model_yaml), evidence)]
    if fp8_script:
        files.append((_LAUNCHER_FP8.format(fp8_script), ["training.model.fp8=", *fp8_evidence]))
    return files


# One row per published layout. `table`: which table, `release`, `model` as the table names it, `pick`:
# table columns that single the row out; `layout`: the table's own columns, checked; `flags`: the recipe's
# settings as Megatron-LM flags; `settings`: the same in words; `recipe`: the files read, with evidence.
ROWS = [
    # ---- NeMo 24.07, DGX-H100, FP8 (docs/source/performance/performance_summary.md)
    dict(name="nemo-24.07-gpt3-5b", table="nemo-24.07", release="24.07", model="GPT3-5B", shape="gpt3-5b",
         layout=dict(gpus=64, gbs=2048, mbs=4, seq=2048, tp=1, pp=1, cp=1, vp=1),
         flags=f"{_NEMO1} {_BF16_GRADS} --fp8-amax-history-len 1024 --fp8-amax-compute-algo max",
         recipe=launcher("gpt3/5b", "gpt/h100/5b_fp8_8node",
                         ["sequence_parallel: False", "ub_tp_comm_overlap: False", "name: distributed_fused_adam",
                          "overlap_grad_sync: True", "fp8_amax_history_len: 1024"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-gpt3-20b", table="nemo-24.07", release="24.07", model="GPT3-20B", shape="gpt3-20b",
         layout=dict(gpus=64, gbs=256, mbs=2, seq=2048, tp=2, pp=1, cp=1, vp=1),
         flags=f"{_NEMO1} {_BF16_GRADS} --sequence-parallel --tp-comm-overlap --fp8-amax-history-len 1024 "
               "--fp8-amax-compute-algo max",
         recipe=launcher("gpt3/20b", "gpt/h100/20b_fp8_8node",
                         ["sequence_parallel: True", "ub_tp_comm_overlap: True", "overlap_param_sync: true"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-gpt3-175b-128", table="nemo-24.07", release="24.07", model="GPT3-175B",
         pick={"#-GPUs": 128}, shape="gpt3-175b",
         layout=dict(gpus=128, gbs=256, mbs=1, seq=2048, tp=4, pp=8, cp=1, vp=6),
         flags=f"{_NEMO1} {_BF16_GRADS} --sequence-parallel --fp8-amax-history-len 1024 "
               "--fp8-amax-compute-algo max",
         recipe=launcher("gpt3/175b", "gpt/h100/175b_fp8_16node",
                         ["sequence_parallel: True", "ub_tp_comm_overlap: False", "overlap_p2p_comm: True"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-gpt3-175b-512", table="nemo-24.07", release="24.07", model="GPT3-175B",
         pick={"#-GPUs": 512}, shape="gpt3-175b",
         layout=dict(gpus=512, gbs=2048, mbs=2, seq=2048, tp=4, pp=8, cp=1, vp=6),
         flags=f"{_NEMO1} {_BF16_GRADS} --sequence-parallel --fp8-amax-history-len 1024 "
               "--fp8-amax-compute-algo max",
         recipe=launcher("gpt3/175b", "gpt/h100/175b_fp8_16node",
                         ["sequence_parallel: True", "ub_tp_comm_overlap: False", "overlap_p2p_comm: True"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-llama2-7b", table="nemo-24.07", release="24.07", model="LLAMA2-7B", shape="llama2-7b",
         layout=dict(gpus=8, gbs=128, mbs=1, seq=4096, tp=1, pp=1, cp=1, vp=1),
         flags=f"{_NEMO1} {_BF16_GRADS} --fp8-amax-history-len 1024 --fp8-amax-compute-algo max",
         recipe=launcher("llama/llama2_7b", "llama/h100/llama2_7b_fp8",
                         ["sequence_parallel: false", "use_flash_attention: true", "fp8_amax_history_len: 1024"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-llama2-13b", table="nemo-24.07", release="24.07", model="LLAMA2-13B",
         shape="llama2-13b", layout=dict(gpus=16, gbs=128, mbs=1, seq=4096, tp=1, pp=4, cp=1, vp=10),
         flags=f"{_NEMO1} {_BF16_GRADS} --fp8-amax-history-len 1 --fp8-amax-compute-algo most_recent",
         recipe=launcher("llama/llama2_13b", "llama/h100/llama2_13b_fp8",
                         ["virtual_pipeline_model_parallel_size: 10", "overlap_p2p_comm: true",
                          "fp8_amax_compute_algo: most_recent"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-llama2-70b", table="nemo-24.07", release="24.07", model="LLAMA2-70B",
         shape="llama2-70b", layout=dict(gpus=64, gbs=128, mbs=1, seq=4096, tp=4, pp=4, cp=1, vp=20),
         flags=f"{_NEMO1} {_BF16_GRADS} --sequence-parallel --tp-comm-overlap --fp8-amax-history-len 1 "
               "--fp8-amax-compute-algo most_recent",
         recipe=launcher("llama/llama2_70b", "llama/h100/llama2_70b_fp8",
                         ["sequence_parallel: true", "ub_tp_comm_overlap: true",
                          "virtual_pipeline_model_parallel_size: 20"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-nemotron-8b", table="nemo-24.07", release="24.07", model="Nemotron-8B",
         shape="nemotron3-8b", layout=dict(gpus=64, gbs=256, mbs=4, seq=4096, tp=2, pp=1, cp=1, vp=1),
         flags=f"{_NEMO1} --sequence-parallel --tp-comm-overlap --cross-entropy-loss-fusion "
               "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max",
         recipe=launcher("nemotron/nemotron_8b", "nemotron/h100/nemotron_8b_fp8",
                         ["sequence_parallel: true", "ub_tp_comm_overlap: true", "cross_entropy_loss_fusion: true",
                          "activation: squared-relu"])),
    dict(name="nemo-24.07-nemotron-22b", table="nemo-24.07", release="24.07", model="Nemotron-22B",
         shape="nemotron3-22b", layout=dict(gpus=64, gbs=256, mbs=2, seq=4096, tp=2, pp=4, cp=1, vp=10),
         flags=f"{_NEMO1} --sequence-parallel --tp-comm-overlap --cross-entropy-loss-fusion "
               "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max",
         recipe=launcher("nemotron/nemotron_22b", "nemotron/h100/nemotron_22b_fp8",
                         ["ub_tp_comm_overlap: True", "overlap_p2p_comm: True", "cross_entropy_loss_fusion: true"])),
    dict(name="nemo-24.07-nemotron4-340b", table="nemo-24.07", release="24.07", model="Nemotron-340B",
         shape="nemotron4-340b", layout=dict(gpus=128, gbs=32, mbs=1, seq=4096, tp=8, pp=8, cp=1, vp=12),
         flags=f"{_NEMO1} {_NEMO1_ADAM_BF16} --sequence-parallel --recompute-granularity selective "
               "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max",
         recipe=launcher("nemotron/nemotron_340b", None,
                         ["activations_checkpoint_granularity: selective", "grad_sync_dtype: bf16", "dtype: bf16",
                          "ub_tp_comm_overlap: False", "num_query_groups: 8"])),
    dict(name="nemo-24.07-llama3-8b", table="nemo-24.07", release="24.07", model="LLAMA3-8B", shape="llama3-8b",
         layout=dict(gpus=8, gbs=128, mbs=1, seq=8192, tp=1, pp=1, cp=2, vp=1),
         flags=f"{_NEMO1} {_BF16_GRADS} --cross-entropy-loss-fusion --fp8-amax-history-len 1024 "
               "--fp8-amax-compute-algo max",
         recipe=launcher("llama/llama3_8b", "llama/h100/llama3_8b_fp8",
                         ["context_parallel_size: 2", "cross_entropy_loss_fusion: true", "sequence_parallel: false"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    dict(name="nemo-24.07-llama3-70b", table="nemo-24.07", release="24.07", model="LLAMA3-70B",
         shape="llama3-70b", layout=dict(gpus=64, gbs=128, mbs=1, seq=8192, tp=4, pp=4, cp=2, vp=5),
         flags=f"{_NEMO1} {_BF16_GRADS} --sequence-parallel --tp-comm-overlap --cross-entropy-loss-fusion "
               "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max",
         recipe=launcher("llama/llama3_70b", "llama/h100/llama3_70b_fp8",
                         ["sequence_parallel: true", "ub_tp_comm_overlap: true", "overlap_p2p_comm: true"],
                         ["+training.model.optim.grad_sync_dtype=bf16"])),
    # ---- Megatron-Bridge, DGX-H100 (docs/performance-summary-archive.md)
    dict(name="bridge-25.09-llama3-8b-fsdp", table="bridge", release="25.09", model="LLAMA3_8B", shape="llama3-8b",
         layout=dict(gpus=8, gbs=128, mbs=1, seq=8192, tp=1, pp=1, cp=1, vp=None, ep=1, fsdp=1),
         flags=f"{_BRIDGE_FP8CS} --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
         recipe=[("scripts/performance/configs/llama3/llama3_8b_llm_pretrain.yaml",
                  ["use_megatron_fsdp: true", "grad_reduce_in_fp32: false"]),
                 ("scripts/performance/utils/helpers.py", ["current_scaling_cfg.first_last_layers_bf16 = False"]),
                 _MIXED_PRECISION]),
    dict(name="bridge-25.11-llama3-70b-gbs128", table="bridge", release="25.11", model="LLAMA3_70B",
         shape="llama3-70b",
         layout=dict(gpus=64, gbs=128, mbs=1, seq=8192, tp=4, pp=8, cp=1, vp=5, ep=1, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --tp-comm-overlap",
         recipe=[("scripts/performance/configs/llama3/workload_base_configs.py",
                  ["LLAMA3_70B_H100_FP8_CS_BASE_CONFIG", "pipeline_model_parallel_size=8"]),
                 ("scripts/performance/configs/llama3/llama3_llm_pretrain.py",
                  ["cfg.ddp.grad_reduce_in_fp32 = False", "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"]),
                 ("src/megatron/bridge/recipes/llama/llama3.py",
                  ["overlap_grad_reduce=True", "overlap_param_gather=True", "use_distributed_optimizer=True"]),
                 _MIXED_PRECISION]),
    dict(name="bridge-26.04.01-llama3-70b-gbs256", table="bridge", release="26.04.01", model="LLAMA3_70B",
         shape="llama3-70b",
         layout=dict(gpus=64, gbs=256, mbs=1, seq=8192, tp=4, pp=8, cp=1, vp=5, ep=None, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --tp-comm-overlap",
         recipe=[("scripts/performance/configs/llama/llama3_workload_base_configs.py",
                  ["LLAMA3_70B_PRETRAIN_CONFIG_H100_FP8_CS_V2", "BASE_LLAMA3_70B_CONFIG_GBS256"]),
                 ("scripts/performance/configs/llama/llama3_llm_pretrain.py",
                  ["cfg.ddp.grad_reduce_in_fp32 = False", "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"]),
                 _MIXED_PRECISION]),
    dict(name="bridge-25.11-llama3.1-405b-gbs512", table="bridge", release="25.11", model="LLAMA3.1_405B",
         shape="llama3.1-405b",
         layout=dict(gpus=1024, gbs=512, mbs=1, seq=8192, tp=8, pp=8, cp=2, vp=8, ep=1, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --tp-comm-overlap --account-for-embedding-in-pipeline-split "
               "--account-for-loss-in-pipeline-split",
         recipe=[("scripts/performance/configs/llama31/workload_base_configs.py",
                  ["LLAMA31_405B_H100_FP8_CS_BASE_CONFIG", "global_batch_size=512"]),
                 ("scripts/performance/configs/llama31/llama31_llm_pretrain.py",
                  ["cfg.ddp.grad_reduce_in_fp32 = False", "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192"]),
                 ("src/megatron/bridge/recipes/llama/llama3.py",
                  ['"account_for_embedding_in_pipeline_split": True', '"account_for_loss_in_pipeline_split": True']),
                 _MIXED_PRECISION]),
    dict(name="bridge-26.06-llama3.1-405b-gbs1536", table="bridge", release="26.06", model="LLAMA3.1_405B",
         shape="llama3.1-405b",
         layout=dict(gpus=1024, gbs=1536, mbs=1, seq=8192, tp=8, pp=8, cp=2, vp=8, ep=None),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --tp-comm-overlap --account-for-embedding-in-pipeline-split "
               "--account-for-loss-in-pipeline-split",
         recipe=[("scripts/performance/configs/llama/llama31_workload_base_configs.py",
                  ["LLAMA31_405B_PRETRAIN_CONFIG_H100_FP8_CS_V2", "global_batch_size=1536"]),
                 ("scripts/performance/configs/llama/llama31_llm_pretrain.py",
                  ["cfg.ddp.grad_reduce_in_fp32 = False", "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192"]),
                 _MIXED_PRECISION]),
    dict(name="bridge-26.02-qwen3-30b-a3b-pp2", table="bridge", release="26.02", model="Qwen3_30B_a3B",
         shape="qwen3-30b-a3b",
         layout=dict(gpus=16, gbs=1024, mbs=1, seq=4096, tp=1, pp=2, cp=1, vp=12, ep=8, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --expert-tensor-parallel-size 1 --moe-token-dispatcher-type flex "
               "--moe-flex-dispatcher-backend deepep --moe-router-force-load-balancing "
               "--overlap-moe-expert-parallel-comm --delay-wgrad-compute",
         recipe=[("scripts/performance/configs/qwen/qwen3_workload_base_configs.py",
                  ["QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1", "moe_a2a_overlap=True",
                   'moe_flex_dispatcher_backend="deepep"']),
                 ("scripts/performance/configs/qwen/qwen3_llm_pretrain.py",
                  ["cfg.model.moe_router_force_load_balancing = True", "cfg.model.recompute_granularity = None"]),
                 ("src/megatron/bridge/training/flex_dispatcher_backend.py",
                  ['model_config.moe_token_dispatcher_type = "flex"']),
                 _MIXED_PRECISION]),
    dict(name="bridge-26.06-qwen3-30b-a3b-ep16", table="bridge", release="26.06", model="Qwen3_30B_a3B",
         shape="qwen3-30b-a3b",
         layout=dict(gpus=16, gbs=1024, mbs=1, seq=4096, tp=1, pp=1, cp=1, vp=None, ep=16),
         flags=f"{_BRIDGE_FP8CS} --expert-tensor-parallel-size 1 --moe-token-dispatcher-type flex "
               "--moe-flex-dispatcher-backend hybridep --moe-router-force-load-balancing",
         recipe=[("scripts/performance/configs/qwen/qwen3_workload_base_configs.py",
                  ["QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1", "expert_model_parallel_size=16",
                   'moe_flex_dispatcher_backend="hybridep"', "moe_a2a_overlap=False"]),
                 ("scripts/performance/configs/qwen/qwen3_llm_pretrain.py",
                  ['cfg.model.moe_token_dispatcher_type = "flex"', "cfg.model.recompute_granularity = None"]),
                 _MIXED_PRECISION]),
    dict(name="bridge-25.09-qwen3-235b-a22b-tokendrop", table="bridge", release="25.09",
         model="Qwen3_235B_a22B (tokendrop)", shape="qwen3-235b-a22b",
         layout=dict(gpus=256, gbs=2048, mbs=1, seq=4096, tp=2, pp=8, cp=1, vp=4, ep=32, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --tp-comm-overlap --expert-tensor-parallel-size 1 "
               "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 "
               "--moe-pad-expert-input-to-capacity --account-for-embedding-in-pipeline-split "
               "--account-for-loss-in-pipeline-split",
         recipe=[("scripts/performance/configs/qwen3/qwen3_235b_a22b_llm_pretrain.yaml",
                  ["ep: 32", "vp: 4", "grad_reduce_in_fp32: false"]),
                 ("scripts/performance/run_script.py",
                  ["recipe.model = apply_moe_token_drop(recipe.model)", "CommOverlapConfig(tp_comm_overlap=True)"]),
                 ("src/megatron/bridge/training/utils/moe_token_drop.py",
                  ["moe_expert_capacity_factor: float = 1.0", "moe_pad_expert_input_to_capacity: bool = True"]),
                 ("src/megatron/bridge/recipes/qwen/qwen3_235b_a22b.py",
                  ["account_for_embedding_in_pipeline_split=True", "overlap_param_gather=True"]),
                 ("src/megatron/bridge/models/qwen/qwen_provider.py", ['moe_token_dispatcher_type: str = "alltoall"']),
                 _MIXED_PRECISION]),
    dict(name="bridge-25.11-qwen3-235b-a22b-gbs2048", table="bridge", release="25.11", model="Qwen3_235B_a22B",
         shape="qwen3-235b-a22b",
         layout=dict(gpus=256, gbs=2048, mbs=1, seq=4096, tp=2, pp=8, cp=1, vp=4, ep=32, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --tp-comm-overlap --expert-tensor-parallel-size 1 "
               "--moe-token-dispatcher-type alltoall --moe-router-force-load-balancing "
               "--overlap-moe-expert-parallel-comm --delay-wgrad-compute",
         recipe=[("scripts/performance/configs/qwen3/workload_base_configs.py",
                  ["QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG", "moe_a2a_overlap=True"]),
                 ("scripts/performance/configs/qwen3/qwen3_llm_pretrain.py",
                  ["comm_overlap_config=CommOverlapConfig(tp_comm_overlap=True)",
                   "cfg.model.moe_router_force_load_balancing = True"]),
                 ("scripts/performance/utils/helpers.py",
                  ["recipe.comm_overlap.overlap_moe_expert_parallel_comm = True",
                   "recipe.comm_overlap.delay_wgrad_compute = True"]),
                 _MIXED_PRECISION]),
    dict(name="bridge-26.04.01-qwen3-235b-a22b-gbs8192", table="bridge", release="26.04.01", model="Qwen3_235B_a22B",
         shape="qwen3-235b-a22b",
         layout=dict(gpus=256, gbs=8192, mbs=1, seq=4096, tp=2, pp=8, cp=1, vp=4, ep=32, fsdp=0),
         flags=f"{_BRIDGE_FP8CS} --sequence-parallel --expert-tensor-parallel-size 1 "
               "--moe-token-dispatcher-type alltoall --moe-router-force-load-balancing "
               "--overlap-moe-expert-parallel-comm --delay-wgrad-compute",
         recipe=[("scripts/performance/configs/qwen/qwen3_workload_base_configs.py",
                  ["QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2", "global_batch_size=8192"]),
                 ("scripts/performance/configs/qwen/qwen3_llm_pretrain.py",
                  ["cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)",
                   'cfg.model.moe_token_dispatcher_type = "alltoall"']),
                 _MIXED_PRECISION]),
]

# Rows of the tables not in the set, by the reason (matched on model name, release, row): anything H100
# not picked above must be named here, so a table change cannot go unnoticed.
NOT_MODELLED = {
    "GPT OSS 120B": "sliding-window attention on half its layers and attention sinks: not in the speed model",
    "Nemotron_3_Nano": "hybrid Mamba-Transformer: the speed model has no Mamba layer",
}
SUPERSEDED = {
    ("25.11", "LLAMA3_8B"): "the 25.11 table prints FSDP 8 where its recipe (v0.2.0) runs DDP with 5 layers "
                            "recomputed; the layout is kept from 25.09, whose recipe gives it",
    ("25.09", "LLAMA3_70B"): "the same layout and recipe in 25.11",
    ("25.09", "LLAMA3.1_405B"): "the same layout and recipe in 25.11",
    ("26.02", "LLAMA3_70B"): "the same layout and recipe in 26.04.01",
    ("26.02.01", "LLAMA3_70B"): "the same layout and recipe in 26.04.01",
    ("26.02", "LLAMA3.1_405B"): "the same layout and recipe in 26.06",
    ("26.04.01", "LLAMA3.1_405B"): "the same layout and recipe in 26.06",
    ("26.02.01", "Qwen3_30B_a3B"): "the table prints PP 2 VP 12 EP 8, its recipe (v0.3.1) runs EP 16 with HybridEP",
    ("26.04.01", "Qwen3_30B_a3B"): "the same layout and recipe in 26.06",
    ("25.09", "Qwen3_30B_a3B (tokendrop)"): "the table prints VP 24 and MBS 2, its recipe (r0.1.0) VP 12",
    ("25.11", "Qwen3_30B_a3B"): "the table prints VP 24 and MBS 2, its recipe (v0.2.0) VP 12 and MBS 1",
    ("26.02", "Qwen3_235B_a22B"): "the same layout and recipe in 26.04.01",
    ("26.02.01", "Qwen3_235B_a22B"): "the same layout and recipe in 26.04.01",
}


# --------------------------------------------------------------------------------------------
# Reading the mirrors
# --------------------------------------------------------------------------------------------
def _number(cell: str) -> float | None:
    """A table cell's first number ('338 (330)' -> 338); None for 'n/a' or an empty cell."""
    found = re.match(r"\s*([0-9][0-9,]*(?:\.[0-9]+)?)", cell)
    return float(found.group(1).replace(",", "")) if found else None


COLUMNS = {"#-GPUs": "gpus", "GBS": "gbs", "MBS": "mbs", "Sequence Length": "seq", "TP": "tp", "PP": "pp",
           "CP": "cp", "VP": "vp", "EP": "ep", "FSDP": "fsdp", "Tokens / sec / GPU": "tokens",
           "Model TFLOP / sec / GPU": "tflops"}


def parse_tables(text: str, default_release: str | None = None) -> list[dict]:
    """Every H100 pre-training row of a performance summary (markdown): its release, system, model,
    precision and the COLUMNS, as numbers; left-out releases and models are skipped by name before their
    numbers are read."""
    rows, release, system, model, header, pretraining = [], default_release, None, None, None, True
    for line in text.splitlines():
        if heading := re.match(r"##\s+([0-9.]+) NeMo Container", line):
            release, system, model, header = heading.group(1), None, None, None
        elif re.match(r"###\s+(Pre-?[Tt]raining)", line):
            pretraining, header = True, None
        elif re.match(r"###\s+", line) and not line.startswith("####"):
            pretraining, header = False, None
        elif heading := re.match(r"####\s+Model:\s*(.+)", line):
            model, system, header = heading.group(1).strip(), None, None
        elif heading := re.match(r"####\s+System:\s*(.+)", line):
            system, model, header = heading.group(1).strip(), None, None
        elif bullet := re.match(r"\s*- System:\s*(.+)", line):
            system = bullet.group(1).strip()
        elif line.startswith("|") and not re.match(r"\|\s*-", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in ("Model", "System"):
                header = cells
                continue
            if header is None or not pretraining or release in LEFT_OUT_RELEASES:
                continue
            row = dict(zip(header, cells))
            name = row.get("Model", model) or ""
            where = row.get("System", system) or ""
            if "H100" not in where or any(word in name.lower() for word in LEFT_OUT_MODELS):
                continue
            parsed = {"release": release, "system": where, "model": name, "precision": row.get("Precision")}
            parsed.update({key: _number(row[column]) for column, key in COLUMNS.items() if column in row})
            rows.append(parsed)
    return rows


def megatron_args(spec: dict) -> str:
    """The row's `pretrain_gpt.py` flags: model shape, layout, batch and the recipe's settings."""
    lay = spec["layout"]
    words = [MODELS[spec["shape"]], f"--seq-length {lay['seq']} --max-position-embeddings {lay['seq']}",
             f"--micro-batch-size {lay['mbs']} --global-batch-size {lay['gbs']}",
             f"--tensor-model-parallel-size {lay['tp']} --pipeline-model-parallel-size {lay['pp']}"]
    if (lay.get("vp") or 1) > 1:
        words.append(f"--num-virtual-stages-per-pipeline-rank {lay['vp']}")
    if lay["cp"] > 1:
        words.append(f"--context-parallel-size {lay['cp']}")
    if (lay.get("ep") or 1) > 1:
        words.append(f"--expert-model-parallel-size {lay['ep']}")
    words.append(spec["flags"])
    return " ".join(" ".join(words).split())


def _check_layout(spec: dict, table_row: dict) -> None:
    for key, value in spec["layout"].items():
        got = table_row.get(key)
        if got is None and value in (None, 1) and key in ("vp", "ep", "cp"):
            continue
        if (got or None) != (value or None) and not (key == "fsdp" and value == 1 and (got or 0) >= 1):
            raise ValueError(f"{spec['name']}: the table gives {key} = {got}, the row says {value}")


def _check_recipe(checkout: Path, commit: str, files: list, name: str) -> None:
    for path, evidence in files:
        text = git(checkout, "show", f"{commit}:{path}")
        for line in evidence:
            if line not in text:
                raise ValueError(f"{name}: {path} at {commit[:10]} does not hold {line!r}")


def build(mirrors: dict[str, Path]) -> tuple[list[dict], list[tuple[str, str]]]:
    """(the dev set, [(table row, why it was left out)])."""
    tables = {}
    for key, (repo, commit, path) in TABLES.items():
        text = git(mirrors[repo], "show", f"{commit}:{path}")
        tables[key] = parse_tables(text, default_release="24.07" if key == "nemo-24.07" else None)
    items, used = [], set()
    for spec in ROWS:
        candidates = [r for r in tables[spec["table"]] if r["release"] == spec["release"]
                      and r["model"] == spec["model"] and all(r.get(COLUMNS.get(k, k)) == v
                                                               for k, v in spec.get("pick", {}).items())]
        if len(candidates) != 1:
            raise ValueError(f"{spec['name']}: {len(candidates)} table rows match, expected one")
        found = candidates[0]
        used.add(id(found))
        _check_layout(spec, found)
        repo, commit, ref = RECIPES[spec["release"]]
        _check_recipe(mirrors[repo], commit, spec["recipe"], spec["name"])
        table_repo, table_commit, table_path = TABLES[spec["table"]]
        lay = spec["layout"]
        items.append({
            "name": spec["name"],
            "model": spec["shape"],
            "hardware": HARDWARE,
            "world_size": lay["gpus"],
            "gpus_per_node": GPUS_PER_NODE,
            "megatron_args": megatron_args(spec),
            "measured_tokens_per_s_per_gpu": found["tokens"],
            "measured_tflops_per_gpu": found["tflops"],
            "precision": PRECISION[spec["table"]],
            "source": {
                "table": {"repository": REPOSITORIES[table_repo], "commit": table_commit, "path": table_path,
                          "release": spec["release"], "model": spec["model"]},
                "recipe": {"repository": REPOSITORIES[repo], "commit": commit, "ref": ref,
                           "paths": [path for path, _ in spec["recipe"]]},
            },
        })
    left_out = []
    for key, rows in tables.items():
        for row in rows:
            if id(row) in used:
                continue
            label = f"{row['release']} {row['model']} ({row.get('gpus'):.0f} GPUs, GBS {row.get('gbs'):.0f})"
            why = NOT_MODELLED.get(row["model"]) or SUPERSEDED.get((row["release"], row["model"]))
            if why is None:
                raise ValueError(f"{label}: an H100 row that is neither in the set nor left out with a reason")
            left_out.append((label, why))
    return items, left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, name in REPOSITORIES.items():
        parser.add_argument(f"--{key}", type=Path, required=True, help=f"a git mirror of {name}")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    mirrors = {key: getattr(args, key) for key in REPOSITORIES}
    return build_and_write("build_public_dev", lambda: build(mirrors), args.out)


if __name__ == "__main__":
    sys.exit(main())
