"""The import contracts: which part of charllm may import which (README, "How the code is laid out").

Each sub-package is one concern and imports only the concerns below it, never the other way; there
are no import cycles, even through imports inside functions (an import under `if TYPE_CHECKING:` is
never run: it names a type for mypy and makes no cycle); an import inside a function says why it
waits (`# deferred: ...`); and the headless packages never load textual (nor torch outside the
workload)."""

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import charllm.engine
import charllm.probes

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"engine": "charllm.engine", "probes": "charllm.probes", "tui": "charllm.tui"}

# concern -> the concerns it may import (besides itself). Bottom to top.
ALLOWED = {
    "probes.core": set(),                                                    # errors, paths, lifeline
    "probes.store": {"probes.core"},                                         # the run directory
    "probes.backends": {"probes.core", "probes.store"},                      # replay and sim read runs
    "probes": {"probes.core", "probes.store", "probes.backends"},             # the probe: sampler, cli
    "engine.model": {"probes.core", "probes.store", "probes.backends"},      # pure arithmetic and rules
    "probes.analysis": {"probes.core", "probes.store", "engine.model"},
    "engine.workload": {"probes.core", "engine.model"},
    "engine.launch": {"probes.core", "probes.store", "probes.analysis", "engine.model", "engine.workload"},
    "engine": {"probes.core", "probes.store", "probes.backends", "probes", "engine.model", "engine.launch"},
    "engine.campaign": {"probes.core", "probes.store", "probes.analysis", "engine.model", "engine.launch"},
    "tui": {"probes.core", "probes.store", "probes.backends", "probes", "probes.analysis", "engine.model",
            "engine.launch", "engine", "engine.campaign"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _concern(module: str) -> str:
    name = module.removeprefix("charllm.")
    return max((c for c in ALLOWED if name == c or name.startswith(c + ".")), key=len)


def _imports(path: Path):
    """(imported charllm module, line, inside a function?) for every import in the file."""
    source = path.read_text()
    tree = ast.parse(source)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("charllm"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield (full if full in MODULES else node.module), node, id(node) in in_function
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("charllm"):
                    yield alias.name, node, id(node) in in_function


def test_every_module_belongs_to_a_concern():
    assert len(MODULES) > 60
    assert {_concern(m) for m in MODULES} == set(ALLOWED)


def test_each_concern_imports_only_those_below_it():
    broken = []
    for module, path in MODULES.items():
        mine = _concern(module)
        for target, node, _ in _imports(path):
            theirs = _concern(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                broken.append(f"{path.relative_to(REPO)}:{node.lineno}: {mine} imports {target} ({theirs})")
    assert not broken, "\n".join(broken)


def _type_checking_only(path: Path) -> set[int]:
    """The lines of the imports under `if TYPE_CHECKING:` in the file."""
    tree = ast.parse(path.read_text())
    return {n.lineno for f in ast.walk(tree)
            if isinstance(f, ast.If) and isinstance(f.test, ast.Name) and f.test.id == "TYPE_CHECKING"
            for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}


def test_no_import_cycles():
    graph = {}
    for module, path in MODULES.items():
        for_mypy = _type_checking_only(path)
        graph[module] = {t for t, node, _ in _imports(path)
                         if t != module and t in MODULES and node.lineno not in for_mypy}
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    cycles = []

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def _standard_library_imports_in_functions(path: Path):
    """Imports of the standard library inside functions (nodes)."""
    tree = ast.parse(path.read_text())
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(f):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                if any(name.split(".")[0] in sys.stdlib_module_names for name in names):
                    yield node


def test_imports_inside_functions_say_why():
    """Plain imports at the top; one that waits (start-up time, a vendor library) says so. Checked
    for charllm's own modules and the standard library's (third-party ones wait for start-up time
    or because they are vendor libraries a node may lack)."""
    silent = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        nodes = [node for _, node, in_function in _imports(path) if in_function]
        nodes += list(_standard_library_imports_in_functions(path))
        for node in nodes:     # the reason may sit on any line of the statement (a formatter moves it)
            if not any("# deferred:" in line for line in lines[node.lineno - 1:node.end_lineno]):
                silent.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not silent, "\n".join(silent)


def _packages(pkg) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
            if ".workload" not in m.name]  # the workload runs on compute nodes and imports torch


@pytest.mark.parametrize("pkg", [charllm.engine, charllm.probes])
def test_headless_packages_do_not_import_textual(pkg):
    mods = _packages(pkg)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted(n for n in ('textual', 'textual_plotext', 'torch', 'megatron') if n in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{pkg.__name__} imported {out.stdout.strip()}"


def test_cli_help_does_not_import_textual():
    code = (
        "import sys\nfrom charllm.tui.cli import build_parser\nbuild_parser(every=True)\n"
        "print('textual' in sys.modules, 'polars' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_runs_list_of_local_runs_loads_no_other_target_kind(charllm_dirs):
    """`runs list` imports only what it uses (issue 36, start-up time): a local run needs neither SSH's
    nor Slurm's code, nor polars or textual."""
    from charllm.probes.analysis.summary import keep_summaries
    from charllm.probes.store.rundir import RunDir
    from charllm.tui.demo import make_demo_run

    # a finished run with its kept summary, as every run that ends keeps one
    keep_summaries(RunDir(make_demo_run(charllm_dirs["runs"], "20251121-080000-demo", seconds=20, gpus=1)))
    code = ("import sys\nfrom charllm.tui.cli import main\nassert main(['runs', 'list']) == 0\n"
            "print(sorted(n for n in ('charllm.engine.launch.ssh', 'charllm.engine.launch.slurm', 'polars', "
            "'textual') if n in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "20251121-080000-demo" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


def _readme_block(marker: str) -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- readme-test: {marker} "))
    end = lines.index("```", start + 2)
    return lines[start + 2:end]


def test_readme_tree_is_the_tree():
    """Every folder and file the README's tree names exists, and every sub-package is named."""
    named, parent = set(), ""
    for line in _readme_block("tree"):
        depth = len(line) - len(line.lstrip())
        if depth > 4 or not line.strip():
            continue                                    # a wrapped description
        names = [n.strip() for n in line.strip().split("  ")[0].split(",") if n.strip()]
        for name in names:
            path = name if depth == 0 else f"{parent}{name}"
            assert (REPO / path).exists(), f"README tree names {path}, which does not exist"
            named.add(path.rstrip("/"))
        if depth == 0:
            parent = names[0]
    packages = {str(p.parent.relative_to(REPO)) for folder in FOLDERS for p in (REPO / folder).rglob("__init__.py")}
    assert packages - named == set(), "sub-packages the README tree does not show"


def test_readme_layers_are_the_contracts():
    """A concern on a row of the README's drawing imports only concerns on rows below it."""
    rows = []
    for line in _readme_block("layers"):
        cells = [c for c in line.split("  ") if c.strip()]
        concerns = [
            c.strip().split(" (")[0] for c in cells if re.fullmatch(r"(engine|probes|tui)[\w.]*( \(.*\))?", c.strip())
        ]
        rows.append(concerns)
    shown = [c for row in rows for c in row]
    assert sorted(shown) == sorted(ALLOWED), "the drawing shows each concern once"
    for i, row in enumerate(rows):
        below = {c for r in rows[i + 1:] for c in r}
        for concern in row:
            assert ALLOWED[concern] <= below, (
                f"{concern} may import {ALLOWED[concern] - below}, drawn beside or above it"
            )


def test_the_tests_mirror_the_packages():
    """tests/engine/model/ tests engine/model/, and so on; only whole-product tests sit in tests/."""
    homes = {p.parent.relative_to(REPO / "tests") for p in (REPO / "tests").rglob("test_*.py")} - {Path(".")}
    assert homes
    assert [h for h in homes if not (REPO / h / "__init__.py").exists()] == [], "tests with no package of that name"


def _above(concern: str) -> set[str]:
    """The concerns that may import `concern`, directly or through others."""
    up = {c for c, below in ALLOWED.items() if concern in below}
    return up | {a for c in up for a in _above(c)}


def test_modules_run_by_name_are_not_above_their_runner():
    """A module run as a program (`python -m NAME`, the name a string) is a dependency the imports
    do not show: the engine running the command line's flags on a node would hide an upward one."""
    broken = []
    for module, path in MODULES.items():
        mine = _concern(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
                theirs = _concern(node.value)
                if theirs != mine and theirs in _above(mine):
                    broken.append(f"{path.relative_to(REPO)}:{node.lineno}: {mine} runs {node.value} ({theirs})")
    assert not broken, "\n".join(broken)


def _kinds() -> dict[str, str]:
    """Target kind -> the module of its class (engine/launch/targets.py's registry)."""
    from charllm.engine.launch.targets import KINDS, LOCAL

    assert LOCAL.name == LOCAL.kind == "local"
    return {kind: cls.__module__ for kind, cls in KINDS.items()}


def _names_kind(node: ast.expr) -> bool:
    """`x.kind`, `x["kind"]`, `x.get("kind")` or a variable called kind."""
    return any(isinstance(n, ast.Attribute) and n.attr == "kind" or isinstance(n, ast.Name) and n.id == "kind"
               or isinstance(n, ast.Constant) and n.value == "kind" for n in ast.walk(node))


def test_no_module_outside_engine_launch_names_a_target_kind():
    """What differs by kind is a Target method (engine/launch); elsewhere code asks the target, and
    text about kinds comes from the registry. Caught: comparing a kind with a kind's name, a
    `"kind": NAME` entry, and outside docstrings a string that says a kind's name as a word or as the
    prefix of a key ("slurm_job_id"). "local" is also the built-in target's name and an ordinary word
    (megatron's local layers), so only the first two count for it."""
    kinds = _kinds()
    words = [k for k in kinds if k != "local"]
    word = re.compile(rf"\b({'|'.join(words)})\b|^({'|'.join(words)})_")
    found = []
    for module, path in MODULES.items():
        if module.startswith("charllm.engine.launch"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        where = f"{path.relative_to(REPO)}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = {c.value for side in sides for c in ast.walk(side)
                         if isinstance(c, ast.Constant) and c.value in kinds}
                if named and any(_names_kind(side) for side in sides):
                    found.append(f"{where}:{node.lineno}: compares a kind with {sorted(named)}")
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "kind" and isinstance(value, ast.Constant) \
                            and value.value in kinds:
                        found.append(f"{where}:{node.lineno}: \"kind\": {value.value!r}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and word.search(node.value):
                found.append(f"{where}:{node.lineno}: {node.value.strip()[:60]!r}")
    assert not found, "\n".join(found)
