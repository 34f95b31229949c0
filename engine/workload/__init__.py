"""The Megatron-Core training workload: runs on compute nodes under torchrun."""

# Exit status of a rank that stopped cleanly after SIGTERM (128 + SIGTERM, as a shell reports it).
CANCELLED_EXIT = 143

# How a launch starts the ranks: torchrun as `python -m torch.distributed.run` (the target's python
# picks its torch), which starts this workload's module on every rank.
TORCHRUN_MODULE = "torch.distributed.run"
TRAIN_MODULE = "charllm.engine.workload.train"
