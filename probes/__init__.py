"""Telemetry: device backends, the per-node sampler and its recording format, summaries.

Headless: never imports textual. The lowest layer of charllm: it imports no other charllm package.
"""
