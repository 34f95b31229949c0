"""Add runs measured on a real GPU (the acceptance kit's, ../shared/gpu) to tests/data/gpu_runs/.

    python tools/import_gpu_runs.py RUN_DIR... --out tests/data/gpu_runs/FILE.json

Per run it keeps what the plan needs to be checked again without the GPU: the experiment as it ran
(experiment.toml, whole), the node's stack and versions (the manifest's runtime record: what plans
for that node must assume), and what was measured: the largest allocator peak of any iteration, the
steady window's median step, TFLOP/s, MFU, mean power and energy per token (summaries/run-steady).

Only completed GPU runs are taken; one that is not (it failed, or ran on the CPU) is named on stderr
as left out. A run that cannot be read (missing, a damaged manifest, experiment or summary, no
runtime record, no iteration, a pipe in a file's place) is one line naming it and what is wrong, and
then nothing is written (exit 2); so is a set with no run left. --out is replaced atomically, whole
or not at all. Nothing in a run directory is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import polars as pl

from charllm.engine.model.experiment import Experiment
from charllm.probes.core import paths
from charllm.probes.core.atomic import write_atomic
from charllm.probes.core.errors import UserError, one_line, os_error_line
from charllm.probes.core.files import is_regular, open_regular
from charllm.probes.store.rundir import RunDir

STEADY = ("iter_time_p50_s", "tflops_per_gpu", "mfu_pct", "power_mean_w", "energy_per_token_j", "power_limit_w")
MAX_SUMMARY_BYTES = 64 * 2**20   # a kept summary is one row: a few KiB


class LeftOut(Exception):
    """A readable run that is not one to keep (its reason)."""


def run_record(run_dir: Path) -> dict:
    """One completed GPU run's record; LeftOut for a run that is not one, UserError (one line naming
    the run and what is wrong) for one that cannot be read."""
    where = f"run {str(run_dir)!r}"
    if not run_dir.is_dir():
        raise UserError(f"{where}: no such run directory")
    run = RunDir(run_dir)
    if not run.manifest_path.exists():
        raise UserError(f"{where}: no manifest.json")
    manifest = run.read_manifest()   # damage is one line naming the file
    if manifest.get("status") != "completed":
        raise LeftOut(f"status {manifest.get('status')!r}, not completed")
    runtime = manifest.get("runtime")
    if not isinstance(runtime, dict):
        raise UserError(f"{run.manifest_path}: no runtime record (what ran; the workload writes it once it starts)")
    devices = runtime.get("devices")
    if not devices or _table(runtime, "implementation").get("device") == "cpu":
        raise LeftOut("ran on the CPU, not a GPU")
    if not isinstance(devices, list) or not isinstance(devices[0], dict) or not isinstance(devices[0].get("name"), str):
        raise UserError(f"{run.manifest_path}: runtime.devices is not a list of devices with a name")
    experiment = paths.read_toml(run.experiment_path, "experiment")
    Experiment.from_dict(experiment, source=str(run.experiment_path))   # one that loads, as the tests load it
    return {
        "run": run_dir.name,
        "experiment": experiment,
        "device": devices[0]["name"],
        **{key: _table(runtime, key, run.manifest_path) for key in ("stack", "implementation", "versions")},
        "tf32": runtime.get("tf32"),
        "measured": {**_iterations(run), **_steady(run)},
    }


def _table(record: dict, key: str, where: Path | None = None) -> dict:
    """A runtime record's sub-table; with `where`, one that is missing is one line naming the file."""
    value = record.get(key)
    if isinstance(value, dict):
        return value
    if where is None:
        return {}
    raise UserError(f"{where}: runtime.{key} is missing or not a table")


def _iterations(run: RunDir) -> dict:
    """The steps the iteration log holds, and the largest allocator peak any of them recorded."""
    if run.iterations_path.exists() and not is_regular(run.iterations_path):
        raise UserError(f"{run.iterations_path}: not a regular file (a pipe, a device or a socket)")
    iterations = [r for r in run.iteration_records() if isinstance(r, dict) and r.get("event") == "iteration"]
    steps = {r["iteration"] for r in iterations if type(r.get("iteration")) is int}
    peaks = [r.get("mem_peak_bytes") or 0 for r in iterations]
    if not steps:
        raise UserError(f"{run.iterations_path}: no iteration logged")
    if not all(type(peak) is int for peak in peaks) or not max(peaks):
        raise UserError(f"{run.iterations_path}: mem_peak_bytes is not a whole number of bytes on every line")
    return {"iterations": len(steps), "peak_allocated_bytes": max(peaks)}


def _steady(run: RunDir) -> dict:
    """The steady window's figures of the run's kept summary (charllm-tui summarize keeps it)."""
    path = run.path / "summaries" / "run-steady.parquet"
    try:
        with open_regular(path, "kept summary") as fh:
            if os.fstat(fh.fileno()).st_size > MAX_SUMMARY_BYTES:
                raise UserError(f"{path}: more than {MAX_SUMMARY_BYTES:,} bytes, not a kept summary")
            frame = pl.read_parquet(fh)
    except FileNotFoundError:
        raise UserError(f"{path}: no kept summary (summarize the run first: charllm-tui summarize RUN)") from None
    except UserError:
        raise
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (Exception, pl.exceptions.PanicException) as exc:  # noqa: BLE001 - polars raises many kinds for a damaged file
        raise UserError(f"{path}: not a readable Parquet file ({one_line(exc)[:120]})") from None
    missing = [name for name in STEADY if name not in frame.columns]
    if missing or frame.height != 1:
        raise UserError(f"{path}: " + (f"no column {', '.join(missing)}" if missing else f"{frame.height} rows, not 1"))
    steady = frame.row(0, named=True)
    return {name: steady[name] for name in STEADY}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    records, problems = [], []
    try:
        out = paths.output_file(args.out, "--out")
        for run_dir in args.runs:
            try:
                records.append(run_record(run_dir))
            except LeftOut as why:
                print(f"import_gpu_runs: {str(run_dir)!r}: {why}: left out", file=sys.stderr)
            except UserError as exc:
                problems.append(str(exc))
        if not problems and not records:
            problems.append(f"no completed GPU run among the {len(args.runs)} given")
        if not problems:
            write_atomic(out, json.dumps(records, indent=1, sort_keys=True) + "\n")
    except UserError as exc:
        problems.append(str(exc))
    except OSError as exc:   # --out cannot be written (a full disk, a read-only place)
        problems.append(os_error_line(exc, args.out))
    for problem in problems:
        print(f"import_gpu_runs: error: {one_line(problem)}; nothing written", file=sys.stderr)
    if problems:
        return 2
    print(f"{len(records)} runs written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
