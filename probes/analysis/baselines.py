"""Named baselines: a run's summary (and its experiment) kept to compare new runs against.

    <data_dir>/baselines/<name>/           presets/baselines/<name>/ (shipped, read-only)
        summary.parquet    the run-level summary (probes.analysis.summary, by="run")
        gpus.parquet       the per-GPU summary (absent for host-only CPU runs)
        experiment.toml    the run's experiment, when it had one
        baseline.json      name, source run, window, when saved, description (what it is)

A user baseline with the same name as a shipped one takes its place.
"""

from __future__ import annotations

import builtins
import json
import re
import shutil
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import polars as pl

from charllm.probes.analysis.summary import summarize
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError
from charllm.probes.core.files import open_regular, read_bounded
from charllm.probes.store.rundir import RunDir, resolve_run, write_json_atomic

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Baseline:
    name: str
    source: str                     # "user" | "shipped"
    meta: dict
    summary: pl.DataFrame           # one row, run level
    gpus: pl.DataFrame | None
    experiment_toml: str | None

    @property
    def description(self) -> str:
        return str(self.meta.get("description", ""))


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise UserError(f"baseline name {name!r}: use letters, digits, '.', '_' and '-' "
                        "(at most 128, not starting with '.' or '-')")
    return name


def save(run: RunDir | str, name: str, *, window="steady", description: str = "",
         overwrite: bool = False) -> Path:
    """Summarize `run` and keep the result as baseline `name` in the user's data dir."""
    check_name(name)
    run = run if isinstance(run, RunDir) else resolve_run(run)
    target = paths.baselines_dir() / name
    if target.exists() and not overwrite:
        raise UserError(f"baseline {name!r}: already exists in {target.parent}; delete it first or pick another name")
    summary = summarize(run, window, by="run")  # a finished run's pass keeps its per-GPU level too
    has_gpus = "power_mean_w" in summary.columns  # host-only (CPU) runs have no per-GPU rows
    gpus = summarize(run, window, by="gpu") if has_gpus else None
    manifest = run.read_manifest()
    meta = {
        "name": name, "run": run.id, "window": summary["window"][0], "saved_at": time.time(),
        "simulated": bool(summary["simulated"][0]),
        # measured | simulated | imported: what the numbers are, in one word
        "provenance": "simulated" if summary["simulated"][0] else
                      "imported" if manifest.get("kind") == "import" else "measured",
        "run_kind": manifest.get("kind"), "imported_from": manifest.get("imported_from"),
        "description": description or f"summary of run {run.id}",
    }
    # Build in a sibling temp dir and rename, so a failure never leaves half a baseline.
    tmp = target.with_name(f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    summary.write_parquet(tmp / "summary.parquet")
    if gpus is not None:
        gpus.write_parquet(tmp / "gpus.parquet")
    if run.experiment_path.is_file():
        shutil.copyfile(run.experiment_path, tmp / "experiment.toml")
    write_json_atomic(tmp / "baseline.json", meta)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _shipped_root():
    return resources.files("charllm.presets") / "baselines"


def _locations(name: str):
    """(source, directory) candidates for a name, user first."""
    yield "user", paths.baselines_dir() / name
    yield "shipped", _shipped_root() / name


def exists(name: str) -> bool:
    return bool(_NAME.match(name or "")) and any(d.is_dir() and (d / "summary.parquet").is_file()
                                                  for _, d in _locations(name))


def show(name: str) -> Baseline:
    """Load a baseline by name (user's first, then shipped)."""
    check_name(name)
    for source, d in _locations(name):
        if d.is_dir() and (d / "summary.parquet").is_file():
            meta = _meta(d) or {"name": name}
            summary = _frame(d / "summary.parquet")
            gpus = _frame(d / "gpus.parquet") if (d / "gpus.parquet").is_file() else None
            exp = None
            if (d / "experiment.toml").is_file():
                exp = read_bounded(d / "experiment.toml", paths.MAX_TOML_BYTES, "baseline experiment").decode(
                    errors="replace"
                )
            return Baseline(name, source, meta, summary, gpus, exp)
    known = ", ".join(b["name"] for b in list()) or "none"
    raise UserError(f"baseline {name!r}: no such baseline (known: {known})")


def _meta(d: Path) -> dict:
    """A baseline's baseline.json; {} where it is missing or damaged (the name and files still say
    what it is)."""
    try:
        meta = json.loads(read_bounded(d / "baseline.json", 2**20, "baseline.json"))
    except (OSError, ValueError, RecursionError, UserError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _frame(path: Path) -> pl.DataFrame:
    """A baseline's Parquet table; a damaged one is one UserError line naming it."""
    try:
        with open_regular(path, "baseline table") as fh:
            return pl.read_parquet(fh)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise UserError(f"{path}: damaged baseline table, not readable Parquet ({first}); delete and save it "
                        "again") from None


def list() -> builtins.list[dict]:  # the agreed name (save/list/show/delete)
    """Every baseline: name, source (user|shipped), run, window, simulated, description."""
    found: dict[str, dict] = {}
    for source, root in (("shipped", _shipped_root()), ("user", paths.baselines_dir())):
        if not root.is_dir():
            continue
        for d in root.iterdir():
            if d.is_dir() and _NAME.match(d.name) and (d / "summary.parquet").is_file():
                meta = _meta(d)
                found[d.name] = {  # a user baseline replaces a shipped one of the same name
                    "name": d.name, "source": source, "run": meta.get("run"), "window": meta.get("window"),
                    "simulated": meta.get("simulated"), "description": meta.get("description", ""),
                }
    return [found[k] for k in sorted(found)]


def delete(name: str) -> None:
    check_name(name)
    target = paths.baselines_dir() / name
    if not target.is_dir():
        if (_shipped_root() / name).is_dir():
            raise UserError(f"baseline {name!r}: shipped with charllm-tui, cannot be deleted")
        raise UserError(f"baseline {name!r}: no such baseline in {target.parent}")
    shutil.rmtree(target)
