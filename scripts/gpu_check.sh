#!/usr/bin/env bash
# `make gpu-check`: every CUDA check and benchmark of lioncub, in one command, in under 6 minutes.
#   bash scripts/gpu_check.sh [OUTDIR] [--size full|tiny] [--only STEP,...]
# Runs in the machine's existing Python (the first of $PYTHON, .venv/bin/python, python3, python that imports
# torch); installs lioncub into it without the network, plus the wheels in .whl/ (scripts/fetch_gpu_wheels.sh).
# Everything else is scripts/gpu_check.py: see its docstring and scripts/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu-check}
[ $# -gt 0 ] && shift
py=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then py=$c; break; fi
done
mkdir -p "$out"
if [ -z "$py" ]; then
  echo "gpu-check: no Python with torch found (tried \$PYTHON, .venv/bin/python, python3, python)" | tee "$out/summary.txt" >&2
  exit 2
fi
exec "$py" scripts/gpu_check.py "$out" "$@"
