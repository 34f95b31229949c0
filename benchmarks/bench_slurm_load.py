"""Benchmark: the load a followed campaign puts on Slurm's controller, as `sdiag` counts it.

    sudo python benchmarks/bench_slurm_load.py [--minutes 10] [--members 64]

Brings up the tests' loopback Slurm (tests/infra_slurm.py: slurmctld and two slurmd; root, slurm-wlm
and munge), starts a campaign of `--members` tiny-local members (2 at once, each a real 1-node CPU
training job) at Slurm's own pace (engine.launch.slurmctl.Pace: no CHARLLM_TEST_ONLY_SLURM_PACE),
and once every member is submitted samples `sdiag` every 10 s for `--minutes`. It prints the calls
that follow jobs (REQUEST_JOB_INFO, REQUEST_JOB_INFO_SINGLE, REQUEST_FED_INFO: scontrol, squeue and
sacct ask with these) per 10 s: the mean over the window and the most in any 10 s; the other RPCs
(the jobs' own: steps, node lookups, completions) are listed apart. `--readers N` also runs
`charllm-tui campaign status` N times a minute meanwhile, as a user watching does.

Target (issue 38): at most 1 call per 10 s per campaign being followed. Before (issue 38's report):
a 6-member campaign made 228 REQUEST_JOB_INFO_SINGLE and 228 REQUEST_FED_INFO in 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FOLLOWING = ("REQUEST_JOB_INFO", "REQUEST_JOB_INFO_SINGLE", "REQUEST_FED_INFO", "REQUEST_JOB_USER_INFO")


def campaign_file(members: int) -> str:
    """tiny-local in 2 layouts x 2 micro batches x members/4 iteration counts: `members` short jobs."""
    iters = list(range(4, 4 + max(1, members // 4)))
    return (f'experiments = ["tiny-local"]\n[axes]\nmicro_batch_size = [1, 2]\ntrain_iters = {iters}\n'
            '[[layouts]]\ntensor_model_parallel_size = 1\n[[layouts]]\ntensor_model_parallel_size = 2\n'
            '[target]\nname = "cluster"\nmax_parallel = 2\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--readers", type=int, default=0, help="`campaign status` calls a minute meanwhile")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from infra_slurm import skip_reason, start_cluster  # deferred: the tests' helpers, found through sys.path

    reason = skip_reason()
    if reason:
        print(f"bench_slurm_load: {reason}")
        return 2
    root = Path(tempfile.mkdtemp(prefix="charllm-slurm-bench-"))
    cleanups: list = [lambda: shutil.rmtree(root, ignore_errors=True)]
    private = Path(tempfile.mkdtemp(prefix="charllm-bench-"))
    try:
        cluster = start_cluster(root, cleanups)
        env = {**cluster.env, "CHARLLM_CONFIG_DIR": f"{private}/config", "CHARLLM_DATA_DIR": f"{private}/data",
               "CHARLLM_RUNS_DIR": f"{private}/runs"}
        env.pop("CHARLLM_TEST_ONLY_SLURM_PACE", None)      # Slurm's own pace
        (private / "config" / "campaigns").mkdir(parents=True)
        (private / "config" / "targets.toml").write_text(
            f'[cluster]\nkind = "slurm"\npartition = "debug"\ntime = "00:10:00"\npython = "{sys.executable}"\n')
        (private / "config" / "campaigns" / "load.toml").write_text(campaign_file(args.members))

        def tui(*argv: str) -> str:
            return subprocess.run([sys.executable, "-m", "charllm.tui", *argv], env=env, capture_output=True,
                                  text=True).stdout.strip()

        started = time.monotonic()
        print(tui("campaign", "run", "load", "--detach").splitlines()[-1])
        print(f"every member submitted in {time.monotonic() - started:.1f} s; sampling sdiag every 10 s for "
              f"{args.minutes:g} min")
        cluster.reset_rpc_counts()
        samples, last = [], {}
        window_s = args.minutes * 60
        begin = time.monotonic()
        next_reader = begin
        while time.monotonic() - begin < window_s:
            time.sleep(10 - (time.monotonic() - begin) % 10)
            counts = cluster.rpc_counts()
            samples.append({k: counts.get(k, 0) - last.get(k, 0) for k in set(counts) | set(last)})
            last = counts
            if args.readers and time.monotonic() >= next_reader:
                tui("campaign", "status", "load")
                next_reader += 60 / args.readers
        progress = tui("campaign", "status", "load").splitlines()
        totals = {k: sum(s.get(k, 0) for s in samples) for s in samples for k in s}
        following = [sum(s.get(k, 0) for k in FOLLOWING) for s in samples]
        print(f"campaign after {args.minutes:g} min: {progress[0] if progress else '?'}")
        print(f"calls that follow jobs: {sum(following)} in {len(samples) * 10} s = "
              f"{sum(following) / len(samples):.2f} per 10 s (most in one 10 s: {max(following)}; target: at most 1)")
        record = json.loads((private / "runs" / ".campaigns" / "load" / "campaign.json").read_text())
        for member in record["members"]:
            if member["status"] in ("failed", "unknown", "missing"):
                print(f"member {member['name']}: {member['status']}: {member.get('failure')} (run {member.get('run')})")
        for name in sorted(totals, key=lambda k: -totals[k]):
            if name != "REQUEST_STATS_INFO":
                whose = "(following)" if name in FOLLOWING else "(the jobs' own)"
                print(f"  {name:32} {totals[name]:6}  {whose}")
    finally:
        if "tui" in locals():
            tui("campaign", "cancel", "load")
        for cleanup in reversed(cleanups):
            cleanup()
        shutil.rmtree(private, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TZ", "UTC")
    sys.exit(main())
