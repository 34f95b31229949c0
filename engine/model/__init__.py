"""The experiment and everything computed from it without running anything: catalog, validation,
Megatron command lines, software-stack decisions, node calibrations, memory, sweep and FLOPs."""
