"""Megatron-LM's own training script, one process per rank under torchrun:
`python -m torch.distributed.run ... -m charllm.engine.workload.megatron_lm DIR/pretrain_gpt.py FLAGS...`.

It runs the script as `python DIR/pretrain_gpt.py FLAGS` would: DIR first on the path, so the checkout's
own `megatron` package (training and core) and its helpers (gpt_builders, model_provider) are the ones
imported. On a GPU that is all it does.

Without CUDA it trains on the CPU through the workload's compatibility layer (cpu_compat: the virtual
CUDA device, gloo), plus what Megatron-LM's `megatron/training` hard-wires to CUDA. The rule is the
workload's: redirect devices, never hide what a GPU would fail. Each redirection below names the line of
Megatron-LM it answers (tags core_v0.16.1 and core_v0.19.0); nothing else is changed:

- `--distributed-backend gloo` is added unless the flags name a backend: the default is nccl
  (arguments.py:2235 at core_v0.16.1, config/common_config.py:74 at core_v0.19.0), which needs CUDA.
- `initialize_megatron` asserts `torch.cuda.is_available()` (initialize.py:62; :66) unless called with
  `allow_no_cuda=True`, its own switch for running without CUDA: pretrain() never passes it.
- `torch.cuda.device_count()` answers 1, the one virtual device of this process: without a device
  Megatron skips `mpu.initialize_model_parallel` (initialize.py:319; :270) and the model-parallel RNG seeds
  (initialize.py:422; :447), so no model could be built.
- `fused_kernels.load` (initialize.py:224, core_v0.16.1 only) reads nvcc's version (legacy/fused_kernels/
  __init__.py:21) and builds nothing: there is no nvcc on a CPU node, so it is skipped.
- `import triton` (initialize.py:25 imports custom_layers/batch_invariant_kernels.py, whose line 15
  imports triton unguarded at core_v0.16.1; core_v0.19.0 guards it itself): triton is a GPU compiler, absent
  on a CPU node. A stand-in module lets the import succeed; any kernel it declares raises when launched
  (the batch-invariant mode, `--batch-invariant-mode`, cannot run on a CPU).
- torch.compile is off (torch._dynamo disabled): `_warmup_jit_function` (initialize.py:460; :494) runs the
  torch.compile'd fusions whatever the flags say, and compiling them for the CPU under the device mode takes
  minutes; they run eagerly, the same arithmetic.
- `_warmup_jit_function` (initialize.py:463; :497) draws its warm-up inputs with `torch.rand(...,
  device="cuda")`: on a GPU from CUDA's generator, on the virtual device from the CPU's, which the model's
  initialization and data order draw from next; the CPU generator's state is put back after it, so the
  same seed gives the same model as on a GPU (and as charllm's workload).
- `get_device_arch_version()` (arguments.py:928; :1414, with tensor or context parallelism) asks CUDA for
  device 0's architecture: it answers 9 (Hopper), so the checks before Blackwell hold, the stricter ones
  (CUDA_DEVICE_MAX_CONNECTIONS=1, which `export megatron --script` sets).
Megatron's memory report reads torch's CUDA allocator, which holds nothing on a CPU: it prints zeros.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import runpy
import sys
import types
from pathlib import Path

USAGE = "usage: python -m charllm.engine.workload.megatron_lm PRETRAIN_SCRIPT [FLAGS...]"


class _Kernel:
    """A triton kernel declared on a node without triton: launching it is an error, as it would be."""

    def __init__(self, fn=None):
        self.fn = fn

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        name = getattr(self.fn, "__name__", "a triton kernel")
        raise RuntimeError(f"{name} is a triton (GPU) kernel: it cannot run on a CPU node")


class _Language(types.ModuleType):
    """triton.language's names as annotations and constants (`tl.constexpr`) for declarations only."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Kernel()


def _triton_stand_in() -> None:
    """Register a stand-in `triton` for an import that declares kernels (see the module docstring)."""
    if importlib.util.find_spec("triton") is not None:
        return
    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    language = _Language("triton.language")
    language.__spec__ = importlib.machinery.ModuleSpec("triton.language", None)
    setattr(triton, "jit", lambda fn=None, **options: _Kernel(fn) if fn is not None else _Kernel)
    setattr(triton, "autotune", lambda *args, **options: _Kernel)
    setattr(triton, "Config", lambda *args, **options: None)
    setattr(triton, "cdiv", lambda a, b: -(-a // b))
    setattr(triton, "language", language)
    sys.modules["triton"], sys.modules["triton.language"] = triton, language


def on_cpu(argv: list[str]) -> list[str]:
    """Ready this process to train Megatron-LM on the CPU; the flags to run with (gloo added)."""
    import torch  # deferred: after the checkout is on the path (main)

    from charllm.engine.workload import cpu_compat  # deferred: loads megatron-core (the checkout's)

    cpu_compat.apply()
    torch._dynamo.config.disable = True
    torch.cuda.device_count = lambda: 1
    _triton_stand_in()
    import megatron.training.initialize as initialize  # deferred: the checkout's, once it is on the path

    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    import megatron.training.training as training  # deferred: as above

    training.initialize_megatron = initialize_megatron   # (bound by name at its import)
    warmup = initialize._warmup_jit_function

    def warmup_jit_function(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return warmup(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    initialize._warmup_jit_function = warmup_jit_function
    import megatron.training.arguments as arguments  # deferred: as above

    arguments.get_device_arch_version = lambda: 9      # (imported by name; see the module docstring)
    fused = getattr(initialize, "fused_kernels", None)
    if fused is not None:
        fused.load = lambda args: None
    named = any(flag == "--distributed-backend" or flag.startswith("--distributed-backend=") for flag in argv)
    return argv if named else [*argv, "--distributed-backend", "gloo"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or not argv[0].endswith(".py"):
        print(USAGE, file=sys.stderr)
        return 2
    script = Path(argv[0]).resolve()
    if not script.is_file():
        print(f"megatron_lm: {script}: no such script (is MEGATRON_LM a Megatron-LM checkout?)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(script.parent))   # as `python SCRIPT` puts the script's directory first
    flags = argv[1:]
    from charllm.engine.workload import cpu_compat  # deferred: loads torch (after the checkout is on the path)

    if cpu_compat.needed():
        flags = on_cpu(flags)
    sys.argv = [str(script), *flags]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
