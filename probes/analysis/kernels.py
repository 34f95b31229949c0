"""Where a step's time goes: PyTorch profiler traces (Kineto JSON) split into kernel categories per
pipeline stage or rank, as the CharLLM-PPT paper's Figures 10 and 15 split them.

Categories, in the order that decides an instant when several run at once (two streams, or a
compute thread beside a communication thread):

    compute        matmul, attention, norm, elementwise, optimizer, other
    memory         memcpy (and memset)
    communication  SendRecv, AllGather, ReduceScatter, AllReduce, AllToAll, OtherComm

The paper's eight (matmul, SendRecv, AllGather, ReduceScatter, AllReduce, elementwise, norm,
other) plus attention, optimizer and memcpy; AllToAll (MoE token dispatch) and OtherComm (any
other collective) keep communication apart from compute. As the artifact's figure scripts do
(scripts/visualization/figure_10_2.py), a broadcast counts as SendRecv.

What is classified:
- A GPU trace (it has `kernel`, `gpu_memcpy` or `gpu_memset` events): the device's kernels, by name,
  as Holistic Trace Analysis tells them apart (NCCL kernels are communication, Memcpy/Memset
  memory, the rest compute), the NCCL kernel's collective from its `Collective name` argument where
  the trace has it (all-to-all runs as SendRecv kernels) else from its name, and a kernel launched
  from inside an `Optimizer.step#...` annotation counted as optimizer (by its launch's correlation id).
- A CPU trace (a CPU run: gloo and aten ops): every thread's ops and annotations, nested, each
  instant given to the innermost op that has a category (or, failing one, the nearest enclosing
  op that has), communication (gloo:*, c10d::*) always as itself, everything inside an
  optimizer step as optimizer.

Per trace, over its step (the `ProfilerStep#N` spans; else the whole trace), per category:
`time_s`, the time the category held the device (or the rank's threads) with nothing ahead of it
running, so the categories add up to `busy_s`, the time anything ran; and `kernel_s`, the sum of
its kernels' (ops') own durations as the artifact's figure scripts add them (overlaps counted
twice). Besides: `step_s`, `idle_s` (step - busy), `compute_s`, `comm_s` (the time any compute,
any communication ran), `overlap_s` (both at once) and `overlap_frac` (overlap_s / comm_s: how
much of the communication was hidden behind compute). A trace of several steps gives per-step
means (overlapping step spans count once).

A trace is read as it streams by, in bounds whatever its file holds: its JSON decompressed
(MAX_TRACE_BYTES), its events (MAX_TRACE_EVENTS, each kept as a few numbers), one value's text, and
each time's range; the breakdown sorts once and sweeps, so its time grows with the events, not with
events times steps. A trace beyond a bound, or damaged, is one line naming it; in a run's summary it
is left out and a note says so, and the run's other traces are summarized.
"""

from __future__ import annotations

import codecs
import gzip
import json
import math
import os
import re
import zlib
from array import array
from dataclasses import dataclass, field
from json.scanner import make_scanner
from pathlib import Path

import numpy as np
import polars as pl

from charllm.probes.analysis.cache import keep, kept_place, read_kept
from charllm.probes.analysis.render import format_figure
from charllm.probes.core.errors import UserError, plural, shown
from charllm.probes.core.files import open_regular
from charllm.probes.core.formatting import size
from charllm.probes.store.rundir import RunDir, resolve_run

COMPUTE = ("matmul", "attention", "norm", "elementwise", "optimizer", "other")
MEMORY = ("memcpy",)
COMMUNICATION = ("SendRecv", "AllGather", "ReduceScatter", "AllReduce", "AllToAll", "OtherComm")
CATEGORIES = COMPUTE + MEMORY + COMMUNICATION     # precedence: first wins an instant
# A trace is read as it streams by, within bounds whatever its file holds (a few MB of .json.gz can
# hold GiBs of text): its JSON decompressed, its events, one event's text, each time's range.
MAX_TRACE_BYTES = 2 * 2**30         # a rank's trace of a few profiled steps is tens to hundreds of MiB
MAX_TRACE_EVENTS = 10_000_000       # about 40 bytes each once read
MAX_VALUE_CHARS = 64 * 2**20        # one event, or any other value of the trace's top level
MAX_TIME_US = 2**53                 # |ts| and dur in µs: 285 years, each exact in a float
MAX_STEP_DIGITS = 18                # ProfilerStep#N: N fits 64 bits
_READ_BYTES = 4 * 2**20
_SPACE = re.compile(r"[ \t\n\r]*")
_AFTER_ELEMENT = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# raw_decode's scanner, called directly (CPython's make_scanner takes the decoder; typeshed says otherwise)
_SCAN = make_scanner(_DECODER)  # type: ignore[arg-type]

# -- names ---------------------------------------------------------------------------------------
_COLLECTIVES = (   # (pattern in a name or a `Collective name`, category); first match wins
    (re.compile(r"all_?to_?all", re.I), "AllToAll"),
    (re.compile(r"all_?reduce", re.I), "AllReduce"),
    (re.compile(r"reduce_?scatter", re.I), "ReduceScatter"),
    (re.compile(r"all_?gather", re.I), "AllGather"),
    (re.compile(r"send|recv|broadcast", re.I), "SendRecv"),
)
_ATTENTION = re.compile(r"flash|fmha|sdpa|scaled_dot_product|attention|attn|masked_softmax", re.I)
_NORM = re.compile(r"(layer|rms|group|batch)_?norm|\bln_(fwd|bwd)|norm_(fwd|bwd)|normalization", re.I)
_OPTIMIZER = re.compile(r"adam|multi_tensor|l2norm|optimizer|\blamb|muon|sgd", re.I)
_MATMUL_KERNEL = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|matmul|Kernel2|splitKreduce|tensorop", re.I)
_ELEMENTWISE_KERNEL = re.compile(r"elementwise|vectorized|unrolled|reduce_kernel|fill|gelu|silu|swiglu|glu|relu|"
                                 r"dropout|bias|add|mul|copy|cast|triton_(poi|red|per)|transpose|permute|softmax", re.I)
_MATMUL_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|dot|einsum)$|"
                        r"(Mm|Addmm|Bmm|Baddbmm|Linear\w*)Backward|Linear", re.I)
_ELEMENTWISE_OP = re.compile(r"^aten::(add|sub|mul|div|neg|abs|exp|log|sqrt|rsqrt|pow|sigmoid|tanh|gelu|silu|relu|"
                             r"dropout|native_dropout|fill|zero|where|masked_fill|clamp|sum|mean|max|min|"
                             r"linalg_vector_norm|_foreach_\w+|addcmul|addcdiv|lerp|mul|sign|square|"
                             r"gelu_backward|silu_backward|threshold_backward|softmax|_softmax)_?$|"
                             r"^(Add|Sub|Mul|Div|Neg|Gelu|Silu|Relu|Pow|Sum|Mean|Dropout|NativeDropout|Where)"
                             r"\w*Backward|AccumulateGrad", re.I)
_MEMCPY_OP = re.compile(r"^aten::(copy_|_to_copy|to|clone|contiguous|cat|_copy_from)$", re.I)
_STEP = re.compile(r"ProfilerStep#(\d+)")   # (fullmatch)
_LAUNCHES = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_OPTIMIZER_CODE, _OTHER_CODE = CATEGORIES.index("optimizer"), CATEGORIES.index("other")
_FIRST_COMM_CODE = len(COMPUTE) + len(MEMORY)


def collective(text: str) -> str:
    """The communication category a collective's name says ("OtherComm" for any other)."""
    return next((category for pattern, category in _COLLECTIVES if pattern.search(text)), "OtherComm")


def classify_kernel(name: str, args: dict | None = None, cat: str = "kernel") -> str:
    """A device event's category: its kernel's name (and, for NCCL, its `Collective name`)."""
    if cat in ("gpu_memcpy", "gpu_memset") or name.startswith(("Memcpy", "Memset")):
        return "memcpy"
    if "nccl" in name.lower() or "userbuffers" in name.lower():   # NCCL, and TE's TP-overlap buffers
        named = (args or {}).get("Collective name")
        return collective(named if isinstance(named, str) and named else name)
    for pattern, category in ((_ATTENTION, "attention"), (_NORM, "norm"), (_OPTIMIZER, "optimizer"),
                              (_MATMUL_KERNEL, "matmul"), (_ELEMENTWISE_KERNEL, "elementwise")):
        if pattern.search(name):
            return category
    return "other"


def classify_op(name: str) -> str | None:
    """A host op's or annotation's own category; None for one that says nothing by itself (views,
    allocations, autograd's wrappers): it takes the category of the op around it."""
    if name.startswith(("gloo:", "c10d::", "nccl:")) or name == "record_param_comms":
        return collective(name.partition(":")[2] if ":" in name else name)
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) or "_fused_adam" in name:
        return "optimizer"
    if name.startswith("autograd::engine::evaluate_function: "):
        return classify_op(name.removeprefix("autograd::engine::evaluate_function: "))
    for pattern, category in ((_ATTENTION, "attention"), (_NORM, "norm"), (_MATMUL_OP, "matmul"),
                              (_MEMCPY_OP, "memcpy"), (_ELEMENTWISE_OP, "elementwise")):
        if pattern.search(name):
            return category
    if name.startswith(("aten::embedding", "aten::cross_entropy", "aten::nll_loss", "aten::index", "aten::gather",
                        "aten::scatter", "aten::topk", "aten::sort", "aten::randint", "aten::arange")):
        return "other"
    return None


# -- reading -------------------------------------------------------------------------------------
class _Damaged(Exception):
    """What is wrong with a trace (read_trace names the file)."""


def _out_of_range(value) -> str:
    """A number as a message quotes it: a hostile int of thousands of digits by its size."""
    if isinstance(value, int) and abs(value) > 10**30:
        return f"a number of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    return shown(value)


class _Text:
    """A trace's JSON text, decoded a piece at a time as it is parsed: at most MAX_TRACE_BYTES are
    read (decompressed), and only the value being parsed is held, never the whole text."""

    def __init__(self, raw, compressed: bool):
        self.raw, self.compressed = raw, compressed
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf, self.pos, self.before = "", 0, 0   # the text held, the cursor in it, characters dropped
        self.read_bytes, self.eof = 0, False

    def _more(self) -> bool:
        """Read the next piece (dropping what was parsed); False at the end."""
        if self.eof:
            return False
        chunk = self.raw.read(_READ_BYTES)
        self.read_bytes += len(chunk)
        if self.read_bytes > MAX_TRACE_BYTES:
            raise _Damaged(f"more than {size(MAX_TRACE_BYTES)} of JSON{' once decompressed' * self.compressed}, "
                           "the most a trace may hold (profile fewer steps: telemetry.profile_steps)")
        self.eof = not chunk
        self.before += self.pos
        if self.pos == len(self.buf) and self.read_bytes > len(chunk) and not self.decoder.getstate()[0] \
                and not chunk.translate(None, b" \t\n\r"):
            self.before += len(chunk)   # a piece of white space between values, dropped undecoded (faster)
            chunk = b""
        self.buf = self.buf[self.pos:] + self.decoder.decode(chunk, final=self.eof)
        self.pos = 0
        return True

    def at(self) -> str:
        return f"at character {self.before + self.pos:,}"

    def peek(self) -> str:
        """The next character that is not white space ("" at the end of the text)."""
        while True:
            space = _SPACE.match(self.buf, self.pos)
            self.pos = space.end() if space else self.pos
            if self.pos < len(self.buf) or not self._more():
                return self.buf[self.pos: self.pos + 1]

    def expect(self, chars: str) -> str:
        """The next character, one of `chars`."""
        found = self.peek()
        if not found or found not in chars:
            raise _Damaged(f"not a readable Kineto JSON trace (expecting {' or '.join(map(repr, chars))} {self.at()})")
        self.pos += 1
        return found

    def value(self):
        """The next JSON value (a value cut by the end of a piece is read again with the next)."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:   # (a number at the end of a piece may go on)
                    self.pos = end
                    return value
            except json.JSONDecodeError as exc:   # damaged, or cut by the piece's end: then read on
                if self.eof or (exc.pos < len(self.buf) - 16 and not exc.msg.startswith("Unterminated string")):
                    raise _Damaged(f"not a readable Kineto JSON trace ({exc.msg.removesuffix(' at')} at character "
                                   f"{self.before + exc.pos:,})") from None
            if len(self.buf) - self.pos > MAX_VALUE_CHARS:
                raise _Damaged(f"a value of more than {MAX_VALUE_CHARS:,} characters {self.at()}")
            self._more()


def _parse(text: _Text, events: "_Events") -> dict:
    """A Kineto JSON object, its traceEvents streamed into `events`; the other top-level values
    read_trace needs (`charllm`, `distributedInfo`)."""
    if text.peek() != "{":
        text.value()   # not JSON says so; JSON of another shape is not a trace
        raise _Damaged("not a Kineto JSON trace (no traceEvents list)")
    text.pos += 1
    meta: dict = {}
    found = False
    while text.peek() != "}":
        key = text.value()
        if not isinstance(key, str):
            raise _Damaged(f"not a readable Kineto JSON trace (a key that is not a string {text.at()})")
        text.expect(":")
        if key == "traceEvents" and text.peek() == "[" and not found:
            found = True
            text.pos += 1
            _elements(text, events)
        elif key in ("charllm", "distributedInfo"):
            meta[key] = text.value()
        else:
            text.value()
        if text.peek() != "}":
            text.expect(",")
    text.pos += 1
    if text.peek():
        raise _Damaged(f"not a readable Kineto JSON trace (extra data {text.at()})")
    if not found:
        raise _Damaged("not a Kineto JSON trace (no traceEvents list)")
    return meta


def _elements(text: _Text, events: "_Events") -> None:
    """The elements of the array the cursor is in, each given to `events`, up to its closing "]".
    Those whole in the piece held are scanned in a tight loop; one cut by its end goes the slow way."""
    if text.peek() == "]":
        text.pos += 1
        return
    add, scan, after = events.add, _SCAN, _AFTER_ELEMENT.match
    while True:
        buf, pos = text.buf, text.pos
        try:
            while True:
                value, end = scan(buf, pos)
                found = after(buf, end)
                if found is None or found.end() >= len(buf):
                    break                    # at the piece's end, or damaged: the slow way says which
                add(value)
                if found[1] == "]":
                    text.pos = found.end()
                    return
                pos = found.end()
        except (StopIteration, json.JSONDecodeError):
            pass
        text.pos = pos
        add(text.value())
        if text.expect(",]") == "]":
            return


class _Events:
    """What the breakdown needs of a trace's events, kept as they stream by: a few numbers each
    (times in µs, a category, a thread, a correlation id), never the events themselves."""

    def __init__(self) -> None:
        self.count = 0
        self.device = False                   # it has device events: a GPU trace
        self.step_numbers: set[int] = set()
        self.steps = _Columns(start="d", end="d")                         # ProfilerStep#N spans
        self.first, self.last = math.inf, -math.inf                       # the whole trace's span
        self.kernels = _Columns(start="d", end="d", code="b", correlation="q")
        self.optimizer = _Columns(thread="q", start="d", end="d")        # Optimizer.step# spans
        self.launches = _Columns(thread="q", ts="d", correlation="q")
        self.ops = _Columns(thread="q", start="d", end="d", code="b")   # host ops and annotations
        self._threads: dict = {}
        self._kernel_codes: dict = {}   # each distinct kernel classified once
        self._op_codes: dict = {}

    def _out_of_range(self, key: str, value) -> _Damaged:
        return _Damaged(f"event {self.count:,}: {key} = {_out_of_range(value)}: out of range "
                        f"(a time in µs of at most {MAX_TIME_US:,})")

    def _thread(self, event: dict) -> int:
        key = (event.get("pid"), event.get("tid"))
        try:
            return self._threads.setdefault(key, len(self._threads))
        except TypeError:   # a list or an object: no thread of ours
            plain = tuple(v if isinstance(v, (str, int, float)) else None for v in key)
            return self._threads.setdefault(plain, len(self._threads))

    def add(self, event) -> None:
        """Keep what the breakdown needs of one event (most are looked at and dropped)."""
        self.count += 1
        if self.count > MAX_TRACE_EVENTS:
            raise _Damaged(f"more than {MAX_TRACE_EVENTS:,} events, the most a trace may hold "
                           "(profile fewer steps: telemetry.profile_steps)")
        if type(event) is not dict:
            return
        get = event.get
        ts, dur = get("ts"), get("dur", 0)   # a time that is not a number leaves the event untimed
        ts = ts if type(ts) is float or type(ts) is int else None
        dur = dur if type(dur) is float or type(dur) is int else None
        if ts is not None and not -MAX_TIME_US <= ts <= MAX_TIME_US:   # (NaN too)
            raise self._out_of_range("ts", ts)
        if dur is not None and not -MAX_TIME_US <= dur <= MAX_TIME_US:
            raise self._out_of_range("dur", dur)
        cat, ph, name = get("cat"), get("ph"), get("name")
        cat = cat if type(cat) is str else None
        name = name if type(name) is str else ""
        if cat in _DEVICE_CATS:
            self.device = True
        step = _STEP.fullmatch(name) if ph == "X" and name.startswith("ProfilerStep#") else None
        if step:
            if len(step[1]) > MAX_STEP_DIGITS:
                raise _Damaged(f"event {self.count:,}: name {shown(name, 40)}: a step number of "
                               f"{len(step[1]):,} digits (at most {MAX_STEP_DIGITS})")
            self.step_numbers.add(int(step[1]))
        if ts is None or dur is None or dur < 0:
            return
        ts = float(ts)
        end = ts + dur
        if cat in _LAUNCHES and (correlation := _correlation(event)) >= 0:
            self.launches.add(self._thread(event), ts, correlation)
        if ph != "X":
            return
        if cat != "Trace":
            if ts < self.first:
                self.first = ts
            if end > self.last:
                self.last = end
        if step:
            self.steps.add(ts, end)
        if name.startswith("Optimizer.step#"):
            self.optimizer.add(self._thread(event), ts, end)
        if cat in _DEVICE_CATS:
            args = get("args")
            named = args.get("Collective name") if type(args) is dict else None
            key = (cat, name, named if type(named) is str else None)
            code = self._kernel_codes.get(key)
            if code is None:
                code = self._kernel_codes[key] = CATEGORIES.index(classify_kernel(name, {"Collective name": key[2]},
                                                                                  cat))
            self.kernels.add(ts, end, code, _correlation(event))
        elif (cat == "cpu_op" or cat == "user_annotation") and not step:
            code = self._op_codes.get(name)
            if code is None:
                own = classify_op(name)
                code = self._op_codes[name] = CATEGORIES.index(own) if own else -1
            self.ops.add(self._thread(event), ts, end, code)


def _correlation(event: dict) -> int:
    """The event's correlation id (a launch's, and its kernel's), or -1."""
    args = event.get("args")
    value = args.get("correlation") if type(args) is dict else None
    return value if type(value) is int and 0 <= value < 2**63 else -1


class _Columns:
    """Numbers kept per event, one compact array per field (typecodes of `array`)."""

    def __init__(self, **fields: str):
        self.fields = {name: array(code) for name, code in fields.items()}
        self.appends = [a.append for a in self.fields.values()]

    def add(self, *values) -> None:
        for append, value in zip(self.appends, values):
            append(value)

    def __len__(self) -> int:
        return len(next(iter(self.fields.values())))

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.fields[name])


@dataclass
class Trace:
    """One Kineto JSON trace of one rank: what the breakdown needs of its events, and who recorded it."""

    path: Path
    events: _Events
    rank: int | None = None
    pp_rank: int | None = None
    node: str | None = None
    steps: list[int] = field(default_factory=list)


def _rank(value) -> int | None:
    return value if type(value) is int and 0 <= value < 2**31 else None


def read_trace(path: str | os.PathLike) -> Trace:
    """A trace file (.json or .json.gz), read as it streams by: at most MAX_TRACE_BYTES of JSON
    (decompressed) and MAX_TRACE_EVENTS events, each time checked for range. Its rank and stage come
    from the `charllm` entry the workload writes, else `distributedInfo` (Kineto's) and a
    `rank-R.json` / `rankR-...` name. A damaged trace is one UserError naming it."""
    path = Path(path)
    events = _Events()
    try:
        with open_regular(path, "trace") as fh:
            compressed = path.suffix == ".gz"
            meta = _parse(_Text(gzip.GzipFile(fileobj=fh) if compressed else fh, compressed), events)
    except _Damaged as exc:
        raise UserError(f"trace {str(path)!r}: {exc}") from None
    except (ValueError, EOFError, OSError, RecursionError, zlib.error) as exc:   # not UTF-8, not gzip, deep
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:120]
        raise UserError(f"trace {str(path)!r}: not a readable Kineto JSON trace ({why})") from None
    ours: dict = meta["charllm"] if isinstance(meta.get("charllm"), dict) else {}
    dist: dict = meta["distributedInfo"] if isinstance(meta.get("distributedInfo"), dict) else {}
    named = re.search(r"rank-?(\d{1,9})(?!\d)", path.name)
    rank = next((r for v in (ours.get("rank"), dist.get("rank"), int(named[1]) if named else None)
                 if (r := _rank(v)) is not None), None)
    node = ours.get("node")
    return Trace(path, events, rank, _rank(ours.get("pp_rank")), node if isinstance(node, str) else None,
                 sorted(events.step_numbers))


# -- intervals -----------------------------------------------------------------------------------
def _runs(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) given in order of start, as disjoint runs in order."""
    if starts.size == 0:
        return starts, ends
    reach = np.maximum.accumulate(ends)
    first = np.flatnonzero(np.r_[True, starts[1:] > reach[:-1]])   # where a new run starts
    return starts[first], reach[np.r_[first[1:] - 1, starts.size - 1]]


class _Window:
    """The time a breakdown covers (the step spans, as disjoint runs), and how much of it lies
    before any instant: the time of any interval inside it is then two look-ups, whatever the
    number of steps."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        order = np.argsort(starts, kind="stable")
        self.starts, self.ends = _runs(starts[order], ends[order])
        self.before = np.r_[0.0, np.cumsum(self.ends - self.starts)]
        self.length = float(self.before[-1])

    def _upto(self, t: np.ndarray) -> np.ndarray:
        """The window's time before each instant."""
        if self.starts.size == 0:
            return np.zeros(t.shape)
        i = np.searchsorted(self.starts, t, side="right") - 1      # the last run starting by t
        j = np.maximum(i, 0)
        inside = np.clip(t - self.starts[j], 0.0, self.ends[j] - self.starts[j])
        return np.where(i >= 0, self.before[j] + inside, 0.0)

    def within(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Each interval's time inside the window."""
        return self._upto(ends) - self._upto(starts)

    def measure(self, starts: np.ndarray, ends: np.ndarray) -> float:
        """The time inside the window of the union of intervals given in order of start."""
        run_starts, run_ends = _runs(starts, ends)
        return float(self.within(run_starts, run_ends).sum())


def _window(events: _Events) -> _Window:
    """The ProfilerStep#N spans (µs), or the whole trace's span when it marks none."""
    if len(events.steps):
        return _Window(events.steps["start"], events.steps["end"])
    if events.first <= events.last:
        return _Window(np.array([events.first]), np.array([events.last]))
    return _Window(np.empty(0), np.empty(0))


@dataclass
class _Work:
    """A trace's work as time segments with a category code (non-overlapping per thread on the
    host), and the items counted (kernels, or ops) with theirs."""

    start: np.ndarray
    end: np.ndarray
    code: np.ndarray
    item_start: np.ndarray
    item_end: np.ndarray
    item_code: np.ndarray


def _device_work(events: _Events) -> _Work:
    """The device's kernels, one launched from inside an optimizer step counted as optimizer."""
    k = events.kernels
    code = k["code"].astype(np.int64)
    launched = _optimizer_launches(events)
    if launched.size:
        code = np.where((code < len(COMPUTE)) & np.isin(k["correlation"], launched), _OPTIMIZER_CODE, code)
    return _Work(k["start"], k["end"], code, k["start"], k["end"], code)


def _optimizer_launches(events: _Events) -> np.ndarray:
    """Correlation ids of the kernel launches made inside an optimizer step (on the step's host
    thread): one sort of spans and launches by thread and time, and the reach of the spans so far."""
    if not len(events.optimizer) or not len(events.launches):
        return np.empty(0, np.int64)
    spans, launches = events.optimizer, events.launches
    both = pl.concat([
        pl.DataFrame({"thread": spans["thread"], "t": spans["start"], "launch": False, "reach": spans["end"],
                      "correlation": np.full(len(spans), -1, np.int64)}),
        pl.DataFrame({"thread": launches["thread"], "t": launches["ts"], "launch": True,
                      "reach": np.full(len(launches), -np.inf), "correlation": launches["correlation"]}),
    ])
    inside = (both.sort("thread", "t", "launch")     # a span that starts as a launch does holds it
              .filter(pl.col("launch") & (pl.col("reach").cum_max().over("thread") >= pl.col("t"))))
    return inside["correlation"].to_numpy()


def _host_work(events: _Events) -> _Work:
    """Every host thread's ops and annotations as non-overlapping self-time segments, each with
    the category of the innermost op that has one (communication always itself; everything in an
    optimizer step optimizer). One pass per thread in order of start, with a stack of open ops."""
    ops = events.ops
    starts, ends = ops["start"], ops["end"]
    order = np.lexsort((starts - ends, starts, ops["thread"]))   # a parent before the children it starts with
    threads, own_codes = ops["thread"].tolist(), ops["code"].tolist()
    start_list, end_list = starts.tolist(), ends.tolist()
    seg_start: list[float] = []
    seg_end: list[float] = []
    seg_code: list[int] = []
    codes = [0] * len(own_codes)
    stack: list[list] = []          # [end, code, in an optimizer step, cursor]
    thread = None

    def segment(start: float, end: float, code: int) -> None:
        seg_start.append(start)
        seg_end.append(end)
        seg_code.append(code)

    def close(until: float) -> None:
        """Pop the ops that end by `until`, giving each its time after its last child."""
        while stack and stack[-1][0] <= until:
            end, code, _, cursor = stack.pop()
            if end > cursor:
                segment(cursor, end, code)
            if stack and stack[-1][3] < end:
                stack[-1][3] = end

    for i in order.tolist():
        if threads[i] != thread:
            close(math.inf)
            thread = threads[i]
        start, end, own = start_list[i], end_list[i], own_codes[i]
        close(start)
        if stack:   # the parent's time up to this child is its own
            parent = stack[-1]
            if start > parent[3]:
                segment(parent[3], start, parent[1])
                parent[3] = start   # (gloo's annotations may outlast the op that began them)
        in_optimizer = bool(stack and stack[-1][2]) or own == _OPTIMIZER_CODE
        if own >= _FIRST_COMM_CODE:
            code = own
        elif in_optimizer:
            code = _OPTIMIZER_CODE
        else:
            code = own if own >= 0 else stack[-1][1] if stack else _OTHER_CODE
        codes[i] = code
        stack.append([end, code, in_optimizer, start])
    close(math.inf)
    return _Work(np.asarray(seg_start, float), np.asarray(seg_end, float), np.asarray(seg_code, np.int64),
                 starts, ends, np.asarray(codes, np.int64))


def breakdown(trace: Trace) -> dict:
    """One trace's step split into categories (see the module's docstring); times in seconds.
    Linear in the trace's events but for sorting them once: each interval's time inside the steps
    is two look-ups (_Window), and each category's union is a sweep over the time-ordered segments."""
    events = trace.events
    window = _window(events)
    work = _device_work(events) if events.device else _host_work(events)
    n = len(CATEGORIES)
    kernel_s = np.bincount(work.code, weights=window.within(work.start, work.end), minlength=n)
    counts = np.bincount(work.item_code, weights=window.within(work.item_start, work.item_end) > 0, minlength=n)
    order = np.argsort(work.start, kind="stable")
    starts, ends, codes = work.start[order], work.end[order], work.code[order]

    def measure(mask: np.ndarray) -> float:
        return window.measure(starts[mask], ends[mask])

    steps = max(1, len(trace.steps))
    out: dict = {"source": "device" if events.device else "host", "steps": steps}
    covered = 0.0
    for i, category in enumerate(CATEGORIES):
        through = measure(codes <= i)
        out[f"{category}_s"] = (through - covered) / 1e6 / steps
        out[f"{category}_kernel_s"] = float(kernel_s[i]) / 1e6 / steps
        out[f"{category}_count"] = float(counts[i]) / steps
        covered = through
    compute, comm = codes < len(COMPUTE), codes >= _FIRST_COMM_CODE
    compute_s, comm_s, both = measure(compute), measure(comm), measure(compute | comm)
    out.update(step_s=window.length / 1e6 / steps, busy_s=covered / 1e6 / steps,
               idle_s=(window.length - covered) / 1e6 / steps, compute_s=compute_s / 1e6 / steps,
               comm_s=comm_s / 1e6 / steps, overlap_s=(compute_s + comm_s - both) / 1e6 / steps)
    out["overlap_frac"] = out["overlap_s"] / out["comm_s"] if out["comm_s"] > 0 else None
    return out


# -- a run's traces --------------------------------------------------------------------------------
def trace_files(folder: Path) -> list[Path]:
    """The trace files in `folder` (a run's traces/, or an artifact's <job>_kineto/), by name."""
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if not f.name.startswith(".")
                  and f.name.endswith((".json", ".json.gz")) and f.is_file())


BY = ("stage", "rank")


def breakdowns(files: list[Path], skipped: list[str] | None = None) -> pl.DataFrame:
    """One row per trace: rank, pipeline stage, node, step(s) and its breakdown. A trace that names
    no stage (an imported one) takes its place among the ranks: one trace per stage, whose first
    ranks grow with the stage (Megatron's rank order). A damaged trace raises its UserError, or,
    when `skipped` is given, is left out and its line appended there: it costs only itself."""
    rows = []
    traces = []
    for f in files:
        try:
            traces.append(read_trace(f))
        except UserError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
    unstaged = sorted({t.rank for t in traces if t.pp_rank is None and t.rank is not None})
    for trace in traces:
        pp = trace.pp_rank if trace.pp_rank is not None else \
            unstaged.index(trace.rank) if trace.rank in unstaged else None
        rows.append({"file": trace.path.name, "rank": trace.rank, "pp_rank": pp, "node": trace.node,
                     "step": trace.steps[0] if len(trace.steps) == 1 else None, **breakdown(trace)})
    if not rows:
        return pl.DataFrame()
    return pl.DataFrame(rows, infer_schema_length=None)


def by_group(per_trace: pl.DataFrame, by: str) -> pl.DataFrame:
    """Per pipeline stage (or rank): the mean over its traces (its ranks and steps) of each figure,
    with each category's share of the step."""
    if by not in BY:
        raise UserError(f"--by {by!r}: the kernel summary is per stage or per rank (stage, rank)")
    key = "pp_rank" if by == "stage" else "rank"
    figures = [c for c in per_trace.columns if c not in ("file", "rank", "pp_rank", "node", "step", "source", "steps")]
    other = pl.col("rank").drop_nulls().unique().sort().cast(pl.String).str.join(", ").alias("ranks") \
        if by == "stage" else pl.col("pp_rank").first()
    out = (per_trace.group_by(key).agg(pl.len().alias("traces"), other, pl.col("source").first(),
                                       pl.col("node").drop_nulls().first(), *(pl.col(c).mean() for c in figures))
           .sort(key))
    return out.with_columns(*(pl.when(pl.col("step_s") > 0).then(pl.col(f"{c}_s") / pl.col("step_s"))
                              .alias(f"{c}_frac") for c in CATEGORIES),
                            (pl.col("busy_s") / pl.col("step_s")).alias("busy_frac"))


def run_traces(run) -> list[Path]:
    """The profiler traces a run holds (RUN_DIR/traces/, engine.model.profiling)."""
    return trace_files(run.traces_dir)


def kernel_summary(run, by: str = "stage") -> pl.DataFrame:
    """The run's traces split into categories per pipeline stage (or rank): see by_group; a damaged
    trace is left out, and `notes` names it. A finished run's result is kept in RUN_DIR/summaries/
    (remade when its traces change)."""
    run = run if isinstance(run, RunDir) else resolve_run(run)
    if by not in BY:
        raise UserError(f"--by {by!r}: the kernel summary is per stage or per rank (stage, rank)")
    files = run_traces(run)
    if not files:
        raise UserError(f"run {run.id}: no profiler traces under {run.traces_dir} (set telemetry.profile_steps, "
                        "e.g. --set profile_steps=[10], to record some)")
    traces = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    place = kept_place(run, f"kernels-by-{by}", traces=traces)
    if place is not None and (df := read_kept(*place)) is not None:
        return df
    skipped: list[str] = []
    per_trace = breakdowns(files, skipped)
    if per_trace.height == 0:
        raise UserError(f"run {run.id}: no readable profiler trace ({skipped_note(skipped, len(files))})")
    df = by_group(per_trace, by).with_columns(pl.lit(run.id).alias("run"), pl.lit(by).alias("level"),
                                              pl.lit(skipped_note(skipped, len(files)) or None, pl.String)
                                              .alias("notes"))
    if place is not None:
        keep(df, *place)
    return df


def skipped_note(skipped: list[str], total: int) -> str:
    """One line naming the traces left out and why (the first three); "" when none was."""
    if not skipped:
        return ""
    more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return f"{len(skipped)} of {plural(total, 'trace')} skipped: {'; '.join(skipped[:3])}{more}"


def kernel_table(summary: pl.DataFrame) -> pl.DataFrame:
    """A kernel summary for reading: one row per figure, one column per stage (or rank): the step,
    busy and idle time, each category's time with its share of the step, and the overlap."""
    by = summary["level"][0] if "level" in summary.columns else "stage"
    key = "pp_rank" if by == "stage" else "rank"
    labels = [f"{by} {k}" for k in summary[key]]
    rows = [("step", "step_s"), ("busy", "busy_s"), ("idle", "idle_s")]
    rows += [(c, f"{c}_s") for c in CATEGORIES if summary[f"{c}_s"].fill_null(0).sum() > 0]
    rows += [("compute (any)", "compute_s"), ("communication (any)", "comm_s"), ("overlap", "overlap_s")]
    table: dict[str, list[str]] = {"time per step": [name for name, _ in rows]}
    for label, row in zip(labels, summary.iter_rows(named=True)):
        cells = []
        for name, column in rows:
            value = row[column]
            text = format_figure(column, value)
            if column == "overlap_s" and row.get("overlap_frac") is not None:
                text += f" ({100 * row['overlap_frac']:.0f}% of comm.)"
            elif name not in ("step",) and row["step_s"] and value is not None:
                text += f" ({100 * value / row['step_s']:.1f}%)"
            cells.append(text)
        table[label] = cells
    return pl.DataFrame(table)


def compare_kernels(refs: list[str]) -> tuple[pl.DataFrame, list[str]]:
    """Runs side by side: each run's kernel summary, averaged over its pipeline stages (as the
    artifact's Figure 10 divides by the pipeline degree), one row per run; and a note for each
    ref that has no traces."""
    rows, notes = [], []
    for ref in refs:
        try:
            run = resolve_run(ref)
            per_stage = kernel_summary(run, "stage")
        except UserError as exc:
            notes.append(str(exc))
            continue
        figures = [c for c in per_stage.columns if c.endswith(("_s", "_frac", "_count"))]
        rows.append(per_stage.select(pl.lit(run.id).alias("run"), pl.len().alias("stages"),
                                     pl.col("source").first(), *(pl.col(c).mean() for c in figures)))
    return (pl.concat(rows, how="diagonal_relaxed") if rows else pl.DataFrame()), notes


def kernels_side_by_side(overview: pl.DataFrame, labels: dict[str, str] | None = None) -> pl.DataFrame:
    """compare_kernels' rows for reading: one row per figure, one column per run; each category's
    share of the step and its time per step."""
    labels = labels or {}
    rows = [("step", "step_s"), ("busy", "busy_s"), ("idle", "idle_s")]
    rows += [(c, f"{c}_s") for c in CATEGORIES if overview[f"{c}_s"].fill_null(0).sum() > 0]
    rows += [("compute (any)", "compute_s"), ("communication (any)", "comm_s"), ("overlap", "overlap_s")]
    table: dict[str, list[str]] = {"mean per stage": [name for name, _ in rows]}
    for row in overview.iter_rows(named=True):
        cells = []
        for name, column in rows:
            value = row[column]
            share = (
                f"{100 * value / row['step_s']:.1f}% " if name != "step" and row["step_s"] and value is not None else ""
            )
            cells.append(f"{share}({format_figure(column, value)})" if share else format_figure(column, value))
        table[labels.get(row["run"], row["run"])] = cells
    return pl.DataFrame(table)
