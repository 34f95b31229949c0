"""Other programs' training logs, read into the iteration log: one parser per format.

A command that charllm did not write (`launch --command`, `attach`) logs its steps its own way; the
parsers here turn each line that reports a step into the iteration log's fields (probes.store.schema),
so summaries, Live, Runs and Compare read such a run like any other. Each format is taken from the
code that prints it:

- `megatron`: Megatron-LM's `training_log` (megatron/training/training.py at core_v0.16.1 and
  core_v0.19.0; the line is printed by the last rank, `print_rank_last`) and Megatron-Bridge's, which
  prints the same line (src/megatron/bridge/training/utils/train_utils.py `training_log`, v0.4.2):
  ` [DATE] iteration N/ TOTAL | consumed samples: S | elapsed time per iteration (ms): T | ...
  | lm loss: L | loss scale: X | grad norm: G | number of skipped iterations: K | number of nan
  iterations: M |`. Its figures are means over the log interval; Megatron-LM (core_v0.16.1 and
  core_v0.19.0: `should_reset = not is_first_iteration`) logs the run's first iteration without resetting
  them, so its next line averages from that first iteration on: a run read from its start (a first line
  at iteration 1, stamped to the microsecond as Megatron-LM stamps it; Megatron-Bridge stamps to the
  second and resets) has that line's loss and time taken back out of the next. Their memory reports too:
  Megatron-LM's `report_memory` (megatron/training/utils.py at core_v0.16.1,
  megatron/training/utils/common_utils.py at core_v0.19.0), `[Rank R] (after N iterations) memory (MB)
  | allocated: A | max allocated: B | reserved: C | max reserved: D` in MiB, and Megatron-Bridge's
  (train_utils.py `training_log`, MEMORY_KEYS), `memory (GB) | mem-allocated-gigabytes: A | ...` in
  units of 10^9 bytes.
- `torchtitan`: torchtitan's `MetricsProcessor.log` (torchtitan/components/metrics.py, v0.2.0 to v0.2.2;
  v0.1.0 without grad_norm): `step: N  loss: L  grad_norm: G  memory: M GiB(P%)  tps: T  tflops: F
  mfu: U%`, coloured with ANSI codes unless disabled. Its validation lines (`validate step: N`) are no
  training steps. It logs no step time: tps is tokens per second per device.
- `nemo`: NeMo 2's `ProgressPrinter` (nemo/lightning/pytorch/callbacks/progress_printer.py, v2.4.0):
  `Training epoch E, iteration I/TOTAL | lr: ... | global_batch_size: B | global_step: S |
  reduced_train_loss: L | train_step_timing in s: T | consumed_samples: C`, where I counts from 0
  (it prints n-1 after step n) and each metric is the mean over the log interval.
- `none`: no steps are read (the log is kept as it is).
- a regular expression with named groups (the user's own format): `iteration` is required; `loss`,
  `grad_norm`, `step_s`, `step_ms`, `samples`, `tflops_per_gpu` and `tokens_per_s` are read where present.

Only the matching part of a line counts, so prefixes that launchers add (torchrun's `[default0]:`,
srun's `0: `, a logger's date) change nothing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from charllm.probes.core.errors import UserError, shown

FORMATS = ("megatron", "torchtitan", "nemo", "none")   # none: the log is kept, no steps are read from it
REGEX_GROUPS = ("iteration", "loss", "grad_norm", "step_s", "step_ms", "samples", "tflops_per_gpu",
                "tokens_per_s")
MIB, GB = 2**20, 10**9

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = r"[-+]?(?:\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"

# Megatron-LM / Megatron-Bridge
_MEGATRON_STEP = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*elapsed time per iteration \(ms\).*)$")
_MICROSECOND_STAMP = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]\s*$")   # Megatron-LM's, not Bridge's
_MEGATRON_MEMORY = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \((MB|GB)\)\s*(\|.*)$")
_MEGATRON_FIELDS = {   # the line's name -> (our field, type)
    "elapsed time per iteration (ms)": ("step_ms", float),
    "throughput per GPU (TFLOP/s/GPU)": ("tflops_per_gpu", float),
    "learning rate": ("learning_rate", float),
    "global batch size": ("samples", int),
    "lm loss": ("loss", float),
    "loss scale": ("loss_scale", float),
    "grad norm": ("grad_norm", float),
    "number of skipped iterations": ("skipped_iterations", int),
    "number of nan iterations": ("nan_iterations", int),
}
_MEMORY_FIELDS = {   # the report's name -> our field, in MiB (Megatron-LM) or 10^9 bytes (Megatron-Bridge)
    "allocated": "allocated_bytes", "max allocated": "mem_peak_bytes",
    "reserved": "reserved_bytes", "max reserved": "mem_reserved_bytes",
    "mem-allocated-gigabytes": "allocated_bytes", "mem-max-allocated-gigabytes": "mem_peak_bytes",
    "mem-reserved-gigabytes": "reserved_bytes", "mem-max-reserved-gigabytes": "mem_reserved_bytes",
}

# torchtitan: "validate step:" lines are evaluation, not training steps
_TITAN_STEP = re.compile(rf"(?<!validate )\bstep:\s*(\d+)\s+loss:\s*({_NUMBER})(.*)$")
_TITAN_FIELDS = {
    "grad_norm": re.compile(rf"\bgrad_norm:\s*({_NUMBER})"),
    "memory": re.compile(rf"\bmemory:\s*({_NUMBER})GiB"),
    "tps": re.compile(rf"\btps:\s*({_NUMBER})"),
    "tflops": re.compile(rf"\btflops:\s*({_NUMBER})"),
    "mfu": re.compile(rf"\bmfu:\s*({_NUMBER})%"),
}

# NeMo 2
_NEMO_STEP = re.compile(r"\bTraining epoch (\d+), iteration (\d+)/(\d+)\s*((?:\|.*)?)$")
_NEMO_FIELDS = {
    "reduced_train_loss": ("loss", float),
    "train_step_timing in s": ("step_s", float),
    "global_batch_size": ("samples", int),
    "lr": ("learning_rate", float),
    "global_step": ("global_step", int),
}


def _number(text: str, kind: type = float):
    """A logged number ('1,126', '6.942921E+00', 'nan'); None for anything else."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    if kind is int:
        return int(value) if value == value and abs(value) < 2**63 and value == int(value) else None
    return value


def _pairs(text: str) -> dict[str, str]:
    """'| key: value | key: value |' as {key: value}."""
    out = {}
    for part in text.split("|"):
        key, sep, value = part.rpartition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _megatron(line: str) -> dict | None:
    step = _MEGATRON_STEP.search(line)
    if step:
        record: dict = {"event": "iteration", "iteration": int(step.group(1)), "train_iters": int(step.group(2))}
        if _MICROSECOND_STAMP.search(line[:step.start()]):
            record["unreset"] = True   # Megatron-LM's: its first line leaves the interval's sums as they are
        for name, value in _pairs(step.group(3)).items():
            if name in _MEGATRON_FIELDS:
                key, kind = _MEGATRON_FIELDS[name]
                record[key] = _number(value, kind)
        if record.get("step_ms") is None:
            return None          # a step line without its time is cut or not Megatron's
        record["step_s"] = record.pop("step_ms") / 1000
        return record
    memory = _MEGATRON_MEMORY.search(line)
    if memory:
        unit = MIB if memory.group(3) == "MB" else GB
        record = {"event": "memory", "rank": int(memory.group(1)), "iteration": int(memory.group(2))}
        for name, value in _pairs(memory.group(4)).items():
            if name in _MEMORY_FIELDS and (number := _number(value)) is not None:
                record[_MEMORY_FIELDS[name]] = round(number * unit)
        return record if "mem_peak_bytes" in record else None
    return None


def _torchtitan(line: str) -> dict | None:
    step = _TITAN_STEP.search(line)
    if not step:
        return None
    record: dict = {"event": "iteration", "iteration": int(step.group(1)), "loss": _number(step.group(2))}
    rest = step.group(3)
    found = {name: _number(m.group(1)) for name, pattern in _TITAN_FIELDS.items() if (m := pattern.search(rest))}
    if "tps" not in found:
        return None              # every torchtitan release logs tps on a training step
    record["tokens_per_s_per_device"] = found["tps"]
    record["grad_norm"] = found.get("grad_norm")
    record["tflops_per_gpu"] = found.get("tflops")
    record["mfu_pct"] = found.get("mfu")
    if found.get("memory") is not None:
        record["mem_reserved_bytes"] = round(found["memory"] * 2**30)   # max_reserved_gib
    return record


def _nemo(line: str) -> dict | None:
    step = _NEMO_STEP.search(line)
    if not step:
        return None
    # ProgressPrinter prints `iteration {n-1}`: the step just finished is n (1-based).
    record: dict = {"event": "iteration", "iteration": int(step.group(2)) + 1, "train_iters": int(step.group(3)) + 1}
    for name, value in _pairs(step.group(4)).items():
        if name in _NEMO_FIELDS:
            key, kind = _NEMO_FIELDS[name]
            record[key] = _number(value, kind)
    return record


def compile_regex(text: str) -> re.Pattern:
    """A user's log format: a regular expression with named groups (REGEX_GROUPS), `iteration` required."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise UserError(f"--log-format {shown(text)}: not one of {', '.join(FORMATS)}, nor a regular expression "
                        f"({exc})") from None
    groups = set(pattern.groupindex)
    if "iteration" not in groups:
        raise UserError(f"--log-format {shown(text)}: a regular expression needs a named group (?P<iteration>...) "
                        f"(or give one of {', '.join(FORMATS)})")
    unknown = sorted(groups - set(REGEX_GROUPS))
    if unknown:
        raise UserError(f"--log-format {shown(text)}: unknown group {unknown[0]!r}; groups it reads: "
                        f"{', '.join(REGEX_GROUPS)}")
    return pattern


def check_format(text: str) -> str:
    """`text` if it is a log format (a name in FORMATS, or a regular expression with an `iteration`
    group); else a UserError naming the rule."""
    if text not in FORMATS:
        compile_regex(text)
    return text


def _regex(pattern: re.Pattern):
    def parse(line: str) -> dict | None:
        match = pattern.search(line)
        if not match:
            return None
        values = match.groupdict()
        iteration = _number(values.get("iteration") or "", int)
        if iteration is None:
            return None
        record: dict = {"event": "iteration", "iteration": iteration}
        for name in ("loss", "grad_norm", "step_s", "tflops_per_gpu", "tokens_per_s"):
            if values.get(name) is not None:
                record[name] = _number(values[name])
        if values.get("samples") is not None:
            record["samples"] = _number(values["samples"], int)
        if values.get("step_ms") is not None and (ms := _number(values["step_ms"])) is not None:
            record["step_s"] = ms / 1000
        return record
    return parse


def parser(log_format: str):
    """The line parser of a format (a name in FORMATS, or a regular expression): line -> a record
    ({"event": "iteration" | "memory", ...}) or None."""
    known = {"megatron": _megatron, "torchtitan": _torchtitan, "nemo": _nemo, "none": lambda line: None}
    parse = known.get(log_format) or _regex(compile_regex(log_format))

    def clean(line: str) -> dict | None:
        return parse(_ANSI.sub("", line.rstrip("\r\n")))
    return clean


@dataclass
class LogReader:
    """A command's log, line by line, into iteration-log lines (schema.ITERATION_FIELDS).

    A step's end is when its line was read (`now_ns`): the reader runs beside the command and its
    output is unbuffered, so the two are the same moment. Its start is its end minus the time the line
    reports (Megatron's mean over the log interval), else the time since the previous step line spread
    over the steps between (torchtitan); a first step without either has no start (summaries leave
    it out). `warmup` marks the
    first `warmup_iters` steps, as the workload does; `seq_length`, where the layout is known, turns
    samples into tokens. Memory reports are kept in their own lines and raise the running peak the
    next steps carry (`mem_peak_bytes`, `mem_reserved_bytes`: the highest any rank reported so far)."""

    log_format: str
    node: str
    warmup_iters: int = 2
    seq_length: int | None = None
    lines: int = 0                   # lines read
    records: int = 0                 # lines that gave a record
    _parse: object = field(init=False, repr=False)
    _last: tuple[int, int] | None = field(default=None, init=False, repr=False)    # (iteration, end_ns)
    _first: dict | None = field(default=None, init=False, repr=False)   # Megatron-LM's first line, not reset
    _steps: int = field(default=0, init=False, repr=False)
    _peaks: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._parse = parser(self.log_format)

    def read(self, line: str, now_ns: int | None = None) -> dict | None:
        """The iteration-log line `line` gives, or None."""
        self.lines += 1
        parsed = self._parse(line)   # type: ignore[operator]
        if parsed is None:
            return None
        self.records += 1
        now_ns = time.time_ns() if now_ns is None else now_ns
        if parsed["event"] == "memory":
            for key in ("mem_peak_bytes", "mem_reserved_bytes"):
                if parsed.get(key) is not None:
                    self._peaks[key] = max(self._peaks.get(key, 0), parsed[key])
            return {**parsed, "node": self.node, "source": self.log_format, "ts_ns": now_ns}
        return self._step(parsed, now_ns)

    def _step(self, parsed: dict, end_ns: int) -> dict:
        iteration = parsed["iteration"]
        self._steps += 1
        if parsed.pop("unreset", False) and self._steps == 1 and iteration == 1:
            self._first = {key: parsed.get(key) for key in ("loss", "step_s")}
        elif self._first is not None and self._steps == 2 and iteration > 1:
            # This line's means cover iterations 1..N: take the first line's out of them.
            for key, first in self._first.items():
                if isinstance(parsed.get(key), float) and isinstance(first, float):
                    parsed[key] = (iteration * parsed[key] - first) / (iteration - 1)
        step_s = parsed.pop("step_s", None)
        start_ns = None
        if step_s is not None and step_s >= 0:
            start_ns = end_ns - round(step_s * 1e9)
        elif self._last and self._last[0] < iteration:
            last_iteration, last_end = self._last
            start_ns = end_ns - (end_ns - last_end) // (iteration - last_iteration)
        self._last = (iteration, end_ns)
        samples = parsed.get("samples")
        record = {
            **parsed, "rank": None, "node": self.node, "source": self.log_format,
            "start_ns": start_ns, "end_ns": end_ns,
            "tokens": samples * self.seq_length if isinstance(samples, int) and self.seq_length else None,
            "warmup": iteration <= self.warmup_iters,
        }
        for key, peak in self._peaks.items():
            record.setdefault(key, peak)
            if record[key] is None or record[key] < peak:
                record[key] = peak
        return record
