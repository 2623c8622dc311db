#!/usr/bin/env bash
# The convergence map's larger-model regimes on one GPU: char-small and char-medium at the map's base regime
# (4 ranks, batch 16 x 64 per rank, the tuned lr, 200 steps), seeds 0-3, the five configurations of the
# held-out parts; every rank of a run on the one GPU (Gloo). Four grids at once (model x seed pair), each
# seed by seed, so a deadline cuts whole seeds. Parts resume: rerun with the same OUTDIR to finish.
#   bash scripts/gpu_map.sh OUTDIR [DEADLINE_S]     (DEVICE=cpu MODELS=char-tiny STEPS=3: a rehearsal)
# CONFIGS, LR_FACTORS (of the tuned lr) and MODELS override the grid; SKIP_INSTALL=1 when lioncub is installed
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_map.sh OUTDIR [DEADLINE_S]}
deadline=$(( $(date +%s) + ${2:-420} ))
device=${DEVICE:-cuda}
models=${MODELS:-char-medium char-small}
steps=${STEPS:-200}
configs=${CONFIGS:-allreduce,vote-1bit,vote-pbit,l1-pbit,vote-1bit@adaptive}
lr_factors=${LR_FACTORS:-1}
mkdir -p "$out"
py=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then py=$c; break; fi
done
[ -n "$py" ] || { echo "gpu_map: no Python with torch found" | tee "$out/summary.txt" >&2; exit 2; }
if [ "$device" != cpu ] && [ -z "${SKIP_INSTALL:-}" ]; then  # lioncub and its pure-Python dependencies, offline (make gpu-check's install step)
  "$py" -m lioncub.gpu_check "$out/install" --only env,install > "$out/install.log" 2>&1 \
    || echo "gpu_map: the install step reported a failure (install.log); going on" >&2
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "$py" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0]); import triton; print('triton', triton.__version__)" 2>&1
  nproc; } > "$out/env.txt"
grid() {  # model, output, seeds...: one grid, seed by seed, until the deadline
  local model=$1 part=$2; shift 2
  for s in "$@"; do
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 5 ] || { echo "deadline: seed $s not started"; return 0; }
    OMP_NUM_THREADS=1 timeout "$left" "$py" -m lioncub.cli bench convergence --grid --model "$model" --steps "$steps" \
      --device "$device" --worlds 4 --batches 16 --lr-factors "$lr_factors" --seeds "$s" --configs "$configs" --output "$part"
    echo "seed $s rc $?"
  done
}
pids=()
for m in $models; do
  grid "$m" "$out/$m-s01.json" 0 1 > "$out/$m-s01.log" 2>&1 &
  pids+=($!)
  grid "$m" "$out/$m-s23.json" 2 3 > "$out/$m-s23.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
for m in $models; do
  "$py" -m lioncub.cli bench convergence --merge "$out/$m"-s*.json --output "$out/$m-map.json" > "$out/$m-map.txt" 2>&1
  "$py" -m lioncub.autotune.risk_rule check "$out/$m-map.json" --check-output "$out/$m-check.json" >> "$out/$m-map.txt" 2>&1
done
tail -n 40 "$out"/*-map.txt | tee "$out/summary.txt"
