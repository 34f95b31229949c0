"""The Megatron-Core training workload: runs on compute nodes under torchrun."""

# Exit status of a rank that stopped cleanly after SIGTERM (128 + SIGTERM, as a shell reports it).
CANCELLED_EXIT = 143
