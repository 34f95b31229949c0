#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian 12 machine, then lint (ruff), type-check
# (mypy) and run all tests.
# Python packages come from pyproject.toml ([train,test] extras) and go into the project's virtualenv
# (.venv, or CHARLLM_VENV), never into the system Python: Debian's is externally managed (PEP 668). The
# venv is made with the python3 on PATH where it is missing (Debian's needs python3-venv for that), and
# an existing one is used as it is. The integration tests also need Debian packages (Slurm, munge,
# OpenSSH server, tmux), installed here when run as root.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(python3-venv slurm-wlm munge openssh-server tmux iproute2 procps)
missing=()
for d in "${debs[@]}"; do dpkg -s "$d" >/dev/null 2>&1 || missing+=("$d"); done
if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ]; then
        echo "tests/run.sh: installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "tests/run.sh: not root, cannot install ${missing[*]}; the tests that need them will be skipped"
    fi
fi

venv=$(realpath -m -- "${CHARLLM_VENV:-.venv}")
# (a venv whose pip does not run is one that `venv` could not finish: without ensurepip, say)
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "tests/run.sh: making the virtualenv $venv with $(command -v python3)"
    python3 -m venv --clear "$venv" || {
        echo "tests/run.sh: python3 -m venv failed; on Debian it needs python3-venv (as root: apt-get install python3-venv)"
        exit 1
    }
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[train,test]'
# From here `python3`, `charllm-tui` and what the tests start are the venv's.
export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
status=0
# Lint and type check first (their configuration is in pyproject.toml): a finding fails the run, as a
# failed test does, and the tests still run.
echo "tests/run.sh: ruff check ."
python3 -m ruff check . || status=$?
echo "tests/run.sh: mypy (engine, probes, tui)"
python3 -m mypy || status=$?
python3 -m pytest "$@" || status=$?

# The whole suite runs above on this Python (3.11: megatron-core 0.16.1). With no pytest arguments the
# workload and launch tests run again on Python 3.12 with the newest megatron-core the [train] extra
# allows, in their own virtualenv (CHARLLM_PY312_VENV). There is no CPU torch wheel for 3.12 here, so
# pip fetches the CUDA build (about 4.7 GB installed; measured 65 s). Skipped, with the reason, where
# no Python 3.12 is found, or with CHARLLM_SKIP_PY312=1.
# That CUDA build also runs the fake-CUDA lane (tests/engine/workload/test_fake_cuda.py: the CUDA path
# without a GPU), on both megatron-core lines: the venv's, then the one Python 3.11 gets, installed
# beside it without dependencies (it needs only numpy and packaging, which the venv has) and put first
# on the path. A second venv would download the CUDA build again for one package.
py312=
for candidate in python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
    # (a pyenv shim exists whether or not it can run 3.12 here: ask the interpreter itself)
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
        py312=$candidate
        break
    fi
done
if (($# == 0)) && [ -z "${CHARLLM_SKIP_PY312:-}" ]; then
    if [ -z "$py312" ]; then
        echo "tests/run.sh: no python3.12 found: skipping the workload and launch tests on Python 3.12"
    else
        venv=${CHARLLM_PY312_VENV:-.venv-py312}
        [ -x "$venv/bin/python" ] || "$py312" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[train,test]'
        echo "tests/run.sh: Python 3.12, megatron-core $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("megatron-core"))')"
        # (test_model_builder and test_memory: the HybridModel that 0.19 builds, checked against GPTModel
        # and the memory model's parameter count; on 3.11 those checks are skipped)
        "$venv/bin/python" -m pytest -p no:cacheprovider tests/engine/workload/test_workload.py tests/engine/launch/test_launch_local.py \
            tests/engine/workload/test_cpu_compat.py tests/engine/workload/test_model_builder.py \
            tests/engine/model/test_memory.py tests/engine/workload/test_fake_cuda.py || status=$?
        older=$(grep -o "megatron-core==[0-9.]*" pyproject.toml | head -1)   # the Python 3.11 line
        overlay="$venv-${older/==/-}"
        [ -d "$overlay/megatron" ] || "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
            --target "$overlay" "$older"
        echo "tests/run.sh: Python 3.12, $(PYTHONPATH="$overlay" "$venv/bin/python" -c \
            'from importlib.metadata import version; print("megatron-core", version("megatron-core"))'): the fake-CUDA lane"
        PYTHONPATH="$overlay" "$venv/bin/python" -m pytest -p no:cacheprovider tests/engine/workload/test_fake_cuda.py \
            || status=$?
    fi
fi
exit "$status"
