"""A campaign: many experiments planned, queued and read together, as data.

A campaign is a TOML file, `<config>/campaigns/NAME.toml` or shipped in `presets/campaigns/`:

    description = "micro batch 1/2/4/8 on every H200 layout, recomputation on"
    experiments = ["ppt-h200-*-01000"]          # experiment presets by name or glob, or TOML files

    [axes]                                      # any experiment field, each value in turn
    micro_batch_size = [1, 2, 4, 8]

    [[layouts]]                                 # parallel settings, each applied in turn (optional)
    tensor_model_parallel_size = 2

    [target]                                    # where it runs and its limits (all optional)
    name = "mycluster"
    max_parallel = 2                            # members at once
    time_limit = "01:00:00"                     # per member (Slurm's --time, or stopped here)

Its members are every base experiment x every layout x every combination of the axes' values, in
that order. Each member is a whole experiment, planned like any other (engine.model.memory) and run
like any other (engine.launch): nothing here knows how to train or where.

Or, instead of experiments, a user's own command (`launch --command`) as a template, each axis a
placeholder that its values fill in turn:

    command = "torchrun --nproc-per-node 2 pretrain_gpt.py --micro-batch-size {micro_batch_size} ..."
    log_format = "megatron"                     # how its log reports steps (launch's --log-format)
    [axes]
    micro_batch_size = [1, 2, 4]

Each member is the command with its values filled in, planned from its Megatron flags where they give
a layout (engine.launch.command.plan_command, as `launch --command` plans), else "layout unknown" and
still run.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from charllm.engine.launch.command import Command, gpus_here, plan_command, run_name
from charllm.engine.model import catalog, speed
from charllm.engine.model.experiment import Experiment, all_keys, resolve_key
from charllm.engine.model.memory import DOES_NOT_FIT, estimate
from charllm.engine.model.validate import validate
from charllm.probes.core import paths
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, did_you_mean, plural, shown
from charllm.probes.core.formatting import size
from charllm.probes.store.trainlogs import check_format

KIND = "campaigns"                         # its catalog kind: presets/campaigns, <config>/campaigns
KEYS = ("description", "experiments", "command", "log_format", "hardware", "cwd", "axes", "layouts", "target")
COMMAND_KEYS = ("log_format", "hardware", "cwd")   # what only a campaign of a command takes
TARGET_KEYS = ("name", "max_parallel", "time_limit")
LAYOUT_SECTIONS = ("parallel", "cluster")  # what a layout may set; any other field is an axis
MAX_MEMBERS = 10_000
MAX_PARALLEL = 1024
# What each key of a campaign file holds (`charllm-tui campaign keys` shows it).
HELP = {
    "description": "one line saying what the campaign is for",
    "experiments": "the base experiments: preset names, globs over them (ppt-h200-*-01000) or TOML files",
    "command": "instead of experiments: your own command, each axis a {placeholder} in it (--micro-batch-size {mbs})",
    "log_format": "a command's log format: megatron (default), torchtitan, nemo, none, or a regular expression",
    "hardware": "a command's device preset, for its plan (default cpu only on a target here without a GPU)",
    "cwd": "where a command runs (relative: to the campaign file; default: where `campaign run` runs)",
    "axes": "a table: an experiment field (or a command's placeholder) -> the values it takes in turn (mbs = [1, 2])",
    "layouts": "[[layouts]] tables of parallel (or cluster) settings, each applied to every base in turn",
    "target.name": "the target members run on (a name from targets.toml, or local); launch's --target wins",
    "target.max_parallel": f"at most this many members at once (1 to {MAX_PARALLEL}; default 1)",
    "target.time_limit": "a member's time limit: seconds, or [D-]HH:MM:SS; Slurm's --time, else stopped here",
}


@dataclass(frozen=True)
class Member:
    """One experiment of a campaign: a base experiment with a layout and the axes' values applied."""

    index: int                      # 0-based, in expansion order
    base: str                       # the base experiment's name
    layout: dict                    # the [[layouts]] entry applied ({} when there are none)
    values: dict                    # axis -> value
    experiment: Experiment          # a command's: its flags' layout where they give one, else only its shape
    command: Command | None = None  # a campaign of a command: the member's, its values filled in
    notes: tuple[str, ...] = ()     # how a command was planned, or why it was not (plan_command)

    @property
    def key(self) -> str:
        """What identifies the member across runs of the campaign (resume keys on it)."""
        return json.dumps([self.base, self.layout, self.values], sort_keys=True, separators=(",", ":"))

    @property
    def varied(self) -> dict:
        """The settings this member was given: its layout's, then its axes' values."""
        return {**self.layout, **self.values}

    @property
    def known(self) -> bool:
        """Whether its layout is known: an experiment's always, a command's where its flags give one."""
        return self.command is None or self.command.planned

    @property
    def layout_label(self) -> str:
        return self.experiment.layout_label if self.known else LAYOUT_UNKNOWN


@dataclass(frozen=True)
class Plan:
    """A member's plan: runnable (fits, tight, a command's layout unknown), skipped (does not fit) or
    invalid, and why."""

    member: Member
    verdict: str                    # fits | tight | does not fit | invalid
    reason: str = ""                # the rule broken, or "planned X GiB of Y"
    peak_bytes: int | None = None
    allocator_bytes: int | None = None
    planned: dict | None = None     # the speed model's step time, tokens/s and power (engine.model.speed)

    @property
    def runnable(self) -> bool:
        return self.verdict not in (DOES_NOT_FIT, "invalid")

    @property
    def skip_reason(self) -> str:
        """What a campaign run records for a member it does not run."""
        return f"skipped: {self.verdict} ({self.reason})" if self.verdict == DOES_NOT_FIT else f"invalid: {self.reason}"


@dataclass(frozen=True)
class Campaign:
    name: str
    experiments: tuple[str, ...]
    description: str = ""
    axes: dict = field(default_factory=dict)          # field -> list of values
    layouts: tuple[dict, ...] = ()
    target: str | None = None
    max_parallel: int = 1
    time_limit_s: float | None = None
    source: str = ""                                  # the file it was read from
    command: str | None = None                        # a user's command template, in place of experiments
    log_format: str = "megatron"
    hardware: str | None = None                       # a command's device preset (None: cpu without a GPU here)
    cwd: str | None = None                            # where a command runs (None: where `campaign run` runs)

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, ref: str | Path) -> "Campaign":
        """The campaign named `ref` (the user's, else shipped), or a campaign TOML file (named by
        record_name)."""
        path = Path(ref).expanduser()
        if is_file_ref(ref):
            return cls.from_dict(record_name(ref), paths.read_toml(path, "campaign file"), str(path.resolve()))
        table = catalog.entries(KIND)
        if str(ref) not in table:
            hint = did_you_mean(ref, table, "; see `charllm-tui campaign list`", cutoff=0.5)
            raise UserError(f"campaign {str(ref)!r}: no such campaign{hint}")
        return cls.from_dict(str(ref), paths.read_toml(table[str(ref)], "campaign file"), str(table[str(ref)]))

    @classmethod
    def from_dict(cls, name: str, data: dict, source: str = "campaign") -> "Campaign":
        """A campaign from its TOML table; every mistake is one line naming the key."""
        where = f"campaign {name!r}"
        check_name(name)
        for key in data:
            if key not in KEYS:
                raise UserError(f"{where}: unknown key {key!r}{did_you_mean(key, KEYS)}")
        if "command" in data:
            return cls._of_command(name, data, source)
        for key in COMMAND_KEYS:
            if key in data:
                raise UserError(f"{where}: {key} goes with command (a campaign of your own command)")
        experiments = data.get("experiments")
        if isinstance(experiments, str):
            experiments = [experiments]
        if not isinstance(experiments, list) or not experiments or not all(isinstance(e, str) and e.strip()
                                                                             for e in experiments):
            raise UserError(f"{where}: experiments = {shown(experiments)}: give a list of experiment names, globs "
                            "or files (experiments = [\"tiny-local\"]), or a command")
        description = _description(where, data)
        axes = data.get("axes", {})
        if not isinstance(axes, dict):
            raise UserError(f"{where}: axes = {shown(axes)}: must be a table of field = [values]")
        for key, values in axes.items():
            _field(where, f"axes.{key}", key)
            if not isinstance(values, list) or not values:
                raise UserError(f"{where}: axes.{key} = {shown(values)}: must be a non-empty list of values")
            if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
                raise UserError(f"{where}: axes.{key} = {shown(values)}: a value is listed twice")
        layouts = data.get("layouts", [])
        if not isinstance(layouts, list) or not all(isinstance(t, dict) and t for t in layouts):
            raise UserError(f"{where}: layouts = {shown(layouts)}: must be [[layouts]] tables of parallel settings")
        for i, layout in enumerate(layouts, start=1):
            for key in layout:
                section = _field(where, f"layouts[{i}].{key}", key)
                if section not in LAYOUT_SECTIONS:
                    raise UserError(f"{where}: layouts[{i}].{key}: not a parallel setting ([{section}]); vary it "
                                    "under [axes]")
                if key in axes:
                    raise UserError(f"{where}: layouts[{i}].{key}: also an axis; set it in one place")
        return cls(name=name, experiments=tuple(e.strip() for e in experiments), description=description,
                   axes=dict(axes), layouts=tuple(dict(t) for t in layouts), source=source,
                   **_target(where, data))

    @classmethod
    def _of_command(cls, name: str, data: dict, source: str) -> "Campaign":
        """A campaign of a user's command template: its axes are the template's placeholders, each
        used, and every placeholder an axis."""
        where = f"campaign {name!r}"
        for key in ("experiments", "layouts"):
            if key in data:
                raise UserError(f"{where}: {key} and command: give one (a command's layout is in its flags: vary "
                                "them under [axes], --tensor-model-parallel-size {tp})")
        line = data["command"]
        if not isinstance(line, str) or not line.strip():
            raise UserError(f"{where}: command = {shown(line)}: give your command as one string")
        axes = data.get("axes", {})
        if not isinstance(axes, dict):
            raise UserError(f"{where}: axes = {shown(axes)}: must be a table of placeholder = [values]")
        used = placeholders(line)
        for key in used:
            if key not in axes:
                raise UserError(f"{where}: command: {{{key}}} is no axis{did_you_mean(key, axes)}; give its values "
                                f"under [axes] ({key} = [...]); a shell variable is written ${{{key}}}")
        for key, values in axes.items():
            if key not in used:
                raise UserError(f"{where}: axes.{key}: the command never uses {{{key}}}")
            if not isinstance(values, list) or not values or not all(
                    isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
                raise UserError(f"{where}: axes.{key} = {shown(values)}: must be a non-empty list of numbers or "
                                "strings (what the command's {placeholder} becomes)")
            if len({json.dumps(v) for v in values}) != len(values):
                raise UserError(f"{where}: axes.{key} = {shown(values)}: a value is listed twice")
        log_format = data.get("log_format", "megatron")
        if not isinstance(log_format, str):
            raise UserError(f"{where}: log_format = {shown(log_format)}: must be a string")
        try:
            check_format(log_format)
        except UserError as exc:
            raise UserError(f"{where}: log_format: {exc}") from None
        hardware, cwd = data.get("hardware"), data.get("cwd")
        for key, value in (("hardware", hardware), ("cwd", cwd)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise UserError(f"{where}: {key} = {shown(value)}: must be a non-empty string")
        if cwd is not None:   # (relative to the campaign's file, wherever `campaign run` runs)
            folder = Path(source).parent if Path(source).is_file() else Path.cwd()
            cwd = str(folder / Path(cwd).expanduser())
        return cls(name=name, experiments=(), description=_description(where, data), axes=dict(axes), source=source,
                   command=line, log_format=log_format, hardware=hardware, cwd=cwd, **_target(where, data))

    # -- members ---------------------------------------------------------------------------
    def bases(self) -> list[str]:
        """The base experiments, each pattern's matches in name order, each once."""
        names = list(catalog.entries("experiments"))
        out: list[str] = []
        for pattern in self.experiments:
            if pattern.endswith(".toml") or Path(pattern).expanduser().is_file():
                matched = [pattern]
            elif any(c in pattern for c in "*?["):
                matched = fnmatch.filter(names, pattern)
            else:
                matched = [pattern] if pattern in names else []
            if not matched:
                hint = did_you_mean(pattern, names, "; see `charllm-tui presets list experiments`", cutoff=0.5)
                raise UserError(f"campaign {self.name!r}: experiments: {pattern!r} matches no experiment{hint}")
            out += [m for m in matched if m not in out]
        return out

    def members(self) -> list[Member]:
        """Every base x layout x combination of the axes' values, each a whole experiment (of a
        command: each fill of its template). The count is checked against MAX_MEMBERS by arithmetic
        before any member is built."""
        if self.command is not None:
            return self._command_members()
        bases = self.bases()
        self._check_count(len(bases) * max(1, len(self.layouts)))
        combos = list(itertools.product(*self.axes.values()))
        out: list[Member] = []
        for base in bases:
            experiment = Experiment.load(base)
            for layout in self.layouts or ({},):
                for combo in combos:
                    values = dict(zip(self.axes, combo))
                    out.append(Member(len(out), experiment.name, dict(layout), values,
                                      self._member_experiment(experiment, layout, values)))
        return out

    def _check_count(self, per_combination: int) -> None:
        """Refuse more than MAX_MEMBERS members, counted by arithmetic before any is built: `per_combination`
        members for each combination of the axes' values."""
        count = per_combination * math.prod(len(values) for values in self.axes.values())
        if count > MAX_MEMBERS:
            raise UserError(f"campaign {self.name!r} ({self.source}): {count:,} members, more than the "
                            f"{MAX_MEMBERS:,} a campaign may have")

    def command_hardware(self, elsewhere: str | None = None) -> str:
        """The device preset a command's members are planned on: the campaign's `hardware`, else cpu on
        this machine without a GPU; one line asking for it otherwise, or where target `elsewhere` runs
        the command on other machines."""
        if self.hardware is not None:
            return self.hardware
        if elsewhere is None and not gpus_here():
            return "cpu"
        raise UserError(f"campaign {self.name!r}: hardware: give the nodes' device preset (hardware = \"NAME\"; "
                        "charllm-tui presets list hardware), which a command's plan needs"
                        + (f": target {elsewhere!r} runs the command on other machines, which this machine's cpu "
                           "default would misname" if elsewhere else ""))

    def _member_experiment(self, base: Experiment, layout: dict, values: dict) -> Experiment:
        exp = base.copy()
        for key, value in {**layout, **values}.items():
            try:
                exp.set(key, value)
            except UserError as exc:
                raise UserError(f"campaign {self.name!r}: {exc}") from None
        varied = {k: v for k, v in {**layout, **values}.items() if k in self.varying}
        if varied:   # the run's name says which member it is
            exp.name = member_name(base.name, varied)
        return exp

    def _command_members(self) -> list[Member]:
        assert self.command is not None
        self._check_count(1)
        hardware = self.command_hardware()
        # named by the script it runs (pretrain_gpt), else by the campaign
        base = run_name(self.command) if any(w.endswith(".py") for w in self.command.split()) else self.name
        out: list[Member] = []
        for combo in itertools.product(*self.axes.values()):
            values = dict(zip(self.axes, combo))
            varied = {k: v for k, v in values.items() if k in self.varying}
            line = fill(self.command, values)
            try:
                exp, command, notes = plan_command(line, log_format=self.log_format, hardware=hardware,
                                                   name=member_name(base, varied) if varied else base, cwd=self.cwd)
            except UserError as exc:
                raise UserError(f"campaign {self.name!r}: member {len(out) + 1} ({line}): {exc}") from None
            out.append(Member(len(out), base, {}, values, exp, command, tuple(notes)))
        return out

    @property
    def varying(self) -> set[str]:
        """The settings that differ between members (a one-value axis sets, it does not vary)."""
        layouts = {k for t in self.layouts for k in t} if len(self.layouts) > 1 else set()
        return layouts | {k for k, values in self.axes.items() if len(values) > 1}

    def plan(self) -> list[Plan]:
        """Every member validated and planned: its verdict, or the rule it breaks."""
        return [plan_member(m) for m in self.members()]


def plan_member(member: Member) -> Plan:
    if not member.known:   # run all the same: the job is the user's
        return Plan(member, LAYOUT_UNKNOWN, member.notes[0].removeprefix("not planned: ") if member.notes else "")
    problems = validate(member.experiment)
    if problems:
        return Plan(member, "invalid", str(problems[0]))
    report = estimate(member.experiment)
    allocator = report.budget.allocator_bytes
    fast = speed.estimate(member.experiment)
    planned = {"step_s": fast.step_s, "tokens_per_s": fast.tokens_per_s, "power_w": fast.power_w} if fast else None
    return Plan(member, report.verdict, f"planned {size(report.peak_bytes, 1)} of {size(allocator, 1)}",
                report.peak_bytes, allocator, planned)


LAYOUT_UNKNOWN = "layout unknown"   # a command member whose flags give no layout: not planned, still run

_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")   # {name}; ${NAME} is the shell's own


def placeholders(template: str) -> list[str]:
    """The axes a command template names ({micro_batch_size}), each once, in order."""
    return list(dict.fromkeys(_PLACEHOLDER.findall(template)))


def fill(template: str, values: dict) -> str:
    """The command with each {axis} replaced by its value, one shell word (quoted where it needs to be)."""
    return _PLACEHOLDER.sub(lambda m: shlex.quote(str(values[m[1]])), template)


VARIANTS = ("base", "overlap", "recompute", "overlap + recompute")   # the paper's optimization codes


def variant(exp: Experiment, name: str | None = None) -> str:
    """Which of the paper's four optimization variants an experiment is: communication overlap
    (any of grad-reduce, param-gather, TP overlap) and full activation recomputation, on or off.
    A CharLLM-PPT preset says its own in its name's code (ppt-...-01000): the artifact labels a
    variant by what it asked for, also where a layout has no overlap to turn on (MoE at TP1, FSDP),
    and its figures group by that label."""
    code = re.search(r"-([01])([01])000$", name or exp.name)
    if code:
        return VARIANTS[int(code[1]) + 2 * int(code[2])]
    t = exp.training
    overlap = t.overlap_grad_reduce or t.overlap_param_gather or t.tp_comm_overlap
    recompute = t.recompute_granularity == "full"
    return VARIANTS[overlap + 2 * recompute]


def member_name(base: str, varied: dict) -> str:
    """A member's experiment name: the base's, then what it varies ("tiny-local-tp2-mbs4")."""
    words = [f"{_SHORT.get(key, key.split('.')[-1])}{_word(value)}" for key, value in varied.items()]
    return "-".join([base, *words])[:120]


# Megatron's own abbreviations for the settings campaigns usually vary.
_SHORT = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "context_parallel_size": "cp",
          "expert_model_parallel_size": "ep", "virtual_pipeline_model_parallel_size": "vp",
          "micro_batch_size": "mbs", "global_batch_size": "gbs", "recompute_granularity": "recompute-",
          "sequence_parallel": "sp-", "gpus_per_node": "gpn", "nodes": "nodes", "overlap_grad_reduce": "ogr-",
          "overlap_param_gather": "opg-", "tp_comm_overlap": "tpo-", "use_distributed_optimizer": "distopt-",
          "train_iters": "iters"}


def _word(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return re.sub(r"[^A-Za-z0-9.]+", "", text) or "x"


def _field(where: str, label: str, key: str) -> str:
    """The section of experiment field `key` (as --set names it); a key no field has is one line."""
    if key in ("model", "hardware"):
        return key
    try:
        return resolve_key(key)[0]
    except UserError as exc:
        raise UserError(f"{where}: {label}: {exc}") from None


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def is_file_ref(ref: str | Path) -> bool:
    """Whether `ref` names a campaign file rather than a campaign (its name)."""
    path = Path(ref).expanduser()
    return path.suffix == ".toml" or path.is_file()


def record_name(ref: str | Path) -> str:
    """The name campaign `ref` runs and is recorded under (<runs>/.campaigns/NAME): a campaign's name
    as given; a campaign file's, its name with a digest of its real path ("tiny-local-1f2e3d4c"), so
    that a copy elsewhere never shares the record of the campaign it copies. A catalog's own file
    keeps its catalog name."""
    if not is_file_ref(ref):
        return str(ref)
    path = Path(ref).expanduser().resolve()
    stem = check_name(path.stem)
    if (mine := campaigns().get(stem)) is not None and mine.resolve() == path:
        return stem
    return f"{stem[:55]}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def _description(where: str, data: dict) -> str:
    description = data.get("description", "")
    if not isinstance(description, str):
        raise UserError(f"{where}: description = {shown(description)}: must be a string")
    return description


def _target(where: str, data: dict) -> dict:
    """A campaign's [target] table, checked, as the Campaign's fields."""
    target = data.get("target", {})
    if not isinstance(target, dict):
        raise UserError(f"{where}: target = {shown(target)}: must be a table (name, max_parallel, time_limit)")
    for key in target:
        if key not in TARGET_KEYS:
            raise UserError(f"{where}: unknown key 'target.{key}'{did_you_mean(key, TARGET_KEYS)}")
    target_name = target.get("name")
    if target_name is not None and (not isinstance(target_name, str) or not target_name.strip()):
        raise UserError(f"{where}: target.name = {shown(target_name)}: must be a target's name")
    return {"target": target_name,
            "max_parallel": check_max_parallel(target.get("max_parallel", 1), f"{where}: target.max_parallel"),
            "time_limit_s": parse_time_limit(target.get("time_limit"), f"{where}: target.time_limit")}


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise UserError(f"campaign name {shown(name)}: use letters, digits, '.', '_' and '-' (at most 64, "
                        "not starting with '.' or '-')")
    return name


def check_max_parallel(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PARALLEL:
        raise UserError(f"{where} = {shown(value)}: must be an integer from 1 to {MAX_PARALLEL}")
    return value


def parse_time_limit(value, where: str) -> float | None:
    """Seconds from a number of seconds or Slurm's [D-]HH:MM:SS (MM:SS, MM); None: no limit."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())):
        days, *parts = m.groups()
        units = [int(p) for p in parts if p is not None]
        if len(units) == 1:
            units = [0, units[0], 0]           # Slurm: a lone number is minutes
        elif len(units) == 2:
            units = [0, *units]
        seconds = int(days or 0) * 86400 + units[0] * 3600 + units[1] * 60 + units[2]
    else:
        raise UserError(f"{where} = {shown(value)}: give seconds or [D-]HH:MM:SS")
    if not 0 < seconds <= 366 * 86400:
        raise UserError(f"{where} = {shown(value)}: must be more than 0 and at most a year")
    return seconds


def campaigns() -> dict[str, Path]:
    """name -> file of every campaign (the user's over shipped ones)."""
    return catalog.entries(KIND)


def describe(plans: list[Plan]) -> str:
    """One line: how many members, how many runnable, skipped and invalid."""
    runnable = sum(p.runnable for p in plans)
    skipped = sum(p.verdict == DOES_NOT_FIT for p in plans)
    invalid = sum(p.verdict == "invalid" for p in plans)
    return (f"{plural(len(plans), 'member')}: {runnable:,} planned to run, {skipped:,} skipped (do not fit), "
            f"{invalid:,} invalid")



# -- a campaign of chosen layouts (the workbench's Sweep: marked layouts become a campaign) ----------
NAMED_BY = ("tensor_model_parallel_size", "pipeline_model_parallel_size")   # every [[layouts]] entry says these


def from_layouts(base: str, base_exp: Experiment, layouts: list[Experiment], description: str = "") -> dict:
    """A campaign's table: the experiment `base` (its preset name or file; `base_exp` is what it
    loads as) in each of `layouts`, experiments that differ from it in their layout only (sweep rows
    loaded into it). Each layout's parallel and cluster settings that differ from the base's or
    between the layouts, and its TP and PP always, are its [[layouts]] entry; any other setting they
    change (a micro batch, a recompute choice) must be the same in all of them, and is a one-value
    axis. Layouts that differ in such a setting are refused, with the setting named."""
    if not layouts:
        raise UserError("no layouts given: mark at least one")
    sections = all_keys()
    before = _settings(base_exp)
    rows = list({json.dumps(s, sort_keys=True, default=str): s for s in map(_settings, layouts)}.values())
    layout_keys, axes = [], {}
    for key, value in before.items():
        values = [row[key] for row in rows]
        differ = any(v != values[0] for v in values)
        if sections[key] in LAYOUT_SECTIONS:
            if differ or values[0] != value or key in NAMED_BY:
                layout_keys.append(key)
        elif differ:
            shown_values = ", ".join(dict.fromkeys(str(_toml(v)) for v in values))
            raise UserError(f"the layouts differ in {key} ({shown_values}): [[layouts]] hold parallel settings "
                            f"only; choose layouts of one {key}, or vary it under [axes] in the campaign file")
        elif values[0] != value:
            axes[key] = [_toml(values[0])]
    table: dict[str, Any] = {"description": description, "experiments": [base]} if description \
        else {"experiments": [base]}
    if axes:
        table["axes"] = axes
    table["layouts"] = [{key: _toml(row[key]) for key in layout_keys} for row in rows]
    return table


def _settings(exp: Experiment) -> dict:
    """Every cluster, parallel and training field of `exp`, by its bare name (as a campaign names it)."""
    sections = all_keys()
    return {name: value for section in ("cluster", "parallel", "training")
            for name, value in dataclasses.asdict(getattr(exp, section)).items() if sections.get(name) == section}


def _toml(value):
    return "none" if value is None else value      # TOML has no null; every optional field reads "none"


def save_new(name: str, table: dict) -> Path:
    """Write the user's new campaign `name` (<config>/campaigns/NAME.toml) and read it back whole
    (Campaign.load and its members); a name taken (the user's, or a shipped one that it would
    hide) or a table that does not load is refused, and nothing is left written."""
    import tomli_w  # deferred: only writing a campaign needs it

    check_name(name)
    taken = campaigns()
    if name in taken:
        raise UserError(f"campaign {name!r}: already exists ({taken[name]}); choose another name")
    Campaign.from_dict(name, table)
    path = paths.config_dir() / KIND / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, tomli_w.dumps(table))
    try:
        Campaign.load(name).members()
    except UserError:
        path.unlink(missing_ok=True)
        raise
    return path
