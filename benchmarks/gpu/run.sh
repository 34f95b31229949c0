#!/usr/bin/env bash
# The GPU acceptance kit, from the project root of any checkout: on the GPU machine with .gpu/carry/
# beside it (benchmarks/gpu/carry.py builds it), or with --dry-run on this CPU. What it runs, the
# budget and the archive: benchmarks/gpu/kit.py; how to run it within the device tool's limits: the
# README's "The GPU acceptance kit".
#   bash benchmarks/gpu/run.sh --part 1 --budget 540
#   bash benchmarks/gpu/run.sh --dry-run --out DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu/kit.py "$@"
