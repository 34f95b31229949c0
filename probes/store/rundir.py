"""The run directory: the contract between engine, probes and TUI.

    <runs_dir>/<run_id>/
        experiment.toml      the experiment as launched (engine writes it)
        manifest.json        id, target, times, status, exact commands (atomic rewrites)
        iterations.jsonl     the workload's iteration log (probes.store.schema.ITERATION_FIELDS)
        logs/                one log file per rank / sampler / launcher
        telemetry/<node>/    Arrow IPC chunks, NNNNNN.arrow, one sampler per node; compacted
                             Parquet files NNNNNN-MMMMMM.parquet hold chunks NNNNNN..MMMMMM
                             (finished telemetry: recorder.write_parquet; imports write it too)
        traces/              PyTorch profiler traces (Kineto JSON) of the profiled steps, one per
                             rank and step (engine.model.profiling; imports copy the artifact's)

A run can be watched live, replayed, summarised and compared from any process, after a crash
too: nothing important lives only in memory.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import stat
import statistics
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

from charllm.probes.core import paths, procid
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, plural, shown
from charllm.probes.core.files import is_regular, open_regular, read_bounded
from charllm.probes.core.formatting import clock

# "unknown": how the run ended cannot be known (a Slurm job gone from Slurm without its own end
# record, where no accounting keeps it); also what a run without a manifest reads as.
STATUSES = ("pending", "running", "completed", "failed", "cancelled", "unknown")
TRACES = "traces"   # the run's profiler traces
MAX_MANIFEST_BYTES = 16 * 2**20   # a manifest is a few KiB (commands, process records)
FINAL_STATUSES = ("completed", "failed", "cancelled", "unknown")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RUN_ID_STAMP = "%Y%m%d-%H%M%S"   # UTC: ids sort by start time
# A chunk (NNNNNN.arrow, Arrow IPC) or a compacted file holding chunks NNNNNN..MMMMMM
# (NNNNNN-MMMMMM.parquet); see probes/store/recorder.py.
CHUNK_NAME = re.compile(r"^(\d{6,})(?:-(\d{6,}))?\.(?:arrow|parquet)$")


def chunk_span(name: str) -> tuple[int, int] | None:
    """(first, last) chunk number held by a telemetry file name; None for anything else (.tmp files)."""
    m = CHUNK_NAME.match(name)
    if not m:
        return None
    first = int(m.group(1))
    return first, int(m.group(2) or first)


def node_chunks(directory: Path) -> list[tuple[int, int, Path]]:
    """(first, last, path) of the files that hold each of a node's chunks exactly once, in order.

    The recorder renames a compacted file into place before it deletes the chunks it holds, so a
    chunk inside a compacted file's span is skipped. The union of two listings makes this hold
    even when a compaction happens while the directory is read: a chunk missing from the first
    listing was deleted after its compacted file appeared, which the second listing then sees.
    """
    try:
        names = set(os.listdir(directory)) | set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    spans = sorted((s[0], -s[1], name) for name in names if (s := chunk_span(name)))
    out, reach = [], -1
    for first, neg_last, name in spans:  # by first, widest first: a span within an earlier one is covered
        if -neg_last > reach:
            out.append((first, -neg_last, directory / name))
            reach = -neg_last
    return out


@dataclass(frozen=True)
class Manifest:
    """The manifest's fields readers rely on, typed. Each annotation is the field's JSON type when
    present (manifest_problem checks it); an absent field reads as its default. Writers add other
    fields freely: `RunDir.read_manifest()` keeps every field as the plain dict they update."""

    id: str = ""
    kind: str = ""                       # "probe" for a probe-only run
    name: str = ""
    status: str = "unknown"
    failure: str | None = None
    note: str = ""
    target: dict = field(default_factory=dict)   # the target's record (engine.launch): its fields, and
    #                                             under "run" what it keeps of this run (a scheduler's job)
    nodes: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    commands: list = field(default_factory=list)
    forced: list = field(default_factory=list)
    processes: list = field(default_factory=list)
    supervisor: dict = field(default_factory=dict)
    sampler: dict = field(default_factory=dict)
    launched_from: dict = field(default_factory=dict)   # procid.place() of the launch
    created_ns: int = 0
    started_ns: int | None = None
    ended_ns: int | None = None
    world_size: int = 1
    telemetry_lost: list = field(default_factory=list)
    exit_codes: dict = field(default_factory=dict)
    runtime: dict | None = None
    disk_full: str = ""
    orphaned_ns: int | None = None       # when a reader found the owner dead and settled the run
    command: dict = field(default_factory=dict)   # a user's command that ran instead of the workload
    #                                             (engine.launch.command: line, log_format, planned, notes)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        """The typed view of a manifest that manifest_problem passed."""
        values = {name: data[name] for name in _MANIFEST_TYPES if name in data}
        kind = (values.get("target") or {}).get("kind")
        if isinstance(kind, str) and kind:
            # Older manifests kept the target's record of the run at the top level, each key named
            # `<kind>_<key>` (a Slurm job's id and state); runs last for months, so read them where
            # the target keeps that record now, `target["run"]` (which wins where both are).
            legacy = {key.removeprefix(kind + "_"): value for key, value in data.items()
                      if key.startswith(kind + "_") and isinstance(value, str) and value}
            run = values["target"].get("run")
            if legacy:
                values["target"] = {**values["target"], "run": {**legacy, **(run if isinstance(run, dict) else {})}}
        return cls(**values)

    @property
    def target_name(self) -> str:
        """The target it ran on; a probe-only or imported run names its kind instead ("-": neither)."""
        name = self.target.get("name")
        return name if isinstance(name, str) and name else self.kind or "-"

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def owner(self) -> dict:
        """The record of who owns the run's processes, and where (probes.core.procid): a probe-only
        run's sampler, else the supervisor (until it has recorded itself, where it was launched)."""
        if self.kind == "probe":
            return self.sampler
        return self.supervisor or self.launched_from

    @property
    def elsewhere(self) -> str | None:
        """Where an unfinished run runs when that is not here ("n1"), else None: its pids mean
        nothing here, so only its own host can tell whether it lives."""
        if self.final or procid.where(self.owner) != "elsewhere":
            return None
        return procid.described(self.owner)

    @property
    def status_line(self) -> str:
        """The status as the user should read it: "completed, telemetry lost at 12:03:04 (node n1)",
        "running on n1 (not visible from here)"."""
        line = self.status
        if self.elsewhere:
            return f"{line} on {self.elsewhere} (not visible from here)"
        for entry in self.telemetry_lost:
            if isinstance(entry, dict) and isinstance(entry.get("at_ns"), int):
                full = ", disk full" if "disk full" in str(entry.get("reason")) and not self.disk_full else ""
                line += f", telemetry lost at {clock(entry['at_ns'])} (node {_text(entry, 'node')}{full})"
        if self.disk_full:
            line += f", {self.disk_full}"
        return line


# Each manifest field's JSON types, from Manifest's annotations (bool is never taken for int).
_MANIFEST_TYPES = {name: typing.get_args(kind) or (kind,) for name, kind in typing.get_type_hints(Manifest).items()}
# What each list field holds (a reader iterates them).
_ITEM_TYPES = {"nodes": str, "steps": dict, "commands": str, "forced": str, "processes": dict, "telemetry_lost": dict}
_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true/false", list: "a list",
               dict: "an object", type(None): "null"}


def manifest_problem(data) -> str | None:
    """What is wrong with a manifest's shape, or None."""
    if not isinstance(data, dict):
        return f"{_JSON_NAMES.get(type(data), type(data).__name__)} instead of an object"
    for name, kinds in _MANIFEST_TYPES.items():
        value = data.get(name)
        if name in data and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            want = " or ".join(_JSON_NAMES[k] for k in kinds)
            return f"field {name!r} is {_JSON_NAMES.get(type(value), type(value).__name__)}, expected {want}"
    for name, kind in _ITEM_TYPES.items():
        items = data.get(name)
        if isinstance(items, list) and not all(isinstance(item, kind) for item in items):
            return f"field {name!r} holds something other than {_JSON_NAMES[kind].split(' ', 1)[1]}s"
    # times and counts a calendar holds
    for name in ("created_ns", "started_ns", "ended_ns", "orphaned_ns", "world_size"):
        value = data.get(name)
        if isinstance(value, int) and not 0 <= value < 2**63:
            return f"field {name!r} = {value}: out of range"
    if "status" in data and data["status"] not in STATUSES:
        return f"field 'status' = {data['status']!r}, expected one of {', '.join(STATUSES)}"
    return None


def write_json_atomic(path: Path, data) -> None:
    """Write JSON (indented, keys sorted) so a reader never sees half a file."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise UserError(
            f"run id {run_id!r}: use letters, digits, '.', '_' and '-' (at most 128, not starting with '.' or '-')"
        )
    return run_id


def check_node_name(node: str) -> str:
    """A node name names a directory (telemetry/<node>/): one plain name, never a path."""
    if not _RUN_ID.match(node):
        raise UserError(f"node {node!r}: use letters, digits, '.', '_' and '-' (at most 128, "
                        "not starting with '.' or '-'); it names a directory of the run")
    return node


def new_run_id(name: str) -> str:
    """A sortable, unique, shell-safe id: <UTC time>-<sanitised experiment name>."""
    stamp = time.strftime(_RUN_ID_STAMP, time.gmtime())
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:80] or "run"
    return f"{stamp}-{safe}"


def unique_run_dir(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ...: the first that does not exist yet (runs started in the
    same second under the same name; whoever creates it first has it)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def run_id_name(run_id: str) -> str | None:
    """The name part of an id new_run_id made ("20250101-120000-gpt" -> "gpt"); None for another id."""
    day, _, rest = run_id.partition("-")
    clock, _, name = rest.partition("-")
    return name if day.isdigit() and clock.isdigit() and name else None


# A file in every run directory charllm-tui makes, naming what made it: the proof, before anything
# is deleted or written there, that the directory is a run of ours and not somebody's folder.
MARKER = ".charllm-run"
CANCEL_REQUEST = ".charllm-cancel"
MADE_BY = ("launch", "probe", "import", "synthetic")


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, path: Path, made_by: str) -> "RunDir":
        """Make a new run directory (never an existing one: FileExistsError) and mark it as ours.
        Neither it nor the directory holding it is made writable by group or others, whatever the
        umask (a manifest others could write is never acted on: procid.trust_problem)."""
        path = Path(path)
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o755, exist_ok=True)
        path.mkdir(mode=0o755)
        run = cls(path)
        if not run.claim(made_by):
            raise FileExistsError(f"{path}: claimed by another writer")
        return run

    def claim(self, made_by: str) -> bool:
        """Mark an existing directory as a run made by `made_by` (MADE_BY); False if it already is
        one (of whatever maker): of several writers, exactly one claims it."""
        assert made_by in MADE_BY, made_by
        try:
            fd = os.open(self.path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({"made_by": made_by}) + "\n")
        return True

    @property
    def made_by(self) -> str | None:
        """What made this run directory (MADE_BY), from its marker; None for a directory without
        one (not ours, or a run older than the marker)."""
        try:
            fd = os.open(self.path / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    return None
                made_by = json.loads(fh.read(256)).get("made_by")
        except (OSError, ValueError, AttributeError):
            return None
        return made_by if made_by in MADE_BY else None

    def ours(self) -> bool:
        """Whether charllm-tui made this directory, so it may write and delete there: it holds our
        marker, or (runs made before the marker) it sits in the runs directory with a manifest."""
        if self.path.is_symlink():
            return False
        if self.made_by is not None:
            return True
        return self.in_runs_dir() and self.manifest_path.is_file() and not self.manifest_path.is_symlink()

    def in_runs_dir(self) -> bool:
        """Whether the directory is an entry of the runs directory itself, by real path (a link
        out of it is not)."""
        try:
            return not self.path.is_symlink() and \
                os.path.realpath(self.path.parent) == os.path.realpath(paths.runs_dir())
        except OSError:
            return False

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def token(self) -> str | None:
        """The run's token (probes.core.procid), which every process it starts carries: the proof
        a signal needs. None for a run recorded before tokens, or a token file not to be trusted."""
        return procid.read_token(self.path)

    def trust_problem(self) -> str | None:
        """Why nothing this run's manifest names may be acted on (procid.trust_problem: the
        manifest and the directory must be the user's, and nobody else may write them), or None."""
        return procid.trust_problem(self.path, self.manifest_path)

    @property
    def cancel_request_path(self) -> Path:
        """Where `runs cancel` asks a probe-only run's sampler to stop (a process it did not start
        carries no token of the run, so it is asked, never signalled)."""
        return self.path / CANCEL_REQUEST

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def experiment_path(self) -> Path:
        return self.path / "experiment.toml"

    @property
    def iterations_path(self) -> Path:
        return self.path / "iterations.jsonl"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def telemetry_dir(self) -> Path:
        return self.path / "telemetry"

    @property
    def traces_dir(self) -> Path:
        return self.path / TRACES

    def node_telemetry_dir(self, node: str) -> Path:
        return self.telemetry_dir / node

    def exists(self) -> bool:
        return self.manifest_path.is_file() or self.telemetry_dir.is_dir()

    # -- manifest ---------------------------------------------------------------------------
    def read_manifest(self) -> dict:
        """The manifest; a damaged one (not JSON, not an object, a field of the wrong type) is
        one UserError naming the file, so it costs only this run."""
        try:
            data = json.loads(read_bounded(self.manifest_path, MAX_MANIFEST_BYTES, "manifest"))
        except FileNotFoundError:
            if self.manifest_path.is_symlink():
                raise UserError(f"{self.manifest_path}: damaged manifest, a link to a missing file") from None
            return {"id": self.id, "status": "unknown"}
        except json.JSONDecodeError as exc:
            raise UserError(f"{self.manifest_path}: damaged manifest, not valid JSON "
                            f"({exc.msg} at line {exc.lineno})") from None
        except ValueError:  # UnicodeDecodeError: binary content
            raise UserError(f"{self.manifest_path}: damaged manifest, not UTF-8 text") from None
        except RecursionError:
            raise UserError(f"{self.manifest_path}: damaged manifest, nested too deeply") from None
        except OSError as exc:
            raise UserError(f"{self.manifest_path}: cannot read the manifest ({exc.strerror})") from None
        problem = manifest_problem(data)
        if problem:
            raise UserError(f"{self.manifest_path}: damaged manifest, {problem}")
        return data

    def manifest(self) -> Manifest:
        """The typed manifest (read_manifest's checks and errors; a missing one is "unknown")."""
        return Manifest.from_dict({**self.read_manifest(), "id": self.id})   # the directory names the run

    def write_manifest(self, manifest: dict) -> None:
        """Write the manifest into the existing run directory (never made again here: a run
        deleted meanwhile stays deleted)."""
        write_json_atomic(self.manifest_path, manifest)

    def update_manifest(self, **changes) -> dict:
        manifest = self.read_manifest()
        manifest.update(changes)
        self.write_manifest(manifest)
        return manifest

    @property
    def status(self) -> str:
        return self.manifest().status

    def check_deletable(self) -> None:
        """A run still pending or running must be cancelled first (its processes own the files).
        A damaged manifest says nothing, and deleting is the way to get rid of such a run: it
        goes once no process here names the run's directory (its supervisor, a probe's --out)."""
        try:
            status = self.status
        except UserError as damaged:
            users = self.processes()
            if users:
                raise UserError(f"{damaged}; still in use by process {users[0].pid} "
                                f"({' '.join(users[0].info['cmdline'])[:120]}), stop it first") from None
            return
        if status not in FINAL_STATUSES:
            raise UserError(f"run {self.id!r} is {status}; cancel it first "
                            f"(charllm-tui runs cancel {self.id}, or c on the Runs screen)")

    def processes(self) -> list:
        """Live processes on this host whose command line names the run's directory, leaving out
        this one and its ancestors (`timeout 10 charllm-tui runs delete DIR` names it too)."""
        import psutil

        here = str(self.path.resolve())
        me = psutil.Process()
        ours = {me.pid, *(p.pid for p in me.parents())}
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            words = proc.info["cmdline"] or []
            if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.pid not in ours \
                    and any(here in word for word in words):
                found.append(proc)
        return found

    def check_ours_to_delete(self) -> None:
        """Refuse, in one line, a directory that is not a run of ours in the runs directory: by
        real path (a symbolic link out of it is not in it), with our marker or a manifest."""
        where = paths.runs_dir()
        if self.path.is_symlink():
            raise UserError(f"run {self.id!r}: {self.path} is a symbolic link; charllm-tui deletes only "
                            f"run directories in {where}, never what a link points to")
        if not self.in_runs_dir():
            raise UserError(f"{self.path}: not in the runs directory {where}; charllm-tui deletes only its "
                            "own runs there (delete other directories yourself)")
        if not self.ours():
            raise UserError(f"{self.path}: not a run charllm-tui made (no {MARKER} or manifest.json); "
                            "left as it is")

    def delete(self) -> None:
        self.check_ours_to_delete()
        self.check_deletable()
        try:
            shutil.rmtree(self.path)
        except OSError as exc:  # rmtree names only the entry (read-only, or not ours)
            raise UserError(f"run {self.id!r}: cannot delete {self.path}: {exc.strerror or exc}") from None

    # -- data -------------------------------------------------------------------------------
    def telemetry_files(self) -> list[Path]:
        """Complete telemetry files, per node oldest first, each chunk once (see node_chunks)."""
        if not self.telemetry_dir.is_dir():
            return []
        nodes = sorted(d for d in self.telemetry_dir.iterdir() if d.is_dir())
        return [path for d in nodes for _, _, path in node_chunks(d)]

    def scan_telemetry(self, skipped: list[str] | None = None, *, columns: set[str] | None = None,
                       thorough: bool = False):
        """A polars LazyFrame over every readable telemetry file, conformed to the schema.

        A file that cannot be read (truncated, garbage, empty, a column of the wrong type) is
        left out; when `skipped` is given, one line saying what was lost is appended to it
        (`damage_note`). Only a file's footer and schema are checked, unless `thorough`: then
        each file is read whole first, which finds damage inside its data (what a reader does
        again after a scan failed on it, see TELEMETRY_DAMAGE). `columns`, when given, receives the names of
        the columns the files hold (finished files leave out all-null ones: a reader may skip what none holds).
        Compacted Parquet files go into one scan, given the schema (a file missing a column
        gets nulls); Arrow chunks with the schema's exact columns likewise, others (older or
        imported files) are conformed one by one. One scan is far faster than a scan per file.
        """
        import polars as pl

        from charllm.probes.store.schema import conform, empty_frame  # deferred: loads polars (start-up time)

        files = self.telemetry_files()
        kinds, damaged = {}, []
        for f in files:
            try:
                kinds[f], held = _telemetry_kind(f, thorough)
                if columns is not None:
                    columns.update(held)
            except _Unreadable as exc:
                damaged.append((f, str(exc)))
        if damaged and skipped is not None:
            skipped.append(damage_note(self, damaged, len(files)))
        files = [f for f in files if f in kinds]
        if not files:
            return empty_frame().lazy()
        parts = []
        for k, same_kind in itertools.groupby(files, key=kinds.get):
            group = list(same_kind)
            if k == "parquet":
                parts.append(scan_parquet(group))
            else:
                parts += [pl.scan_ipc(group, glob=False)] if k == "arrow" else \
                    [conform(pl.scan_ipc(f, glob=False)) for f in group]
        return parts[0] if len(parts) == 1 else pl.concat(parts, how="vertical")

    def runtime(self) -> dict | None:
        """What actually ran (the workload's record: engine.model.runtime's implementation, stack,
        versions, devices): the manifest's copy once the run ended, else the iteration log's
        start event. None before the workload started, or for a probe-only run."""
        saved = self.manifest().runtime
        if saved:
            return saved
        for record in self.iteration_records():
            if not isinstance(record, dict):
                continue
            if record.get("event") == "start" and isinstance(record.get("runtime"), dict):
                return record["runtime"]
            if record.get("event") == "iteration":
                return None    # start events come first; this run's workload wrote none
        return None

    def read_iterations(self):
        """The iteration log as a DataFrame (tolerates a half-written last line)."""
        return iteration_frame(self.iteration_records())

    def read_steps(self):
        """One row per training step (`merged_steps`)."""
        return merged_steps(self.read_iterations())

    def rank_steps(self, skipped: list[str] | None = None):
        """Every rank's step timers, one row per step and rank (see `rank_rows`, and for `skipped`);
        empty for a run whose workload logged no timers."""
        return rank_rows(self.iteration_records(), skipped)

    def profile_account(self) -> dict:
        """What the profiler window recorded and cost, from the iteration log: the traces written
        (the workload's "profile" lines), their bytes, and the profiled steps' mean time against the
        median of the other steady steps."""
        traces = [r for r in self.iteration_records() if isinstance(r, dict) and r.get("event") == "profile"]
        steps = self.read_steps()
        seconds = ((steps["end_ns"] - steps["start_ns"]) / 1e9).to_list()
        profiled = [s for s, p in zip(seconds, steps["profiled"]) if p]
        others = [s for s, p, w in zip(seconds, steps["profiled"], steps["warmup"]) if not p and not w]
        out = {"traces": len(traces), "bytes": sum(r["bytes"] for r in traces if isinstance(r.get("bytes"), int)),
               "profiled_step_s": round(statistics.fmean(profiled), 6) if profiled else None,
               "other_step_s": round(statistics.median(others), 6) if others else None}
        if out["profiled_step_s"] and out["other_step_s"]:
            out["slowdown"] = round(out["profiled_step_s"] / out["other_step_s"], 3)
        return out

    def end_events(self) -> list[dict]:
        """The workload's end records (each carries its status: completed, cancelled, failed)."""
        return [r for r in self.iteration_records() if isinstance(r, dict) and r.get("event") == "end"]

    def iteration_records(self):
        """Each JSON line of the iteration log; a damaged line (half-written, binary, not JSON)
        is skipped, costing only itself."""
        try:
            with open_regular(self.iterations_path, "iteration log") as fh:
                for line in fh:
                    try:
                        record = json.loads(line)
                    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
                        continue
                    yield record
        except (OSError, UserError):   # none yet, or not a file (a pipe, a directory): nothing to read
            return


class Reserve:
    """A little disk space a run's owner holds from its start (a hidden file in the run), given back
    when its final status must be written on a full disk. `held` is False when there was no room
    for it: then nothing should start that could not record how it ended."""

    NAME = ".reserve"

    def __init__(self, run_path: Path, size: int):
        self.path = Path(run_path) / self.NAME
        self.held = True
        try:
            with open(self.path, "wb") as fh:
                fh.write(b"\0" * size)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            self.path.unlink(missing_ok=True)
            self.held = False

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


# The (step, rank) rows of timers a summary reads at most: 100,000 ranks for 100 steps, or 1,000 for
# 10,000; each row is about 130 bytes once read.
MAX_RANK_ROWS = 10_000_000
_RANK_BATCH = 2**18   # rows gathered as Python values before they become a compact frame
_FLOAT_MAX = 2.0**1023   # a float constant: 2**1023 would be an int built anew at each use


def rank_rows(records, skipped: list[str] | None = None):
    """Every rank's step timers from iteration-log records (a run's file, or the lines a follower
    has seen), one row per step and rank: rank 0's `timers` (schema.RANK_TIMERS), with the step's
    start and end, warm-up and profiled marks, and where the rank ran (its node and coordinates,
    from rank 0's latest start record; null where unknown). A damaged value costs only itself; a
    line whose iteration is not a whole number is skipped (counted in one line appended to
    `skipped`, when given). Linear in the timers, gathered a batch at a time into compact frames;
    more than MAX_RANK_ROWS rows is one UserError."""
    import polars as pl

    from charllm.probes.store.schema import RANK_TIMERS  # deferred: loads polars (start-up time)

    schema = {"iteration": pl.Int64, "rank": pl.Int64, "start_ns": pl.Int64, "end_ns": pl.Int64,
              "warmup": pl.Boolean, "profiled": pl.Boolean, "placed": pl.Int64, **{t: pl.Float64 for t in RANK_TIMERS}}
    batch: dict[str, list] = {name: [] for name in schema}
    frames: list = []
    places: list = []     # each start record's places, numbered in order ("placed")
    bad, example, total = 0, None, 0

    def flush() -> None:
        located = pl.concat(places) if places else _places([], 0)
        frames.append(pl.DataFrame(batch, schema=schema)
                      .join(located, on=["placed", "rank"], how="left", maintain_order="left")
                      .select("iteration", "rank", "node", "local_rank", "pp_rank", "tp_rank", "dp_rank", "start_ns",
                              "end_ns", "warmup", "profiled", *RANK_TIMERS))
        for values in batch.values():
            values.clear()

    for record in records:
        if not isinstance(record, dict):
            continue
        if record.get("event") == "start" and isinstance(record.get("ranks"), list):
            places.append(_places(record["ranks"], len(places)))
        timers = record.get("timers")
        if record.get("event") != "iteration" or not isinstance(timers, dict):
            continue
        iteration = _typed(record.get("iteration"), pl.Int64)
        if iteration is None:
            bad += 1
            example = example or shown(record.get("iteration"), 40)
            continue
        columns = {name: timers[name] if isinstance(timers.get(name), list) else [] for name in RANK_TIMERS}
        ranks = max(len(values) for values in columns.values())
        total += ranks
        if total > MAX_RANK_ROWS:
            raise UserError(f"iteration log: timers for more than {MAX_RANK_ROWS:,} (step, rank) pairs ({ranks:,} "
                            "ranks on one line), the most a summary reads")
        step = {"iteration": iteration, "start_ns": _typed(record.get("start_ns"), pl.Int64),
                "end_ns": _typed(record.get("end_ns"), pl.Int64), "warmup": _typed(record.get("warmup"), pl.Boolean),
                "profiled": _typed(record.get("profiled"), pl.Boolean), "placed": len(places) - 1 if places else None}
        for key, value in step.items():
            batch[key].extend(itertools.repeat(value, ranks))
        batch["rank"].extend(range(ranks))
        for name, values in columns.items():
            batch[name].extend([v if type(v) is float and -_FLOAT_MAX < v < _FLOAT_MAX else _typed(v, pl.Float64)
                                for v in values])
            batch[name].extend(itertools.repeat(None, ranks - len(values)))
        if len(batch["rank"]) >= _RANK_BATCH:
            flush()
    flush()
    if bad and skipped is not None:
        skipped.append(f"{plural(bad, 'iteration-log line')} with timers skipped: 'iteration' is not a whole number "
                       f"(e.g. {example})")
    return pl.concat(frames, rechunk=False)


def _places(entries: list, placed: int):
    """Where each rank ran, from a start record's `ranks` (one row per rank: the last entry naming it)."""
    import polars as pl

    schema = {"rank": pl.Int64, "node": pl.String, "local_rank": pl.Int64, "pp_rank": pl.Int64, "tp_rank": pl.Int64,
              "dp_rank": pl.Int64}
    rows = [{k: _typed(entry.get(k), dtype) for k, dtype in schema.items()} for entry in entries
            if isinstance(entry, dict)]
    return (pl.DataFrame([r for r in rows if r["rank"] is not None], schema=schema)
            .unique("rank", keep="last", maintain_order=True).with_columns(pl.lit(placed, pl.Int64).alias("placed")))


def iteration_frame(records) -> typing.Any:
    """Iteration-log lines (dicts, as read or as a follower hands them on) as a typed DataFrame; a
    line that is not an object is left out, a field of the wrong type is null."""
    import polars as pl

    from charllm.probes.store.schema import ITERATION_SCHEMA  # deferred: loads polars (start-up time)

    rows = [r for r in records if isinstance(r, dict)]
    if not rows:
        return pl.DataFrame(schema=ITERATION_SCHEMA)
    clean = [{k: _typed(r.get(k), dtype) for k, dtype in ITERATION_SCHEMA.items()} for r in rows]
    return pl.DataFrame(clean, schema=ITERATION_SCHEMA, strict=False)


def merged_steps(log) -> typing.Any:
    """One row per training step of an iteration log (`iteration_frame`): the lines its ranks logged
    (rank 0 and the last rank both log each step) merged, from the first start to the last end; a
    step without both times is left out. `profiled` says a rank recorded a profiler trace of it. Every
    figure of a run's steps (summaries, Live) counts these."""
    import polars as pl  # deferred: loads polars (start-up time)

    return (
        log.filter(pl.col("event") == "iteration")
        .group_by("iteration")
        .agg(
            pl.col("start_ns").min(), pl.col("end_ns").max(),
            pl.col("samples").drop_nulls().first(), pl.col("tokens").drop_nulls().first(),
            pl.col("tflops_per_gpu").drop_nulls().first(), pl.col("warmup").fill_null(False).any(),
            pl.col("profiled").fill_null(False).any(),
        )
        .drop_nulls(["start_ns", "end_ns"])
        .sort("iteration")
    )


def one_per_step(events: list[dict]) -> list[dict]:
    """One iteration-log line per step, in step order: the first line logged for it (rank 0 and
    the last rank both log each step), or a later one that carries the loss (the last rank's)
    and rank 0's timers where the first has neither. read_steps merges a step's lines instead,
    and the CLI's follower prints the last rank's line."""
    steps: dict = {}
    for event in events:
        kept = steps.setdefault(event.get("iteration"), event)
        if kept is not event:
            for key in ("loss", "timers"):
                if kept.get(key) is None and event.get(key) is not None:
                    kept = steps[event.get("iteration")] = {**kept, key: event[key]}
    return [steps[k] for k in sorted(steps, key=lambda k: (k is None, k))]


def _typed(value, dtype):
    """A value of the column's type, else null (a wrong-typed field costs only that field)."""
    import polars as pl

    if value is None or isinstance(value, bool) and dtype != pl.Boolean:
        return None
    if dtype == pl.Boolean:
        return value if isinstance(value, bool) else None
    if dtype.is_integer():
        return value if isinstance(value, int) and -2**63 <= value < 2**63 else None
    if dtype.is_float():
        return float(value) if isinstance(value, (int, float)) and abs(value) < _FLOAT_MAX else None
    if dtype == pl.String:
        return value if isinstance(value, str) else None
    return value


class _Unreadable(Exception):
    """A telemetry file that cannot be read as what its name says."""


def past_damage(compute):
    """`compute(thorough)` once as usual; if a telemetry file proves damaged inside its data (which
    only reading it shows: polars' errors, its Rust panics, the OSError of a file cut short), once
    more with every file read whole first, the damaged ones left out and named (RunDir.scan_telemetry)."""
    import polars as pl

    try:
        return compute(False)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException, OSError):
        return compute(True)


def _telemetry_kind(path: Path, thorough: bool = False) -> tuple[str, list[str]]:
    """("parquet", "arrow" (exactly the schema) or "other" (conformable), the file's columns);
    raises _Unreadable for a file whose footer or schema cannot be read, or whose columns have
    types the schema's cannot take (or, `thorough`, whose data cannot be read whole)."""
    import polars as pl

    from charllm.probes.store.schema import TELEMETRY_SCHEMA  # deferred: loads polars (start-up time)

    parquet = path.suffix == ".parquet"
    try:
        if not is_regular(path):
            raise _Unreadable("not a regular file")
        schema = pl.read_parquet_schema(path) if parquet else pl.read_ipc_schema(path)
        if thorough:
            pl.read_parquet(path) if parquet else pl.read_ipc(path)
    except FileNotFoundError:
        raise  # merged and deleted since the listing: not damage
    except _Unreadable:
        raise
    except (Exception, pl.exceptions.PanicException) as exc:  # noqa: BLE001 - polars raises many kinds for a damaged file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise _Unreadable(f"not {'Parquet' if path.suffix == '.parquet' else 'Arrow IPC'} ({first[:80]})") from None
    for name, dtype in schema.items():
        want = TELEMETRY_SCHEMA.get(name)
        if want is not None and dtype != want and not _widens(dtype, want):
            raise _Unreadable(f"column {name} is {dtype}, expected {want}")
    if path.suffix == ".parquet":
        return "parquet", list(schema)
    return "arrow" if schema == dict(TELEMETRY_SCHEMA) else "other", list(schema)


def _widens(have, want) -> bool:
    """Whether a column of type `have` is read as `want` without loss (what the scans cast)."""
    import polars as pl

    if want == pl.Int64():
        return have.is_integer() and have != pl.UInt64()
    if want == pl.Float64():
        return have.is_float() or have.is_integer()
    if want == pl.String():
        return isinstance(have, (pl.Categorical, pl.Enum))
    return False


def damage_note(run: RunDir, damaged: list[tuple[Path, str]], total: int) -> str:
    """One line: how many telemetry files were skipped, which, why, and about how much time they held."""
    chunks = sum(last - first + 1 for f, _ in damaged for first, last in [chunk_span(f.name) or (0, -1)])
    names = ", ".join(f"{f.relative_to(run.path)} ({why})" for f, why in damaged[:3])
    more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
    return (f"{len(damaged)} of {total} telemetry files unreadable, skipped: {names}{more}; "
            f"{plural(chunks, 'chunk')} lost, about {chunks * 1.0:.1f} s at the sampler's 1 s chunks")


def scan_parquet(files: list[Path], **options):
    """One polars scan of finished telemetry files, conformed to the schema (the compact files
    leave out all-null columns, and a file may hold narrower numbers: both are filled in)."""
    import polars as pl

    from charllm.probes.store.schema import TELEMETRY_SCHEMA  # deferred: loads polars (start-up time)

    return pl.scan_parquet(
        files, glob=False, schema=dict(TELEMETRY_SCHEMA), missing_columns="insert", extra_columns="ignore",
        cast_options=pl.ScanCastOptions(integer_cast="upcast", float_cast="upcast"), **options)


def scan_runs(root: Path | None = None):
    """The finished telemetry of every run under `root` (the runs directory) as one polars
    LazyFrame with a `run` column first: the campaign-wide scan the layout is made for
    (`<runs>/<run>/telemetry/<node>/*.parquet`; the README shows the same in DuckDB)."""
    import polars as pl

    from charllm.probes.store.schema import empty_frame  # deferred: loads polars (start-up time)

    files = sorted(f for f in (root or paths.runs_dir()).glob("*/telemetry/*/*.parquet")
                   if not f.parents[2].name.startswith("."))  # not an import still being written
    if not files:
        return empty_frame().lazy().select(pl.lit(None, pl.String).alias("run"), pl.all())
    scan = scan_parquet(files, include_file_paths="_path")
    run = pl.col("_path").str.split(os.sep).list.get(-4)  # <run>/telemetry/<node>/<file>
    return scan.select(run.alias("run"), pl.exclude("_path"))


# Who provides Adam and the multi-tensor kernels (gradient norm, scaling), as megatron-core picks them:
# Transformer Engine's, else Apex's, else torch's (megatron-core's fallback builds torch's AdamW
# without fused=True and computes the gradient norm with a host sync per parameter; the workload
# turns fused on and computes the norm on the device, see train.use_torch_fast_paths).
OPTIMIZERS = {
    "transformer_engine": "optimizer kernels Transformer Engine's",
    "apex": "optimizer kernels Apex's",
    "torch": "optimizer kernels torch's (fused Adam, gradient norm on the device)",
}


def implementation_words(impl: dict | None, versions: dict | None = None) -> list[str]:
    """What an implementation record (`engine.model.runtime.Implementation.to_dict()`) says runs, in
    words: the one wording of the plan (`Implementation.describe`) and of the run (`runtime_line`).
    A field of the wrong type reads as unknown ("?")."""
    impl, versions = _table(impl), _table(versions)
    transformer = {"transformer_engine": f"Transformer Engine {_text(versions, 'transformer_engine', '')}".strip(),
                   "local": "local layers"}.get(_text(impl, "transformer_impl"), "?")
    fusions = _items(impl.get("fusions"))
    fused = ", ".join(str(f).removesuffix("_fusion") for f in fusions) or "none"
    words = [transformer, f"attention {_text(impl, 'attention')}", f"fusions {fused}"]
    optimizer = impl.get("optimizer")
    if isinstance(optimizer, str):
        words.append(OPTIMIZERS.get(optimizer, f"optimizer kernels {optimizer}"))
    if impl.get("device") == "cpu":
        words.append("on CPU")
    return words + [str(note) for note in _items(impl.get("notes"))]


def runtime_line(record: dict | None) -> str:
    """One line saying what ran: implementation (`implementation_words`), devices, versions, and the
    megatron-core class that built the model. A field of the wrong type (a damaged record) reads
    as unknown ("?"), never as an error."""
    if not isinstance(record, dict) or not record:
        return "not recorded (the workload has not started, or predates this record)"
    impl, versions, model = (_table(record.get(k)) for k in ("implementation", "versions", "model"))
    words = implementation_words(impl, versions)
    devices = [d for d in _items(record.get("devices")) if isinstance(d, dict)]
    if devices:
        names = sorted({_text(d, "name") for d in devices})
        driver = _text(record, "driver", "")
        words.append(f"{len(devices)}x {'/'.join(names)}" + (f" (driver {driver})" if driver else ""))
    elif "on CPU" not in words:
        words.append("CPU")
    torch = f"torch {_text(versions, 'torch')}"
    if _text(versions, "cuda", ""):
        nccl = _text(versions, "nccl", "")
        torch += f" (CUDA {versions['cuda']}" + (f", NCCL {nccl})" if nccl else ")")
    built = f" {model['class']}" if isinstance(model.get("class"), str) else ""
    return " · ".join([*words, torch, f"megatron-core {_text(versions, 'megatron_core')}{built}"])


def command_line(manifest: Manifest) -> str | None:
    """The user's command a run ran in place of the workload (`launch --command`), on one line, or what an
    attach followed ("attached to slurm job 12 ..."); None for the workload's own runs."""
    attached = manifest.command.get("attached")
    if isinstance(attached, str) and attached:
        return f"attached to {attached}"
    line = manifest.command.get("line")
    return " ".join(line.split()) if isinstance(line, str) and line.strip() else None


def ran_line(manifest: Manifest, runtime: dict | None) -> str:
    """What ran, as status lines say it: "ran: CMD" for a user's command, else "ran as ..." (runtime_line)."""
    command = command_line(manifest)
    return f"ran: {command}" if command else f"ran as {runtime_line(runtime)}"


def _items(value) -> list | tuple:
    """A record's list, or () where a damaged record holds something else."""
    return value if isinstance(value, (list, tuple)) else ()


def _table(value) -> dict:
    """A record's sub-table, or {} where a damaged record holds something else."""
    return value if isinstance(value, dict) else {}


def _text(table: dict, key: str, default: str = "?") -> str:
    """A record's plain value as text, or `default` where it is missing or not a plain value."""
    value = table.get(key)
    return str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else default


def staging_dir(final: Path) -> Path:
    """Where a run is written before it takes its name (an import). Named for its writer, process
    and thread, so a simultaneous writer of the same id never removes it, and hidden from lists."""
    return final.with_name(f".{final.name}.{os.getpid()}-{threading.get_ident()}.importing")


_STAGING = re.compile(r"^\..+\.(\d+)-\d+\.importing$")


def remove_abandoned_staging(root: Path) -> None:
    """Remove the staging directories of writers that died (a killed import); a live one's stays."""
    import psutil

    for entry in root.iterdir() if root.is_dir() else []:
        m = _STAGING.match(entry.name)
        if not m:
            continue
        try:
            alive = psutil.Process(int(m[1])).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            shutil.rmtree(entry, ignore_errors=True)


def list_runs(root: Path | None = None) -> list[RunDir]:
    root = root or paths.runs_dir()
    if not root.is_dir():
        return []
    remove_abandoned_staging(root)
    return sorted((RunDir(p) for p in root.iterdir() if _a_run(p)), key=lambda r: r.id)


def _a_run(path: Path) -> bool:
    """Whether a runs-directory entry is a run: a directory with a manifest; one that cannot be
    looked into (its permissions) is listed too, so that its row says why."""
    try:
        if not path.is_dir():
            return False
        os.lstat(path / "manifest.json")
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


def resolve_run(ref: str | os.PathLike, root: Path | None = None) -> RunDir:
    """A run given as a path, an id, or a unique id prefix/suffix."""
    if not str(ref).strip():
        raise UserError("run '': give a run id, a unique prefix or suffix of one, or a path")
    candidate = Path(ref).expanduser()
    if candidate.is_dir() and ((candidate / "manifest.json").exists() or (candidate / "telemetry").is_dir()):
        return RunDir(candidate.resolve())
    root = root or paths.runs_dir()
    ref = str(ref)
    exact = root / ref
    if _RUN_ID.match(ref) and exact.is_dir():
        return RunDir(exact)
    matches = [r for r in list_runs(root) if r.id.startswith(ref) or r.id.endswith(ref)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UserError(f"run {ref!r}: no such run directory or run id under {root}")
    names = ", ".join(r.id for r in matches[:5])
    raise UserError(f"run {ref!r}: ambiguous, matches {len(matches)} runs ({names}); give more of the id")
