"""Telemetry: the per-node probe and what it records, and the analysis of recorded runs.

- `core/`: basics every charllm package uses: `UserError` and message wording, where things live,
  tying a process's life to its parent's.
- `backends/`: one interface over NVML, AMD SMI, the host, a simulator and a replay.
- `sampler.py`, `cli.py`: the probe itself (`python -m charllm.probes` on compute nodes).
- `store/`: the run directory, the telemetry schema, crash-safe recording, following a run, imports.
- `analysis/`: summaries, comparisons and baselines.

Headless: never imports textual. `tests/test_layering.py` holds the import rules.
"""
