"""Turn the GPU acceptance kit's archives (benchmarks/gpu/kit.py) into test data in tests/data/gpu_runs/.

    python tools/import_gpu_kit.py gpu-kit-p1.tar.gz [gpu-kit-p2.tar.gz.000 gpu-kit-p2.tar.gz.001 ...] \\
        [--into tests/data/gpu_runs] [--name NAME]

It writes, whole or not at all:
- NAME.json: the records tools/import_gpu_runs.py makes of every completed GPU run (the memory and
  step-time checks of tests/engine/model/test_gpu_runs.py read them);
- NAME/partN/: each part's record as the kit packed it (results.json, each item's commands and
  output, kit.log, the node calibrations);
- NAME/runs/RUN/: the runs the kit marked to keep (the profiled run, the micro-batch sweep, the
  runners), whole; profiler traces gzipped (the kernel summary reads .json.gz), and telemetry over
  TELEMETRY_LIMIT thinned to every k-th sample of each device;
- NAME/import.json and NAME/results.md: what came from which part, each item's outcome, and every
  trace gzipped and telemetry thinned, said.

NAME defaults to the GPU and the day the first part started (h200-2026-11-29; a dry run: cpu-dry-run-...).
An archive that is not the kit's, a piece missing, or a NAME already there is one line and exit 2,
with nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import io
import json
import math
import re
import shutil
import sys
import tarfile
from pathlib import Path

import polars as pl

from charllm.probes.core.errors import UserError, one_line

ROOT = Path(__file__).resolve().parents[1]
TELEMETRY_LIMIT = 2 * 2**20     # bytes of Parquet per kept run; a 40 s run at 100 Hz is a few hundred KiB


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)   # type: ignore[arg-type]
    sys.modules[name] = module                       # (dataclasses look their module up there)
    spec.loader.exec_module(module)                  # type: ignore[union-attr]
    return module


kit = _load("gpu_kit", ROOT / "benchmarks" / "gpu" / "kit.py")                  # the archive's layout
import_gpu_runs = _load("import_gpu_runs", ROOT / "tools" / "import_gpu_runs.py")   # the records


def unpack(name: str, data: bytes, into: Path) -> dict:
    """One part into `into`: its members must all lie under the kit's folder; its results.json."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            stray = [m.name for m in members if m.name.split("/")[0] != kit.ARCHIVE_TOP]
            if stray:
                raise UserError(f"{name}: not the kit's archive ({stray[0]!r} is outside {kit.ARCHIVE_TOP}/)")
            tar.extractall(into, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise UserError(f"{name}: not a readable tar.gz ({one_line(exc)[:120]})") from None
    try:
        results = json.loads((into / kit.ARCHIVE_TOP / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{name}: no readable {kit.ARCHIVE_TOP}/results.json ({one_line(exc)[:120]})") from None
    if not isinstance(results, dict) or not isinstance(results.get("items"), list):
        raise UserError(f"{name}: {kit.ARCHIVE_TOP}/results.json has no list of items")
    return results


def default_name(results: dict) -> str:
    day = str(results.get("started", ""))[:10] or "undated"
    if results.get("dry_run"):
        return f"cpu-dry-run-{day}"
    gpu = str((results.get("machine") or {}).get("gpu") or "gpu")
    model = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]*)\b", gpu)
    return f"{(model[1] if model else 'gpu').lower()}-{day}"


def gzip_traces(run: Path) -> list[str]:
    done = []
    for trace in sorted((run / "traces").glob("*.json")):
        gz = trace.with_name(trace.name + ".gz")
        gz.write_bytes(gzip.compress(trace.read_bytes(), compresslevel=9, mtime=0))
        trace.unlink()
        done.append(gz.name)
    return done


def thin_telemetry(run: Path, limit: int = TELEMETRY_LIMIT) -> dict | None:
    """Keep every k-th sample of each device where the run's telemetry is over `limit` bytes."""
    files = sorted((run / "telemetry").glob("*/*.parquet"))
    before = sum(f.stat().st_size for f in files)
    if before <= limit:
        return None
    k = math.ceil(before / limit)
    for f in files:
        frame = pl.read_parquet(f)
        frame.filter(pl.int_range(pl.len()).over("device") % k == 0).write_parquet(f, compression="zstd")
    after = sum(f.stat().st_size for f in files)
    return {"every": k, "bytes_before": before, "bytes_after": after}


def records(runs: list[Path], out: Path) -> str:
    """import_gpu_runs's records of `runs` into `out`; what it said."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = import_gpu_runs.main([*map(str, runs), "--out", str(out)])
    if code:
        raise UserError(f"the records of the GPU runs: {one_line(err.getvalue().strip())}")
    return err.getvalue().strip()


def results_table(items: list[dict]) -> str:
    lines = ["| item | part | status | seconds | reason |", "|---|---|---|---|---|"]
    for i in items:
        reason = str(i.get("reason", "")).replace("|", "/")
        lines.append(f"| {i['name']} | {i['part']} | {i['status']} | {i.get('seconds', 0):.0f} | {reason} |")
    return "\n".join(lines) + "\n"


def import_kit(paths: list[Path], into: Path, name: str | None = None) -> Path:
    """Import the archives at `paths` into `into`; the folder written (NAME/; NAME.json beside it)."""
    try:
        parts = kit.archives(paths)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    if not into.is_dir():
        raise UserError(f"--into {str(into)!r}: no such directory")
    staging = into / f".import-gpu-kit.{'-'.join(sorted(parts))}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        return _import(parts, into, staging, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _import(parts: dict[str, bytes], into: Path, staging: Path, name: str | None) -> Path:
    unpacked, results = staging / "unpacked", {}
    for archive, data in parts.items():
        part = re.search(r"-p(\d+)\.", archive)[1]   # type: ignore[index]
        results[int(part)] = unpack(archive, data, unpacked / part)
    first = results[min(results)]
    name = name or default_name(first)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UserError(f"--name {name!r}: letters, digits, '.', '_' and '-' only")
    folder, record_file = into / name, into / f"{name}.json"
    for there in (folder, record_file):
        if there.exists():
            raise UserError(f"{str(there)!r} is already there (a kit imported before; --name another)")
    out = staging / name
    out.mkdir()
    items, rows, kept, notes = [], {}, [], []
    for part, result in sorted(results.items()):
        source = unpacked / str(part) / kit.ARCHIVE_TOP
        shutil.copytree(source, out / f"part{part}", ignore=shutil.ignore_patterns("runs"))
        for item in result["items"]:
            if item.get("reason") != "completed in an earlier part":
                items.append({**item, "part": part})
        for item in result["items"]:
            for row in (item.get("data") or {}).get("rows", [item.get("data") or {}]):
                if isinstance(row, dict) and row.get("run"):
                    rows[row["run"]] = (row, source / "runs" / row["run"])
    for run, (row, where) in sorted(rows.items()):
        if not row.get("keep") or not where.is_dir():
            continue
        target = out / "runs" / run
        shutil.copytree(where, target, ignore=shutil.ignore_patterns(".*"))
        gz = gzip_traces(target)
        if gz:
            notes.append(f"{run}: {len(gz)} profiler trace(s) gzipped ({', '.join(gz)})")
        thinned = thin_telemetry(target)
        if thinned:
            notes.append(f"{run}: telemetry thinned to every {thinned['every']}th sample of each device "
                         f"({thinned['bytes_before']:,} -> {thinned['bytes_after']:,} bytes of Parquet)")
        kept.append({"run": run, "item": row.get("item"), **({"telemetry_thinned": thinned} if thinned else {})})
    gpu_runs = [where for run, (row, where) in sorted(rows.items())
                if row.get("device") == "cuda" and row.get("status") == "completed" and where.is_dir()]
    said = records(gpu_runs, staging / record_file.name) if gpu_runs else "no completed GPU run: no records"
    summary = {"name": name, "parts": sorted(results), "dry_run": bool(first.get("dry_run")),
               "machine": first.get("machine"), "megatron_core": first.get("megatron_core"),
               "records": [p.name for p in gpu_runs], "records_said": said, "kept_whole": kept, "notes": notes,
               "items": [{k: i.get(k) for k in ("name", "part", "status", "reason", "seconds", "runs")} for i in items]}
    (out / "import.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "results.md").write_text(f"# {name}\n\n" + results_table(items) + "".join(f"\n- {n}" for n in notes)
                                    + ("\n" if notes else ""))
    out.rename(folder)
    if gpu_runs:
        try:
            (staging / record_file.name).rename(record_file)
        except OSError:
            shutil.rmtree(folder)   # whole or not at all
            raise
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("archives", nargs="+", type=Path, help="gpu-kit-pN.tar.gz files, or their .NNN pieces")
    parser.add_argument("--into", type=Path, default=ROOT / "tests" / "data" / "gpu_runs",
                        help="where the test data goes (default tests/data/gpu_runs)")
    parser.add_argument("--name", help="the name of what is written (default: the GPU and the day)")
    args = parser.parse_args(argv)
    try:
        folder = import_kit(args.archives, args.into, args.name)
    except UserError as exc:
        print(f"import_gpu_kit: error: {one_line(exc)}; nothing written", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"import_gpu_kit: error: {one_line(exc)}; nothing written", file=sys.stderr)
        return 2
    print((folder / "results.md").read_text(), end="")
    print(f"written: {folder}/" + (f" and {folder}.json" if Path(f"{folder}.json").exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
