"""The GPU acceptance kit: what only a GPU can show, run against a time budget and packed into one archive.

    bash benchmarks/gpu/run.sh [--part N] [--budget S] [--only NAMES] [--skip NAMES] [--resume [ARCHIVE]]
    bash benchmarks/gpu/run.sh --dry-run [--work DIR] [--out DIR] ...   # the same on this CPU (CI)

On the GPU machine it installs the carry (.gpu/carry/kit.tar.xz, built by benchmarks/gpu/carry.py),
then runs ITEMS in priority order (the order of issue 42): an item starts only when its estimate fits in
what is left of the budget and is stopped at its cap or where the budget ends, and each ends completed,
failed (with its reason) or skipped (with its reason: the budget, a missing piece, an item it needs).
After every item the whole record (results.json, each item's commands and output, the runs whole, the
node calibrations) is packed again into $OUT/gpu-kit-pN.tar.gz, so whatever stops the command, the
archive holds every item that ended. Only a few files come back from $OUT (8, 16 MiB each): an
archive over the limit is split into numbered pieces, which tools/import_gpu_kit.py joins.

--dry-run runs every item on this machine's CPU with the environment as it is (no carry): each launch
is the tiny CPU experiment standing in for the GPU one (the GPU experiment is still planned), so the
kit's own steps (launch and cancel, summaries, kernel breakdowns, the counters check, packing, the
budget) run for real; what needs a GPU fails with its reason, as it would on a GPU machine without it.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(__file__).resolve().parent
EXPERIMENTS = KIT / "experiments"
CARRY = ROOT / ".gpu" / "carry"          # what travels to the GPU machine (git-ignored; carry.py builds it)
CARRY_ARCHIVE = "kit.tar.xz"             # wheels/<set>/*.whl and megatron-lm/<tag>/, xz over uncompressed wheels
CARRY_RECORD = "kit.json"                # what the carry holds (carry.py writes it)
MEGATRON_CORE_LINES = ("0.16.1", "0.19.2")   # both lines the [train] extra allows on Python 3.12
MEGATRON_LM_TAGS = {"0.16.1": "core_v0.16.1", "0.19.2": "core_v0.19.0"}   # the checkouts issue 37's tests use
ARCHIVE_TOP = "gpu-kit"                  # every member of an archive lives under this folder
# The device tool brings back at most 8 files of 16 MiB from $OUT (/work/.library/device/README.md):
PIECE_BYTES = 15 * 2**20
MAX_PIECES = 7                           # and one file left for whatever else a session writes there
PACK_RESERVE_S = 20.0                    # kept back from the budget for the last packing
# What an item stopped at its end still does (its launch's interrupt, cancel, final status, summary) takes at
# most about 60 s beyond the budget: a command of --budget 540 ends within the device tool's 600.
STOP_GRACE_S = 15
CLEANUP_STEP_S = 10                      # the least a step of an item past its end is given
CAMPAIGN = "tiny-local"


# -- the budget -----------------------------------------------------------------------------------
class Budget:
    """Seconds left of the command's budget. An item is admitted only when its estimate fits in
    what is left (less the packing reserve); it runs at most until its cap or the budget's end."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s, self.clock, self.start = total_s, clock, clock()

    def left(self) -> float:
        return self.total_s - (self.clock() - self.start) - PACK_RESERVE_S

    def admits(self, item: Item, estimate_s: float) -> str | None:
        """None if `item` may start; else why not (the skip reason)."""
        left = self.left()
        if estimate_s > left:
            return f"budget: needs about {estimate_s:.0f} s, {max(left, 0):.0f} s left"
        return None

    def deadline_s(self, cap_s: float) -> float:
        """How many seconds an admitted item may run."""
        return max(1.0, min(cap_s, self.left()))


# -- the items --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    name: str                 # e.g. experiments/0.16.1/g-llama1b; --only/--skip match it (fnmatch)
    group: str                # the priority item it belongs to
    gpu_s: float              # estimate on one H200 (the 2026-11-26 run's times where it ran)
    cpu_s: float              # estimate of the dry run on a 2-core CPU machine
    cap_s: float              # stopped past this
    run: Callable[[Kit, Item], Outcome]
    line: str = MEGATRON_CORE_LINES[0]
    args: dict = field(default_factory=dict)

    def estimate(self, dry_run: bool) -> float:
        return self.cpu_s if dry_run else self.gpu_s


@dataclass
class Outcome:
    status: str               # completed | failed | skipped
    reason: str = ""
    runs: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)


class Failed(Exception):
    """An item's step failed: the item is recorded failed with this reason."""


def do_doctor(kit: Kit, item: Item) -> Outcome:
    argv = ["doctor", "--json", *item.args.get("argv", [])]
    done = kit.cli(item, argv, out="doctor.json")
    report = _json(done.stdout) or {}
    return Outcome("completed", data={"hardware": _find(report, "hardware"), "stdout_bytes": len(done.stdout)})


def do_experiment(kit: Kit, item: Item) -> Outcome:
    exp = item.args["experiment"]
    sets = list(item.args.get("sets", []))
    kit.cli(item, ["plan", str(EXPERIMENTS / f"{exp}.toml"), "--json", *_sets(sets)], out="plan.json", ok=(0, 1, 3))
    run = kit.launch(item, exp, sets, keep=item.args.get("keep", False))
    return Outcome("completed", runs=[run["run"]], data=run)


def do_profile(kit: Kit, item: Item) -> Outcome:
    outcome = do_experiment(kit, item)
    run = outcome.runs[0]
    for by in ("stage", "rank"):
        kit.cli(item, ["summarize", run, "--kernels", "--by", by], out=f"kernels-{by}.txt")
        kit.cli(item, ["summarize", run, "--kernels", "--by", by, "--format", "json"], out=f"kernels-{by}.json")
    traces = sorted(p.name for p in (kit.runs / run / "traces").glob("*.json"))
    outcome.data.update(traces=traces, hta=kit.hta(item, kit.runs / run / "traces"))
    if not traces:
        raise Failed("the run wrote no profiler trace")
    return outcome


def do_counters(kit: Kit, item: Item) -> Outcome:
    """GPM and the violation counters, sampled during the profiled run, against the profiler where both
    measure the same thing: the share of the profiled step the GPU ran kernels (the trace's busy time)
    bounds the SMs' mean activity (GPM's sm_active_pct) over the same span."""
    profiled = kit.completed("profile")
    if not profiled:
        return Outcome("skipped", "needs the profile item's run, which did not complete here")
    run = profiled["runs"][0]
    kit.cli(item, ["summarize", run, "--format", "json"], out="summary.json")
    check = kit.python(item, COUNTERS_CHECK, str(kit.runs / run), out="check.json")
    data = _json(check.stdout) or {}
    missing = [name for name in ("sm_active_pct", "kernel_busy_pct") if data.get(name) is None]
    if missing:
        why = f" ({data['why']})" if data.get("why") else ""
        raise Failed(f"no {' and no '.join(missing)} over the profiled step{why}")
    return Outcome("completed", runs=[run], data=data)


def do_runner(kit: Kit, item: Item) -> Outcome:
    help_text = kit.cli(item, ["launch", "--help"], out="launch-help.txt").stdout
    if "--runner" not in help_text:
        return Outcome("skipped", "launch has no --runner in this charllm-tui (issue 37 adds it)")
    checkout = kit.megatron_lm(item.line)
    if checkout is None:
        return Outcome("skipped", f"no Megatron-LM {MEGATRON_LM_TAGS[item.line]} checkout in the carry")
    sets = list(item.args.get("sets", []))
    run = kit.launch(item, item.args["experiment"], sets, extra=["--runner", "megatron-lm", "--megatron-lm",
                                                                  str(checkout)], keep=True)
    return Outcome("completed", runs=[run["run"]], data=run)


def do_ours_beside_runner(kit: Kit, item: Item) -> Outcome:
    if not kit.completed("runner/megatron-lm"):
        return Outcome("skipped", "nothing to compare with: runner/megatron-lm did not complete")
    return do_experiment(kit, item)


def do_campaign(kit: Kit, item: Item) -> Outcome:
    deadline = kit.deadline
    done = kit.cli(item, ["campaign", "run", CAMPAIGN], out="campaign-run.txt", ok=None)
    if done.returncode is None:      # stopped at its cap: cancel it, and record how far it got
        kit.cli(item, ["campaign", "cancel", CAMPAIGN], out="campaign-cancel.txt", ok=None, timeout=STOP_GRACE_S)
    status = kit.cli(item, ["campaign", "status", CAMPAIGN], out="campaign-status.txt", ok=None, timeout=60)
    kit.cli(item, ["campaign", "summary", CAMPAIGN, "--format", "json"], out="campaign-summary.json", ok=None,
            timeout=60)
    if done.returncode is None:
        raise Failed(f"stopped at its cap ({deadline:.0f} s): {status.stdout.strip().splitlines()[:1]}")
    if done.returncode != 0:
        raise Failed(f"campaign run exit {done.returncode}: {_last_line(done)}")
    return Outcome("completed", data={"status": status.stdout.strip().splitlines()[:3]})


def _items() -> list[Item]:
    items = [
        Item("doctor", "1 doctor", 30, 15, 180, do_doctor),
        Item("doctor-train", "1 doctor", 90, 40, 300, do_doctor, args={"argv": ["--train"]}),
    ]
    # the 2026-11-26 H200 run's seconds per launch (run ids 30-66 s apart), plus the plan and summaries
    seconds = {"g-llama1b": 70, "m1-llama1b-mbs1": 32, "m2-llama1b-full": 36, "m3-llama1b-sel": 44,
               "m4-moe": 32, "m5-gpt1b": 36, "m6-llama1b-fp32": 37, "m7-gpt1b-dropout-sel": 38}
    for line in MEGATRON_CORE_LINES:
        items += [Item(f"experiments/{line}/{exp}", "2 experiments", s, 15, 240, do_experiment, line,
                       {"experiment": exp}) for exp, s in seconds.items()]
    profile = {"experiment": "g-llama1b", "keep": True,
               "sets": ["name=profile-g-llama1b", "train_iters=8", "profile_steps=[6]", "hz=100"],
               "cpu_sets": ["pipeline_model_parallel_size=2", "profile_steps=[4]", "hz=100"]}
    items += [Item("profile", "3 profile", 60, 20, 240, do_profile, args=profile),
              Item("counters", "4 counters", 10, 5, 120, do_counters)]
    for mbs in (1, 2, 4, 8):   # the power model's micro-batch sweep: one layout, 100 Hz, runs kept whole
        sweep = {"experiment": "m1-llama1b-mbs1", "keep": True,
                 "sets": [f"name=sweep-mbs{mbs}", "hardware=h200", f"micro_batch_size={mbs}",
                          "global_batch_size=8", "train_iters=10", "hz=100"],
                 "cpu_sets": [f"micro_batch_size={mbs}", "global_batch_size=16", "hz=100"]}
        items.append(Item(f"sweep/mbs{mbs}", "5 micro-batch sweep", 35 + 4 * mbs, 12, 240, do_experiment, args=sweep))
    runner = {"experiment": "m1-llama1b-mbs1", "keep": True, "sets": ["name=runner-ours-m1"]}
    items += [Item("runner/megatron-lm", "6 runners", 45, 10, 240, do_runner,
                   args={**runner, "sets": ["name=runner-megatron-lm-m1"]}),
              Item("runner/ours", "6 runners", 32, 12, 240, do_ours_beside_runner, args=runner),
              Item("campaign", "7 campaign", 60, 90, 240, do_campaign)]
    return items


ITEMS = _items()


# -- the counters check (runs in the kit's Python environment, where polars is) ---------------------
COUNTERS_CHECK = r'''
import json, sys
from pathlib import Path
import polars as pl
run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "iterations.jsonl").read_text().splitlines() if line.strip()]
steps = [r for r in rows if r.get("event") == "iteration" and r.get("profiled") and r.get("rank") == 0]
out = {"sm_active_pct": None, "kernel_busy_pct": None}
if not steps:
    out["why"] = "no profiled step in the iteration log"
else:
    step = steps[0]
    start, end = step["start_ns"], step["end_ns"]
    out.update(step=step["iteration"], step_s=(end - start) / 1e9)
    frames = [pl.read_parquet(p) for p in sorted((run / "telemetry").glob("*/*.parquet"))]
    tel = pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()
    gpu = tel.filter((pl.col("device") != "host") & pl.col("ts_ns").is_between(start, end)) if tel.height else tel
    out["samples_in_step"] = gpu.height
    for name in ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_bw_util_pct", "power_w",
                 "sm_clock_mhz", "violation_power_ns", "violation_thermal_ns", "violation_sync_boost_ns"):
        values = gpu[name].drop_nulls() if name in gpu.columns else pl.Series([], dtype=pl.Float64)
        if values.is_empty():
            out[name] = None
        elif name.endswith("_ns"):   # counters since the driver loaded: what the step added
            out[name.removesuffix("_ns") + "_in_step_ns"] = int(values.max() - values.min())
        else:
            out[name] = float(values.mean())
    if out["sm_active_pct"] is None:
        out["why"] = "the backend recorded no GPM sm_active_pct: no GPU, or GPM unsupported"
    traces = sorted((run / "traces").glob(f"rank00000-step{step['iteration']:06d}*.json"))
    if traces:
        from charllm.probes.analysis import kernels
        b = kernels.breakdown(kernels.read_trace(traces[0]))
        out["kernel_busy_pct"] = 100 * b["busy_s"] / b["step_s"] if b.get("step_s") else None
        out["kernel_compute_pct"] = 100 * b["compute_s"] / b["step_s"] if b.get("step_s") else None
        out["trace_source"] = b.get("source")
    if out["sm_active_pct"] is not None and out["kernel_busy_pct"] is not None:
        # SMs can be busy only while a kernel runs: GPM's activity must not exceed the trace's busy share
        out["sm_active_within_busy"] = out["sm_active_pct"] <= out["kernel_busy_pct"] + 5
print(json.dumps(out))
'''

HTA_CHECK = r'''
import json, sys
from hta.trace_analysis import TraceAnalysis
out = {}
analyzer = TraceAnalysis(trace_dir=sys.argv[1])
temporal = analyzer.get_temporal_breakdown(visualize=False)
out["temporal"] = json.loads(temporal.to_json(orient="records"))
kernel_type, kernels = analyzer.get_gpu_kernel_breakdown(visualize=False)[:2]
out["kernel_type"] = json.loads(kernel_type.to_json(orient="records"))
out["kernels"] = len(kernels)
print(json.dumps(out))
'''


# -- the record ------------------------------------------------------------------------------------
class Record:
    """results.json: the machine, the carry, and each item's outcome, rewritten after every item."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.data = path, {**header, "items": []}

    def item(self, name: str) -> dict | None:
        return next((i for i in self.data["items"] if i["name"] == name), None)

    def add(self, entry: dict) -> None:
        self.data["items"].append(entry)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


# -- running ---------------------------------------------------------------------------------------
def _interruptible() -> None:
    """In a step's process, before it runs: SIGINT at its default, which Python turns into
    KeyboardInterrupt. A kit started in the background by a non-interactive shell (`cmd &`, as a remote
    runner may start it) inherits SIGINT ignored, and the stop at an item's end would otherwise wait out
    its grace for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Kit:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dry_run, self.part = args.dry_run, args.part
        self.work = Path(args.work or (tempfile.mkdtemp(prefix="gpu-kit-") if self.dry_run else "/tmp/gpu-kit"))
        self.out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-results")
        self.stage = self.work / f"p{self.part}"   # what the archive holds besides the runs
        self.runs = self.work / "runs"             # shared by the parts: a later one reads an earlier one's
        self.data_dir, self.config = self.work / "data", self.work / "config"
        for d in (self.stage / "items", self.runs, self.data_dir, self.config / "experiments", self.out):
            d.mkdir(parents=True, exist_ok=True)
        for f in EXPERIMENTS.glob("*.toml"):
            shutil.copy(f, self.config / "experiments" / f.name)
        self.earlier_runs = set(os.listdir(self.runs))   # an earlier part's, packed there already
        self.earlier: dict[str, dict] = {}               # what earlier parts completed, by item name
        self.sites: dict[str, list[str]] = {}     # megatron-core line -> PYTHONPATH entries
        self.hta_site: str | None = None
        self.record = Record(self.stage / "results.json",
                             {"kit": 1, "part": self.part, "dry_run": self.dry_run, "started": _now()})
        self.deadline = 0.0                      # seconds the item running may take, from its start
        self.item_end = 0.0                      # when it ends (time.monotonic())
        self.log = open(self.stage / "kit.log", "a")

    # -- output
    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    # -- environment
    def env(self, line: str) -> dict:
        env = {**os.environ, "CHARLLM_CONFIG_DIR": str(self.config), "CHARLLM_DATA_DIR": str(self.data_dir),
               "CHARLLM_RUNS_DIR": str(self.runs), "PYTHONUNBUFFERED": "1"}
        path = self.sites.get(line, [])
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])
        return env

    def install(self) -> dict:
        """Unpack the carry and install its wheels: the common ones into site/, each megatron-core line
        into its own site-mcore-X/ (put first on the path for that line's items), HTA's into site-hta/;
        the checkout itself becomes `charllm` by links, so what runs is this working tree."""
        record = json.loads((CARRY / CARRY_RECORD).read_text())
        unpacked = self.work / "carry"
        shutil.rmtree(unpacked, ignore_errors=True)
        with tarfile.open(CARRY / CARRY_ARCHIVE) as tar:
            tar.extractall(unpacked, filter="data")
        site = self.work / "site"
        self._pip(unpacked / "wheels" / "common", site)
        (site / "charllm").mkdir(exist_ok=True)
        for package in ("engine", "probes", "tui", "presets"):
            link = site / "charllm" / package
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(ROOT / package)
        for line in MEGATRON_CORE_LINES:
            wheels = unpacked / "wheels" / f"megatron-core-{line}"
            if wheels.is_dir():
                self._pip(wheels, self.work / f"site-mcore-{line}")
                self.sites[line] = [str(self.work / f"site-mcore-{line}"), str(site)]
        if (unpacked / "wheels" / "hta").is_dir():
            self._pip(unpacked / "wheels" / "hta", self.work / "site-hta")
            self.hta_site = str(self.work / "site-hta")
        return record

    def _pip(self, wheels: Path, target: Path) -> None:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
                               *map(str, sorted(wheels.glob("*.whl")))], capture_output=True, text=True)
        if done.returncode:
            raise Failed(f"pip install of {wheels.name} failed: {_last_line(done)}")

    def installed_lines(self) -> dict[str, str]:
        """megatron-core line -> the version its items import (dry run: this environment's only)."""
        code = "from importlib.metadata import version; print(version('megatron-core'))"
        found = {}
        for line in (MEGATRON_CORE_LINES if self.sites else ["(this environment)"]):
            done = subprocess.run([sys.executable, "-c", code], env=self.env(line), capture_output=True, text=True)
            found[line] = done.stdout.strip() or f"none ({_last_line(done)})"
        return found

    # -- steps
    def item_dir(self, item: Item) -> Path:
        path = self.stage / "items" / item.name.replace("/", "__")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def command(self, item: Item, argv: list[str], out: str, *, timeout: float | None = None,
                ok: tuple | None = (0,), env: dict | None = None) -> subprocess.CompletedProcess:
        """Run argv with its stdout into the item's folder as `out` (stderr beside it); a step that
        outlives its time (`timeout`, and at most until the item's end) is stopped (SIGINT, then killed)
        and has returncode None."""
        folder = self.item_dir(item)
        left = self.item_end - time.monotonic()
        timeout = max(CLEANUP_STEP_S, left if timeout is None else min(timeout, left))
        with open(folder / "commands.txt", "a") as log:
            log.write(" ".join(argv) + "\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=env or self.env(item.line), start_new_session=True, preexec_fn=_interruptible)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 2)
            try:
                stdout, stderr = proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                stdout, stderr = proc.communicate()
            code = None
        (folder / out).write_text(stdout)
        if stderr:
            (folder / f"{out}.stderr").write_text(stderr)
        done = subprocess.CompletedProcess(argv, code, stdout, stderr)   # type: ignore[arg-type]
        if ok is not None and code not in ok:
            raise Failed(f"{' '.join(argv[3:6])}: " + ("stopped at its time limit" if code is None else
                                                        f"exit {code}: {_last_line(done)}"))
        return done

    def cli(self, item: Item, argv: list[str], out: str, **kw) -> subprocess.CompletedProcess:
        return self.command(item, [sys.executable, "-m", "charllm.tui.cli", *argv], out, **kw)

    def python(self, item: Item, code: str, *argv: str, out: str, **kw) -> subprocess.CompletedProcess:
        return self.command(item, [sys.executable, "-c", code, *argv], out, **kw)

    def launch(self, item: Item, exp: str, sets: list[str], *, extra: tuple | list = (), keep: bool) -> dict:
        """Launch `exp` (the dry run: the tiny CPU experiment in its place) and follow it to its end;
        past the item's deadline it is cancelled and waited for. Returns the run's row."""
        if self.dry_run:
            sets = [s for s in sets if s.split("=")[0] not in ("hardware", "train_iters", "hz")]
            sets = [*sets, f"name={item.name.replace('/', '-')}", "train_iters=6", *item.args.get("cpu_sets", [])]
            target = "tiny-local"
        else:
            target = exp
        done = self.cli(item, ["launch", target, "--follow", "--force", *_sets(sets), *extra], out="launch.log",
                        ok=None)
        match = re.search(r"^run (\S+): launched", done.stdout, re.M)
        if not match:
            raise Failed(f"no run launched: {_last_line(done)}")
        run = match.group(1)
        if done.returncode != 0:
            self.cli(item, ["runs", "cancel", run], out="cancel.txt", ok=None, timeout=STOP_GRACE_S)
        row = self.run_row(item, run, keep)
        self.cli(item, ["summarize", run], out="summary.txt", ok=None, timeout=120)
        if done.returncode is None:
            raise Failed(f"run {run} stopped at the item's time limit ({self.deadline:.0f} s), status {row['status']}")
        if row["status"] != "completed":
            raise Failed(f"run {run}: {row['status']}: {_last_line(done)}")
        return row

    def run_row(self, item: Item, run: str, keep: bool) -> dict:
        """What results.json says of a run (the rest is in the run directory, which the archive holds)."""
        rd = self.runs / run
        for _ in range(2 * STOP_GRACE_S):   # the supervisor writes the final status last
            manifest = _json_file(rd / "manifest.json") or {}
            if manifest.get("status") not in (None, "created", "running", "launching"):
                break
            time.sleep(1)
        rows = [r for r in _jsonl(rd / "iterations.jsonl") if r.get("event") == "iteration"]
        steady = sorted(r.get("tflops_per_gpu") or 0 for r in rows if not r.get("warmup"))
        runtime = manifest.get("runtime") or {}
        return {"run": run, "item": item.name, "status": manifest.get("status"), "keep": keep,
                "device": (runtime.get("implementation") or {}).get("device"),
                "megatron_core": (runtime.get("versions") or {}).get("megatron_core"),
                "iterations": len({r.get("iteration") for r in rows}),
                "peak_allocated_bytes": max([r.get("mem_peak_bytes") or 0 for r in rows] or [0]),
                "median_tflops_per_gpu": steady[len(steady) // 2] if steady else None}

    def hta(self, item: Item, traces: Path) -> dict:
        """Holistic Trace Analysis's temporal and kernel breakdowns of the traces, where the carry holds it."""
        if self.hta_site is None:
            return {"status": "skipped", "reason": "Holistic Trace Analysis is not in the carry"}
        env = self.env(item.line)
        env["PYTHONPATH"] = os.pathsep.join([self.hta_site, env.get("PYTHONPATH", "")])
        done = self.command(item, [sys.executable, "-c", HTA_CHECK, str(traces)], "hta.json", ok=None, env=env,
                            timeout=120)
        if done.returncode != 0:
            return {"status": "failed", "reason": _last_line(done)}
        said = _json((done.stdout.strip().splitlines() or [""])[-1])   # (HTA logs to stderr; the JSON is last)
        return {"status": "completed", **(said if isinstance(said, dict) else {"stdout": done.stdout[-500:]})}

    def completed(self, name: str) -> dict | None:
        """The item's completed entry, of this part or an earlier one whose runs are still here."""
        entry = self.record.item(name)
        if entry and entry.get("status") == "completed":
            return entry
        entry = self.earlier.get(name)
        if entry and all((self.runs / run).is_dir() for run in entry.get("runs", [])):
            return entry
        return None

    def megatron_lm(self, line: str) -> Path | None:
        path = self.work / "carry" / "megatron-lm" / MEGATRON_LM_TAGS[line]
        return path if path.is_dir() else None

    # -- packing
    def pack(self) -> list[Path]:
        """The whole record as one archive in the output folder, replacing the last one; split into
        numbered pieces where it is over what comes back as one file."""
        self.record.save()
        name = f"{ARCHIVE_TOP}-p{self.part}.tar.gz"
        tmp = self.work / f".{name}"
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
            tar.add(self.stage, arcname=ARCHIVE_TOP, filter=_no_hidden)
            for run in sorted(set(os.listdir(self.runs)) - self.earlier_runs):
                tar.add(self.runs / run, arcname=f"{ARCHIVE_TOP}/runs/{run}", filter=_no_hidden)
            calibrations = self.data_dir / "calibrations"
            if calibrations.is_dir():
                tar.add(calibrations, arcname=f"{ARCHIVE_TOP}/calibrations", filter=_no_hidden)
        size = tmp.stat().st_size
        for old in self.out.glob(f"{name}*"):
            old.unlink()
        if size <= PIECE_BYTES:
            tmp.replace(self.out / name)
            return [self.out / name]
        pieces = []
        with open(tmp, "rb") as fh:
            while chunk := fh.read(PIECE_BYTES):
                if len(pieces) == MAX_PIECES:
                    self.say(f"kit: the archive ({size:,} bytes) is over {MAX_PIECES} pieces: the rest is lost")
                    break
                piece = self.out / f"{name}.{len(pieces):03d}"
                piece.write_bytes(chunk)
                pieces.append(piece)
        tmp.unlink()
        return pieces


def archives(paths: list[Path]) -> dict[str, bytes]:
    """The kit's archives among `paths` (gpu-kit-pN.tar.gz, or its numbered pieces, joined), by name.
    ValueError names what is wrong: an unknown file, a piece missing from a run of pieces."""
    pieces: dict[str, dict[int, Path]] = {}
    for path in paths:
        match = re.fullmatch(rf"({re.escape(ARCHIVE_TOP)}-p\d+\.tar\.gz)(?:\.(\d{{3}}))?", path.name)
        if not match:
            raise ValueError(f"{str(path)!r}: not a kit archive ({ARCHIVE_TOP}-pN.tar.gz or a .NNN piece of one)")
        pieces.setdefault(match[1], {})[int(match[2]) if match[2] else -1] = path
    out = {}
    for name, parts in sorted(pieces.items()):
        if -1 in parts and len(parts) > 1:
            raise ValueError(f"{name}: given both whole and in pieces")
        numbers = sorted(parts)
        if numbers != [-1] and numbers != list(range(len(numbers))):
            given = ", ".join(f"{n:03d}" for n in numbers)
            raise ValueError(f"{name}: pieces {given} given; each from 000 on is needed")
        out[name] = b"".join(parts[n].read_bytes() for n in numbers)
    return out


def _no_hidden(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    base = os.path.basename(info.name)
    return None if base.startswith(".") and base not in (".charllm-run",) else info


def _sets(sets: list[str]) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return None


def _json_file(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(_json, lines) if isinstance(r, dict)]


def _find(report, key: str):
    """The first value of `key` anywhere in a JSON report (doctor's layout is its own)."""
    if isinstance(report, dict):
        if key in report:
            return report[key]
        report = list(report.values())
    if isinstance(report, list):
        for value in report:
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _last_line(done) -> str:
    text = (done.stderr or "").strip() or (done.stdout or "").strip()
    return text.splitlines()[-1][:300] if text else "no output"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- choosing what runs -------------------------------------------------------------------------------
def chosen(only: list[str], skip: list[str], done: set[str]) -> list[tuple[Item, str | None]]:
    """Every item in priority order with None (it runs) or why it does not."""
    out = []
    for item in ITEMS:
        def matches(patterns):
            return any(fnmatch.fnmatchcase(item.name, p) or fnmatch.fnmatchcase(item.name, p + "/*") for p in patterns)
        if item.name in done:
            out.append((item, "completed in an earlier part"))
        elif only and not matches(only):
            out.append((item, "not chosen (--only)"))
        elif matches(skip):
            out.append((item, "not chosen (--skip)"))
        else:
            out.append((item, None))
    return out


def completed_before(resume: str, work: Path, part: int) -> dict[str, dict]:
    """The items earlier parts completed, by name: from the archive named, else from the records the
    earlier parts left in `work` (the same machine, still warm), else from their archives in the carry
    (a fresh machine: copied there before the call)."""
    if resume:
        records = [_archived_record(Path(resume))]
    else:
        records = [_json_file(work / f"p{n}" / "results.json") for n in range(1, part)]
        if not any(records):
            names = {re.sub(r"\.\d{3}$", "", p.name) for p in CARRY.glob(f"{ARCHIVE_TOP}-p*.tar.gz*")}
            records = [_archived_record(CARRY / name) for name in sorted(names) if _part_of(name) < part]
    if not any(isinstance(r, dict) for r in records):
        where = resume or f"{work}/p1..p{part - 1} or {CARRY}/{ARCHIVE_TOP}-pN.tar.gz"
        raise SystemExit(f"kit: --resume: no record of an earlier part in {where}")
    return {i["name"]: i for r in records if isinstance(r, dict) for i in r.get("items", [])
            if isinstance(i, dict) and i.get("status") == "completed"}


def _part_of(name: str) -> int:
    match = re.search(r"-p(\d+)\.tar\.gz", name)
    return int(match[1]) if match else 0


def _archived_record(path: Path) -> dict | None:
    """results.json of a kit archive: the file, or the numbered pieces of it beside the name."""
    whole = path.with_name(re.sub(r"\.\d{3}$", "", path.name))
    try:
        pieces = [whole] if whole.exists() else sorted(whole.parent.glob(whole.name + ".[0-9][0-9][0-9]"))
        data = archives(pieces)[whole.name]
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.extractfile(f"{ARCHIVE_TOP}/results.json")
            return json.load(member) if member else None
    except (OSError, ValueError, KeyError, tarfile.TarError) as exc:
        raise SystemExit(f"kit: --resume {path}: not a kit archive ({exc})") from None


def table(items: list[dict]) -> str:
    width = max((len(i["name"]) for i in items), default=4)
    lines = [f"{'item':<{width}}  {'status':<9}  {'s':>5}  reason"]
    for i in items:
        lines.append(f"{i['name']:<{width}}  {i['status']:<9}  {i.get('seconds', 0):>5.0f}  {i.get('reason', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run on this machine's CPU, environment as it is")
    parser.add_argument("--budget", type=float, default=540, help="seconds this command may take (default 540)")
    parser.add_argument("--part", type=int, default=1, help="names the archive gpu-kit-pN.tar.gz (default 1)")
    parser.add_argument("--only", default="", help="comma-separated item names or globs (experiments/0.19.2)")
    parser.add_argument("--skip", default="", help="comma-separated item names or globs")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="ARCHIVE",
                        help="skip what an earlier part completed: its archive, or (no value) its --work")
    parser.add_argument("--work", help="working folder (default /tmp/gpu-kit; dry run: a new temporary one)")
    parser.add_argument("--out", help="where the archive goes (default $OUT, else ./gpu-results)")
    parser.add_argument("--list", action="store_true", help="list the items with their estimates and exit")
    args = parser.parse_args(argv)
    if args.list:
        for item in ITEMS:
            print(f"{item.name:<34} {item.group:<22} ~{item.estimate(args.dry_run):>4.0f} s  cap {item.cap_s:.0f} s")
        return 0
    budget = Budget(args.budget)
    kit = Kit(args)
    if args.resume is not None:
        kit.earlier = completed_before(args.resume, kit.work, args.part)
    kit.record.data.update(budget_s=args.budget, argv=sys.argv[1:] if argv is None else argv,
                           python=sys.version.split()[0])
    kit.say(f"kit: part {args.part}, budget {args.budget:.0f} s, work {kit.work}, out {kit.out}"
            + (" (dry run on this CPU)" if kit.dry_run else ""))
    try:
        if not kit.dry_run:
            kit.record.data["carry"] = kit.install()
        kit.record.data["megatron_core"] = kit.installed_lines()
        kit.record.data["machine"] = _machine(kit)
    except (Failed, OSError, tarfile.TarError, ValueError) as exc:
        kit.record.data["install_failed"] = str(exc)
        kit.say(f"kit: install failed: {exc}")
    kit.pack()
    for item, why_not in chosen(_list(args.only), _list(args.skip), set(kit.earlier)):
        started = time.monotonic()
        entry = {"name": item.name, "group": item.group, "estimate_s": item.estimate(kit.dry_run), "started": _now()}
        reason = why_not or kit.record.data.get("install_failed") and "the carry did not install"
        if not reason and kit.sites == {} and not kit.dry_run:
            reason = "the carry did not install"
        if not reason and kit.dry_run and item.line != MEGATRON_CORE_LINES[0] and item.group == "2 experiments":
            reason = f"dry run: one megatron-core line (this environment's) stands in for {item.line}"
        if not reason and not kit.dry_run and item.line not in kit.sites:
            reason = f"megatron-core {item.line} is not in the carry"
        reason = reason or budget.admits(item, item.estimate(kit.dry_run))
        if reason:
            outcome = Outcome("skipped", reason)
        else:
            kit.deadline = budget.deadline_s(item.cap_s)
            kit.item_end = time.monotonic() + kit.deadline
            kit.say(f"kit: {item.name} (about {item.estimate(kit.dry_run):.0f} s, at most {kit.deadline:.0f} s)")
            try:
                outcome = item.run(kit, item)
            except Failed as exc:
                outcome = Outcome("failed", str(exc))
            except Exception as exc:  # noqa: BLE001 - one item's defect must not lose the others' record
                outcome = Outcome("failed", f"{type(exc).__name__}: {exc}")
        entry.update(status=outcome.status, reason=outcome.reason, seconds=round(time.monotonic() - started, 1),
                     runs=outcome.runs, data=outcome.data)
        kit.record.add(entry)
        if outcome.status != "skipped" or not reason or not reason.startswith("not chosen"):
            kit.say(f"kit: {item.name}: {outcome.status}" + (f": {outcome.reason}" if outcome.reason else ""))
        if outcome.status != "skipped":
            kit.pack()
    kit.record.data["ended"] = _now()
    kit.record.data["used_s"] = round(budget.total_s - budget.left() - PACK_RESERVE_S, 1)
    left = [i["name"] for i in kit.record.data["items"] if i["status"] != "completed"
            and not i["reason"].startswith(("not chosen", "dry run", "launch has no", "nothing to compare"))]
    kit.record.data["not_completed"] = left
    files = kit.pack()
    kit.say(table(kit.record.data["items"]))
    kit.say(f"kit: {len(files)} file(s): " + ", ".join(f"{f.name} ({f.stat().st_size:,} bytes)" for f in files))
    if left:
        kit.say(f"kit: not completed here: {', '.join(left)}")
        done = {i["name"] for i in kit.record.data["items"] if i["status"] == "completed"} | set(kit.earlier)
        nxt = f"bash benchmarks/gpu/run.sh --part {args.part + 1}"
        kit.say(f"kit: next, on this machine while it is warm: {nxt} --resume --budget SECONDS")
        if done:
            kit.say(f"kit: next, on a fresh machine: {nxt} --skip {','.join(covering(done))} --budget SECONDS")
    return 0


def covering(names: set[str]) -> list[str]:
    """`names` as few --skip patterns: a folder of items (experiments/0.16.1) where all of it is there."""
    out: list[str] = []
    for item in ITEMS:
        if item.name not in names:
            continue
        parts = item.name.split("/")
        folder = next((f for f in ("/".join(parts[:n]) for n in range(1, len(parts)))
                       if all(i.name in names for i in ITEMS if i.name.startswith(f + "/"))), None)
        pattern = folder or item.name
        if pattern not in out:
            out.append(pattern)
    return out


def _list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _machine(kit: Kit) -> dict:
    smi = shutil.which("nvidia-smi")
    gpu = None
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True)
        gpu = done.stdout.strip() or _last_line(done)
    code = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
    torch = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=kit.env(MEGATRON_CORE_LINES[0]))
    return {"host": os.uname().nodename, "gpu": gpu, "torch": torch.stdout.strip() or _last_line(torch),
            "compiler": shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang"),
            "cpus": os.cpu_count()}


if __name__ == "__main__":
    sys.exit(main())
