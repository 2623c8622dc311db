"""`lioncub autotune`: search method, collective layout, bucket size and momentum-sync schedule for a cluster.

    lioncub autotune --model gpt2-124m --preset 10gbe-4x8
    lioncub autotune --params 1.3B --compute-seconds 0.3 --ranks 64 --gpus-per-node 8 --bandwidth 10Gbit \
        --latency 50us --max-risk low --output tuned.json
    lioncub autotune --model char-small --preset lab-100mbit-4x1 --pilot 60 --output tuned.json

Every configuration's step time comes from the simulator (`lioncub.simulator.simulate_step`), with one
`Cache` shared by the whole search, so each distinct collective (op, algorithm, size) is simulated once.
The search itself imports no torch; only `--pilot` (it trains), `--here` and `--model-fn` (they read the devices
and time the model) do.

The search space
----------------
* method: every method of `lioncub.methods` (`lioncub.methods.NAMES`);
* l1-pbit levels: the default `127 // N`, and (for N > 4) for each wider p-bit field the most levels that
  fit in it (up to 4 more bits, at most 127): more levels cost bytes and lower the quantization risk;
* bucket size (MiB of fp32 gradients): 4, 25, 100 (sizes that give the same buckets are one candidate);
* collective layout, for the compressed methods: `flat` (every rank votes in the method's collectives)
  and, with several GPUs per node, LionCub's `hierarchical` layout (`LionCub(hierarchical=True,
  node_size=G)`: reduce-scatter of the gradients inside the node, the method's collectives across nodes
  on each rank's shard with N/G voters, all-gather of the agreed codes inside); the faster wins and the
  config says which. Separately, each collective's algorithm is the backend's own choice among those it
  implements, per collective and message size, as NCCL's tuner or Gloo does;
* momentum sync: none, every:K (K = 1, 2, 4, ..., 1024, below the planned run length), first:K:M
  (every K steps during the first tenth of the run) and geometric:K (interval doubles every K syncs).
  every:K is simulated as such; first/geometric cost the no-sync step plus their sync rate over the
  planned run times the simulated cost of one sync (the simulator's own amortization, made exact).

The machine at hand: `measure_here(model, batch, loss_fn)` times the user's forward + backward and reads the
devices and backend (`lioncub autotune --model-fn module:function --here`; here.py). Each configuration's bytes
per step are split into those that stay inside the node and those that leave it (`node_split`).

The convergence risk rule (see `risk`) and the pilot ranking (see `run_pilots`) are documented where they
are defined and in docs/autotune.md; `recommend` picks from the search and `pilot_verdict` lets a pilot
overrule that pick.
"""

from .cli import format_pilot, format_table, register, run
from .clusters import CLUSTER_PRESETS, make_cluster
from .config import NCCL_ALGO, build_config, collective_section, search_info, write_config
from .here import Devices, Here, load_model_fn, measure_here, read_devices
from .models import (
    BUILTIN,
    DEFAULT_GPU,
    DEFAULT_TOKENS,
    GPUS,
    PRESETS,
    UTILIZATION,
    ModelSpec,
    builtin_params,
    model_spec,
)
from .pilot import (
    PILOT_RUNNERS,
    TARGET_AT,
    pilot_candidates,
    pilot_node_size,
    pilot_to_dict,
    pilot_verdict,
    run_pilots,
    smoothed,
)
from .risk_rule import MEASURED_AT, RISK_LEVELS, RISK_RULE, level_of, parse_max_risk, risk, unsynced_share
from .risk_rule import _sync_steps as _sync_steps  # the tests check it against the schedules
from .space import (
    BASELINE_BUCKET_MB,
    DEFAULT_BUCKETS_MB,
    EVERY_KS,
    GEOMETRIC_KS,
    MAX_LEVELS,
    Candidate,
    SearchResult,
    default_schedules,
    l1_levels_candidates,
    node_split,
    normalize_schedule,
    recommend,
    search,
)

__all__ = ["BASELINE_BUCKET_MB", "BUILTIN", "CLUSTER_PRESETS", "DEFAULT_BUCKETS_MB", "DEFAULT_GPU",
           "DEFAULT_TOKENS", "EVERY_KS", "GEOMETRIC_KS", "GPUS", "MAX_LEVELS", "MEASURED_AT", "NCCL_ALGO",
           "PILOT_RUNNERS", "PRESETS", "RISK_LEVELS", "RISK_RULE", "TARGET_AT", "UTILIZATION", "Candidate", "Devices",
           "Here", "ModelSpec", "SearchResult", "build_config", "builtin_params", "collective_section",
           "default_schedules", "format_pilot", "format_table", "l1_levels_candidates", "level_of", "load_model_fn",
           "make_cluster", "measure_here", "model_spec", "node_split", "normalize_schedule", "parse_max_risk",
           "pilot_candidates", "pilot_node_size", "pilot_to_dict", "pilot_verdict", "read_devices", "recommend",
           "register", "risk", "run", "run_pilots", "search", "search_info", "smoothed", "unsynced_share",
           "write_config"]
