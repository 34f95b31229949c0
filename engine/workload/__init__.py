"""The Megatron-Core training workload: runs on compute nodes under torchrun."""
