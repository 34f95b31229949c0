"""Build the GPU acceptance kit's carry: what the GPU machine lacks, in .gpu/carry/ (git-ignored).

    python benchmarks/gpu/carry.py [--megatron-lm DIR] [--no-hta]

The lent GPU machine has Python 3.12, a CUDA build of torch and the packages its image lists
(ON_THE_GPU_IMAGE below), and no network. The carry brings the rest as Python 3.12 wheels: the
project's base dependencies it lacks, megatron-core for both lines, Holistic Trace Analysis (to read
the profiler traces there with a client we did not write), and a Megatron-LM checkout per line for
`launch --runner megatron-lm`. Everything that travels, the working tree included, must stay under
the device tool's 64 MiB: the wheels are stored uncompressed in one xz archive (polars' runtime is
51 MiB as a wheel, 30 MiB this way). Downloads are kept in .gpu/downloads/ (not carried) for the next build.

The checkout itself travels as the working tree; benchmarks/gpu/kit.py links it in as `charllm`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit  # the kit's own layout: where the carry goes and what it holds

LIMIT_BYTES = 64 * 2**20          # what travels: tracked and untracked-not-ignored files plus the carry
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
# The lent GPU image's packages that the project needs (KINDS.md's list of the 'cuda' image, 2026-11-17).
ON_THE_GPU_IMAGE = {"numpy", "psutil", "nvidia-ml-py", "pyyaml", "pyarrow", "torch", "packaging", "pandas",
                    "networkx", "pytest", "pyparsing", "narwhals", "typing-extensions", "pygments", "six", "regex"}
# pyproject.toml's base dependencies the image lacks, and theirs, pinned as this project is tested.
COMMON = ("textual==8.2.8", "textual-plotext==1.0.1", "plotext==5.3.2", "polars==2.1.0", "polars-runtime-32==2.1.0",
          "rich==15.0.0", "markdown-it-py==4.0.0", "mdit-py-plugins==0.7.0", "linkify-it-py==2.2.0",
          "uc-micro-py==1.0.3", "mdurl==0.1.2", "platformdirs==4.14.8", "tomli-w==1.2.0", "amdsmi==7.0.2",
          # Megatron-LM's training package (the megatron-lm runner) imports pydantic
          "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2")
HTA = ("holistictraceanalysis==0.5.0", "plotly==7.1.0", "pydot==4.0.1")   # pandas, networkx: on the image
# What a Megatron-LM checkout needs to train (pretrain_gpt.py and the packages it imports), per tag.
MEGATRON_LM_PATHS = ("megatron", "pretrain_gpt.py", "gpt_builders.py", "hybrid_builders.py", "model_provider.py",
                     "LICENSE")


def wheel_sets(hta: bool) -> dict[str, tuple[str, ...]]:
    lines = {f"megatron-core-{line}": (f"megatron-core=={line}",) for line in kit.MEGATRON_CORE_LINES}
    sets = {"common": COMMON, **lines}
    if hta:
        sets["hta"] = HTA
    return sets


def download(spec: str, cache: Path) -> Path:
    """The Python 3.12 x86-64 wheel of `spec` (name==version), from the cache or the index."""
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_').lower()}-{version}-"
    found = [p for p in cache.glob("*.whl") if p.name.lower().startswith(stem)]
    if not found:
        platforms = [arg for p in (*PLATFORMS, "any") for arg in ("--platform", p)]
        argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(cache), spec]
        done = subprocess.run(argv, capture_output=True, text=True)
        found = [p for p in cache.glob("*.whl") if p.name.lower().startswith(stem)]
        if done.returncode or not found:
            said = (done.stderr.strip().splitlines() or ["?"])[-1]
            raise SystemExit(f"carry: no Python 3.12 wheel of {spec}: {said}")
    return found[0]


def stored(wheel: Path) -> bytes:
    """The wheel rewritten with its members stored, not deflated, so that xz compresses what they hold
    (a wheel is a zip; pip installs either kind, and RECORD's hashes are of the members, unchanged)."""
    out = io.BytesIO()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out.getvalue()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def add_megatron_lm(tar: tarfile.TarFile, checkout: Path, tag: str) -> int:
    """`git archive` of the tag's training code into megatron-lm/<tag>/; its size."""
    argv = ["git", "-C", str(checkout), "archive", "--format=tar", f"--prefix=megatron-lm/{tag}/", tag, "--",
            *MEGATRON_LM_PATHS]
    present = subprocess.run(["git", "-C", str(checkout), "ls-tree", "--name-only", tag], capture_output=True,
                             text=True)
    if present.returncode:
        raise SystemExit(f"carry: {checkout} has no tag {tag}: {present.stderr.strip()}")
    names = set(present.stdout.split())
    argv = argv[:-len(MEGATRON_LM_PATHS)] + [p for p in MEGATRON_LM_PATHS if p in names]
    data = subprocess.run(argv, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as src:
        for member in src.getmembers():
            tar.addfile(member, src.extractfile(member) if member.isfile() else None)
    return len(data)


def travelling_bytes(root: Path, carry: Path) -> dict[str, int]:
    """What the device tool sends: the files git does not ignore (tracked or not), and the carry."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((root / os.fsdecode(p)).stat().st_size for p in listed if p and (root / os.fsdecode(p)).is_file())
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    return {"working_tree_bytes": tree, "carry_bytes": carried, "total_bytes": tree + carried}


def build(carry: Path, cache: Path, *, hta: bool, megatron_lm: Path | None, preset: int = 9) -> dict:
    carry.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    record: dict = {"wheels": {}, "megatron_lm": {}}
    tmp = carry / f".{kit.CARRY_ARCHIVE}"
    with lzma.open(tmp, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, specs in wheel_sets(hta).items():
            for spec in specs:
                wheel = download(spec, cache)
                add_bytes(tar, f"wheels/{name}/{wheel.name}", stored(wheel))
                record["wheels"].setdefault(name, []).append(
                    {"wheel": wheel.name, "bytes": wheel.stat().st_size,
                     "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()})
                print(f"carry: {name}: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)", flush=True)
        if megatron_lm:
            for line, tag in kit.MEGATRON_LM_TAGS.items():
                record["megatron_lm"][tag] = add_megatron_lm(tar, megatron_lm, tag)
                print(f"carry: Megatron-LM {tag} for megatron-core {line}", flush=True)
    tmp.replace(carry / kit.CARRY_ARCHIVE)
    commit = subprocess.run(["git", "-C", str(kit.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    record.update(commit=commit.stdout.strip(), archive_bytes=(carry / kit.CARRY_ARCHIVE).stat().st_size)
    (carry / kit.CARRY_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, default=os.environ.get("CHARLLM_MEGATRON_LM") or None,
                        help="a git clone or mirror of NVIDIA/Megatron-LM (default $CHARLLM_MEGATRON_LM; "
                             "none: left out)")
    parser.add_argument("--no-hta", action="store_true", help="leave Holistic Trace Analysis out")
    parser.add_argument("--check", action="store_true", help="only measure what would travel")
    args = parser.parse_args(argv)
    if not args.check:
        build(kit.CARRY, kit.CARRY.parent / "downloads", hta=not args.no_hta, megatron_lm=args.megatron_lm)
    sizes = travelling_bytes(kit.ROOT, kit.CARRY)
    print("carry: " + ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / 2**20:.1f} MiB"
                                for k, v in sizes.items()) + f" (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if sizes["total_bytes"] >= LIMIT_BYTES:
        print("carry: over the limit: the device tool would refuse it (--no-hta leaves the largest optional part out)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
