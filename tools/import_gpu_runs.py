"""Add runs measured on a real GPU (the acceptance kit's, ../shared/gpu) to tests/data/gpu_runs/.

    python tools/import_gpu_runs.py RUN_DIR... --out tests/data/gpu_runs/FILE.json

Per run it keeps what the plan needs to be checked again without the GPU: the experiment as it ran
(experiment.toml, whole), the node's stack and versions (the manifest's runtime record: what plans
for that node must assume), and what was measured: the largest allocator peak of any iteration, the
steady window's median step, TFLOP/s, MFU, mean power and energy per token (summaries/run-steady).
Only completed runs are taken; the rest are named on stderr. Nothing in a run directory is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import polars as pl

from charllm.probes.core.errors import UserError
from charllm.probes.store.rundir import RunDir

STEADY = ("iter_time_p50_s", "tflops_per_gpu", "mfu_pct", "power_mean_w", "energy_per_token_j", "power_limit_w")


def run_record(run_dir: Path) -> dict | None:
    run = RunDir(run_dir)
    manifest = run.read_manifest()
    if manifest.get("status") != "completed":
        print(f"{run_dir.name}: status {manifest.get('status')!r}, not completed: left out", file=sys.stderr)
        return None
    iterations = [r for r in run.iteration_records() if isinstance(r, dict) and r.get("event") == "iteration"]
    steady = pl.read_parquet(run_dir / "summaries" / "run-steady.parquet").row(0, named=True)
    runtime = manifest["runtime"]
    return {
        "run": run_dir.name,
        "experiment": tomllib.loads(run.experiment_path.read_text()),
        "device": runtime["devices"][0]["name"],
        "stack": runtime["stack"],
        "implementation": runtime["implementation"],
        "versions": runtime["versions"],
        "tf32": runtime.get("tf32"),
        "measured": {"iterations": len({r["iteration"] for r in iterations}),
                     "peak_allocated_bytes": max(r.get("mem_peak_bytes") or 0 for r in iterations),
                     **{name: steady[name] for name in STEADY}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    try:
        records = [r for r in (run_record(d) for d in args.runs) if r]
    except (UserError, OSError) as exc:  # a damaged manifest; no kept summary (summarize the run first)
        print(f"import_gpu_runs: {exc}", file=sys.stderr)
        return 2
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    tmp.replace(args.out)
    print(f"{len(records)} runs written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
