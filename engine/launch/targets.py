"""Targets: where a run goes — this machine, SSH nodes, or a Slurm cluster.

Each kind is a class behind the one interface in target.py (local.py, ssh.py, slurm.py); this
module reads targets.toml into them.

Targets live in `<config_dir>/targets.toml` (or a file given with `--target-file`), one table per
target; `local` is built in:

    [lab]                          # charllm-tui launch tiny-local --target lab
    kind = "ssh"
    hosts = ["node1", "node2"]     # the first host is the torchrun rendezvous master
    user = "me"
    port = 22
    identity_file = "~/.ssh/id_ed25519"
    known_hosts = "~/.ssh/known_hosts"    # host keys are always verified
    workdir = "charllm"            # remote; relative paths are under the remote home
    env_setup = "module load cuda; conda activate train"
    python = "python3"

    [cluster]
    kind = "slurm"
    partition = "gpu"
    account = "proj42"
    qos = "normal"
    time = "01:00:00"
    constraint = "H100"
    gpus_per_node = 8
    exclusive = true               # whole nodes (the default), or cpus_per_gpu = 12 and mem_per_gpu = "96G"
    sbatch_lines = ["--mail-type=END"]
    env_setup = "module load cuda"  # its first failing command stops the job, named in the run's status
    python = "python3"
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

from charllm.engine.launch.local import LocalTarget
from charllm.engine.launch.target import Target
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, did_you_mean


class _Kinds(Mapping[str, type[Target]]):
    """Each kind's class by name, its module imported when the kind is first asked for: `runs list`
    of local runs never loads SSH's or Slurm's code (issue 36: commands import only what they use)."""

    _MODULES = {"local": ("local", "LocalTarget"), "ssh": ("ssh", "SshTarget"), "slurm": ("slurm", "SlurmTarget")}

    def __getitem__(self, kind: str) -> type[Target]:
        module, name = self._MODULES[kind]
        return getattr(importlib.import_module(f"charllm.engine.launch.{module}"), name)

    def __contains__(self, kind: object) -> bool:
        return isinstance(kind, str) and kind in self._MODULES

    def __iter__(self) -> Iterator[str]:
        return iter(self._MODULES)

    def __len__(self) -> int:
        return len(self._MODULES)


KINDS = _Kinds()
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")   # newlines, NUL, escapes: never in a config value

LOCAL = LocalTarget(name="local", description="this machine")


# --------------------------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------------------------
def _want(where: str, key: str, value, kind: type | tuple, rule: str):
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise UserError(f"{where}.{key} = {value!r}: {rule}")
    return value


def parse_target(name: str, data: dict, source: str = "targets") -> Target:
    """One target table -> the Target of its kind, with one-line messages for every mistake."""
    if not isinstance(name, str):   # a manifest's record may be damaged
        raise UserError(f"{source}: target name {name!r}: must be a string")
    where = f"{source}: [{name}]"
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be a table with kind = \"ssh\" or \"slurm\"")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        hint = did_you_mean(kind, KINDS, cutoff=0.5)
        raise UserError(f"{where}.kind = {kind!r}: must be one of {', '.join(KINDS)}{hint}")
    cls = KINDS[kind]
    allowed = cls.keys()
    for key in data:
        if key not in allowed:
            hint = did_you_mean(key, allowed, f" for kind {kind!r}")
            raise UserError(f"{where}: unknown key {key!r}{hint}")
    fields = [f for f in dataclasses.fields(cls) if f.name in data]
    ranges = {f.name: f.metadata["range"] for f in fields if "range" in f.metadata}
    switches = [f.name for f in fields if f.metadata.get("switch")]
    lists = [f.name for f in fields if f.name not in ranges and isinstance(f.default, tuple)]
    values: dict = {"name": name}
    for key in (f.name for f in fields if f.name not in ranges and f.name not in lists and f.name not in switches):
        values[key] = _want(where, key, data[key], str, "must be a string")
    if _CONTROL.search(name):
        raise UserError(f"{source}: target name {name!r}: must be one line of printable characters")
    for key, value in values.items():
        if key != "name" and _CONTROL.search(value):  # a newline would break out of an #SBATCH line
            rule = "join commands with ';'" if key == "env_setup" else "no newlines or control characters"
            raise UserError(f"{where}.{key} = {value!r}: must be one line ({rule})")
    for key, (low, high) in ranges.items():
        value = _want(where, key, data[key], int, "must be an integer")
        if not low <= value <= high:
            raise UserError(f"{where}.{key} = {value!r}: must be between {low} and {high}")
        values[key] = value
    for key in switches:
        values[key] = _want(where, key, data[key], bool, "must be true or false")
    for key in lists:
        value = data[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise UserError(f"{where}.{key} = {value!r}: must be a list of non-empty strings")
        values[key] = tuple(v.strip() for v in value)
    if values.get("env_setup"):
        _check_shell(values["env_setup"], f"{where}.env_setup")
    cls.validate(values, where)
    for key in lists:
        for line in values[key]:
            if _CONTROL.search(line):
                raise UserError(f"{where}.{key}: {line!r} must be one line (no newlines or control characters)")
    return cls(**values)


def _check_shell(line: str, where: str) -> None:
    """A line the nodes' bash runs as it is must be whole: an open quote or a trailing `&&` would
    swallow the commands after it. bash itself says (-n: parse, run nothing)."""
    bash = shutil.which("bash")
    if bash is None:
        return
    done = subprocess.run([bash, "-n", "-c", line], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["a syntax error"])[-1].removeprefix("bash: -c: ")
        raise UserError(f"{where} = {line!r}: not a complete shell line ({why})")


def read_file(path: Path) -> tuple[dict[str, Target], dict[str, str]]:
    """The targets in `path`, and the one-line problem of each table that is wrong: a bad
    table costs only itself (the file's other targets, and `local`, still work). A file that
    is not TOML at all raises, since none of its tables can be told apart."""
    path = Path(path).expanduser()
    data = paths.read_toml(path, "targets file")
    good, bad = {}, {}
    for name, table in data.items():
        try:
            if name == "local":
                raise UserError(f"{path}: [local] is built in; give your target another name")
            good[name] = parse_target(name, table, source=str(path))
        except UserError as exc:
            bad[name] = str(exc)
    return good, bad


def load_file(path: Path) -> dict[str, Target]:
    """Every target in `path`; the first wrong table is an error (for checking a whole file)."""
    good, bad = read_file(path)
    if bad:
        raise UserError(next(iter(bad.values())))
    return good


def _user_file(path: Path | None) -> Path | None:
    """The targets file to read: the one given, or the user's if it exists."""
    if path:
        return Path(path)
    return paths.targets_file() if paths.targets_file().is_file() else None


def load_targets(path: Path | None = None) -> tuple[dict[str, Target], dict[str, str]]:
    """`local` plus the targets in `path` (default: the user's targets.toml, if any), and the
    problem of each table that could not be read (by target name)."""
    good, bad = read_file(file) if (file := _user_file(path)) else ({}, {})
    return {"local": LOCAL, **good}, bad


def get_target(name: str = "local", target_file: Path | None = None) -> Target:
    """The target called `name`. `local` needs no file; another name needs only its own table
    to be right."""
    if name == "local" and target_file is None:
        return LOCAL
    targets, bad = load_targets(target_file)
    if name in bad:
        raise UserError(bad[name])
    if name in targets:
        return targets[name]
    hint = did_you_mean(name, targets, f"; define it in {target_file or paths.targets_file()}", cutoff=0.5)
    raise UserError(f"--target {name!r}: no such target{hint}")


def from_record(record: dict) -> Target:
    """The Target a manifest recorded with `Target.to_dict()` (and what it kept of the run, "run")."""
    data = dict(record)
    data.pop("run", None)
    return parse_target(data.pop("name", "target"), data, source="manifest")


def kind_of(record: dict) -> type[Target] | None:
    """The class of the kind a manifest's target record names; None for a kind this version lacks."""
    kind = record.get("kind")
    return KINDS.get(kind) if isinstance(kind, str) else None


def runs_here(record: dict) -> bool:
    """Whether a run on the target a manifest recorded has its processes on this machine."""
    cls = kind_of(record)
    return cls is not None and cls.on_this_machine


def describe(record: dict) -> str:
    """The one line readers print for the target a manifest recorded: its name, and its kind's own
    words for the run's job where it has one ("cluster (slurm job 12, COMPLETED)"). A kind this
    version does not know is shown as recorded."""
    cls = kind_of(record)
    if cls is None:
        kind, name = record.get("kind"), record.get("name")
        return f"{name if isinstance(name, str) and name else '-'} ({kind if isinstance(kind, str) and kind else '-'})"
    return cls.describe_record(record)
