"""The domain and what acts on it.

- `model/`: the experiment, the catalog, validation, Megatron interop, the memory model, the layout
  sweep and the FLOP count: pure arithmetic and rules, no processes.
- `launch/`: targets (this machine, SSH nodes, Slurm), the launcher and the per-run supervisor.
- `workload/`: the Megatron-Core training that runs on compute nodes under torchrun.
- `doctor/`: checking a node (or every node of a target), one module per check.
- `campaign/`: many experiments as one job.

Headless: never imports textual. Only `engine.workload` imports torch / megatron.core.
"""
