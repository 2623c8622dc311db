#!/usr/bin/env bash
# Convergence-map regimes on the device machine: by default char-small and char-medium at the map's base regime
# (4 ranks, batch 16 x 64 per rank, the tuned lr, 200 steps), seeds 0-3, the five configurations of the
# held-out parts; every rank of a run on the one GPU (Gloo). One grid per model x regime x seed stream, all at
# once, each seed by seed, so a deadline cuts whole seeds. Parts resume: rerun with the same OUTDIR to finish.
#   bash research/gpu/gpu_map.sh OUTDIR [DEADLINE_S]     (DEVICE=cpu MODELS=char-tiny STEPS=3: a rehearsal)
# MODELS, REGIMES (N<ranks>-b<batch per rank>-x<lr / tuned lr>, space-separated), SEED_STREAMS (e.g. "0,1 2,3"),
# CONFIGS and DEVICE (cpu: the machine's cores, a rank a core) override the grid; BASE_LR the lr the x factors
# multiply (default the model's default lr), TUNED_LR the lr the rule reads the regimes against, GRID_ARGS more
# options of `python -m research bench convergence-map` (e.g. "--amp bf16 --eval-batches 16"); SKIP_INSTALL=1 when lioncub
# is installed (the install step runs only where nvidia-smi is). A seed's runs start only while the deadline is
# ahead, and a run is not started when one of its kind in the same part took longer than what is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: gpu_map.sh OUTDIR [DEADLINE_S]}
deadline=$(( $(date +%s) + ${2:-420} ))
device=${DEVICE:-cuda}
models=${MODELS:-char-medium char-small}
steps=${STEPS:-200}
configs=${CONFIGS:-allreduce,vote-1bit,vote-pbit,l1-pbit,vote-1bit@adaptive}
regimes=${REGIMES:-N4-b16-x${LR_FACTORS:-1}}
streams=${SEED_STREAMS:-0,1 2,3}
mkdir -p "$out"
py=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then py=$c; break; fi
done
[ -n "$py" ] || { echo "gpu_map: no Python with torch found" | tee "$out/summary.txt" >&2; exit 2; }
if [ -z "${SKIP_INSTALL:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then  # lioncub and its pure-Python dependencies, offline (make gpu-check's install step)
  "$py" scripts/gpu_check.py "$out/install" --only env,install > "$out/install.log" 2>&1 \
    || echo "gpu_map: the install step reported a failure (install.log); going on" >&2
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "$py" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0]); import triton; print('triton', triton.__version__)" 2>&1
  nproc; } > "$out/env.txt"
grid() {  # model, regime, output, seeds...: one grid, seed by seed, until the deadline
  local model=$1 regime=$2 part=$3; shift 3
  [[ $regime =~ ^N([0-9]+)-b([0-9]+)-x([0-9.,]+)$ ]] || { echo "gpu_map: bad regime $regime (N4-b16-x1)"; return 2; }
  for s in "$@"; do
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 5 ] || { echo "deadline: seed $s not started"; return 0; }
    OMP_NUM_THREADS=1 timeout "$left" "$py" -m research bench convergence-map --model "$model" --steps "$steps" \
      --device "$device" --worlds "${BASH_REMATCH[1]}" --batches "${BASH_REMATCH[2]}" --lr-factors "${BASH_REMATCH[3]}" \
      --seeds "$s" --configs "$configs" --output "$part" --deadline "$deadline" ${BASE_LR:+--lr "$BASE_LR"} \
      ${GRID_ARGS:-}
    echo "seed $s rc $?"
  done
}
pids=()
for m in $models; do
  for r in $regimes; do
    for st in $streams; do
      tag="$m-$r-s${st//,/}"
      grid "$m" "$r" "$out/$tag.json" ${st//,/ } > "$out/$tag.log" 2>&1 &
      pids+=($!)
    done
  done
done
wait "${pids[@]}"
for m in $models; do
  if ! compgen -G "$out/$m-N*-s*.json" > /dev/null; then
    echo "$m: no run finished yet (each seed's log says why)" > "$out/$m-map.txt"; continue
  fi
  "$py" -m research bench convergence-map --merge "$out/$m"-N*-s*.json --output "$out/$m-map.json" > "$out/$m-map.txt" 2>&1
  "$py" -m research risk check "$out/$m-map.json" --check-output "$out/$m-check.json" \
    ${TUNED_LR:+--tuned-lr "$TUNED_LR"} >> "$out/$m-map.txt" 2>&1
done
tail -n 40 "$out"/*-map.txt | tee "$out/summary.txt"
