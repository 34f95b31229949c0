"""The profiler window of an experiment (`telemetry.profile_steps`, `telemetry.profile_scope`): which
ranks record which steps, where the traces go, and what it costs, said before the run (plan, the
launch's dry run, the manifest) from the layout alone. The workload records them
(engine.workload.profiler); the kernel summary reads them (probes.analysis.kernels).

Ranks follow Megatron's default order (tp-cp-ep-dp-pp: the pipeline stage is the outermost), so
stage s holds global ranks s*W/PP .. (s+1)*W/PP - 1 and its first rank (tensor, context and data
parallel rank 0) is s*W/PP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from charllm.probes.core.errors import plural
from charllm.probes.core.formatting import size
from charllm.probes.store.rundir import TRACES

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment

# What one profiled step writes, per layer and micro-batch on the rank, and besides: measured on
# tiny CPU runs (about 600 op events a layer and micro-batch, ~170 bytes each); a GPU trace adds a
# kernel and a runtime event for most ops, about twice that. An estimate to plan disk and copying
# time by, not a promise: `runs show` and the manifest give what was written.
BYTES_PER_LAYER_MICROBATCH = {"cpu": 110_000, "cuda": 250_000}
BYTES_PER_STEP = 400_000   # the optimizer step, the loss, the pipeline's sends and receives
# The profiler's cost on a recorded step: every op is recorded (on a GPU also every kernel, by
# CUPTI), and the trace is written before the step ends. The other ranks wait for it at the step's end.
SLOWDOWN = (
    "the recorded steps run slower on every rank (each op is recorded, and the trace written before the step ends)"
)


def trace_name(rank: int, step: int) -> str:
    """A trace's file name in traces/: rank00003-step000010.pt.trace.json (Kineto's suffix)."""
    return f"rank{rank:05d}-step{step:06d}.pt.trace.json"


@dataclass(frozen=True)
class ProfilePlan:
    steps: tuple[int, ...]
    scope: str                   # "stage": each stage's first rank; "all": every rank
    ranks: tuple[int, ...]       # the global ranks that record
    trace_bytes: int             # estimated size of one rank's trace of one step

    @property
    def total_bytes(self) -> int:
        return self.trace_bytes * len(self.ranks) * len(self.steps)

    def describe(self) -> str:
        """One line: what is recorded, where, and what it costs."""
        who = "every rank" if self.scope == "all" else f"the first rank of each pipeline stage ({_ranks(self.ranks)})"
        steps = ", ".join(map(str, self.steps[:8])) + (
            f" and {len(self.steps) - 8} more" if len(self.steps) > 8 else ""
        )
        return (f"profiler: {plural(len(self.steps), 'step')} ({steps}) on {who}: "
                f"{plural(len(self.ranks) * len(self.steps), 'trace')} into {TRACES}/, about "
                f"{size(self.trace_bytes)} each ({size(self.total_bytes)} in all); {SLOWDOWN}")

    def to_dict(self) -> dict:
        return {"steps": list(self.steps), "scope": self.scope, "ranks": list(self.ranks),
                "estimated_bytes": self.total_bytes}


def plan(exp: Experiment, device: str | None = None) -> ProfilePlan | None:
    """The experiment's profiler window, or None when it records nothing. `device` ("cpu" or
    "cuda"): what the trace size is estimated for; default from the hardware."""
    tel = exp.telemetry
    if not tel.profile_steps:
        return None
    world, pp = exp.world_size, exp.parallel.pipeline_model_parallel_size
    ranks = tuple(range(world)) if tel.profile_scope == "all" else tuple(s * world // pp for s in range(pp))
    device = device or ("cpu" if exp.hardware.vendor == "cpu" else "cuda")
    layers = -(-exp.model.num_layers // pp)   # the busiest stage's
    per_step = BYTES_PER_STEP + BYTES_PER_LAYER_MICROBATCH[device] * layers * exp.num_microbatches
    return ProfilePlan(tuple(sorted(tel.profile_steps)), tel.profile_scope, ranks, per_step)


def _ranks(ranks) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
