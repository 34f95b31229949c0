"""The domain: catalog, experiments and their validation, Megatron interop, the memory model,
layout sweep, targets and launchers, and the Megatron-Core training workload.

Headless: never imports textual. Only `engine.workload` imports torch / megatron.core.
"""
