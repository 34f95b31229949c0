"""Live: power, temperatures, SM clock and throttling per GPU, iteration speed, ranks and log.

`u` turns the four charts to what the GPUs do (NVML GPM: SM and tensor-core activity, DRAM and
NVLink bandwidth; a host: its busiest core, iowait, CPU use, network), `m` the strip below them
from throttle reasons to a GPUs x time heat strip of temperature, power, SM clock or link bytes,
and the iterations pane names the slowest ranks of the last steps (probes.analysis.ranks).

A thread worker (`LiveScreen.feed`) follows one source — a run directory through
`probes.store.follow.RunFollower` (live or recorded: a finished run replays whole),
or, with no run selected, this machine's host telemetry from an in-process `probes.sampler.Sampler`
— and posts a `LiveScreen.Frame` about four times a second. The UI thread only draws. Beside host
telemetry or a live local run it also lists the processes on this machine's GPUs (`GpuProcesses`:
the GPU backend's `processes()`, NVML's running processes), `p` in place of the log.
"""

from __future__ import annotations

import queue
import textwrap
import time
from dataclasses import dataclass, field
from functools import reduce
from itertools import groupby
from operator import or_
from pathlib import Path

from rich.markup import escape
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Log, Static
from textual.worker import get_current_worker

from charllm.engine.launch import targets
from charllm.engine.model.experiment import Experiment
from charllm.probes import backends, sampler
from charllm.probes.analysis.iterations import read_experiment, span_stats
from charllm.probes.analysis.ranks import recent_line
from charllm.probes.analysis.render import format_figure
from charllm.probes.backends.base import Backend, GpuProcess, hostname
from charllm.probes.core.errors import UserError
from charllm.probes.core.formatting import GIB, seconds, size
from charllm.probes.store import rundir
from charllm.probes.store.follow import NewIterations, NewLogLines, NewTelemetry, RunFollower
from charllm.probes.store.schema import conform
from charllm.tui.screens.base import WorkbenchScreen
from charllm.tui.widgets.charts import MAX_POINTS, Chart

POLL_S = 0.25
WINDOWS_S = (15, 30, 60, 120, 300, 900, None)     # zoom steps; None: everything recorded
DEFAULT_WINDOW = 2                                 # 60 s
GROUP_ABOVE = 8                                    # more devices than this: one line per node
KEEP_S = 900                                       # live history kept in memory
HOST_HZ = 4.0
PROCESSES_EVERY_S = 2.0   # how often this machine's GPU processes are listed

CHART_EVERY_S = 2.0       # new telemetry redraws the charts at most this often (plotext builds are the
                          # Live view's main cost; 2 s moves a 60 s window by under two cells)
X_LABEL = "time (s)"      # seconds since the source's first sample
GPU_CHARTS = (("power_w", "GPU power (W)"), ("temp_gpu_c", "GPU temperature (°C)"),
              ("temp_mem_c", "memory temperature (°C)"), ("sm_clock_mhz", "SM clock (MHz)"))
# The host panes show the first four of these that the node reports (the host backend marks
# temperature, RAPL energy and InfiniBand unsupported where it cannot read them).
HOST_CHARTS = (("cpu_util_pct", "host CPU utilization (%)"), ("host_mem_used_gib", "host memory used (GiB)"),
               ("cpu_power_w", "host CPU power (W)"), ("temp_cpu_c", "host CPU temperature (°C)"),
               ("net_mb_s", "host network in+out (MB/s)"),
               ("cpu_freq_mhz", "host CPU frequency (MHz)"))
# `u`: what the devices do (GPM counters: null, and said so, on a GPU without GPM)
UTILIZATION_CHARTS = (("sm_active_pct", "SM active (%)"), ("tensor_active_pct", "tensor cores active (%)"),
                      ("dram_bw_util_pct", "DRAM bandwidth used (%)"), ("nvlink_gb_s", "NVLink sent+received (GB/s)"))
HOST_UTILIZATION_CHARTS = (("cpu_core_busiest_pct", "busiest CPU core (%)"), ("cpu_iowait_pct", "host CPU iowait (%)"),
                           ("cpu_util_pct", "host CPU utilization (%)"), ("net_mb_s", "host network in+out (MB/s)"))
NOT_SUPPORTED = {"sm_active_pct", "tensor_active_pct", "dram_bw_util_pct", "nvlink_gb_s"}   # GPM's (Hopper+)
PANES = len(GPU_CHARTS)                            # chart panes on screen
WINDOWED = ("power_w", "cpu_power_w", "net_mb_s")   # power and throughput titles name their window
KEEP_COLUMNS = ("ts_ns", "node", "device", "simulated", "throttle_reasons", *(c for c, _ in GPU_CHARTS),
                "sm_active_pct", "tensor_active_pct", "dram_bw_util_pct", "nvlink_tx_bytes_s", "nvlink_rx_bytes_s",
                "nvlink_tx_bytes", "nvlink_rx_bytes",
                "cpu_util_pct", "cpu_iowait_pct", "cpu_core_util_pct", "temp_cpu_c", "cpu_freq_mhz",
                "host_mem_used_bytes", "cpu_energy_j", "net_tx_bytes", "net_rx_bytes")
# `m`: what the strip under the charts shows per GPU over time: throttle reasons, or a heat strip
STRIPS = ("throttle", "temperature", "power", "clock", "link")
HEAT = " ▁▂▃▄▅▆▇█"
# throttle-strip glyphs, most severe first: (bits, glyph, style, meaning)
THROTTLE_KINDS = ((0x40 | 0x20, "▇", "red", "thermal"), (0x80 | 0x8, "▇", "magenta", "hw slowdown/brake"),
                  (0x4, "▆", "yellow", "power cap"))


@dataclass
class Frame(Message):
    """What the Live screen draws, computed off the UI thread."""

    source: str                                     # run id, or "host telemetry: <host>"
    status: str                                     # run status / sampler state
    kind: str                                       # gpu | host | none
    charts: dict[str, dict] | None = field(default_factory=dict)  # metric -> {label: (xs, ys)}; None: unchanged
    panes: list[tuple[str, str]] = field(default_factory=list)   # (metric, title) of each chart pane
    window: str = ""                                          # what the chart points average over
    throttle: list[tuple[str, list[int]]] = field(default_factory=list)
    heat: list[tuple[str, list[float | None]]] = field(default_factory=list)   # the strip's values, unless throttle
    strip: str = "throttle"                                   # what the strip shows (STRIPS)
    iterations: list[dict] = field(default_factory=list)     # every "iteration" event so far
    progress: str = ""                                        # iterations_text of them
    ranks: str = ""
    stragglers: str | None = None                             # the slowest ranks of the last steps
    log_lines: list[str] = field(default_factory=list)       # new since the previous frame
    simulated: bool = False
    grouped: bool = False
    devices: int = 0
    runtime: str = ""                                         # what ran: "ran as ..." (the workload's start
    #                                                           record) or "ran: CMD" (a user's command)
    error: str | None = None
    frozen: bool = False            # charts of the data shown when paused, redrawn for a new view (zoom)
    processes: list[GpuProcess] | None = None                 # this machine's GPU processes; None: unchanged
    processes_note: str = ""        # whose processes these are, or why none can be listed; "": not shown here
    processes_listed: bool = False  # a GPU library lists them (no processes then means none running)


class RunSource:
    """New telemetry rows, iteration events and log lines of a run directory (probes.store.follow)."""

    def __init__(self, run_dir: Path):
        self.follower = RunFollower(run_dir)
        self.name = self.follower.run.id
        self.expects = _expected_kind(self.follower.run)
        # what ran, where a user's command ran instead of the workload ("ran: CMD")
        self.command = rundir.command_line(self.follower.run.manifest())
        try:    # its figures count tokens as summarize does (the batch where a step logged none)
            self.experiment = read_experiment(self.follower.run.experiment_path)
        except (UserError, OSError):
            self.experiment = None

    def status(self) -> str:
        m = self.follower.manifest or self.follower.run.manifest()
        return f"{m.status} · target {m.target_name}"

    def poll(self):
        rows, events, log_lines = None, [], []
        for event in self.follower.poll():
            if isinstance(event, NewTelemetry):
                rows = event.rows
            elif isinstance(event, NewIterations):
                events = event.events
            elif isinstance(event, NewLogLines):
                log_lines = event.lines
        return rows, events, log_lines

    def close(self) -> None:
        pass


class HostSource:
    """This machine's host telemetry, sampled in-process (no run directory, nothing written)."""

    expects = "host"

    def __init__(self):
        self.name = f"host telemetry: {hostname()}"
        self.sampler = sampler.Sampler([backends.open_backend("host")], hz=HOST_HZ, node=hostname())
        self.ticks = self.sampler.subscribe()
        self.sampler.start()

    def status(self) -> str:
        return f"sampling this machine at {HOST_HZ:g} Hz (host backend, in-process)"

    def poll(self):
        import polars as pl

        rows = []
        while True:
            try:
                rows += self.ticks.get_nowait()
            except queue.Empty:
                break
        frame = conform(pl.from_dicts(rows, infer_schema_length=None)) if rows else None
        return frame, [], []

    def close(self) -> None:
        self.sampler.stop()


def _expected_kind(run: rundir.RunDir) -> str:
    """What a run's telemetry will hold, before any has come: a CPU run (CPU hardware, or only the host
    sampled) charts the host, others the GPUs. A run without a readable experiment counts as a GPU run."""
    try:
        exp = Experiment.load(run.experiment_path)
    except (UserError, OSError):
        return "gpu"
    return "host" if exp.hardware.vendor == "cpu" or exp.telemetry.backend == "host" else "gpu"


class GpuProcesses:
    """The processes on this machine's GPUs, from the GPU backend `auto` opens (NVML, else AMD SMI)."""

    def __init__(self):
        self.listed = False
        self.backend: Backend | None = None
        try:
            self.backend = backends.open_backend("auto")
        except UserError as exc:
            self.note = f"GPU processes: none listed ({exc})"
            return
        self.listed = self.backend.name != "host"
        if not self.listed:
            self.note = f"GPU processes: no GPU library answers on {hostname()} ({self.backend.reason})"
        else:
            self.note = f"GPU processes on {hostname()} ({self.backend.name})"

    def list(self) -> list[GpuProcess]:
        return self.backend.processes() if self.backend else []

    def close(self) -> None:
        if self.backend:
            self.backend.close()


def watches_this_machine(run_dir: Path | None) -> bool:
    """Whether the GPUs of this machine are the source's: host telemetry, or a local run still going."""
    if run_dir is None:
        return True
    try:
        m = rundir.RunDir(run_dir).manifest()
    except UserError:
        return False
    return targets.runs_here(m.target) and not m.final


class LiveScreen(WorkbenchScreen):
    MODE = "live"
    BINDINGS = [
        Binding("space", "pause", "Pause", id="live.pause"),
        Binding("plus,equals_sign", "zoom(-1)", "Zoom in", id="live.zoom_in"),
        Binding("minus", "zoom(1)", "Zoom out", id="live.zoom_out"),
        Binding("g", "group", "Per node", id="live.group"),
        Binding("h", "host", "Host", id="live.host"),
        Binding("c", "next_chart", "Next chart", id="live.next_chart"),
        Binding("p", "processes", "GPU processes", id="live.processes"),
        Binding("u", "utilization", "Utilization", id="live.utilization"),
        Binding("m", "strip", "Strip", id="live.strip"),
    ]

    def __init__(self):
        super().__init__()
        self.source_path: Path | None = None
        self.following = False
        self.paused = False
        self.window = DEFAULT_WINDOW
        self.group_nodes: bool | None = None     # None: automatic (above GROUP_ABOVE devices)
        self.strip_width = 60
        self.chart_points = 120                  # time buckets per series the feed averages into
        self.compact = False                     # small terminal: one chart at a time
        self.chart_index: int | None = None      # the one chart shown (c cycles); None: all four
        self.held: Frame | None = None           # the newest frame while paused, drawn on resume
        self.held_charts = False                 # whether it holds chart data newer than those drawn
        self._shown: dict[str, str | Text] = {}
        self.frames = 0                          # frames drawn (tests and benchmarks read it)
        self.last_frame: Frame | None = None
        self.show_processes: bool | None = None  # the processes pane instead of the log; None: automatic
        self.processes: list[GpuProcess] = []
        self.utilization = False                 # u: the charts show what the devices do
        self.strip = STRIPS[0]                   # m: what the strip under the charts shows

    def compose_body(self) -> ComposeResult:
        with Vertical(id="live"):
            with Horizontal(id="live-top"):
                yield Static(id="live-title")
                yield Static("SIMULATED", id="sim-badge", classes="badge-sim")
            yield Static(id="live-runtime", classes="hint")
            with Vertical(id="charts"):
                for i, (_, title) in enumerate(GPU_CHARTS):
                    yield Chart(title, xlabel=X_LABEL, id=f"chart-{i}")
            yield Static(id="throttle")
            with Horizontal(id="live-bottom"):
                yield Static(id="iterations")
                yield Static(id="gpu-processes")
                yield Log(id="log-tail", max_lines=500)

    def on_mount(self) -> None:
        self.query_one("#sim-badge").display = False

    def on_screen_resume(self) -> None:
        if not self.following or self.source_path != self.app.run_path:
            self.follow(self.app.run_path)

    def on_resize(self) -> None:
        self.compact = self.size.width < 110 or self.size.height < 36
        self.set_class(self.compact, "-compact")
        self.strip_width = max(10, self.size.width - 16)
        self._show_charts()
        if self.last_frame is not None:         # the iterations pane's lines fit its new size
            self.call_after_refresh(self._draw_text, self.last_frame)

    def _show_charts(self) -> None:
        one = 0 if self.compact and self.chart_index is None else self.chart_index
        self.set_class(one is not None, "-one-chart")
        chart_width = self.size.width if one is not None else self.size.width // 2
        self.chart_points = max(10, (chart_width - 8) * 2)     # braille: two points per cell
        for i, chart in enumerate(self.query(Chart)):
            chart.display = one is None or i == one

    def action_next_chart(self) -> None:
        """Small terminal: the next of the four charts. Large: all four, then each alone, full size."""
        if self.compact:
            self.chart_index = ((self.chart_index or 0) + 1) % PANES
        else:
            self.chart_index = 0 if self.chart_index is None else self.chart_index + 1
            if self.chart_index == PANES:
                self.chart_index = None
        self._show_charts()

    # -- following a source ------------------------------------------------------------------
    def follow(self, run_dir: Path | None) -> None:
        self.source_path = run_dir
        self.following = True
        self.paused = False                     # a new source starts live (h while paused froze it empty)
        self.frames = 0
        self.last_frame = self.held = None
        self.held_charts = False
        self.processes = []
        self.query_one("#log-tail", Log).clear()
        self._shown.clear()
        finished = False
        if run_dir is not None:
            finished = rundir.RunDir(run_dir).manifest().final
        self.window = len(WINDOWS_S) - 1 if finished else DEFAULT_WINDOW   # a replay shows it all
        self.feed(run_dir)

    @work(thread=True, exclusive=True, group="live-feed")
    def feed(self, run_dir: Path | None) -> None:
        worker = get_current_worker()
        try:
            source = RunSource(run_dir) if run_dir else HostSource()
        except Exception as exc:  # noqa: BLE001 - shown on screen, never raised into the UI
            self.post_message(Frame(source=str(run_dir or "host telemetry"), status="", kind="none",
                                    error=str(exc)))
            return
        processes = GpuProcesses() if watches_this_machine(run_dir) else None
        listed_at = -PROCESSES_EVERY_S
        import polars as pl

        history = None
        iterations: list[dict] = []
        log = None             # the iteration lines as a typed frame (rundir.iteration_frame), grown as they come
        progress = ""
        starts: dict = {}
        t0 = None
        drawn_with = None      # (rows seen, view settings) of the last chart data sent
        drawn_at = -CHART_EVERY_S
        last_kind = "none"
        rows_seen = 0
        last_status = None
        stragglers = None      # the slowest ranks of the last steps (probes.analysis.ranks.recent_line)
        frozen_ts = None       # while paused: the newest sample the charts show
        try:
            while not worker.is_cancelled:
                began = time.monotonic()
                try:
                    rows, events, log_lines = source.poll()
                except Exception as exc:  # noqa: BLE001 - a bad chunk is shown, and polling goes on
                    self.post_message(Frame(source=source.name, status=source.status(), kind="none",
                                            error=f"reading telemetry failed: {exc}"))
                    time.sleep(1.0)
                    continue
                for event in events:
                    if event.get("event") == "iteration":
                        iterations.append(event)
                    elif event.get("event") == "start" and (not starts.get("ranks") or event.get("ranks")):
                        starts = event   # rank 0's names every rank: kept over the last rank's
                if rows is not None and rows.height:
                    rows_seen += rows.height
                    rows = rows.select([c for c in KEEP_COLUMNS if c in rows.columns])
                    history = rows if history is None else pl.concat([history, rows], how="diagonal_relaxed")
                    t0 = t0 or history["ts_ns"].min()
                    if run_dir is None or not isinstance(source, RunSource):
                        history = history.filter(pl.col("ts_ns") >= history["ts_ns"].max() - KEEP_S * 10**9)
                status = source.status()
                # Telemetry arrives about once a second (one chunk per node): new rows redraw the
                # charts every CHART_EVERY_S, a changed view (zoom, grouping, size) at once; while
                # paused, a new view redraws the data shown when it paused.
                paused = self.paused
                view = (
                    self.window,
                    self.group_nodes,
                    self.strip_width,
                    self.chart_points,
                    self.utilization,
                    self.strip,
                )
                charts_due = drawn_with is None or view != drawn_with[1] or (
                    rows_seen != drawn_with[0] and not paused and began - drawn_at >= CHART_EVERY_S)
                processes_due = processes is not None and began - listed_at >= PROCESSES_EVERY_S
                if not events and not log_lines and status == last_status and not charts_due and not processes_due:
                    time.sleep(max(0.0, POLL_S - (time.monotonic() - began)))
                    continue    # nothing new: no message, no repaint
                last_status = status
                if charts_due:
                    if not paused:
                        frozen_ts = history["ts_ns"].max() if history is not None and history.height else None
                    shown = (history if not paused or frozen_ts is None or history is None
                             else history.filter(pl.col("ts_ns") <= frozen_ts))
                    frame = build_frame(shown, t0, WINDOWS_S[self.window], self.group_nodes, self.strip_width,
                                        self.chart_points, utilization=self.utilization, strip=self.strip)
                    frame.frozen = paused
                    if frame.kind == "none":        # nothing yet: the titles of what will come
                        frame.panes = list(UTILIZATION_CHARTS if self.utilization else GPU_CHARTS) \
                            if source.expects == "gpu" else \
                            list(HOST_UTILIZATION_CHARTS if self.utilization else HOST_CHARTS[:PANES])
                    drawn_with, drawn_at = (rows_seen, view), began
                else:
                    frame = Frame(source="", status="", kind=last_kind, charts=None)
                if processes_due and processes is not None:     # (due only when there are processes to list)
                    frame.processes, listed_at = processes.list(), began
                if processes is not None:
                    frame.processes_note, frame.processes_listed = processes.note, processes.listed
                last_kind = frame.kind
                frame.source, frame.status = source.name, status
                frame.iterations = iterations
                if events or not progress:    # the log's new lines typed once; the figures over all of it
                    new = [e for e in events if e.get("event") == "iteration"]
                    log = rundir.iteration_frame(new) if log is None else pl.concat([log, rundir.iteration_frame(new)])
                    progress = iterations_text(log, getattr(source, "experiment", None))
                frame.progress = progress
                frame.log_lines = log_lines
                frame.ranks = ranks_text(iterations, starts)
                if events:   # rank 0's lines carry every rank's timers: the last steps' slowest ranks
                    stragglers = recent_line([starts, *iterations[-STRAGGLER_STEPS * 2:]], STRAGGLER_STEPS) \
                        if any(e.get("timers") for e in iterations[-2:]) else None
                frame.stragglers = stragglers
                if isinstance(source, RunSource) and source.command:     # (host telemetry has no command)
                    frame.runtime = f"ran: {source.command}"
                elif starts.get("runtime"):
                    frame.runtime = f"ran as {rundir.runtime_line(starts['runtime'])}"
                self.post_message(frame)
                time.sleep(max(0.0, POLL_S - (time.monotonic() - began)))
        finally:
            source.close()
            if processes is not None:
                processes.close()

    # -- drawing -------------------------------------------------------------------------------
    def on_frame(self, frame: Frame) -> None:
        if frame.log_lines:
            self.query_one("#log-tail", Log).write_lines(frame.log_lines)
        if frame.processes is not None:
            self.processes = frame.processes
        new_charts = frame.charts is not None or self.last_frame is None
        newest = self.held or self.last_frame
        if frame.charts is None and newest is not None:   # nothing new to plot: keep the charts drawn
            frame.charts, frame.panes, frame.window = newest.charts, newest.panes, newest.window
            frame.throttle, frame.simulated = newest.throttle, newest.simulated
            frame.heat, frame.strip = newest.heat, newest.strip
            frame.grouped, frame.devices = newest.grouped, newest.devices
        if self.paused and self.last_frame is not None:
            if frame.frozen and frame.charts is not None and frame.kind != "none":
                # the paused data in a new view (zoom): redrawn, with the figures as they were
                last = self.last_frame
                frame.source, frame.status, frame.iterations = last.source, last.status, last.iterations
                frame.progress = last.progress
                frame.ranks, frame.runtime = last.ranks, last.runtime
                self._draw(frame, charts=True)
            else:
                self.held, self.held_charts = frame, self.held_charts or new_charts
            return
        self._draw(frame, charts=new_charts)

    def _draw(self, frame: Frame, charts: bool) -> None:
        self.last_frame = frame
        self._draw_text(frame)
        if not charts:
            return
        frame.charts = frame.charts or {}
        self.frames += 1
        panes = frame.panes or [(metric, title) for metric, title in GPU_CHARTS]
        for (metric, title), chart in zip(panes, self.query(Chart)):
            chart.title = f"{title} · {frame.window}" if metric in WINDOWED and frame.window else title
            series = frame.charts.get(metric, {})
            empty = frame.kind != "none" and not any(v is not None for _, ys in series.values() for v in ys)
            why = " — not supported by these GPUs (NVML GPM: Hopper and newer)" if metric in NOT_SUPPORTED \
                else " — not reported here"
            chart.show(series, note=why if empty else "")
        rows = 1 if self.compact else GROUP_ABOVE
        self.query_one("#throttle", Static).update(
            throttle_text(frame.throttle, frame.kind, max_rows=rows) if frame.strip == "throttle"
            else heat_text(frame.heat, frame.strip, frame.kind, max_rows=rows))

    def _draw_text(self, frame: Frame) -> None:
        """Title, badge, iterations and ranks: cheap, drawn on every frame."""
        window = WINDOWS_S[self.window]
        span = "all" if window is None else f"last {window} s"
        flags = [span, "PAUSED" if self.paused else "", "per node" if frame.grouped else ""]
        title = f"[b]{frame.source}[/b] · {frame.status} · {' · '.join(f for f in flags if f)}"
        if frame.error:
            title = f"[b]{frame.source}[/b] · [yellow]{frame.error}[/]"
        elif frame.kind == "none":
            title += " · waiting for telemetry…"
        self._update("#live-title", title)
        self._update("#live-runtime", escape(frame.runtime))
        self.query_one("#live-runtime").display = bool(frame.runtime)
        self.query_one("#sim-badge").display = frame.simulated
        # The GPU processes: shown of themselves beside host telemetry when a GPU library lists them,
        # else on p (which also says why there are none); never for another machine's run.
        run = self.source_path is not None
        automatic = not run and frame.processes_listed
        processes = bool(frame.processes_note) and (
            self.show_processes if self.show_processes is not None else automatic)
        self.query_one("#iterations").display = run
        self.query_one("#gpu-processes").display = processes
        self.query_one("#log-tail").display = run and not processes
        self.query_one("#live-bottom").display = processes or run     # a run's log and steps from its first second
        if processes:
            self._update("#gpu-processes", processes_text(self.processes, frame.processes_note, frame.processes_listed))
        text = (frame.progress or iterations_text([])) + "\n" + frame.ranks
        if frame.stragglers:          # to the pane's last row, cut only where a phrase ends (80x24 gives it 5)
            width, height = self.query_one("#iterations").content_size.width, \
                self.query_one("#live-bottom").content_size.height
            if width and height:
                stragglers = fit_phrases(frame.stragglers, width, height - rows(text, width))
                text += f"\n{escape(stragglers)}" if stragglers else ""
            elif run and self.is_current:       # just shown: fitted once the layout gives the pane its size
                self.call_after_refresh(self._redraw_text, frame)
        self._update("#iterations", text)

    def _redraw_text(self, frame: Frame) -> None:
        if self.last_frame is frame:    # not replaced by a newer one meanwhile
            self._draw_text(frame)

    def _update(self, selector: str, content: str | Text) -> None:
        """Update a Static only when its text changes (each update costs a repaint)."""
        if self._shown.get(selector) != content:
            self._shown[selector] = content
            self.query_one(selector, Static).update(content)

    # -- actions -------------------------------------------------------------------------------
    def action_pause(self) -> None:
        """Freeze the charts and figures (the log keeps scrolling); Space again shows the newest."""
        self.paused = not self.paused
        if self.paused or self.held is None:
            if self.last_frame is not None:
                self._draw_text(self.last_frame)
        else:
            held, self.held = self.held, None
            self._draw(held, charts=self.held_charts)
            self.held_charts = False

    def action_zoom(self, step: int) -> None:
        self.window = min(len(WINDOWS_S) - 1, max(0, self.window + step))

    def action_group(self) -> None:
        grouped = self.last_frame.grouped if self.last_frame else False
        self.group_nodes = not grouped

    def action_host(self) -> None:
        self.app.open_run(None)

    def action_utilization(self) -> None:
        """The charts: power and heat, or what the devices do (GPM counters; a host's cores)."""
        self.utilization = not self.utilization

    def action_strip(self) -> None:
        """The strip under the charts: throttle reasons, then each GPU's temperature, power, SM
        clock and link bytes over time (heat strips), then throttle reasons again."""
        self.strip = STRIPS[(STRIPS.index(self.strip) + 1) % len(STRIPS)]

    def action_processes(self) -> None:
        """The processes on this machine's GPUs in place of the log, and back."""
        frame = self.last_frame
        if frame is None or not frame.processes_note:
            self.notify("no GPU processes to list: they are this machine's, shown beside its host telemetry (h) "
                        "or a live local run", severity="warning")
            return
        shown = self.query_one("#gpu-processes").display
        self.show_processes = not shown
        self._draw_text(frame)


# -- frame computation (worker thread) -----------------------------------------------------------
def build_frame(history, t0, window_s, group_nodes, strip_width, chart_points: int = 120, *,
                utilization: bool = False, strip: str = "throttle") -> Frame:
    import polars as pl

    if history is None or history.height == 0:
        return Frame(source="", status="", kind="none")
    gpus = history.filter(pl.col("device") != "host")
    kind = "gpu" if gpus.height else "host"
    data = (gpu_metrics(gpus) if kind == "gpu" else host_metrics(history)).with_columns(
        ((pl.col("ts_ns") - t0) / 1e9).alias("t_s"))
    if window_s is not None:
        data = data.filter(pl.col("t_s") >= data["t_s"].max() - window_s)
    nodes = data["node"].n_unique()
    devices = data.select(pl.struct("node", "device").n_unique()).item()
    grouped = group_nodes if group_nodes is not None else devices > GROUP_ABOVE
    if grouped:
        label = pl.col("node")
    elif nodes > 1:
        label = pl.concat_str("node", pl.lit("/"), "device")
    else:
        label = pl.col("device")
    data = data.with_columns(label.alias("label"))
    if kind == "gpu":
        panes = list(UTILIZATION_CHARTS if utilization else GPU_CHARTS)
    else:
        panes = list(HOST_UTILIZATION_CHARTS) if utilization else host_panes(data)
    metrics = [m for m, _ in panes]
    heat_metric = STRIP_METRICS.get(strip)
    if grouped:   # one line per node: the mean of its devices at each instant
        data = (data.group_by("label", "ts_ns", maintain_order=True)
                .agg(pl.col("t_s").first(), pl.col("simulated").any(), pl.col("throttle_reasons").max(),
                     *(pl.col(m).mean() for m in {*metrics, *([heat_metric] if heat_metric else [])})))
    charts: dict[str, dict] = {m: {} for m in metrics}
    throttle: list[tuple[str, list[int]]] = []
    lo, hi = (data["t_s"].min() or 0.0), (data["t_s"].max() or 0.0)
    # Average into the time buckets the charts can show (the chart adapter would do it too, slower).
    labels = data["label"].n_unique()
    buckets = max(10, min(chart_points, MAX_POINTS // max(1, labels)))
    bucket = ((pl.col("t_s") - lo) / ((hi - lo) or 1) * (buckets - 1)).round().cast(pl.Int64)
    means = (
        data.group_by("label", bucket.alias("bucket"))
        .agg(pl.col("t_s").mean(), *(pl.col(m).mean() for m in metrics))
        .sort("label", "bucket")
    )
    for (name,), part in means.partition_by("label", as_dict=True).items():
        for m in metrics:
            charts[m][name] = (part["t_s"].to_list(), part[m].to_list())
    heat: list[tuple[str, list[float | None]]] = []
    for (name,), part in sorted(data.partition_by("label", as_dict=True).items()):
        if kind == "gpu":
            cols = ((part["t_s"] - lo) / ((hi - lo) or 1) * (strip_width - 1)).cast(pl.Int64)
            if heat_metric:
                means = part.select(cols.alias("c"), pl.col(heat_metric)).group_by("c").agg(pl.col(heat_metric).mean())
                values: list[float | None] = [None] * strip_width
                for c, v in means.iter_rows():
                    values[c] = v
                heat.append((name, values))
                continue
            bits = (part.select(cols.alias("c"), pl.col("throttle_reasons").fill_null(0))
                    .group_by("c").agg(pl.col("throttle_reasons").max()))
            row = [0] * strip_width
            for c, b in bits.iter_rows():
                row[c] = b
            throttle.append((name, row))
    span = "all recorded" if window_s is None else f"last {window_s} s"
    averaged = data.height > buckets * labels     # else each point is one sample
    return Frame(source="", status="", kind=kind, charts=charts, throttle=throttle, heat=heat,
                 strip=strip if heat_metric and kind == "gpu" else "throttle", panes=panes,
                 window=f"{seconds((hi - lo) / buckets)} means · {span}" if averaged else f"samples · {span}",
                 simulated=bool(data["simulated"].any()), grouped=grouped, devices=devices)


# The heat strips' per-sample figures (gpu_metrics derives the link rate).
STRIP_METRICS = {"temperature": "temp_gpu_c", "power": "power_w", "clock": "sm_clock_mhz", "link": "nvlink_gb_s"}
STRIP_TITLES = {"temperature": "GPU temperature (°C)", "power": "GPU power (W)", "clock": "SM clock (MHz)",
                "link": "NVLink sent+received (GB/s)"}
STRAGGLER_STEPS = 10


def gpu_metrics(gpus):
    """GPU rows with the NVLink bandwidth the charts plot: GPM's where the GPU has it, else the
    rate of its byte counters (per device, between consecutive samples)."""
    import polars as pl

    rows = gpus.sort("node", "device", "ts_ns")
    dt = pl.col("ts_ns").diff().over("node", "device") / 1e9
    counted = pl.col("nvlink_tx_bytes") + pl.col("nvlink_rx_bytes")
    rate = pl.when(dt > 0).then(counted.diff().over("node", "device") / dt)
    gpm = pl.col("nvlink_tx_bytes_s") + pl.col("nvlink_rx_bytes_s")
    return rows.with_columns((pl.coalesce(gpm, pl.when(rate >= 0).then(rate)) / 1e9).alias("nvlink_gb_s"))


def host_metrics(history):
    """Host rows with the derived figures the host panes plot: memory in GiB, and RAPL power and
    network throughput as rates of their counters (per node, between consecutive samples)."""
    import polars as pl

    rows = history.filter(pl.col("device") == "host").sort("node", "ts_ns")
    dt = pl.col("ts_ns").diff().over("node") / 1e9

    def rate(counter):
        return pl.when(dt > 0).then(counter.diff().over("node") / dt)

    busiest = (
        pl.col("cpu_core_util_pct").list.max() if "cpu_core_util_pct" in rows.columns else pl.lit(None, pl.Float64)
    )
    return rows.with_columns((pl.col("host_mem_used_bytes") / GIB).alias("host_mem_used_gib"),
                             rate(pl.col("cpu_energy_j")).alias("cpu_power_w"),
                             (rate(pl.col("net_tx_bytes") + pl.col("net_rx_bytes")) / 1e6).alias("net_mb_s"),
                             busiest.alias("cpu_core_busiest_pct"))


def host_panes(data) -> list[tuple[str, str]]:
    """The first PANES host charts with any value in `data` (then the rest, shown as not reported)."""
    reported = [pane for pane in HOST_CHARTS if pane[0] in data.columns and data[pane[0]].is_not_null().any()]
    return (reported + [pane for pane in HOST_CHARTS if pane not in reported])[:PANES]


def throttle_text(rows: list[tuple[str, list[int]]], kind: str, max_rows: int = GROUP_ABOVE) -> Text:
    """One strip per device (or node); more rows than fit are folded into one "any GPU" strip."""
    if kind != "gpu":
        return Text("throttle reasons: no GPU in this source", "dim")
    if len(rows) > max_rows:
        rows = [(f"any of {len(rows)}", [reduce(or_, col) for col in zip(*(bits for _, bits in rows))])]
    text = Text.assemble(("throttle", "bold"), "  ", no_wrap=True)
    for _, glyph, style, meaning in THROTTLE_KINDS:
        text.append_text(Text.assemble((glyph, style), f" {meaning}  "))
    text.append_text(Text.assemble(("·", "green"), " none"))
    for label, bits in rows:
        text.append(f"\n{label[:12]:>12}  ")
        for (glyph, style), run in groupby(map(_throttle_glyph, bits)):   # one span per run: cheaper to paint
            text.append(glyph * len(list(run)), style)
    return text


def heat_text(rows: list[tuple[str, list[float | None]]], strip: str, kind: str, max_rows: int = GROUP_ABOVE) -> Text:
    """One heat strip per device (or node): each cell its mean over that span, from the lowest
    figure shown (▁) to the highest (█); a span without a figure is blank. More rows than fit: the
    hottest (highest mean) are shown, the count of the others said."""
    if kind != "gpu":
        return Text(f"{strip} strip: no GPU in this source", "dim")
    known = [v for _, values in rows for v in values if v is not None]
    if not known:
        return Text(f"{STRIP_TITLES[strip]} per GPU over time: not reported here", "dim")
    lo, hi = min(known), max(known)
    text = Text.assemble((f"{STRIP_TITLES[strip]}", "bold"), f"  ▁ {lo:,.4g} … █ {hi:,.4g}  (m: next)", no_wrap=True)
    ranked = sorted(
        rows, key=lambda r: -(sum(v for v in r[1] if v is not None) / max(1, sum(v is not None for v in r[1])))
    )
    shown = ranked[:max_rows] if len(rows) > max_rows else rows
    for label, values in shown:
        text.append(f"\n{label[:12]:>12}  ")
        cells = "".join(" " if v is None else HEAT[1 + round((v - lo) / ((hi - lo) or 1) * (len(HEAT) - 2))]
                        for v in values)
        text.append(cells, "yellow")
    if len(shown) < len(rows):
        text.append(f"\n{'':>12}  … {len(rows) - len(shown)} more (the highest shown)", "dim")
    return text


def _throttle_glyph(bits: int) -> tuple[str, str]:
    return next(((g, st) for mask, g, st, _ in THROTTLE_KINDS if bits & mask), ("·", "green"))


def processes_text(processes: list[GpuProcess], note: str, listed: bool) -> Text:
    """One line per process, most GPU memory first within each GPU, as nvitop lists them."""
    text = Text(note, "bold", no_wrap=True)
    if not processes:
        return text.append("\nnone running" if listed else "", "dim")
    text.append(f"\n{'GPU':<6}{'PID':>8}  {'user':<10}{'memory':>10}{'SM':>5}  command", "dim")
    for p in sorted(processes, key=lambda p: (p.device, -(p.used_bytes or 0), p.pid)):
        memory = size(p.used_bytes) if p.used_bytes is not None else "—"
        sm = f"{p.sm_pct:.0f}%" if p.sm_pct is not None else "—"
        text.append(f"\n{p.device:<6}{p.pid:>8}  {p.user[:9]:<10}{memory:>10}{sm:>5}  {p.name}")
    return text


def iterations_text(log, experiment=None) -> str:
    """The latest iteration, then iteration time and tokens/s over the last 10 steady steps and over
    the whole steady window so far (all steps after warm-up), each line naming its window. Steps and
    figures are summarize's own (`rundir.merged_steps`, `iterations.span_stats`, printed by
    `render.format_figure`): the steady window's are what Runs, Compare and `summarize` give.
    `log`: the iteration lines (dicts, or `rundir.iteration_frame` of them); `experiment`: the run's
    ExperimentFile (the tokens of steps that logged none)."""
    import polars as pl  # deferred: as feed's (the module's own imports name no data library)

    log = rundir.iteration_frame(log) if isinstance(log, list) else log
    its = log.filter(pl.col("event") == "iteration")
    if its.height == 0:
        return "[b]iterations[/]  none yet"
    losses = its.filter(pl.col("loss").is_not_null()).sort("iteration", maintain_order=True)["loss"]
    loss = f" · loss {losses[-1]:.3f}" if losses.len() else ""
    lines = [f"[b]iteration {its['iteration'].max()}[/]{loss}"]
    steps = rundir.merged_steps(its)
    steady = steps.filter(~pl.col("warmup"))
    recent = steady.tail(10) if steady.height else steps.tail(10)
    for window, part in ((f"last {recent.height} steps", recent), ("steady window", steady)):
        stats = span_stats(steps, part, experiment)
        if stats.get("iter_time_mean_s") is not None:
            speed = f" · {format_figure('tokens_per_s', stats['tokens_per_s'])}" \
                if stats.get("tokens_per_s") is not None else ""
            lines.append(f"{window}: {format_figure('iter_time_mean_s', stats['iter_time_mean_s'])}/it{speed}")
    return "\n".join(lines)


def rows(text: str, width: int) -> int:
    """The rows `text` (console markup) takes in a pane `width` columns wide."""
    return sum(max(1, len(textwrap.wrap(line, width))) for line in Text.from_markup(text).plain.split("\n"))


def fit_phrases(text: str, width: int, room: int) -> str:
    """`text` (plain) in at most `room` rows of `width`: whole, or cut where a phrase ends (before ", ", "; ",
    ": " or " (", never inside parentheses) with an ellipsis; "" when not even its first phrase fits."""
    if len(textwrap.wrap(text, width)) <= room:
        return text
    ends = sorted({i for sep in (", ", "; ", ": ", " (") for i in range(len(text)) if text.startswith(sep, i)},
                  reverse=True)
    for end in ends:
        cut = text[:end] + " …"
        if cut.count("(") == cut.count(")") and len(textwrap.wrap(cut, width)) <= room:
            return cut
    return ""


def ranks_text(events: list[dict], start: dict) -> str:
    seen: dict[str, set] = {}
    for e in events:
        seen.setdefault(str(e.get("node", "?")), set()).add(e.get("rank"))
    world = start.get("world_size")
    nodes = "  ".join(
        f"{node}: ranks {','.join(str(r) for r in sorted(rs, key=str))}" for node, rs in sorted(seen.items())
    )
    return (f"world {world} · " if world else "") + (nodes or "no rank has reported yet")

