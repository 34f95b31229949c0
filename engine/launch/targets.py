"""Targets: where a run goes — this machine, SSH nodes, or a Slurm cluster.

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
    sbatch_lines = ["--exclusive"]
    env_setup = "module load cuda"
    python = "python3"
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, did_you_mean

KINDS = ("local", "ssh", "slurm")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")   # newlines, NUL, escapes: never in a config value
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:-]*$")  # names and addresses; never an ssh option

_COMMON = ("kind", "description", "env_setup", "python", "gpus_per_node")
KEYS = {
    "local": _COMMON,
    "ssh": _COMMON + ("hosts", "user", "port", "identity_file", "known_hosts", "workdir", "connect_timeout"),
    "slurm": _COMMON + ("partition", "account", "qos", "time", "constraint", "sbatch_lines"),
}


@dataclass(frozen=True)
class Target:
    name: str
    kind: str = "local"
    description: str = ""
    env_setup: str = ""               # a shell line run before every remote command
    python: str = ""                  # "" : this interpreter (local) / "python3" (remote)
    gpus_per_node: int | None = None  # None: the experiment's cluster.gpus_per_node
    # ssh
    hosts: tuple[str, ...] = ()
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None    # None: OpenSSH's default (~/.ssh/known_hosts)
    workdir: str = "charllm"
    connect_timeout: int = 10
    # slurm
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    constraint: str | None = None
    sbatch_lines: tuple[str, ...] = field(default_factory=tuple)

    @property
    def python_path(self) -> str:
        if self.python:
            return self.python
        return sys.executable if self.kind == "local" else "python3"

    def to_dict(self) -> dict:
        """What the manifest records: the non-default fields (no secrets live in a target)."""
        out = {"name": self.name, "kind": self.kind}
        defaults = Target(name=self.name, kind=self.kind)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in out and value != getattr(defaults, f.name):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


LOCAL = Target(name="local", kind="local", description="this machine")


# --------------------------------------------------------------------------------------------
# Parsing and validation
# --------------------------------------------------------------------------------------------
def _want(where: str, key: str, value, kind: type | tuple, rule: str):
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise UserError(f"{where}.{key} = {value!r}: {rule}")
    return value


def parse_target(name: str, data: dict, source: str = "targets") -> Target:
    """One target table -> Target, with one-line messages for every mistake."""
    where = f"{source}: [{name}]"
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be a table with kind = \"ssh\" or \"slurm\"")
    kind = data.get("kind")
    if kind not in KINDS:
        hint = did_you_mean(kind, KINDS, cutoff=0.5)
        raise UserError(f"{where}.kind = {kind!r}: must be one of {', '.join(KINDS)}{hint}")
    allowed = KEYS[kind]
    for key in data:
        if key not in allowed:
            hint = did_you_mean(key, allowed, f" for kind {kind!r}")
            raise UserError(f"{where}: unknown key {key!r}{hint}")
    values: dict = {"name": name, "kind": kind}
    text = "a string"
    for key in ("description", "env_setup", "python", "user", "identity_file", "known_hosts", "workdir",
                "partition", "account", "qos", "time", "constraint"):
        if key in data:
            values[key] = _want(where, key, data[key], str, f"must be {text}")
    if _CONTROL.search(name):
        raise UserError(f"{source}: target name {name!r}: must be one line of printable characters")
    for key, value in values.items():
        if key != "name" and _CONTROL.search(value):  # a newline would break out of an #SBATCH line
            rule = "join commands with ';'" if key == "env_setup" else "no newlines or control characters"
            raise UserError(f"{where}.{key} = {value!r}: must be one line ({rule})")
    for key, low, high in (("gpus_per_node", 1, 1024), ("port", 1, 65535), ("connect_timeout", 1, 3600)):
        if key in data:
            value = _want(where, key, data[key], int, "must be an integer")
            if not low <= value <= high:
                raise UserError(f"{where}.{key} = {value!r}: must be between {low} and {high}")
            values[key] = value
    for key in ("hosts", "sbatch_lines"):
        if key in data:
            value = data[key]
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                raise UserError(f"{where}.{key} = {value!r}: must be a list of non-empty strings")
            values[key] = tuple(v.strip() for v in value)
    if kind == "ssh":
        hosts = values.get("hosts", ())
        if not hosts:
            raise UserError(f"{where}.hosts: an ssh target needs at least one host")
        for host in hosts:
            if not _HOST.match(host):
                raise UserError(f"{where}.hosts: {host!r} is not a host name or address")
        if len(set(hosts)) != len(hosts):
            raise UserError(f"{where}.hosts = {list(hosts)!r}: a host is listed twice")
        user = values.get("user")
        if user is not None and (user.startswith("-") or "@" in user or any(c.isspace() for c in user)):
            raise UserError(f"{where}.user = {user!r}: not a user name")
    for key in ("hosts", "sbatch_lines"):
        for line in values.get(key, ()):
            if _CONTROL.search(line):
                raise UserError(f"{where}.{key}: {line!r} must be one line (no newlines or control characters)")
    return Target(**values)


def load_file(path: Path) -> dict[str, Target]:
    path = Path(path).expanduser()
    data = paths.read_toml(path, "targets file")
    out = {}
    for name, table in data.items():
        if name == "local":
            raise UserError(f"{path}: [local] is built in; give your target another name")
        out[name] = parse_target(name, table, source=str(path))
    return out


def load_targets(path: Path | None = None) -> dict[str, Target]:
    """`local` plus the targets in `path` (default: the user's targets.toml, if any)."""
    path = Path(path) if path else paths.targets_file()
    targets = {"local": LOCAL}
    if path.is_file() or path != paths.targets_file():
        targets.update(load_file(path))
    return targets


def get_target(name: str = "local", target_file: Path | None = None) -> Target:
    targets = load_targets(target_file)
    if name in targets:
        return targets[name]
    hint = did_you_mean(name, targets, f"; define it in {target_file or paths.targets_file()}", cutoff=0.5)
    raise UserError(f"--target {name!r}: no such target{hint}")


def from_record(record: dict) -> Target:
    """The Target a manifest recorded with `Target.to_dict()`."""
    data = dict(record)
    return parse_target(data.pop("name", "target"), data, source="manifest")
