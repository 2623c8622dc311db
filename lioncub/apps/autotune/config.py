"""The config file: the recommended configuration as JSON for LionCub and `lioncub train --config`."""

from __future__ import annotations

import json
import math

from lioncub import methods
from lioncub.simulator import Cluster
from lioncub.simulator.profiles import BackendProfile

from .models import ModelSpec
from .risk_rule import RISK_RULE, dense_warmup_for
from .space import BASELINE_BUCKET_MB, Candidate, SearchResult

NCCL_ALGO = {"ring": "Ring", "binomial-tree": "Tree"}


def collective_section(c: Candidate, backend: str) -> dict:
    """The collective choices behind the prediction, and what (if anything) to set to get them."""
    bulk, control = set(), set()  # allreduce algorithms of the gradient/vote/sync allreduces; of the control
    for x in c.collectives:
        algs = set()  # x["algorithm"]: "alg" or "op:alg+op:alg" (a composite's collectives)
        for part in x["algorithm"].split("+"):
            op, _, alg = part.rpartition(":")
            if op in ("allreduce", ""):
                algs.add(alg)
        if x["what"] == "control allreduce":
            control |= algs
        elif _bulk_allreduce(x["what"]):
            bulk |= algs
    sec = {"layout": c.layout, "hierarchical": c.layout == "hierarchical", "algorithms": c.algorithms,
           "collectives": c.collectives, "env": {}, "notes": []}
    if c.layout == "hierarchical":
        sec["notes"].append("LionCub's hierarchical layout (optimizer/train keys hierarchical, node_size): inside "
                            "each node a reduce-scatter of the gradients and an all-gather of the agreed codes, "
                            "the method's collectives across nodes on each rank's shard")
    if c.layout == "sharded":
        sec["notes"].append(f"the model sharded by FSDP2 inside each node (train method hsdp+..., node_size; in "
                            f"code: fully_shard each block and the model on mesh['shard'] of a (nodes, G) mesh, then "
                            f"lioncub.attach_fsdp(model, opt, mesh)): {c.memory_fraction:.3f} of the parameters', "
                            f"gradients' and momenta's memory per rank")
    if backend == "nccl" and bulk:
        both = bulk | control
        if len(both) == 1 and next(iter(both)) in NCCL_ALGO:
            alg = next(iter(both))
            sec["env"]["NCCL_ALGO"] = NCCL_ALGO[alg]
            sec["notes"].append(f"every allreduce of this step uses {alg}; NCCL_ALGO pins it (NCCL's tuner "
                                "usually picks it by itself)")
        else:
            sec["notes"].append(f"the prediction uses {'/'.join(sorted(bulk))} for the bulk allreduces"
                                + (f" and {'/'.join(sorted(control))} for the small control allreduce" if control
                                   else "") + ", chosen per message size as NCCL's tuner does: leave NCCL_ALGO unset")
    elif backend == "gloo":
        sec["notes"].append("torch's Gloo backend picks its algorithms itself (not selectable); the prediction "
                            "assumes the fastest of those the profile lists")
    return sec


def _bulk_allreduce(what: str) -> bool:
    """Whether the collectives a step tallies as `what` are bulk all-reduces: a method's whose exchange is an
    all-reduce (the dense method's gradients, a p-bit method's fields), or the momentum sync's."""
    if what in methods.REGISTRY:
        codec = methods.get(what).codec
        return codec is None or codec.kind == "fields"
    return what == "momentum-sync"


def build_config(c: Candidate, result: SearchResult, model: ModelSpec, cluster: Cluster, cluster_desc: str,
                 profile: BackendProfile, verdict: str, *, steps: int, lr: float | None = None,
                 calibration: str | None = None, backend: str | None = None, lion: dict | None = None,
                 here: dict | None = None) -> dict:
    """The JSON config: `LionCub(params, **cfg["optimizer"])` and `lioncub train --config FILE` accept it.

    `lion`: Lion's lr and weight decay and their basis (given, converted from AdamW's, a built-in's default): in
    the `lion` section and the train section (the optimizer section leaves them to the caller's
    `LionCub(params, lr=cfg["lion"]["lr"], ...)`). `here`: the devices read and the compute measured."""
    opt = {"method": c.method, "bucket_mb": c.bucket_mb,
           "momentum_sync": None if c.momentum_sync == "none" or c.dense else c.momentum_sync}
    train = {"method": c.method, "momentum_sync": "none" if c.dense else c.momentum_sync, "bucket_mb": c.bucket_mb}
    if c.levels is not None:
        opt["levels"] = train["levels"] = c.levels
    if c.layout == "hierarchical":
        opt["hierarchical"] = train["hierarchical"] = True
        opt["node_size"] = train["node_size"] = cluster.gpus_per_node
    if c.layout == "sharded":  # (LionCub takes its buckets from FSDP's units there: no bucket_mb)
        train.update(method=f"hsdp+{c.method}", node_size=cluster.gpus_per_node)
        del opt["bucket_mb"], train["bucket_mb"]
    if c.local_steps:  # (LionCub's default outer optimizer, avg, is the one measured; no dense warm-up with them)
        opt["local_steps"] = train["local_steps"] = c.local_steps
        if c.fragments:
            opt["fragments"] = train["fragments"] = c.fragments
            opt["outer_delay"] = train["outer_delay"] = c.outer_delay
    warmup = 0 if c.dense or c.local_steps else dense_warmup_for(c.risk["level"], steps)  # (the guard's may be longer)
    if warmup:
        opt["dense_warmup"] = train["dense_warmup"] = warmup
    if model.builtin:
        train = {"model": model.name, **train, "steps": steps, "batch_size": model.batch_size}
        if model.name != "mlp":
            train["block_size"] = model.block_size
    if lr is not None:
        train["lr"] = lr
    if lion:
        train.update({k: lion[k] for k in ("lr", "weight_decay") if lion.get(k) is not None})
    base = result.baseline
    return {
        "lioncub_autotune": 1,
        "optimizer": opt,
        "train": train,
        "collective": collective_section(c, backend or profile.name),
        "predicted": {
            "step_seconds": c.step_seconds, "speedup": c.speedup, "bytes_sent_per_rank": c.bytes_per_step,
            "bytes_inside_node_per_rank": c.bytes_inside_node_per_step,
            "bytes_leaving_node_per_rank": c.bytes_leaving_node_per_step,
            "bytes_leaving_per_node": c.bytes_leaving_node_per_step * cluster.gpus_per_node,
            "dense_steps": c.dense_steps, "run_step_seconds": c.run_step_seconds, "run_speedup": c.run_speedup,
            "compute_seconds": c.compute_seconds, "codec_seconds": c.codec_seconds,
            "optimizer_seconds": c.optimizer_seconds, "communication_seconds": c.communication_seconds,
            "exposed_communication_seconds": c.exposed_communication_seconds,
            "momentum_sync_seconds": c.momentum_sync_seconds, "syncs_per_step": c.syncs_per_step,
            "memory_bytes_per_rank": c.memory_bytes_per_rank, "memory_fraction": c.memory_fraction,
            "baseline": {"method": methods.BASELINE, "bucket_mb": BASELINE_BUCKET_MB,
                         "step_seconds": base["step_seconds"], "bytes_sent_per_rank": base["bytes_sent_per_rank"],
                         "bytes_inside_node_per_rank": base.get("bytes_inside_node_per_rank"),
                         "bytes_leaving_node_per_rank": base.get("bytes_leaving_node_per_rank"),
                         "exposed_communication_seconds": base["exposed_communication_seconds"]},
            "verdict": verdict,
        },
        "cluster": {**cluster.to_dict(), "description": cluster_desc, "backend": profile.name,
                    "calibration": calibration, "profile": profile.to_dict()},
        "model": model.to_dict(),
        "lion": lion,
        "here": here,
        "risk": {**c.risk, "rule": RISK_RULE},
        "search": search_info(result),
    }


def search_info(result: SearchResult) -> dict:
    return {**result.space, "configurations": len(result.candidates), "within_risk": len(result.ranked),
            "max_risk": None if math.isinf(result.max_risk) else result.max_risk,
            "seconds": round(result.seconds, 3), "collectives_simulated": result.collectives_simulated}


def write_config(cfg: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, default=str)
        f.write("\n")
