#!/usr/bin/env bash
# Issue 30's evidence on the device machine, in one command that resumes across loans:
#   1. the python-src token files carried from the CPU machine, checked against the committed manifest;
#   2. the lr sweep of each model in SWEEP_MODELS (allreduce, 4 ranks sharing the GPU, batch 16, SWEEP_STEPS steps,
#      0.5x, 1x and 2x its placeholder lr, seeds 0 and 1, doubled past the top while the pick is there, at most
#      SWEEP_EXTEND (2) times) and its pick (research/lr_sweep.py: the
#      lowest mean final eval loss; made only once every lr has both seeds);
#   3. the pre-registered convergence map: set SET of PREREG (its regimes, allreduce, its configurations and the
#      prescribed dense warm-up, its seeds, steps and set-up), at x times the sweep's pick, seed by seed, each regime
#      a grid of its own (research/gpu/gpu_map.sh), until the deadline;
#   4. the report per level (`python -m research risk report`): calls, complete, share within 2%, base rate, seeds' SE.
# Each model's sweep and map run one after the other; the models run at once. Everything is written under OUTDIR,
# and what is there is resumed: give the directory that holds the previous loans' results.
#   bash research/gpu/gpu_evidence.sh OUTDIR [DEADLINE_S]
# Knobs: SWEEP_MODELS ("byte-30m byte-gpt2-small"), SWEEP_STEPS (300), SWEEP_FACTORS (0.5,1,2), SWEEP_SEEDS (0,1),
# PREREG (research/notebook/results/issue30/risk-rule-preregistered.json), SET (gpu), MAP_STEPS (the set's), MAP_REGIMES (the
# set's, space-separated), DEVICE (cuda; cpu rehearses), CORPUS_EXPECT (the manifest the token files must match;
# "none" skips the check: a rehearsal on another machine), SKIP_INSTALL=1, PYTHON, LIONCUB_CACHE (default
# ./.cache: the carried .cache/corpus).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: gpu_evidence.sh OUTDIR [DEADLINE_S]}
deadline=$(( $(date +%s) + ${2:-480} ))
device=${DEVICE:-cuda}
prereg=${PREREG:-research/notebook/results/issue30/risk-rule-preregistered.json}
set_name=${SET:-gpu}
sweep_models=${SWEEP_MODELS-byte-30m byte-gpt2-small}
sweep_steps=${SWEEP_STEPS:-300}
sweep_factors=${SWEEP_FACTORS:-0.5,1,2}
sweep_seeds=${SWEEP_SEEDS:-0,1}
corpus_expect=${CORPUS_EXPECT:-research/notebook/results/python-src-corpus/manifest.json}
export LIONCUB_CACHE=${LIONCUB_CACHE:-$PWD/.cache}
mkdir -p "$out/sweep" "$out/map"
say() { echo "gpu_evidence: $*" | tee -a "$out/summary.txt" >&2; }
: > "$out/summary.txt"
py=""
for c in "${PYTHON:-}" .venv/bin/python python3 python; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then py=$c; break; fi
done
[ -n "$py" ] || { say "no Python with torch found"; exit 2; }
stamp=$(date -u +%Y%m%dT%H%M%SZ)
if [ -z "${SKIP_INSTALL:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then  # make gpu-check's install step
  "$py" scripts/gpu_check.py "$out/install-$stamp" --only env,install > "$out/install-$stamp.log" 2>&1 \
    || say "the install step reported a failure (install-$stamp.log); going on"
fi
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  "$py" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  nproc; } > "$out/env-$stamp.txt" 2>&1

# 1. the corpus: the token files built on the CPU machine and carried, never rebuilt from this machine's Python
if [ "$corpus_expect" != none ]; then
  "$py" -m research corpus check --expect "$corpus_expect" > "$out/corpus-$stamp.txt" 2>&1 || {
    say "the python-src token files are missing or not the committed ones ($(tail -n 1 "$out/corpus-$stamp.txt")):"
    say "carry .cache/corpus (run(..., carry=[\".cache/corpus\", \".whl\"]); built by LIONCUB_CACHE=.cache python -m research corpus build)"
    exit 2; }
fi

field() {  # a field of the pre-registration's set: regimes | configs | seeds | steps | model | setup
  "$py" - "$prereg" "$set_name" "$1" <<'PY'
import json, sys
from research.risk import preregister
p = json.load(open(sys.argv[1]))
s = next(x for x in p["sets"] if x["name"] == sys.argv[2])
what = sys.argv[3]
if what == "configs":
    print(",".join(preregister.run_configs(p, s["name"])))
elif what == "seeds":
    print(",".join(map(str, s["seeds"])))
elif what == "regimes":
    print(" ".join(s["regimes"]))
elif what == "setup":
    print(" ".join(f"--{k.replace('_', '-')} {v}" for k, v in s["setup"].items()))
else:
    print(s[what])
PY
}
left() { echo $(( deadline - $(date +%s) )); }

sweep() {  # model: its sweep until complete, then its pick in sweep/MODEL/lr.json; a pick at the sweep's top edge
  # extends it by one doubling (at most SWEEP_EXTEND times; the extensions are kept in sweep/MODEL/extend)
  local m=$1 d="$out/sweep/$1" regimes factors lrs top
  mkdir -p "$d"
  while ! [ -s "$d/lr.json" ] && [ "$(left)" -gt 30 ]; do
    regimes="N4-b16-x$sweep_factors"; factors=$sweep_factors
    for f in $(cat "$d/extend" 2>/dev/null); do regimes+=" N4-b16-x$f"; factors+=",$f"; done
    SKIP_INSTALL=1 PYTHON="$py" DEVICE="$device" MODELS="$m" CONFIGS=allreduce REGIMES="$regimes" \
      SEED_STREAMS="${sweep_seeds//,/ }" STEPS="$sweep_steps" GRID_ARGS="--amp bf16 --eval-batches 16" \
      bash research/gpu/gpu_map.sh "$d" "$(left)" >> "$d/gpu_map-$stamp.log" 2>&1
    lrs=$("$py" -c "from research.convergence_map import regimes
from lioncub.apps.tuned_lr import DEFAULT_LR
print(','.join(repr(r['lr']) for r in regimes(lr_factors=[$factors], lr=DEFAULT_LR['$m'])))")
    "$py" -m research.lr_sweep "$d/$m-map.json" --seeds "$sweep_seeds" --lrs "$lrs" \
      --output "$d/lr.json" > "$d/pick.txt" 2>&1 || return 0
    top=$("$py" -c "import json; p = json.load(open('$d/lr.json')); print(int(p['at_edge'] and p['lr'] == max(r['lr'] for r in p['table'])))")
    if [ "$top" = 1 ] && [ "$(wc -w < "$d/extend" 2>/dev/null || echo 0)" -lt "${SWEEP_EXTEND:-2}" ]; then
      mv "$d/lr.json" "$d/lr-edge-$(wc -w < "$d/extend" 2>/dev/null || echo 0).json"
      "$py" -c "print(max(float(x) for x in '$factors'.split(',')) * 2)" >> "$d/extend"
    fi
  done
}

map_set() {  # the pre-registered set at the sweep's pick of its model (or the model's default, if not swept)
  local m lr steps
  m=$(field model); steps=${MAP_STEPS:-$(field steps)}
  if [[ " $sweep_models " == *" $m "* ]]; then
    [ -s "$out/sweep/$m/lr.json" ] || { say "$m: no lr yet (its sweep is not complete): the map waits"; return 0; }
    lr=$("$py" -c "import json; print(json.load(open('$out/sweep/$m/lr.json'))['lr'])")
  else
    lr=$("$py" -c "from lioncub.apps.tuned_lr import DEFAULT_LR; print(DEFAULT_LR['$m'])")
  fi
  [ "$(left)" -gt 30 ] || { say "$m: no time left for the map"; return 0; }
  SKIP_INSTALL=1 PYTHON="$py" DEVICE="$device" MODELS="$m" CONFIGS="$(field configs)" \
    REGIMES="${MAP_REGIMES:-$(field regimes)}" SEED_STREAMS="$(field seeds)" STEPS="$steps" BASE_LR="$lr" \
    TUNED_LR="$lr" GRID_ARGS="$(field setup)" bash research/gpu/gpu_map.sh "$out/map" "$(left)" \
    > "$out/map/gpu_map-$stamp.log" 2>&1
  "$py" -m research risk report "$prereg" "$out/map/$m-map.json" --tuned "$m=$lr" \
    --output "$out/report.json" > "$out/report.md" 2>&1 || say "the report failed: see report.md"
}

map_model=$(field model) || { say "no set $set_name in $prereg"; exit 2; }
pids=()
for m in $sweep_models; do
  if [ "$m" = "$map_model" ]; then (sweep "$m"; map_set) & else sweep "$m" & fi
  pids+=($!)
done
[[ " $sweep_models " == *" $map_model "* ]] || { map_set & pids+=($!); }
wait "${pids[@]}"
for m in $sweep_models; do
  say "sweep $m: $(tail -n 1 "$out/sweep/$m/pick.txt" 2>/dev/null || echo 'not run')"
done
say "map: $(cat "$out"/map/*-N*-s*.json 2>/dev/null | grep -c '"final_loss"') runs recorded; report: $out/report.md"
[ -s "$out/report.md" ] && head -n 12 "$out/report.md" | tee -a "$out/summary.txt"
exit 0
