"""What runs where: the software a node offers, what an experiment becomes on it, and every rule
for what cannot run there.

A `Stack` is one node's software: CUDA and its GPU's compute capability, which optional
extensions import (Transformer Engine, Apex, DeepEP, ...), and the host C compiler that
torch.compile needs. The training workload detects its own
(`detect()`); planning on a login node uses the stack that `charllm-tui doctor` calibrated on a node
of that hardware, else a stated assumption (`calibration.for_planning`).

`resolve(exp, stack)` says what will actually run: the transformer implementation, the attention
kernel and the fusions. `problems(exp, stack)` lists what cannot run on that stack or by this
workload, one line each. These are the only copies of those decisions: the workload builds its
model from them, the memory model plans with them, and plan, Compose and launch report them.

`transformer_impl = "auto"` (the default) means Transformer Engine where it imports on a CUDA
node, else megatron-core's local layers, with core attention through torch's
scaled_dot_product_attention (a flash-class kernel on GPUs).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from charllm.engine.model.experiment import Problem
from charllm.probes.store.rundir import implementation_words

if TYPE_CHECKING:
    from charllm.engine.model.experiment import Experiment

# Optional extensions the workload can use, by import name. Found = imports, not merely installed:
# a Transformer Engine built for another CUDA or torch is installed but unusable.
EXTENSIONS = (
    "transformer_engine",
    "apex",                                      # FusedLayerNorm (sequence parallel with LayerNorm)
    "deep_ep",                                   # the flex MoE token dispatcher
    "grouped_gemm",                              # MoE grouped GEMM without TE
    "fused_weight_gradient_mlp_cuda",            # gradient accumulation fusion (Apex)
    "scaled_upper_triang_masked_softmax_cuda",   # megatron's fused causal softmax kernel
)

# What NVIDIA's PyTorch container (nvcr.io/nvidia/pytorch) ships of these.
NVIDIA_CONTAINER = frozenset({"transformer_engine", "apex", "fused_weight_gradient_mlp_cuda",
                              "scaled_upper_triang_masked_softmax_cuda"})

# torch.nn.attention.SDPBackend names behind each backend choice on the local path.
SDPA_KERNELS = {"auto": None, "flash": ("FLASH_ATTENTION",), "fused": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}

# A stack not detected on its node (assumed, or calibrated before the compiler was checked) is taken
# to have a C compiler: NVIDIA's container has gcc.
ASSUMED_COMPILER = "cc (assumed)"
NO_COMPILER = ("torch.compile off: no working host C compiler (Triton builds its launchers with $CC, else "
               "gcc, else clang; install gcc or set CC): the bias-activation and bias-dropout fusions are off "
               "and megatron-core's compiled helpers run eagerly")


@dataclass(frozen=True)
class Stack:
    """One node's software, as far as the workload is concerned."""

    cuda: bool
    capability: tuple[int, int] | None = None   # the GPU's compute capability, (9, 0) on an H100
    extensions: frozenset[str] = frozenset()  # EXTENSIONS that import there
    source: str = "assumed"  # how we know: "found on NODE", "calibrated on NODE, DATE", "assumed for HW: ..."
    compiler: str | None = (
        ASSUMED_COMPILER  # the C compiler torch.compile can build with (host_compiler); None: none works
    )

    def has(self, extension: str) -> bool:
        return extension in self.extensions

    @property
    def te(self) -> bool:
        return self.cuda and self.has("transformer_engine")

    def to_dict(self) -> dict:
        return {"cuda": self.cuda, "capability": list(self.capability) if self.capability else None,
                "extensions": sorted(self.extensions), "compiler": self.compiler}

    @classmethod
    def from_dict(cls, data: dict, source: str) -> "Stack":
        capability = data.get("capability")
        compiler = data.get("compiler", ASSUMED_COMPILER)   # records made before the check have none
        return cls(cuda=bool(data.get("cuda")), capability=tuple(capability) if capability else None,
                   extensions=frozenset(e for e in data.get("extensions", []) if e in EXTENSIONS), source=source,
                   compiler=compiler if isinstance(compiler, str) else None)


def detect() -> Stack:
    """This process's stack (imports torch and tries every extension: on compute nodes only)."""
    import torch

    cuda = torch.cuda.is_available()
    found = set()
    for name in EXTENSIONS:
        try:
            # Some extensions print or warn when they import badly; that is an answer, not output.
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                importlib.import_module(name)
            found.add(name)
        except Exception:   # noqa: BLE001 - any failure to import means "not usable here"
            continue
    capability = torch.cuda.get_device_capability() if cuda else None
    return Stack(cuda=cuda, capability=capability, extensions=frozenset(found), source=f"found on {platform.node()}",
                 compiler=host_compiler())


@functools.cache
def host_compiler() -> str | None:
    """The C compiler torch.compile can build with on this node, else None.

    Inductor's GPU kernels are Triton's, and Triton compiles a small C launcher per kernel signature
    with the host compiler (triton/runtime/build.py: $CC, else gcc, else clang, with Python's
    headers); Inductor's CPU kernels need one too. So the check builds a tiny C extension the way
    Triton does, once per process: a compiler that is missing, broken or lacks Python.h fails here,
    not in iteration 1."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory(prefix="charllm-cc-") as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write("#include <Python.h>\nint charllm_probe(void) { return Py_IsInitialized(); }\n")
        try:
            done = subprocess.run([cc, source, "-O3", "-shared", "-fPIC", "-o", os.path.join(tmp, "probe.so"),
                                   f"-I{include}"], capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return (shutil.which(cc) or cc) if done.returncode == 0 else None


def assumed(hardware) -> Stack:
    """The stack assumed for hardware no node was calibrated for: NVIDIA GPUs as NVIDIA's PyTorch
    container has them (Megatron-LM's recommended environment: Transformer Engine, and Apex with its
    fused kernels), other GPUs without either, and no CUDA for the CPU."""
    if hardware.vendor == "cpu":
        return Stack(cuda=False, source=f"assumed for {hardware.name}: no GPU")
    capability = parse_capability(hardware.compute_capability)
    if hardware.vendor == "nvidia":
        return Stack(cuda=True, capability=capability, extensions=NVIDIA_CONTAINER,
                     source=f"assumed for {hardware.name}: NVIDIA's PyTorch container (Transformer Engine, Apex)")
    return Stack(
        cuda=True, capability=capability, source=f"assumed for {hardware.name}: GPU without Transformer Engine"
    )


def parse_capability(text: str | None) -> tuple[int, int] | None:
    """"9.0" -> (9, 0); None for none or a malformed value (engine.model.validate reports that)."""
    parts = (text or "").split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


# --------------------------------------------------------------------------------------------
# What runs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Implementation:
    transformer: str              # "transformer_engine" | "local"
    attention: str                # te-<backend> | sdpa | sdpa-flash | sdpa-fused | megatron-unfused
    fusions: tuple[str, ...] = field(default=())   # TransformerConfig fusion flags that are on
    device: str = "cuda"          # "cuda" (NCCL) | "cpu" (gloo, through cpu_compat)
    optimizer: str = "torch"      # whose Adam and multi-tensor kernels: rundir.OPTIMIZERS
    notes: tuple[str, ...] = field(default=())     # what is off on this node that Megatron-LM has on, and why

    @property
    def unfused_attention(self) -> bool:
        """Attention that materialises the s x s scores (and keeps softmax output for backward)."""
        return self.attention in ("megatron-unfused", "te-unfused")

    @property
    def sdpa_kernels(self) -> tuple[str, ...] | None:
        """torch SDPBackend names the local attention may use (None: torch chooses)."""
        return SDPA_KERNELS[self.attention.removeprefix("sdpa").lstrip("-") or "auto"] \
            if self.attention.startswith("sdpa") else None

    @property
    def compiles(self) -> bool:
        """Whether torch.compile may run (megatron-core compiles its fusions and some helpers)."""
        return NO_COMPILER not in self.notes

    def to_dict(self) -> dict:
        return {"transformer_impl": self.transformer, "attention": self.attention, "fusions": list(self.fusions),
                "device": self.device, "optimizer": self.optimizer, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> "Implementation":
        """The inverse of to_dict (records written before a field existed get its default)."""
        return cls(transformer=data["transformer_impl"], attention=data["attention"],
                   fusions=tuple(data.get("fusions", ())), device=data.get("device", "cuda"),
                   optimizer=data.get("optimizer", "torch"), notes=tuple(data.get("notes", ())))

    def describe(self) -> str:
        """What runs, in the words a run's record is read back in (`rundir.implementation_words`)."""
        return " · ".join(implementation_words(self.to_dict()))


def sdpa_takes_gqa(cuda: bool, half: bool, kernels: tuple[str, ...] | None) -> bool:
    """Whether torch's SDPA is handed grouped-query attention as is (`enable_gqa`, K and V not
    repeated per head), for tensors on CUDA or not, in half precision or not, with the kernels
    allowed (`Implementation.sdpa_kernels`; None: torch chooses).

    Only where a kernel surely takes it: FlashAttention-2 (CUDA, fp16/bf16) when flash is allowed;
    with torch choosing, its math fallback takes anything. torch 2.13's memory-efficient kernel
    does not take it (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp checks its inputs with
    check_batch_size_and_num_heads_dense<false>, "supports GQA" false), and cuDNN's, which does, is
    not always usable (fp32, older GPUs, some dropout and shape limits): restricted to those two
    ("fused"), SDPA would raise "No available kernel". Elsewhere K and V are expanded first."""
    return cuda and half and (kernels is None or "FLASH_ATTENTION" in kernels)


def transformer_impl(exp: Experiment, stack: Stack) -> str:
    """What `training.transformer_impl` becomes on `stack`: "transformer_engine" or "local"."""
    return _transformer(exp.training.transformer_impl, exp.training.attention_backend, stack)


def _transformer(impl: str, backend: str, stack: Stack) -> str:
    if impl != "auto":
        return impl
    # Megatron-LM builds the local spec for attention_backend = local (arguments.py asserts --spec local).
    return "transformer_engine" if stack.te and backend != "local" else "local"


def resolve(exp: Experiment, stack: Stack) -> Implementation:
    """What the workload builds for `exp` on `stack` (assumes problems(exp, stack) is empty)."""
    return _resolve(_resolve_key(exp), stack)


def _resolve_key(exp: Experiment) -> tuple:
    m, t = exp.model, exp.training
    return (t.transformer_impl, t.attention_backend, m.swiglu, m.squared_relu, m.add_bias_linear,
            m.position_embedding_type, t.cross_entropy_loss_fusion)


@functools.lru_cache(maxsize=256)   # the sweep asks for every layout of one model
def _resolve(key: tuple, stack: Stack) -> Implementation:
    impl, backend, swiglu, squared_relu, bias, position, ce_fusion = key
    te = _transformer(impl, backend, stack) == "transformer_engine"
    if te:
        attention = f"te-{backend}"           # Megatron's AttnBackend on TE's DotProductAttention
    elif backend in ("unfused", "local"):
        attention = "megatron-unfused"
    else:
        # Megatron's local spec computes attention unfused (DotProductAttention: the s x s scores in
        # memory, K/V repeated for GQA). The workload swaps in torch's SDPA instead, so a plain
        # install gets flash-class attention; attention_backend = "unfused" keeps Megatron's own.
        attention = "sdpa" if backend == "auto" else f"sdpa-{backend}"
    fusions, notes = [], []
    if stack.cuda:
        # Megatron-LM's defaults (--bias-gelu-fusion, --bias-swiglu-fusion, --bias-dropout-fusion,
        # --apply-rope-fusion, --masked-softmax-fusion, --gradient-accumulation-fusion), each where
        # TransformerConfig accepts it and its kernel exists. The bias-activation and bias-dropout
        # fusions (and the native cross-entropy fusion) are torch.compile'd PyTorch: they need no
        # extension, but a host C compiler (host_compiler). On a CPU they stay off: compiling them
        # there costs more than a test run.
        activation = "silu" if swiglu else "squared_relu" if squared_relu else "gelu"
        if stack.compiler:
            if activation == "silu" or (activation == "gelu" and bias):
                fusions.append("bias_activation_fusion")     # TransformerConfig allows gelu (with bias) and swiglu
            fusions.append("bias_dropout_fusion")
        else:
            notes.append(NO_COMPILER)
        if position == "rope" and te:
            fusions.append("apply_rope_fusion")          # TE's fused RoPE kernel
        if attention in ("megatron-unfused",) and stack.has("scaled_upper_triang_masked_softmax_cuda"):
            fusions.append("masked_softmax_fusion")
        if stack.has("fused_weight_gradient_mlp_cuda"):
            # Apex's kernel: megatron's own ColumnParallelLinear (the output layer, TE or not)
            # raises without it.
            fusions.append("gradient_accumulation_fusion")
        if ce_fusion and stack.compiler:
            fusions.append("cross_entropy_loss_fusion")  # megatron's native (torch.compile'd) implementation
    elif not stack.compiler:
        notes.append(NO_COMPILER)
    # megatron-core's optimizer imports TE's FusedAdam, else Apex's (optimizer/__init__.py), and its
    # multi-tensor kernels the same way (optimizer/clip_grads.py).
    optimizer = "transformer_engine" if stack.has("transformer_engine") else "apex" if stack.has("apex") \
        else "torch"
    return Implementation("transformer_engine" if te else "local", attention, tuple(fusions),
                          "cuda" if stack.cuda else "cpu", optimizer, tuple(notes))


# --------------------------------------------------------------------------------------------
# What cannot run
# --------------------------------------------------------------------------------------------
def problems(exp: Experiment, stack: Stack) -> list:
    """Why `exp` cannot be trained by this workload on `stack`: one Problem per reason.

    `engine.model.validate` holds the layout rules Megatron-LM enforces everywhere; these are the rules
    that depend on the node's software, and the features the workload does not build yet."""
    m, p, t = exp.model, exp.parallel, exp.training
    out: list[Problem] = []
    where = f"({stack.source})"

    def needs(name, value, what: str) -> None:
        out.append(Problem(name, value, f"{what} {where}"))

    # Features the workload does not build yet (the memory model plans them all the same).
    if m.multi_latent_attention:
        needs("multi_latent_attention", True, "not supported by the training workload yet")
    if m.mtp_num_layers:
        needs("mtp_num_layers", m.mtp_num_layers, "not supported by the training workload yet")
    if p.use_megatron_fsdp or p.use_torch_fsdp2:
        needs("use_megatron_fsdp" if p.use_megatron_fsdp else "use_torch_fsdp2", True,
              "not supported by the training workload yet (use use_distributed_optimizer)")
    if t.cuda_graph_impl != "none":
        needs("cuda_graph_impl", t.cuda_graph_impl, "CUDA graphs are not supported by the training workload yet")
    if t.optimizer == "muon":
        needs("optimizer", "muon", "not supported by the training workload yet (megatron-core 0.16's "
                                   "get_megatron_optimizer builds adam and sgd)")

    te = transformer_impl(exp, stack) == "transformer_engine"
    # What a rule that needs Transformer Engine says this node is missing.
    lacks = "needs Transformer Engine, which this node lacks" if stack.cuda else \
        "needs Transformer Engine on a CUDA GPU, and this node has no CUDA"
    if t.transformer_impl == "transformer_engine" and not stack.te:
        needs("transformer_impl", "transformer_engine", f'{lacks}; "auto" would use megatron-core\'s local layers')
    if not te:
        if p.context_parallel_size > 1:
            needs("context_parallel_size", p.context_parallel_size, f"context parallelism {lacks}")
        if p.sequence_parallel and not (m.normalization == "LayerNorm" and stack.has("apex")):
            # megatron-core's local spec builds torch norms, which assert sequence_parallel is off;
            # only Apex's FusedLayerNorm (LayerNorm, not RMSNorm) is sequence-parallel without TE.
            needs("sequence_parallel", True, f"sequence parallelism {lacks} (megatron-core's local "
                                             f"{m.normalization} cannot shard the sequence)")
        if t.fp8:
            needs("fp8", t.fp8, f"FP8 {lacks}")
        if t.tp_comm_overlap:
            needs("tp_comm_overlap", True, f"TP communication overlap {lacks}")
        if t.fp8_param_gather:
            needs("fp8_param_gather", True, f"FP8 parameters {lacks}")
        if t.moe_grouped_gemm and m.is_moe and not (stack.cuda and stack.has("grouped_gemm")):
            needs("moe_grouped_gemm", True, f"the grouped GEMM {lacks} (or the grouped_gemm package on CUDA)")
    if not te and stack.cuda and t.attention_backend == "flash" and not (t.bf16 or t.fp16):
        # torch's flash kernel takes fp16 and bf16 only (sdp_utils.cpp, check_dtypes_flash_attention);
        # restricted to it, SDPA raises "No available kernel" in the first forward.
        needs("attention_backend", "flash", "torch's flash attention kernel takes only fp16 and bf16, and this "
                                            "experiment trains in fp32 (set bf16, or attention_backend auto or fused)")
    if t.use_precision_aware_optimizer and not t.optimizer_cpu_offload and not stack.has("transformer_engine"):
        needs("use_precision_aware_optimizer", True, "needs Transformer Engine's FusedAdam, which this node lacks")
    if t.optimizer_cpu_offload and not stack.cuda:
        needs("optimizer_cpu_offload", True, "moves optimizer state from a GPU to the host, and this node has no CUDA")
    if t.cpu_offloading_num_layers and not (stack.cuda and stack.has("transformer_engine")):
        needs("cpu_offloading_num_layers", t.cpu_offloading_num_layers,
              "layer offloading uses Transformer Engine's CPU offload on a CUDA GPU, which this node lacks")
    if t.fine_grained_activation_offloading and not stack.cuda:
        needs("fine_grained_activation_offloading", True,
              "moves activations from a GPU to the host on side streams, and this node has no CUDA")
    if m.is_moe and t.moe_token_dispatcher_type == "flex" and t.moe_flex_dispatcher_backend == "hybridep":
        needs("moe_flex_dispatcher_backend", "hybridep", "not supported by the training workload yet (deepep is)")
    if t.rampup_batch_size:
        needs("rampup_batch_size", t.rampup_batch_size, "not supported by the training workload yet: it trains the "
                                                        "global batch from the first step")
    if m.is_moe and t.moe_token_dispatcher_type == "flex" and not (stack.cuda and stack.has("deep_ep")):
        needs("moe_token_dispatcher_type", "flex", "the flex dispatcher needs DeepEP (deep_ep) on a CUDA GPU, "
                                                   "which this node lacks")
    if t.defer_embedding_wgrad_compute and "gradient_accumulation_fusion" not in resolve(exp, stack).fusions:
        # megatron-core's ModelParallelConfig refuses it without the fusion
        needs("defer_embedding_wgrad_compute", True, "needs gradient accumulation fusion (Apex's "
                                                    "fused_weight_gradient_mlp_cuda on CUDA), which this node lacks")
    if t.fp8 and stack.capability is not None:
        if stack.capability < (8, 9):
            needs("fp8", t.fp8, f"needs compute capability 8.9 or newer (Ada, Hopper); this GPU is "
                                f"{stack.capability[0]}.{stack.capability[1]}")
        elif t.fp8_recipe == "mxfp8" and stack.capability < (10, 0):
            needs("fp8_recipe", "mxfp8", f"MXFP8 needs compute capability 10.0 or newer (Blackwell); this "
                                         f"GPU is {stack.capability[0]}.{stack.capability[1]}")
    return out


# --------------------------------------------------------------------------------------------
# What a node is
# --------------------------------------------------------------------------------------------
def describe(stack: Stack) -> dict:
    """Versions and devices of this process's node, for run records and `doctor` (imports torch)."""
    from importlib import metadata  # deferred: ~17 ms at start-up, for compute nodes only

    import torch

    def version(distribution: str) -> str | None:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None

    nccl = None
    if stack.cuda:
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:   # noqa: BLE001 - a torch built without NCCL
            nccl = None
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "megatron_core": version("megatron-core"),
        "transformer_engine": (version("transformer-engine") or version("transformer_engine") or "unknown")
        if stack.has("transformer_engine") else None,
    }
    devices = []
    if stack.cuda:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"index": index, "name": props.name, "total_bytes": int(props.total_memory),
                            "capability": f"{props.major}.{props.minor}"})
    return {"stack": stack.to_dict(), "versions": versions, "driver": gpu_driver() if stack.cuda else None,
            "devices": devices, "host": platform.node()}


def gpu_driver() -> str | None:
    """The NVIDIA driver version through NVML; None where NVML does not answer."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:   # noqa: BLE001 - no driver, or an AMD node
        return None
