#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian 12 machine, then run all tests.
# Python packages come from pyproject.toml ([train,test] extras); the integration tests also need
# Debian packages (Slurm, munge, OpenSSH server, tmux), installed here when run as root.
# Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(slurm-wlm munge openssh-server tmux iproute2 procps)
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

python3 -m pip install -q --disable-pip-version-check -e '.[train,test]'
exec python3 -m pytest "$@"
