"""Benchmark: `summarize --kernels` on large and hostile profiler traces, and `summarize --by rank`
on the timers of 100,000 ranks (issue 35).

    python benchmarks/bench_kernels.py [--cache /tmp/charllm-bench-kernels] [--events 1000000]
                                       [--spans 30000] [--ranks 100000] [--steps 20]
                                       [--only NAME ...] [--skip-bomb]

Each case is a run directory with one Kineto JSON trace in traces/ (or an iteration log), generated
once (cached), and summarized cold (`charllm-tui summarize RUN --kernels`, the kept summary removed
first) in a fresh process, so that its wall time, CPU time and peak RSS are its own:

- `gpu`: --events events of a GPU trace as torch.profiler writes it (nested aten ops, a runtime
  launch and its kernel per op, the flow events between them, NCCL kernels on a second stream, an
  Optimizer.step annotation per step with its launches), 10 ProfilerStep spans;
- `cpu`: --events events of a CPU run's trace (nested ops on a main thread and gloo's thread);
- `steps`: --spans ProfilerStep spans with a kernel each, and one kernel across all of them;
- `optimizer`: --spans Optimizer.step spans on one thread with a launch and a kernel each;
- `bomb`: a .json.gz of a few MB that holds 3 GiB of whitespace: refused in one line;
- `ranks`: `summarize RUN --by rank` on an iteration log whose rank-0 lines carry the step timers of
  --ranks ranks, --steps steps (as the workload logs them).

Targets (this 2-core machine): gpu and cpu (10^6 events) under 15 s and 1 GB; steps and optimizer
(30k spans) each under 5 s; bomb refused with one line, in under 1 GB; ranks (100,000 x 20) under
15 s and 1 GB.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0_US = 1_763_700_000_000_000.0
CASES = ("gpu", "cpu", "steps", "optimizer", "bomb", "ranks")


def _write_trace(path: Path, events, meta: dict | None = None) -> int:
    """A Kineto JSON trace, written as torch.profiler's export_chrome_trace lays it out (one event
    per line), from an iterable of events; the number of events."""
    n = 0
    with open(path, "w") as fh:
        fh.write('{\n"schemaVersion": 1,\n"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 8},\n')
        if meta:
            fh.write(f'"charllm": {json.dumps(meta)},\n')
        fh.write('"traceEvents": [\n')
        for event in events:
            fh.write((",\n" if n else "") + json.dumps(event, separators=(", ", ": ")))
            n += 1
        fh.write('\n],\n"traceName": "bench"\n}\n')
    return n


def gpu_events(total: int, steps: int = 10):
    """A GPU trace of about `total` events: per op a cpu_op holding aten::mm holding its launch, the
    kernel, and the flow events that tie launch and kernel (7 events)."""
    per_step = max(1, total // steps // 7)
    corr, pid, tid, ts = 0, 4242, 4242, T0_US
    names = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
             "flash_fwd_kernel", "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>")
    for step in range(steps):
        step_start = ts
        yield {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 1}", "pid": pid, "tid": tid,
               "ts": ts, "dur": per_step * 40.0 + 2000, "args": {"External id": corr}}
        for i in range(per_step):
            corr += 1
            in_optimizer = i >= per_step - max(1, per_step // 20)
            if in_optimizer and i == per_step - max(1, per_step // 20):
                yield {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#FusedAdam.step", "pid": pid,
                       "tid": tid, "ts": ts, "dur": max(1, per_step // 20) * 40.0, "args": {"External id": corr}}
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": pid, "tid": tid, "ts": ts, "dur": 30,
                   "args": {"External id": corr, "Record function id": 0, "Ev Idx": corr}}
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": tid, "ts": ts + 2, "dur": 25,
                   "args": {"External id": corr, "Record function id": 0, "Ev Idx": corr}}
            yield {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                   "ts": ts + 5, "dur": 6, "args": {"External id": corr, "cbid": 211, "correlation": corr}}
            yield {"ph": "s", "id": corr, "pid": pid, "tid": tid, "ts": ts + 5, "cat": "ac2g", "name": "ac2g"}
            stream = 20 if i % 10 == 9 else 7
            name = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)" if stream == 20 \
                else names[i % len(names)]
            yield {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts + 12, "dur": 30,
                   "args": {"External id": corr, "queued": 0, "device": 0, "context": 1, "stream": stream,
                            "correlation": corr, "registers per thread": 168, "shared memory": 213000,
                            "blocks per SM": 1.0, "warps per SM": 4.0, "grid": [132, 1, 1], "block": [384, 1, 1],
                            "est. achieved occupancy %": 0}}
            yield {"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": ts + 12, "cat": "ac2g", "name": "ac2g",
                   "bp": "e"}
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "pid": pid, "tid": tid, "ts": ts + 31, "dur": 4,
                   "args": {"External id": corr, "Record function id": 0, "Ev Idx": corr}}
            ts += 40
        ts = step_start + per_step * 40.0 + 2000


def cpu_events(total: int, steps: int = 10):
    """A CPU run's trace: nested ops on the main thread, gloo's all-reduce on its own thread."""
    per_step = max(1, total // steps // 5)
    ts, main_tid, gloo = T0_US, 1, 2
    for step in range(steps):
        yield {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 1}", "pid": 1, "tid": main_tid,
               "ts": ts, "dur": per_step * 50.0, "args": {}}
        for i in range(per_step):
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": main_tid, "ts": ts, "dur": 30,
                   "args": {"External id": i}}
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::t", "pid": 1, "tid": main_tid, "ts": ts + 1, "dur": 2,
                   "args": {"External id": i}}
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": main_tid, "ts": ts + 5, "dur": 20,
                   "args": {"External id": i}}
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::gelu", "pid": 1, "tid": main_tid, "ts": ts + 32,
                   "dur": 10, "args": {"External id": i}}
            yield {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": gloo,
                   "ts": ts + 20, "dur": 25, "args": {}}
            ts += 50


def step_events(spans: int):
    """`spans` ProfilerStep spans with a kernel each, and one long kernel across all of them."""
    yield {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 20, "ts": T0_US,
           "dur": spans * 100.0, "args": {"correlation": 0}}
    for i in range(spans):
        ts = T0_US + i * 100.0
        yield {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1, "ts": ts,
               "dur": 90.0}
        yield {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "pid": 0, "tid": 7, "ts": ts + 10,
               "dur": 50.0, "args": {"correlation": i + 1}}


def optimizer_events(spans: int):
    """`spans` Optimizer.step spans on one thread, each with a launch and its kernel."""
    yield {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": T0_US,
           "dur": spans * 100.0}
    for i in range(spans):
        ts = T0_US + i * 100.0
        yield {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#FusedAdam.step", "pid": 1, "tid": 1,
               "ts": ts, "dur": 50.0}
        yield {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts + 10,
               "dur": 5.0, "args": {"correlation": i + 1}}
        yield {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel", "pid": 0, "tid": 7, "ts": ts + 20,
               "dur": 30.0, "args": {"correlation": i + 1}}


def rank_log(path: Path, ranks: int, steps: int) -> int:
    """An iteration log as the workload writes it: rank 0's start record placing every rank (8 a
    node, 4 stages), and each step's line of rank 0 with every rank's timers and of the last rank."""
    places = [{"rank": r, "node": f"n{r // 8}", "local_rank": r % 8, "pp_rank": r * 4 // ranks, "tp_rank": 0,
               "cp_rank": 0, "dp_rank": r % (ranks // 4)} for r in range(ranks)]
    with open(path, "w") as fh:
        fh.write(json.dumps({"event": "start", "rank": 0, "world_size": ranks, "ranks": places}) + "\n")
        for i in range(1, steps + 1):
            start = int(T0_US * 1000) + i * 10**9
            compute = [0.5 + 0.001 * (r % 7) for r in range(ranks)]
            timers = {"forward_backward_s": [0.8] * ranks, "compute_s": compute,
                      "pipeline_wait_s": [round(0.8 - c, 6) for c in compute], "grad_reduce_s": [0.05] * ranks,
                      "optimizer_s": [0.1] * ranks, "step_s": [0.95] * ranks}
            for rank in (0, ranks - 1):
                fh.write(json.dumps({"event": "iteration", "iteration": i, "rank": rank, "start_ns": start,
                                     "end_ns": start + 950_000_000, "warmup": i == 1, "profiled": False,
                                     "timers": timers if rank == 0 else None}) + "\n")
    return steps * ranks


def whitespace_bomb(path: Path, gib: float = 3.0) -> None:
    """A .json.gz of a few MB that decompresses to `gib` GiB: a trace's opening, then whitespace."""
    block = b" " * (16 * 2**20)
    with gzip.open(path, "wb", compresslevel=9) as fh:
        fh.write(b'{"traceEvents": [')
        for _ in range(int(gib * 2**30 // len(block))):
            fh.write(block)
        fh.write(b"]}")


def make_case(root: Path, name: str, a: argparse.Namespace) -> Path:
    """The run directory of a case (made once, renamed into place)."""
    run = root / name
    if (run / "manifest.json").exists():
        return run
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    (staging / "traces").mkdir()
    trace = staging / "traces" / ("rank-0.json.gz" if name == "bomb" else "rank-0.json")
    if name == "ranks":
        events = rank_log(staging / "iterations.jsonl", a.ranks, a.steps)
    elif name == "bomb":
        whitespace_bomb(trace)
        events = 0
    else:
        source = {"gpu": lambda: gpu_events(a.events), "cpu": lambda: cpu_events(a.events),
                  "steps": lambda: step_events(a.spans), "optimizer": lambda: optimizer_events(a.spans)}[name]
        events = _write_trace(trace, source(), {"rank": 0, "pp_rank": 0, "node": "n0"})
    (staging / ".charllm-run").write_text('{"made_by": "synthetic"}\n')
    (staging / "manifest.json").write_text(json.dumps({"id": name, "status": "completed", "kind": "test",
                                                       "bench_events": events}))
    staging.rename(run)
    return run


def child(run: str, how: str) -> None:
    import contextlib
    import io

    from charllm.tui.cli import main  # imports are not what we measure

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, start = usage.ru_utime + usage.ru_stime, time.perf_counter()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["summarize", run, *how.split(), "--format", "json"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": time.perf_counter() - start, "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
                      "peak_rss_mb": usage.ru_maxrss / 1024, "exit": code, "stderr": err.getvalue().strip(),
                      "stdout_bytes": len(out.getvalue())}))


def measure(run: Path, how: str) -> dict:
    shutil.rmtree(run / "summaries", ignore_errors=True)   # cold
    code = (f"import sys, runpy; sys.argv = ['x', {str(run)!r}, {how!r}]; "
            f"runpy.run_path({__file__!r}, run_name='__child__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{run.name}: the child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/charllm-bench-kernels"))
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--spans", type=int, default=30_000)
    ap.add_argument("--ranks", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", nargs="+", choices=CASES)
    ap.add_argument("--skip-bomb", action="store_true", help="leave out the 3 GiB whitespace case")
    a = ap.parse_args()
    root = a.cache / f"{a.events}ev-{a.spans}spans-{a.ranks}x{a.steps}"
    root.mkdir(parents=True, exist_ok=True)
    names = a.only or [n for n in CASES if not (a.skip_bomb and n == "bomb")]
    report: dict = {"load_average_1min": os.getloadavg()[0]}
    for name in names:
        run = make_case(root, name, a)
        data = run / "iterations.jsonl" if name == "ranks" else next((run / "traces").iterdir())
        r = measure(run, "--by rank" if name == "ranks" else "--kernels")
        r["events"] = json.loads((run / "manifest.json").read_text())["bench_events"]
        r["trace_mb"] = data.stat().st_size / 1e6
        report[name] = r
        outcome = f"exit {r['exit']}" + (f": {r['stderr']}" if r["stderr"] else "")
        what = "(step, rank) timers" if name == "ranks" else "events"
        print(f"{name:9s} {r['events']:>9,} {what}, {r['trace_mb']:7.1f} MB: {r['seconds']:6.2f} s wall, "
              f"{r['cpu_s']:6.2f} s CPU, peak RSS {r['peak_rss_mb']:6.0f} MB; {outcome[:200]}", flush=True)
    report["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
elif __name__ == "__child__":
    child(sys.argv[1], sys.argv[2])
