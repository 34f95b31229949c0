"""Make megatron-core 0.16 run on CPU with gloo when CUDA is absent (how CI trains real models).

megatron-core hard-wires CUDA in places that have nothing to do with the maths: device
arguments, RNG bookkeeping, streams, type-name assertions. `apply()` redirects exactly those,
once per process, and only when `torch.cuda.is_available()` is False; on a GPU megatron runs as
is. Each patch below says which megatron code needs it (see RECIPES.md, "Megatron-Core training
on CPU"). Call `apply()` before building megatron models; it enters the device mode in the
calling thread and in every thread started afterwards (the mode is thread-local).

The rule: redirect devices, never hide a failure a GPU would have. So CUDA is emulated as a
*virtual device* rather than by renaming every tensor. A tensor lives on the virtual device when,
on a GPU, it would be a CUDA tensor: it was created or moved by a CUDA request (`device="cuda"`,
`"cuda:N"`, `torch.device("cuda")`, a bare int, `.cuda()`, `.to("cuda")`, `Module.cuda()`), or it
was computed by a torch function from a tensor that lives there. Only such tensors answer
`Tensor.type()` with a `torch.cuda.*Tensor` name; a host-born tensor that was never moved keeps
its CPU name, so megatron's type checks fail here exactly as they would on a GPU.

Mechanism, in CudaToCpuMode (a TorchFunctionMode, so it sees every torch call):
- The mark belongs to the *storage*, which views, `param.data = ...` and in-place results share:
  `_MARKED` maps the StorageImpl pointer to a weak handle on it (what torch.multiprocessing's
  StorageWeakRef wraps). The handle does not keep the data alive but keeps the StorageImpl's
  control block allocated, so a listed pointer is never reused by a new storage. Dead entries are
  pruned each time the table has doubled since the last prune: it stays proportional to the
  live marked storages.
- A call's new result storages are marked when one of its tensor inputs is marked; a result that
  shares an input's storage keeps that input's status (so `host.copy_(dev)` stays on the host).
  An explicit `device=` decides instead. `t.device` of a marked tensor is still the CPU device,
  but the one instance `_VIRTUAL`, recognised by identity, so `device=t.device` follows t.
- The mode is off while a call it handles runs, and `torch.autograd.backward` is such a call:
  the engine is entered with the mode on again (`_backward_in_mode`), so custom Functions'
  backward, activation recompute and grad hooks are mapped and propagate like the forward.
  Grads the C++ engine accumulates are new storages; they are marked when read through
  `.grad` from a marked parameter (on a GPU a grad lives on its parameter's device).
Not emulated: device-mismatch errors between host and virtual tensors; `is_cuda` and
`get_device()` report the host.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_CPU = torch.device("cpu")
_VIRTUAL = torch.device("cpu")   # what `.device` answers for a tensor on the virtual device (by identity)
_Tensor = torch.Tensor


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Install every redirection (idempotent). Returns True when the CPU path is active."""
    global _applied
    if not needed():
        return False
    if not _applied:
        _redirect_torch_cuda()
        _backward_in_mode()
        _patch_megatron()
        _enter_in_new_threads()
        _applied = True
    enter_thread()
    return True


def enter_thread() -> CudaToCpuMode | None:
    """Enter the CUDA-to-CPU device mode in the calling thread (TorchFunctionModes are per thread);
    the mode entered, or None when the thread had it already."""
    stack = torch.overrides._get_current_function_mode_stack()
    if _applied and not any(isinstance(mode, CudaToCpuMode) for mode in stack):
        mode = CudaToCpuMode()
        mode.__enter__()   # the main thread's is never exited: it lasts for the process's life
        return mode
    return None


def _enter_in_new_threads() -> None:
    # megatron starts threads of its own (the dataset builder's pool, the straggler detector);
    # whatever runs there must see CUDA requests mapped too.
    run = threading.Thread.run

    @functools.wraps(run)
    def run_in_mode(self):
        mode = enter_thread()
        try:
            run(self)
        finally:
            # Left before the thread ends: a mode still on a finished thread's stack made the
            # interpreter's exit abort now and then ("terminate called without an active exception").
            if mode is not None:
                mode.__exit__(None, None, None)

    setattr(threading.Thread, "run", run_in_mode)   # patched on purpose (mypy refuses method assignment)


# --------------------------------------------------------------------------------------------
# 1. torch.cuda.* used as plain utilities: devices, RNG, sync, streams and events, NVTX
# --------------------------------------------------------------------------------------------
class Stream:
    """Stands in for torch.cuda.Stream: on CPU every op is synchronous, so ordering is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


class Event:
    """Stands in for torch.cuda.Event (the MoE alltoall dispatcher's device-to-host sync)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = Stream()


def _redirect_torch_cuda() -> None:
    # Patched on purpose with stand-ins that are not torch's own types: an untyped namespace here.
    cuda: Any = torch.cuda
    # megatron passes `torch.cuda.current_device()` as a device all over (buffers, masks,
    # optimizer state). Real CUDA answers the ordinal 0; a bare int is a CUDA device to torch,
    # so the mode below places those allocations on the virtual device.
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # The RNG tracker (tensor_parallel.random) saves, seeds and restores the "CUDA" generator to
    # give each TP rank its own init/dropout stream; on CPU the default generator is that stream.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # Streams and events: the alltoall token dispatcher overlaps its DtoH copy on a side stream.
    cuda.Stream = Stream
    cuda.Event = Event
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    # NVTX ranges (megatron's profiling hooks) raise on a CPU build; they mark nothing here.
    cuda.nvtx.range_push = lambda msg: None
    cuda.nvtx.range_pop = lambda: None


# --------------------------------------------------------------------------------------------
# 2. The virtual CUDA device: CUDA requests land on the CPU, and the storages they create are
#    marked (see the module docstring), so `type()` names CUDA exactly where a GPU would.
# --------------------------------------------------------------------------------------------
# StorageImpl pointer -> weak handle on that StorageImpl (reserves the pointer while listed)
_MARKED: dict[int, int] = {}
_PRUNE_MIN = 4096
_prune_at = _PRUNE_MIN
_pruning = threading.Lock()
_expired = torch.UntypedStorage._expired
_free_weak_ref = torch.UntypedStorage._free_weak_ref


def _key(tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):   # sparse and other storage-less tensors
        return None


def _mark(tensor) -> None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return
    if storage._cdata not in _MARKED:
        _mark_storage(storage._cdata, storage)


def _mark_storage(key: int, storage) -> None:
    global _prune_at
    # The raw handle StorageWeakRef wraps, without its Python object and __del__ per mark.
    handle = storage._weak_ref()
    if _MARKED.setdefault(key, handle) != handle:
        _free_weak_ref(handle)         # another thread marked it first
    if len(_MARKED) > _prune_at and _pruning.acquire(blocking=False):
        try:
            for dead, weak in list(_MARKED.items()):
                if _expired(weak):
                    del _MARKED[dead]
                    _free_weak_ref(weak)     # the pointer may now be reused by a new storage
            _prune_at = max(_PRUNE_MIN, 2 * len(_MARKED))
        finally:
            _pruning.release()


def on_virtual_cuda(tensor) -> bool:
    """Whether `tensor` would be a CUDA tensor on a GPU (its storage is marked)."""
    return isinstance(tensor, _Tensor) and _key(tensor) in _MARKED


def _is_cuda_request(device) -> bool:
    if device is _VIRTUAL:
        return True                    # `device=t.device` of a tensor on the virtual device
    if isinstance(device, int) and not isinstance(device, bool):
        return True                    # a bare ordinal means a CUDA device to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _type(args, kwargs):
    out = _Tensor.type(*args, **kwargs)
    if len(args) > 1 or kwargs:        # a conversion, not the name
        _propagate(out, args, kwargs)
    elif on_virtual_cuda(args[0]):
        return out.replace("torch.", "torch.cuda.", 1)
    return out


def _device(args, kwargs):
    # A CPU device either way (the data is on the host), but the virtual device's own instance,
    # so `torch.empty(n, device=t.device)` lands where t is, as on a GPU.
    return _VIRTUAL if on_virtual_cuda(args[0]) else _DEVICE(*args, **kwargs)


def _cuda(args, kwargs):
    # A GPU copies a host tensor to the device and returns a device tensor as is.
    tensor = args[0]
    if on_virtual_cuda(tensor):
        return tensor
    out = _Tensor.to(tensor, _CPU, copy=True,
                     memory_format=kwargs.get("memory_format", torch.preserve_format))
    _mark(out)
    return out


def _cpu(args, kwargs):
    tensor = args[0]
    if not on_virtual_cuda(tensor):
        return tensor
    return _Tensor.to(tensor, _CPU, copy=True,
                      memory_format=kwargs.get("memory_format", torch.preserve_format))


def _to(args, kwargs):
    # Tensor.to(dtype | device[, dtype] | other, non_blocking, copy, ...): find the target
    # device; crossing between host and virtual device must copy, as it does on a GPU.
    tensor, rest, kwargs = args[0], list(args[1:]), dict(kwargs)
    target = None                      # None: stays where it is; True: CUDA; False: host
    copy_at = 3                        # position of `copy` in the device form
    if kwargs.get("device") is not None:
        target = _is_cuda_request(kwargs["device"])
        kwargs["device"] = _CPU
    elif rest and isinstance(rest[0], (str, int, torch.device)) and not isinstance(rest[0], bool):
        target = _is_cuda_request(rest[0])
        rest[0] = _CPU
    elif rest and isinstance(rest[0], _Tensor):
        target = on_virtual_cuda(rest[0])
        copy_at = 2                    # to(other, non_blocking, copy)
    source = on_virtual_cuda(tensor)
    if target is not None and target != source:
        if len(rest) > copy_at:
            rest[copy_at] = True
        else:
            kwargs["copy"] = True
    out = _Tensor.to(tensor, *rest, **kwargs)
    if target or (target is None and source):
        _mark(out)
    return out


def _pin_memory(args, kwargs):
    return args[0]                     # pinning needs a CUDA runtime; pageable memory is fine


_DEVICE = _Tensor.device.__get__
_SPECIAL = {
    _DEVICE: _device,
    _Tensor.type: _type,
    _Tensor.cuda: _cuda,
    _Tensor.cpu: _cpu,
    _Tensor.to: _to,
    _Tensor.pin_memory: _pin_memory,
}


def _propagate(out, args, kwargs) -> None:
    """Mark the new storages in `out` when a tensor input lives on the virtual device.
    It runs after nearly every torch call: inputs first (cheap, usually decisive), flat loops."""
    if isinstance(out, _Tensor):
        out = (out,)
    elif not isinstance(out, (tuple, list)) or isinstance(out, torch.Size):
        return
    try:
        if not (_any_marked(args) or kwargs and _any_marked(kwargs.values())):
            return
        for tensor in out:
            if isinstance(tensor, _Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                # Views and in-place results keep their input's status (a host tensor written from
                # device data, e.g. copy_, stays on the host).
                if key not in _MARKED and not _is_input(key, args, kwargs):
                    _mark_storage(key, storage)
    except (RuntimeError, NotImplementedError, TypeError):   # storage-less tensors
        return


def _any_marked(args) -> bool:
    for arg in args:
        if isinstance(arg, _Tensor):
            if arg.untyped_storage()._cdata in _MARKED:
                return True
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, _Tensor) and item.untyped_storage()._cdata in _MARKED:
                    return True
    return False


def _is_input(key: int, args, kwargs) -> bool:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, _Tensor):
            if arg.untyped_storage()._cdata == key:
                return True
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, _Tensor) and item.untyped_storage()._cdata == key:
                    return True
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to the CPU and keeps track of what lives on the virtual device.

    megatron allocates with `device="cuda"` / `.cuda()` (optimizer, schedules, grad buffers) and
    its optimizer and grad clipping assert `param.type()` is a `torch.cuda.*Tensor`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(args, kwargs)
        if kwargs:
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
            device = kwargs.get("device")
            if device is not None:     # an explicit device decides, whatever the inputs
                cuda = _is_cuda_request(device)
                if cuda:
                    kwargs = {**kwargs, "device": _CPU}
                out = func(*args, **kwargs)
                if cuda:
                    for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
                        if isinstance(tensor, _Tensor):
                            _mark(tensor)
                return out
        out = func(*args, **kwargs)
        if _MARKED:
            _propagate(out, args, kwargs)
        return out


def _backward_in_mode() -> None:
    # A mode is off while a call it handles runs, and torch.autograd.backward/grad are such calls:
    # without this, the Python that backward runs (custom Functions' backward, activation
    # recompute, grad hooks) would see no device mapping (a bare current_device() ordinal is
    # rejected on a CPU build) and no marks. Both reach the engine through this one function.
    run = torch.autograd.graph._engine_run_backward

    @functools.wraps(run)
    def run_in_mode(*args, **kwargs):
        if any(isinstance(mode, CudaToCpuMode) for mode in torch.overrides._get_current_function_mode_stack()):
            return run(*args, **kwargs)
        with CudaToCpuMode():
            return run(*args, **kwargs)

    torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = run_in_mode


# --------------------------------------------------------------------------------------------
# 3-5. megatron internals
# --------------------------------------------------------------------------------------------
def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import mappings, random
    from megatron.core.transformer.moe import token_dispatcher

    # 3. tensor_parallel.random has private copies of torch.cuda's RNG getters/setters that go
    #    straight to torch.cuda.default_generators (empty without CUDA).
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # The tracker warns when the CPU generator moves inside a forked "CUDA" region; here they are
    # the same generator, so it always moves: the warning says nothing.
    logging.getLogger(random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())

    # 4. The alltoall dispatcher copies its split sizes to the host (as numpy for all_to_all)
    #    when they are CUDA tensors, testing `is_cuda`, which is False here: test the virtual
    #    device instead. record_stream is left out (there are no streams on CPU).
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if on_virtual_cuda(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # 5. gloo has no uneven all-gather (MoE alltoall with TP > 1 gathers variable token counts):
    #    pad every piece to the largest, gather evenly, then cut the padding out.
    original_gather = mappings._gather_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)], dim=0)

    mappings._gather_along_first_dim = gather_along_first_dim
