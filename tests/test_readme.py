"""Every command block of the README and every example in a `--help` epilog runs as written, in
a fresh data directory, in order: a README example that fails is a failing test.

What a test cannot have is either stood in for here (STAND_INS: a finished and a running CPU run
for RUN, a results tree in the charllm-PPT artifact's layout, a file of Megatron flags) or marked
in the README, in an HTML comment right before its block, with the reason:

    <!-- readme-test: not run: REASON -->                 the whole block
    <!-- readme-test: not run `COMMAND`: REASON -->       one command of it
    <!-- readme-test: file <config>/NAME -->              the block is that file (written before it is used)
    <!-- readme-test: duckdb in <runs> -->                the SQL runs in DuckDB in the runs directory
    <!-- readme-test: tree (...) -->, layers (...)        the repository layout, checked by test_layering.py

A marker that names no command of its block, or a block with no way to run it, fails too.
`probe` without --duration records until it is signalled: it is interrupted after a few seconds
and must then exit cleanly, as on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from charllm.tui.cli import build_parser

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INTERRUPT_AFTER_S = 5.0
TIMEOUT_S = 600


@dataclass
class Block:
    lang: str
    line: int                      # of the opening fence
    text: str
    markers: list[str] = field(default_factory=list)


@dataclass
class Command:
    source: str                    # "README.md:LINE" or "charllm-tui plan --help"
    text: str
    skip: str | None = None        # the README's reason for not running it

    @property
    def id(self) -> str:
        return f"{self.source}: {self.text[:90]}"


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        markers, j = [], i - 1
        while j >= 0 and (m := re.match(r"^<!-- readme-test: (.*) -->$", lines[j])):
            markers.insert(0, m.group(1))
            j -= 1
        end = lines.index("```", i + 1)
        blocks.append(Block(fence.group(1), i + 1, "\n".join(lines[i + 1:end]) + "\n", markers))
        i = end + 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        line = re.sub(r"(^|\s+)#\s.*$", "", line).rstrip() if not pending else line.rstrip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = (pending + line.strip()).strip()
        pending = ""
        if line:
            out.append(re.sub(r"\s+#\s.*$", "", line))
    return out


def readme_commands() -> list[Command]:
    out = []
    for block in readme_blocks(README.read_text()):
        if block.lang != "bash":
            continue
        whole = [m.removeprefix("not run: ") for m in block.markers if m.startswith("not run: ")]
        for text in shell_commands(block.text):
            reasons = [m for m in block.markers if m.startswith(f"not run `{text}`: ")]
            skip = whole[0] if whole else reasons[0].split("`: ", 1)[1] if reasons else None
            out.append(Command(f"README.md:{block.line}", text, skip))
    return out


def subparsers(parser: argparse.ArgumentParser, prog: str = "charllm-tui"):
    for action in parser._actions:  # argparse keeps its subcommands here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}", sub
                yield from subparsers(sub, f"{prog} {name}")


def epilog_commands() -> list[Command]:
    """The commands under `examples:` of every subcommand's help: a line that starts with
    `charllm-tui` (and its continuation lines), up to two or more spaces before what it does."""
    out = []
    for prog, parser in subparsers(build_parser(every=True)):
        help_text = parser.format_help()
        if "\nexamples:\n" not in help_text:
            continue
        section = help_text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0]
        for text in shell_commands(section):
            if text.startswith("charllm-tui "):
                out.append(Command(f"{prog} --help", re.split(r"\s{2,}", text)[0]))
    return out


README_COMMANDS = readme_commands()
EPILOG_COMMANDS = epilog_commands()


# --------------------------------------------------------------------------------------------
# Stand-ins for what the examples assume exists
# --------------------------------------------------------------------------------------------
class Session:
    """One fresh set of charllm directories and a working directory; commands run in order."""

    def __init__(self, root: Path):
        self.cwd = root / "work"
        self.cwd.mkdir(parents=True)
        self.dirs = {kind: root / kind for kind in ("config", "data", "runs")}
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                    "COLUMNS": "120", **{f"CHARLLM_{k.upper()}_DIR": str(v) for k, v in self.dirs.items()}}
        self.finished_run: str | None = None     # RUN: the quick start's CPU run
        self.second_run: str | None = None       # RUN in `runs cancel RUN` (running then), RUN_B
        self.results: dict[str, tuple[int, str, str]] = {}
        self.recorded = 0                        # RUN_DIRs made so far (each example gets its own)

    def runs(self) -> list[str]:
        return sorted(p.name for p in self.dirs["runs"].iterdir() if not p.name.startswith(".")) \
            if self.dirs["runs"].is_dir() else []

    def shell(self, text: str, interrupt: bool = False) -> tuple[int, str, str]:
        proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", text], cwd=self.cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=INTERRUPT_AFTER_S if interrupt else TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT if interrupt else signal.SIGKILL)
            out, err = proc.communicate(timeout=60)
            if not interrupt:
                err += f"\n(killed after {TIMEOUT_S} s)"
        return proc.returncode, out, err

    def prepare(self, text: str) -> str:
        """Create what `text` needs and put the stand-ins in."""
        if "my_launch_flags.txt" in text and not (self.cwd / "my_launch_flags.txt").exists():
            self.check("charllm-tui export megatron ppt-h100-llama3-70b-1-01000 > my_launch_flags.txt")
        if "train.sh" in text and not (self.cwd / "train.sh").exists():
            self.check("charllm-tui export megatron ppt-h200-mixtral-8x7b-1-01000 --script --out train.sh")
        if re.search(r"\bRUN_DIR\b", text):   # probe --out: a new run directory each time (never another's)
            self.recorded += 1
            text = re.sub(r"\bRUN_DIR\b", f"recorded-{self.recorded}", text)
        if "path/to/charllm-ppt/results" in text:
            from infra_charllm_ppt import make_results

            root = self.cwd / "path/to/charllm-ppt/results"
            for where in ("power-sweep/gpt3-175b/run0", "power-sweep/gpt3-175b/run1", "base/llama3-70b/run0"):
                make_results(root / where)
        if re.search(r"\bRUN(_[AB])?\b", text):
            if self.finished_run is None:
                self.finished_run = self._launch("--follow")
            if text.startswith("charllm-tui runs cancel "):
                self.second_run = self._launch("--set train_iters=100000", wait_iterations=2)
                text = re.sub(r"\bRUN\b", self.second_run, text)
            if re.search(r"\bRUN_B\b", text):
                text = re.sub(r"\bRUN_B\b", self.second_run or self._launch("--follow"), text)
            text = re.sub(r"\bRUN(_A)?\b", self.finished_run, text)
        return text

    def _launch(self, extra: str, wait_iterations: int = 0) -> str:
        from charllm.probes.store.rundir import RunDir
        from infra_runs import iterations_logged, wait_for

        before = set(self.runs())
        self.check(f"charllm-tui launch tiny-local --target local {extra}")
        (run,) = set(self.runs()) - before
        if "--follow" in extra:   # it returns once the supervisor has kept the summaries and exited
            from charllm.probes.analysis.summary import cached_summary
            from infra_runs import run_processes

            assert run_processes(run) == []
            assert cached_summary(RunDir(self.dirs["runs"] / run), "steady", by="run") is not None
        if wait_iterations:
            rd = RunDir(self.dirs["runs"] / run)
            wait_for(lambda: iterations_logged(rd) >= wait_iterations, 240, "the stand-in run's iterations")
        return run

    def check(self, text: str) -> None:
        code, out, err = self.shell(text)
        assert code == 0, f"stand-in {text!r} exited {code}: {err[-2000:]}"

    def run(self, command: Command) -> tuple[int, str, str]:
        if command.text not in self.results:
            text = self.prepare(command.text)
            interrupt = re.match(r"charllm-tui probe\b", text) and not re.search(r"--duration|--list", text)
            before = set(self.runs())
            self.results[command.text] = self.shell(text, interrupt=bool(interrupt))
            launched = set(self.runs()) - before
            if text.startswith("charllm-tui launch ") and len(launched) == 1 and self.finished_run is None:
                (self.finished_run,) = launched   # the quick start's run is RUN from here on
        return self.results[command.text]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A fresh session with the README's config files (targets.toml, tui.toml) in place, as a reader
    who set them up has them: `launch ... --target mycluster` names the README's own target."""
    s = Session(tmp_path_factory.mktemp("readme"))
    for block in readme_blocks(README.read_text()):
        for marker in block.markers:
            if marker.startswith("file <config>/"):
                path = s.dirs["config"] / marker.removeprefix("file <config>/")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.text)
    yield s
    if s.second_run:  # nothing the stand-ins started outlives the test (if cancel failed)
        s.shell(f"charllm-tui runs cancel {s.second_run}")


# --------------------------------------------------------------------------------------------
# The tests, in README order, then the epilogs
# --------------------------------------------------------------------------------------------
def test_every_block_of_the_readme_is_run_or_marked_with_a_reason():
    for block in readme_blocks(README.read_text()):
        where = f"README.md:{block.line} ({block.lang or 'no language'})"
        commands = shell_commands(block.text) if block.lang == "bash" else []
        for marker in block.markers:
            named = re.match(r"not run `(.+)`: (.+)$", marker)
            assert (marker.startswith("not run: ") and len(marker) > 20) or (named and named.group(1) in commands) \
                or re.match(r"file <config>/[\w.-]+(/[\w.-]+)?$", marker) or marker == "duckdb in <runs>" \
                or re.match(r"(tree|layers) \(tests/test_layering.py checks", marker), \
                f"{where}: marker {marker!r} names no command of its block, or gives no reason"
        if block.lang != "bash":
            assert block.markers, f"{where}: a {block.lang!r} block needs a readme-test marker saying how it is used"


@pytest.mark.train           # one session: it trains the tiny CPU run the later commands read
@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("command", README_COMMANDS, ids=lambda c: c.id)
def test_readme_command_runs_as_written(session, command):
    if command.skip:
        pytest.skip(f"README marks it not run: {command.skip}")
    code, out, err = session.run(command)
    assert code == 0, f"{command.text!r} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    assert "Traceback" not in err
    if command.text.startswith("charllm-tui runs cancel "):
        assert "cancelled" in (out + err)


def test_readme_config_files_are_read_as_the_readme_says(session):
    from charllm.engine.launch.targets import load_file
    from charllm.tui.app import load_settings

    files = {m.removeprefix("file <config>/"): b.text for b in readme_blocks(README.read_text()) for m in b.markers
             if m.startswith("file <config>/")}
    assert set(files) == {"tui.toml", "targets.toml", "campaigns/my-sweep.toml", "experiments/my-llama3-70b.toml",
                          "campaigns/my-gpt.toml", "campaigns/my-steps.toml"}
    tmp = session.cwd / "config-check"
    for name, body in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(body)
    settings = load_settings(tmp / "tui.toml")
    assert settings["theme"] == "gruvbox" and settings["keymap"] == {"screen.live": "f12"}
    targets = load_file(tmp / "targets.toml")
    assert {t.kind for t in targets.values()} == {"slurm", "ssh"}
    from charllm.engine.model.experiment import Experiment
    from charllm.engine.model.validate import validate

    mine = Experiment.load(tmp / "experiments/my-llama3-70b.toml")    # the minimal experiment: valid as it is
    assert mine.hardware.name == "h100-sxm-80gb" and mine.world_size == 64 and validate(mine) == []
    from charllm.engine.campaign.spec import Campaign

    campaign = Campaign.load(tmp / "campaigns/my-sweep.toml")
    assert campaign.target in targets and campaign.max_parallel == 2 and campaign.time_limit_s == 1800
    assert [(m.experiment.parallel.pipeline_model_parallel_size, m.experiment.training.micro_batch_size)
            for m in campaign.members()] == [(4, 1), (4, 2), (2, 1), (2, 2)]
    gpt = Campaign.load(tmp / "campaigns/my-gpt.toml")     # a command's members, planned from their flags
    assert [(m.layout_label, m.experiment.training.micro_batch_size, m.command.cwd) for m in gpt.members()] == \
        [("TP1 PP1 DP2", mbs, str(Path.home() / "Megatron-LM")) for mbs in (1, 2, 4)]
    steps = Campaign.load(tmp / "campaigns/my-steps.toml")   # and a command's whose flags give no layout
    assert [(m.layout_label, m.command.line.split(";")[0]) for m in steps.members()] == \
        [("layout unknown", f"for i in $(seq 1 {n})") for n in (3, 5)]


def test_readme_sql_runs_in_duckdb_over_the_runs_the_readme_made(session):
    import duckdb  # a declared test dependency: imported, never skipped

    (block,) = [b for b in readme_blocks(README.read_text()) if b.lang == "sql"]
    assert "duckdb in <runs>" in block.markers
    # The runs the query reads: the README's import, run here if this test runs alone.
    (imported,) = [c for c in README_COMMANDS if c.text.startswith("charllm-tui import ")]
    assert session.run(imported)[0] == 0
    cwd = os.getcwd()
    os.chdir(session.dirs["runs"])
    try:
        rows = duckdb.sql(block.text).fetchall()
    finally:
        os.chdir(cwd)
    assert rows and all(row[3] > 0 for row in rows)  # one row per run, node and GPU, with samples


def test_readme_sql_runs_on_a_runs_directory_of_cpu_runs_only(tmp_path):
    """Host rows only: no file has power_w or temp_gpu_c, and the query still runs (no GPU rows)."""
    import duckdb

    from charllm.probes.store.recorder import ChunkWriter
    from charllm.probes.store.synthetic import cpu_run

    for name in ("20261121-100000-cpu-a", "20261121-110000-cpu-b"):
        run = cpu_run(tmp_path, name, 1.0)
        ChunkWriter(run.node_telemetry_dir("node0")).close()        # compacted into Parquet, as a run ends
    assert list(tmp_path.glob("*/telemetry/*/*.parquet")) and not list(tmp_path.glob("*/telemetry/*/*.arrow"))
    (block,) = [b for b in readme_blocks(README.read_text()) if b.lang == "sql"]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert duckdb.sql(block.text).fetchall() == []
    finally:
        os.chdir(cwd)


@pytest.mark.train           # the examples train (doctor --train, campaign run) and read the session's runs
@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("command", EPILOG_COMMANDS, ids=lambda c: c.id)
def test_help_epilog_example_runs_as_written(session, command):
    code, out, err = session.run(command)
    assert code == 0, f"{command.text!r} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    assert "Traceback" not in err


def test_every_subcommand_with_examples_is_covered():
    """The epilogs that show examples: a new one is run by the test above without a change here."""
    progs = {c.source for c in EPILOG_COMMANDS}
    assert {"charllm-tui plan --help", "charllm-tui sweep --help", "charllm-tui doctor --help",
            "charllm-tui probe --help"} <= progs
    assert all(c.text.startswith("charllm-tui ") for c in EPILOG_COMMANDS), \
        [c.text for c in EPILOG_COMMANDS if not c.text.startswith("charllm-tui ")]
