"""The GPU acceptance kit (benchmarks/gpu/), checked on the CPU before a GPU is ever lent: its budget,
what it chooses to run, its carry, its archive within what comes back from the device machine, the
dry run of the whole kit (`bash benchmarks/gpu/run.sh --dry-run`, real launches of the tiny CPU
experiment), and the import of its archives into tests/data/gpu_runs/ (tools/import_gpu_kit.py),
round-tripped both from the dry run and from the real H200 run this repository keeps.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
REAL_RUN = REPO / "tests" / "data" / "gpu_runs" / "runs" / "20261126-045153-m1-llama1b-mbs1"
SHIPPED = REPO / "tests" / "data" / "gpu_runs" / "h200-2026-11-26.json"
BACK_NAME = re.compile(r"[A-Za-z0-9._-]+")     # what the device tool brings back from $OUT: names, 16 MiB each
BACK_BYTES, BACK_FILES = 16 * 2**20, 8


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kit = _load("gpu_kit", REPO / "benchmarks" / "gpu" / "kit.py")
importer = _load("import_gpu_kit", REPO / "tools" / "import_gpu_kit.py")
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))   # carry.py imports the kit by name, as its script does
carry = _load("gpu_kit_carry", REPO / "benchmarks" / "gpu" / "carry.py")


# -- the budget ------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_item_starts_only_when_its_estimate_fits_what_is_left():
    clock = Clock()
    budget = kit.Budget(300, clock)
    item = kit.ITEMS[0]
    assert budget.left() == 300 - kit.PACK_RESERVE_S
    assert budget.admits(item, 200) is None
    clock.now += 150                                   # 130 s left after the packing reserve
    assert budget.admits(item, 100) is None
    assert budget.admits(item, 131) == "budget: needs about 131 s, 130 s left"
    assert budget.deadline_s(240) == 130 and budget.deadline_s(60) == 60
    clock.now += 1000
    assert budget.admits(item, 1) == "budget: needs about 1 s, 0 s left" and budget.deadline_s(60) == 1


def test_the_items_are_the_issues_priority_list_on_both_megatron_core_lines():
    groups = [item.group for item in kit.ITEMS]
    assert groups == sorted(groups) and [g[0] for g in dict.fromkeys(groups)] == list("1234567")
    experiments = [i for i in kit.ITEMS if i.group == "2 experiments"]
    files = sorted(p.stem for p in kit.EXPERIMENTS.glob("*.toml"))
    assert len(files) == 8 and len(experiments) == 16
    assert {(i.line, i.args["experiment"]) for i in experiments} == {(line, f) for line in kit.MEGATRON_CORE_LINES
                                                                      for f in files}
    assert [i.args["sets"][2] for i in kit.ITEMS if i.name.startswith("sweep/")] == [
        f"micro_batch_size={m}" for m in (1, 2, 4, 8)]
    assert all(0 < i.gpu_s <= i.cap_s < 600 and 0 < i.cpu_s for i in kit.ITEMS)
    assert len({i.name for i in kit.ITEMS}) == len(kit.ITEMS)


def test_the_kits_experiments_load_and_name_real_presets():
    from charllm.engine.model.experiment import Experiment

    for path in kit.EXPERIMENTS.glob("*.toml"):
        exp = Experiment.load(str(path))
        assert exp.name == path.stem and exp.world_size == 1 and exp.telemetry.backend == "nvml"


def test_only_skip_and_resume_choose_items_in_priority_order():
    names = [i.name for i in kit.ITEMS]
    chosen = kit.chosen(["experiments/0.19.2", "campaign"], ["*/m4-moe"], {"campaign"})
    assert [i.name for i, _ in chosen] == names                     # every item keeps its place and a reason
    run = [i.name for i, why in chosen if why is None]
    assert run == [n for n in names if n.startswith("experiments/0.19.2/") and not n.endswith("m4-moe")]
    why = {i.name: why for i, why in chosen}
    assert why["campaign"] == "completed in an earlier part"
    assert why["experiments/0.19.2/m4-moe"] == "not chosen (--skip)" and why["doctor"] == "not chosen (--only)"
    assert all(why is None for _, why in kit.chosen([], [], set()))


# -- the archive -----------------------------------------------------------------------------------
def _kit(tmp_path: Path, part: int = 1):
    args = SimpleNamespace(dry_run=True, part=part, work=str(tmp_path / "work"), out=str(tmp_path / "out"))
    k = kit.Kit(args)
    k.record.data["started"] = "2026-11-29T00:00:00+00:00"
    return k


def test_an_archive_over_one_file_comes_back_in_numbered_pieces_that_join(tmp_path, monkeypatch):
    monkeypatch.setattr(kit, "PIECE_BYTES", 40_000)
    k = _kit(tmp_path)
    (k.stage / "items" / "noise.bin").write_bytes(os.urandom(100_000))   # does not compress
    pieces = k.pack()
    assert [p.name for p in pieces] == [f"gpu-kit-p1.tar.gz.{n:03d}" for n in range(3)]
    assert all(BACK_NAME.fullmatch(p.name) and p.stat().st_size <= kit.PIECE_BYTES for p in pieces)
    joined = kit.archives(list(reversed(pieces)))["gpu-kit-p1.tar.gz"]
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        assert tar.extractfile("gpu-kit/items/noise.bin").read() == (k.stage / "items" / "noise.bin").read_bytes()
    (k.stage / "items" / "noise.bin").unlink()
    assert [p.name for p in k.pack()] == ["gpu-kit-p1.tar.gz"]            # repacked whole: the pieces are gone
    assert sorted(p.name for p in k.out.iterdir()) == ["gpu-kit-p1.tar.gz"]
    with pytest.raises(ValueError, match="pieces 000, 002 given; each from 000 on is needed"):
        kit.archives([pieces[0], pieces[2]])
    with pytest.raises(ValueError, match="not a kit archive"):
        kit.archives([tmp_path / "results.tar.gz"])


def test_an_archive_past_the_last_piece_says_what_is_lost(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kit, "PIECE_BYTES", 10_000)
    k = _kit(tmp_path)
    (k.stage / "items" / "noise.bin").write_bytes(os.urandom(120_000))
    pieces = k.pack()
    assert len(pieces) == kit.MAX_PIECES <= BACK_FILES - 1
    assert "is over 7 pieces: the rest is lost" in capsys.readouterr().out


# -- the carry -------------------------------------------------------------------------------------
def _wheel(folder: Path, name: str, version: str, text: str) -> Path:
    """A real (if tiny) wheel: one module, METADATA, WHEEL and a RECORD with the members' hashes."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VALUE = {text!r}\n".encode(),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(d)},{len(d)}\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_the_carry_holds_every_base_dependency_the_gpu_image_lacks():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {re.split(r"[<>=!; \[]", d, maxsplit=1)[0].lower() for d in pyproject["project"]["dependencies"]}
    carried = {spec.split("==")[0] for spec in carry.COMMON}
    assert needed - carried - carry.ON_THE_GPU_IMAGE == set()
    assert not carried & carry.ON_THE_GPU_IMAGE                      # one version of each: two stop the install
    assert set(carry.wheel_sets(hta=False)) == {"common", *(f"megatron-core-{v}" for v in kit.MEGATRON_CORE_LINES)}


def test_the_carry_is_built_measured_and_installed_as_the_gpu_machine_installs_it(tmp_path, monkeypatch):
    cache, out = tmp_path / "downloads", tmp_path / "carry"
    cache.mkdir()
    lines = {f"megatron-core-{v}": (f"kitcore=={v}",) for v in kit.MEGATRON_CORE_LINES}
    sets = {"common": ("kitcommon==1.0",), **lines}
    _wheel(cache, "kitcommon", "1.0", "common")
    for v in kit.MEGATRON_CORE_LINES:
        _wheel(cache, "kitcore", v, v)
    monkeypatch.setattr(carry, "wheel_sets", lambda hta: sets)
    record = carry.build(out, cache, hta=False, megatron_lm=None, preset=1)
    with tarfile.open(out / kit.CARRY_ARCHIVE) as tar:
        names = sorted(tar.getnames())
        stored = zipfile.ZipFile(tar.extractfile("wheels/common/kitcommon-1.0-py3-none-any.whl"))
        assert {i.compress_type for i in stored.infolist()} == {zipfile.ZIP_STORED}   # xz sees the bytes
    assert names == ["wheels/common/kitcommon-1.0-py3-none-any.whl",
                     *(f"wheels/megatron-core-{v}/kitcore-{v}-py3-none-any.whl" for v in kit.MEGATRON_CORE_LINES)]
    assert json.loads((out / kit.CARRY_RECORD).read_text()) == record and record["archive_bytes"] > 0
    # the GPU machine's side: every set into its own site, the checkout linked in as charllm
    monkeypatch.setattr(kit, "CARRY", out)
    k = _kit(tmp_path)
    k.install()
    for v in kit.MEGATRON_CORE_LINES:
        code = ("import os, kitcore, kitcommon, charllm.engine as e; "
                "print(kitcore.VALUE, kitcommon.VALUE, os.path.realpath(e.__file__))")
        done = subprocess.run([sys.executable, "-c", code], env=k.env(v), capture_output=True, text=True, check=True)
        assert done.stdout.split() == [v, "common", str(REPO / "engine" / "__init__.py")]


def test_what_travels_is_the_tree_git_does_not_ignore_and_the_carry(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.gpu/\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)
    (tmp_path / ".gpu" / "downloads").mkdir(parents=True)
    (tmp_path / ".gpu" / "downloads" / "big.whl").write_bytes(b"z" * 5000)      # ignored and not carried
    (tmp_path / ".gpu" / "carry").mkdir()
    (tmp_path / ".gpu" / "carry" / "kit.tar.xz").write_bytes(b"w" * 700)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt", ".gitignore"], check=True)
    sizes = carry.travelling_bytes(tmp_path, tmp_path / ".gpu" / "carry")
    assert sizes == {"working_tree_bytes": 1000 + 300 + len("/.gpu/\n"), "carry_bytes": 700,
                     "total_bytes": 1000 + 300 + len("/.gpu/\n") + 700}


# -- the dry run, and its archive imported back -------------------------------------------------------
# one of each kind of item; the rest are the same code with another experiment (the dry run of everything,
# as the README gives it, takes about 5 minutes here)
DRY_ONLY = "doctor,experiments/*/m1-llama1b-mbs1,profile,counters,sweep/mbs1,runner"


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_kit_dry_runs_on_the_cpu_and_its_archive_imports_back(tmp_path):
    work, out, into = tmp_path / "work", tmp_path / "out", tmp_path / "gpu_runs"
    into.mkdir()
    budget = 540     # the GPU's first part's: the items chosen take about 2 minutes here
    started = time.monotonic()
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), "--dry-run", "--work", str(work),
                           "--out", str(out), "--budget", str(budget), "--only", DRY_ONLY],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=380)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert took < budget + 30, f"the dry run took {took:.0f} s of a {budget} s budget"
    # one archive, as the device tool brings files back
    [archive] = list(out.iterdir())
    assert archive.name == "gpu-kit-p1.tar.gz" and archive.stat().st_size < BACK_BYTES
    members = _members(archive)
    assert all(name.startswith("gpu-kit/") for name in members)
    results = json.loads(members["gpu-kit/results.json"])
    items = {i["name"]: i for i in results["items"]}
    assert list(items) == [i.name for i in kit.ITEMS] and results["dry_run"] is True
    assert all(i["status"] in ("completed", "failed", "skipped") and (i["status"] == "completed" or i["reason"])
               for i in items.values())
    for name in ("doctor", "experiments/0.16.1/m1-llama1b-mbs1", "profile", "sweep/mbs1"):
        assert items[name]["status"] == "completed", items[name]
    assert items["experiments/0.19.2/m1-llama1b-mbs1"]["reason"].startswith("dry run: one megatron-core line")
    assert items["counters"]["status"] == "failed" and "GPM" in items["counters"]["reason"]   # a CPU has none
    # launch has --runner (issue 37); the dry run's carry holds no Megatron-LM checkout to run
    assert items["runner/megatron-lm"]["reason"] == "no Megatron-LM core_v0.16.1 checkout in the carry"
    assert items["doctor-train"]["reason"] == items["campaign"]["reason"] == "not chosen (--only)"
    assert "gpu-kit/items/doctor/doctor.json" in members and "gpu-kit/kit.log" in members
    profile = items["profile"]["runs"][0]
    stages = json.loads(members["gpu-kit/items/profile/kernels-stage.json"])
    assert sorted(row["pp_rank"] for row in stages) == [0, 1]                 # the dry run's profiled PP2 run
    assert len(json.loads(members["gpu-kit/items/profile/kernels-rank.json"])) == 2
    assert sorted(n for n in members if n.startswith(f"gpu-kit/runs/{profile}/traces/")) == [
        f"gpu-kit/runs/{profile}/traces/rank0000{r}-step000004.pt.trace.json" for r in (0, 1)]
    assert all(f"gpu-kit/runs/{run}/manifest.json" in members for i in items.values() for run in i["runs"])

    # imported back: each part's record, the kept runs whole (traces gzipped), no GPU run: no records
    code = importer.main([str(archive), "--into", str(into)])
    [folder] = [p for p in into.iterdir()]
    assert code == 0 and folder.name.startswith("cpu-dry-run-") and not list(into.glob("*.json"))
    summary = json.loads((folder / "import.json").read_text())
    assert summary["records_said"] == "no completed GPU run: no records"
    assert [i["name"] for i in summary["items"]] == list(items)
    assert [(i["status"], i["reason"]) for i in summary["items"]] == [(i["status"], i["reason"])
                                                                      for i in items.values()]
    kept = {k["run"] for k in summary["kept_whole"]}
    assert kept == {profile, items["sweep/mbs1"]["runs"][0]}
    for run in kept:
        original = {n.removeprefix(f"gpu-kit/runs/{run}/"): d for n, d in members.items()
                    if n.startswith(f"gpu-kit/runs/{run}/") and not n.endswith(".charllm-run")}
        imported = {str(p.relative_to(folder / "runs" / run)): p.read_bytes()
                    for p in (folder / "runs" / run).rglob("*") if p.is_file()}
        unzipped = {n.removesuffix(".gz"): gzip.decompress(d) if n.endswith(".gz") else d for n, d in imported.items()}
        assert unzipped == original
    assert (folder / "part1" / "results.json").read_bytes() == members["gpu-kit/results.json"]
    assert "| counters | 1 | failed |" in (folder / "results.md").read_text()

    # a second part resumes after the first (on a fresh machine: from its archive): what completed there
    # is not run again, and what does not fit in what is left of the budget is skipped for it
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), "--dry-run", "--work",
                           str(tmp_path / "work2"), "--out", str(out), "--part", "2", "--budget", "60",
                           "--only", "doctor,counters,campaign", "--resume", str(archive)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    second = json.loads(_members(out / "gpu-kit-p2.tar.gz")["gpu-kit/results.json"])
    reasons = {i["name"]: i["reason"] for i in second["items"]}
    assert reasons["doctor"] == "completed in an earlier part"
    assert reasons["counters"] == "needs the profile item's run, which did not complete here"
    assert reasons["campaign"].startswith("budget: needs about 90 s, ") and reasons["campaign"].endswith(" s left")
    assert importer.main([str(out / "gpu-kit-p1.tar.gz"), str(out / "gpu-kit-p2.tar.gz"), "--into", str(into),
                          "--name", "both"]) == 0
    both = json.loads((into / "both" / "import.json").read_text())
    assert both["parts"] == [1, 2] and [i["name"] for i in both["items"]].count("doctor") == 1


def test_a_real_gpu_run_round_trips_through_a_kit_archive(tmp_path):
    """The H200 run this repository keeps, packed as the kit packs a run and imported back: the run
    whole, and the record import_gpu_runs made of it when it was shipped."""
    k = _kit(tmp_path)
    import shutil

    shutil.copytree(REAL_RUN, k.runs / REAL_RUN.name)
    item = next(i for i in kit.ITEMS if i.name == "sweep/mbs1")
    row = k.run_row(item, REAL_RUN.name, keep=True)
    assert row["device"] == "cuda" and row["status"] == "completed" and row["megatron_core"] == "0.19.2"
    k.record.data["dry_run"] = False
    k.record.data["machine"] = {"gpu": "NVIDIA H200, 143771 MiB, 700.00 W, 1980 MHz, 580.159.04"}
    k.record.add({"name": item.name, "group": item.group, "status": "completed", "reason": "", "seconds": 30,
                  "runs": [REAL_RUN.name], "data": row})
    [archive] = k.pack()
    into = tmp_path / "gpu_runs"
    into.mkdir()
    assert importer.main([str(archive), "--into", str(into)]) == 0
    [record] = json.loads((into / "h200-2026-11-29.json").read_text())
    shipped = {r["run"]: r for r in json.loads(SHIPPED.read_text())}
    assert record == shipped[REAL_RUN.name]
    kept = into / "h200-2026-11-29" / "runs" / REAL_RUN.name
    assert {str(p.relative_to(kept)): p.read_bytes() for p in kept.rglob("*") if p.is_file()} == {
        str(p.relative_to(REAL_RUN)): p.read_bytes() for p in REAL_RUN.rglob("*")
        if p.is_file() and p.name != ".charllm-run"}   # test data is no run of ours: nothing writes its summaries


def test_telemetry_over_the_limit_is_thinned_and_said(tmp_path):
    import shutil

    import polars as pl

    run = tmp_path / "run"
    shutil.copytree(REAL_RUN, run)
    [chunk] = list((run / "telemetry").glob("*/*.parquet"))
    before = pl.read_parquet(chunk)
    limit = chunk.stat().st_size // 3
    every = -(-chunk.stat().st_size // limit)
    thinned = importer.thin_telemetry(run, limit=limit)
    after = pl.read_parquet(chunk)
    assert thinned["every"] == every and thinned["bytes_after"] < thinned["bytes_before"]
    for device in before["device"].unique():
        rows = before.filter(pl.col("device") == device)
        assert after.filter(pl.col("device") == device).equals(rows.gather_every(every)) and rows.height > every
    assert importer.thin_telemetry(run, limit=10 * 2**20) is None


def test_an_import_that_cannot_be_whole_writes_nothing(tmp_path, capsys):
    into = tmp_path / "gpu_runs"
    into.mkdir()
    bad = tmp_path / "gpu-kit-p1.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        data = b"{}"
        info = tarfile.TarInfo("elsewhere/results.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert importer.main([str(bad), "--into", str(into)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not the kit's archive ('elsewhere/results.json' is outside gpu-kit/)" in err
    assert list(into.iterdir()) == []
    bad.write_bytes(b"not gzip")
    assert importer.main([str(bad), "--into", str(into)]) == 2
    assert "not a readable tar.gz" in capsys.readouterr().err and list(into.iterdir()) == []


def test_a_step_past_its_items_end_is_interrupted_and_the_item_fails_saying_so(tmp_path, monkeypatch):
    """Also where the kit itself ignores SIGINT, as one started in the background by a script does: the
    step it stops still gets it (before, it waited out the 15 s grace and was killed)."""
    monkeypatch.setattr(kit, "CLEANUP_STEP_S", 1)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _interrupted_step(tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_step(tmp_path) -> None:
    k = _kit(tmp_path)
    item = kit.ITEMS[0]
    k.deadline, k.item_end = 2, time.monotonic() + 2
    started = time.monotonic()
    sleeper = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    done = k.command(item, sleeper, "sleep.txt", ok=None)
    assert done.returncode is None and 1.5 < time.monotonic() - started < 10   # SIGINT ends it at once
    assert (k.item_dir(item) / "sleep.txt").read_text() == "started\n"
    assert "KeyboardInterrupt" in (k.item_dir(item) / "sleep.txt.stderr").read_text()
    with pytest.raises(kit.Failed, match="stopped at its time limit"):
        k.command(item, sleeper, "again.txt")                   # past the end: the least a step gets, 1 s


def test_a_fresh_machine_is_told_what_to_skip_in_few_patterns():
    names = {i.name for i in kit.ITEMS if i.name.startswith(("doctor", "experiments/0.16.1/"))}
    names |= {"experiments/0.19.2/g-llama1b", "sweep/mbs1"}
    patterns = kit.covering(names)
    assert patterns == ["doctor", "doctor-train", "experiments/0.16.1", "experiments/0.19.2/g-llama1b", "sweep/mbs1"]
    assert {i.name for i, why in kit.chosen([], patterns, set()) if why} == names   # the --skip it prints
