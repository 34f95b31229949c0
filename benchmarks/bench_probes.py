"""Benchmark: the telemetry sampler's own cost, rate accuracy, disk use and memory.

    python benchmarks/bench_probes.py [--seconds 60] [--hours 1] [--skip-memory]

1. CPU cost per device-sample, excluding time inside the backends (8 simulated GPUs; the host
   backend is timed and excluded as well), at 20 Hz and 100 Hz — recording to disk included.
   Target: under 2 % of one core at 100 Hz x 8 devices.
2. Rate accuracy over --seconds: achieved Hz, jitter of tick times against their deadlines,
   missed deadlines.
3. Bytes on disk per device-sample, as recorded: zstd Arrow IPC chunks, one per second, compacted
   every minute into zstd Parquet files (recorder.py). The simulated values have full float
   precision, unlike a real device's (NVML: whole mW, degrees and MHz), so they compress less.
4. Memory over a time-compressed --hours simulated recording at 20 Hz x 8 GPUs (the clock is
   injected and advanced instead of sleeping): RSS must stay flat.
5. The utilization and violation counters on: the NVML backend itself at 20 Hz x 8 GPUs with GPM
   (SM and tensor activity, occupancy, DRAM and NVLink/PCIe bandwidth) and the violation-time
   counters, beside the host backend with per-core CPU use and iowait, recording to disk; and the
   same with them off (GPM unsupported, no violation counters), for the difference. No GPU here:
   the test suite's fake NVML (tests/fakes_nvml.py, pynvml's own module with its C calls replaced)
   answers; the time inside the fake's calls stands in for the driver's, and the host backend's
   (psutil reading /proc) is timed as in 1.: both are counted apart. The rest, the sampler's own,
   includes the NVML backend's Python (and pynvml's). Target: under 2 % of one core with them on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import polars as pl
import psutil
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from charllm.probes.backends.host import HostBackend
from charllm.probes.backends.sim import SimBackend
from charllm.probes.sampler import Sampler
from charllm.probes.store.rundir import RunDir

console = Console(width=150)


class Timed:
    """Wraps a backend and adds up the CPU time spent inside sample() (the 'vendor' time)."""

    def __init__(self, backend) -> None:
        self.backend, self.seconds = backend, 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def sample(self):
        t = time.thread_time()
        try:
            return self.backend.sample()
        finally:
            self.seconds += time.thread_time() - t


def bench_rate(hz: float, seconds: float, progress: Progress) -> dict:
    backends = [Timed(SimBackend(gpus=8, profile="bursty")), Timed(HostBackend())]
    with tempfile.TemporaryDirectory() as tmp:
        sampler = Sampler(backends, hz=hz, node="bench", run_dir=tmp)
        task = progress.add_task(f"{hz:g} Hz x 8 GPUs, {seconds:g} s", total=seconds)
        done = threading.Event()

        def tick_progress():
            start = time.monotonic()
            while not done.wait(2.0):  # rare redraws: the bar must not cost what we measure
                progress.update(task, completed=min(seconds, time.monotonic() - start), refresh=True)

        threading.Thread(target=tick_progress, daemon=True).start()
        proc = psutil.Process()
        cpu0, wall0 = proc.cpu_times(), time.monotonic()
        sampler.run(duration=seconds)
        cpu1, wall = proc.cpu_times(), time.monotonic() - wall0
        done.set()
        progress.update(task, completed=seconds)
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        vendor = sum(b.seconds for b in backends)
        frame = RunDir(Path(tmp)).scan_telemetry().collect()
        gpu = frame.filter(pl.col("device") == "gpu0").sort("mono_ns")
        mono = gpu["mono_ns"].to_numpy() / 1e9
        start = mono[0]
        # lateness of each tick against its deadline start + k/hz (k from the nearest deadline)
        late = [(t - start) - round((t - start) * hz) / hz for t in mono]
        disk = sum(p.stat().st_size for p in RunDir(Path(tmp)).telemetry_files())
        gpu_rows = frame.filter(pl.col("backend") == "sim").height
    overhead = max(0.0, cpu - vendor)
    return {
        "hz": hz, "seconds": wall, "ticks": sampler.ticks, "achieved_hz": (gpu.height - 1) / (mono[-1] - mono[0]),
        "jitter_ms": statistics.pstdev(late) * 1e3, "late_p99_ms": sorted(late)[int(0.99 * len(late))] * 1e3,
        "missed": sampler.missed_deadlines, "cpu_pct": 100 * cpu / wall, "vendor_pct": 100 * vendor / wall,
        "overhead_pct": 100 * overhead / wall, "us_per_device_sample": overhead / sampler.rows * 1e6,
        "bytes_per_device_sample": disk / frame.height, "gpu_rows": gpu_rows, "rows": frame.height,
    }


class CompressedSampler(Sampler):
    """Sleeps by advancing the injected clock: an hour of 20 Hz sampling in a few minutes."""

    def __init__(self, *args, fake_clock, **kw) -> None:
        super().__init__(*args, clock=fake_clock, **kw)
        self.fake_clock = fake_clock

    def _sleep(self, seconds: float) -> bool:
        self.fake_clock.t += seconds
        return self._stop.is_set()


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def bench_memory(hours: float, progress: Progress) -> list[tuple[float, float]]:
    clock = FakeClock()
    samples: list[tuple[float, float]] = []
    proc = psutil.Process()
    total = hours * 3600
    task = progress.add_task(f"{hours:g} h simulated recording, 20 Hz x 8 GPUs", total=total)
    next_mark = [0.0]

    def on_sample(_rows):
        if clock.t >= next_mark[0]:
            samples.append((clock.t, proc.memory_info().rss / 2**20))
            progress.update(task, completed=clock.t, refresh=True)
            next_mark[0] += total / 24

    with tempfile.TemporaryDirectory() as tmp:
        sim = SimBackend(gpus=8, profile="bursty", clock=clock)
        sampler = CompressedSampler([sim], hz=20, node="bench", run_dir=tmp, on_sample=on_sample, fake_clock=clock)
        sampler.run(duration=total)
        samples.append((clock.t, proc.memory_info().rss / 2**20))
        progress.update(task, completed=total)
        chunks = len(RunDir(Path(tmp)).telemetry_files())
    console.print(f"memory run: {sampler.rows} rows in {chunks} chunks")
    return samples


def bench_counters(seconds: float, progress: Progress, counters: bool = True) -> dict:
    """The NVML backend (fake library) with GPM and violation counters on or off, 8 GPUs + host, 20 Hz."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _pytest.monkeypatch import MonkeyPatch

    from charllm.probes.backends import open_backends
    from fakes_nvml import FakeGpu, FakeNvml

    class TimedFake(FakeNvml):
        """The fake NVML, adding up the time spent inside its calls (the 'driver' time). The fake is
        pure Python that never blocks, so its wall time is its CPU time; perf_counter, unlike a
        thread CPU clock, costs no system call, so the measuring adds little of its own."""

        ns = 0

        def _counted(self, name, fn):
            def call(*args):
                t = time.perf_counter_ns()
                try:
                    return fn(*args)
                finally:
                    TimedFake.ns += time.perf_counter_ns() - t
            return call

    patch = MonkeyPatch()
    try:
        off = set() if counters else {"nvmlDeviceGetViolationStatus"}
        TimedFake([FakeGpu(i, gpm=counters, unsupported_calls=off) for i in range(8)]).install(patch)
        nvml, host = open_backends("nvml")[0]
        host = Timed(host)
        with tempfile.TemporaryDirectory() as tmp:
            sampler = Sampler([nvml, host], hz=20, node="bench", run_dir=tmp)
            task = progress.add_task(f"NVML counters {'on' if counters else 'off'}, 20 Hz x 8 GPUs, {seconds:g} s",
                                     total=None)
            proc = psutil.Process()
            cpu0, wall0 = proc.cpu_times(), time.monotonic()
            sampler.run(duration=seconds)
            cpu1, wall = proc.cpu_times(), time.monotonic() - wall0
            progress.update(task, completed=1, total=1)
            frame = RunDir(Path(tmp)).scan_telemetry().collect()
        nvml.close()
    finally:
        patch.undo()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    outside = TimedFake.ns / 1e9 + host.seconds
    gpu = frame.filter(pl.col("device") != "host")
    cores = frame.filter(pl.col("device") == "host")["cpu_core_util_pct"].drop_nulls().list.len().max()
    return {
        "counters": counters,
        "seconds": wall,
        "cpu_pct": 100 * cpu / wall,
        "fake_pct": 100 * TimedFake.ns / 1e9 / wall,
        "host_pct": 100 * host.seconds / wall,
        "sampler_pct": 100 * (cpu - outside) / wall,
        "gpm_rows": gpu["sm_active_pct"].drop_nulls().len(),
        "gpu_rows": gpu.height,
        "cores": cores,
        "missed": sampler.missed_deadlines,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    with Progress(console=console, transient=True, auto_refresh=False) as progress:
        results = [bench_rate(hz, args.seconds, progress) for hz in (20.0, 100.0)]
        counters = [bench_counters(args.seconds, progress, on) for on in (False, True)]
        memory = [] if args.skip_memory else bench_memory(args.hours, progress)

    table = Table(title=f"sampler, 8 simulated GPUs + host, {args.seconds:g} s per rate")
    for col in ("Hz", "achieved Hz", "jitter ms", "p99 late ms", "missed", "process CPU %", "in backends %",
                "sampler CPU %", "µs / device-sample", "bytes / device-sample"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(f"{r['hz']:g}", f"{r['achieved_hz']:.3f}", f"{r['jitter_ms']:.2f}", f"{r['late_p99_ms']:.2f}",
                      str(r["missed"]), f"{r['cpu_pct']:.2f}", f"{r['vendor_pct']:.2f}", f"{r['overhead_pct']:.2f}",
                      f"{r['us_per_device_sample']:.1f}", f"{r['bytes_per_device_sample']:.0f}")
    console.print(table)
    r100 = results[1]
    verdict = "PASS" if r100["overhead_pct"] < 2.0 else "FAIL"
    console.print(f"target: sampler CPU at 100 Hz x 8 GPUs < 2 % of one core: {r100['overhead_pct']:.2f} % {verdict}")
    table = Table(title=f"NVML backend (fake library) + host ({counters[0]['cores']} cores), 20 Hz x 8 GPUs, "
                        f"{args.seconds:g} s each")
    for col in ("GPM and violation counters", "GPU rows with GPM figures", "missed", "process CPU %",
                "in the fake NVML %", "in the host backend %", "sampler CPU %"):
        table.add_column(col, justify="right")
    for r in counters:
        table.add_row("on" if r["counters"] else "off", f"{r['gpm_rows']} of {r['gpu_rows']}", str(r["missed"]),
                      f"{r['cpu_pct']:.2f}", f"{r['fake_pct']:.2f}", f"{r['host_pct']:.2f}", f"{r['sampler_pct']:.2f}")
    console.print(table)
    c = counters[1]
    verdict = "PASS" if c["sampler_pct"] < 2.0 else "FAIL"
    console.print(f"target: sampler CPU with the counters on at 20 Hz x 8 GPUs < 2 % of one core: "
                  f"{c['sampler_pct']:.2f} % {verdict}")
    if memory:
        mem = Table(title=f"RSS over a time-compressed {args.hours:g} h recording")
        mem.add_column("simulated time", justify="right")
        mem.add_column("RSS MiB", justify="right")
        for t, rss in memory[:: max(1, len(memory) // 12)] + [memory[-1]]:
            mem.add_row(f"{t / 60:.0f} min", f"{rss:.1f}")
        console.print(mem)
        settled = [rss for t, rss in memory if t >= args.hours * 3600 / 6]
        growth = max(settled) - min(settled)
        console.print(f"RSS growth after the first sixth: {growth:.1f} MiB ({'flat' if growth < 20 else 'GROWING'})")


if __name__ == "__main__":
    main()
