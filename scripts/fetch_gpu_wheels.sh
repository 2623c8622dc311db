#!/usr/bin/env bash
# Download, on a machine with network, the wheels that `make gpu-check` installs on the GPU machine (which
# has none): the packages of scripts/gpu-wheels.txt, for CPython 3.12 on x86-64 Linux, into .whl/
# (git-ignored). Usage: bash scripts/fetch_gpu_wheels.sh [DEST]   (PYTHON=... picks the pip to use)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$dest"
grep -v '^\s*\(#\|$\)' scripts/gpu-wheels.txt | while read -r spec; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$dest" "$spec"
done
ls -l "$dest"/*.whl
