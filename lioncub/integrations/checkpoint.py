"""Sharded checkpoints of a model and its LionCub optimizer on torch.distributed.checkpoint (DCP).

    lioncub.checkpoint.save("ckpt/step1000", model, opt)     # every rank calls it (a collective)
    lioncub.checkpoint.load("ckpt/step1000", model, opt)     # every rank, after building model and opt

Layout (one DCP checkpoint: a directory with one .distcp file per rank and a .metadata file that DCP writes
last, so a checkpoint whose save did not finish cannot be loaded):

    model.<name>              the model's state_dict; replicated, so DCP writes each tensor once
    lioncub.meta              JSON: format, world size, step, method, levels, dense warm-up, whether the
                              momenta were identical on every rank, the optimizer's param_groups
    rank<r>.exp_avg.<i>       rank r's momentum of the optimizer's parameter i (in param_groups order):
                              each rank writes its own into its own file (the rank-sharded entries)
    rank<r>.stats             JSON: rank r's opt.stats
    rank<r>.momentum_shards.<k>  (hierarchical layout) rank r's momentum shard of bucket k
    lioncub.local.anchor.<k>, lioncub.local.velocity.<k>   (local steps) the anchor and outer momentum of
                              bucket k: replicated, written once
    rank<r>.residual.<k>, rank<r>.local_counts   (local steps) rank r's error-feedback residual of bucket k
                              and its counters
    rank<r>.params.<i>        (local steps, saved between outer steps, and always when they are streamed)
                              rank r's own parameter i: the replicas differ there, and each resumes from its own
    lioncub.local.pending.<j>.<i>   (streamed outer steps) the agreed update of the j-th exchange in flight, for
                              the i-th bucket of its fragment: the same on every rank, written once

Resuming on the same world size is bit-exact: each rank reads its own momentum. On another world size
(the policy; it logs which, never silently):
  * momenta that were identical (the allreduce method, a dense warm-up, a momentum sync on the last step):
    every rank takes rank 0's, exactly;
  * otherwise every rank takes the average of all the saved ranks' momenta (summed in fp32 in rank order,
    so the new ranks start identical) and a warning says so: the ranks' own momenta cannot be split or
    merged, and the average is what a momentum sync would have given.
A hierarchical optimizer's checkpoint (momentum shards) resumes on the same world and node size only, and
so does one with local steps (each rank's residuals, and its parameters between outer steps, are its own).
Steps, hyperparameters and the warm-up resume as with opt.load_state_dict; opt.stats resume on the same
world size and restart on another.
"""

from __future__ import annotations

import json
import logging
import warnings

import torch
import torch.distributed.checkpoint as dcp

from lioncub.optim.stats import CommStats

log = logging.getLogger("lioncub")
FORMAT = 1
_LOAD_RANKS_AT_ONCE = 8  # saved ranks whose momenta one dcp.load reads when averaging (bounds the memory)


def _dcp(fn, state: dict, path: str, opt) -> None:
    """dcp.save or dcp.load on the optimizer's process group, or in a single process (quietly: torch warns
    that it assumes so)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        fn(state, checkpoint_id=path, process_group=opt.process_group)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(state, checkpoint_id=path, no_dist=True)


def _params(opt) -> list:
    return [p for group in opt.param_groups for p in group["params"]]


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in the checkpoint's metadata")


def _local_entries(opt, meta: dict, mine: dict) -> dict:
    """Local steps' state: each rank's residuals, counters and, between outer steps (when the replicas differ),
    its own parameters into `mine`; what they ran into `meta`; returns the anchor and outer momentum (replicated:
    written once)."""
    sd = opt.local.state_dict()
    stream = sd.get("stream")  # streamed outer steps: some fragment's replicas differ at almost every step
    own_params = opt.engine.steps % sd["local_steps"] != 0 or stream is not None
    meta["local"] = dict(local_steps=sd["local_steps"], outer=sd["outer"], own_params=own_params,
                         buckets=[b.n for b in opt.engine.buckets],
                         **{name: sd[name] is not None for name in ("anchor", "velocity", "residual")})
    shared = {name: {str(k): t for k, t in enumerate(sd[name])} for name in ("anchor", "velocity")
              if sd[name] is not None}
    if stream is not None:  # the agreed updates of the exchanges in flight (the same on every rank)
        meta["local"]["stream"] = dict(stream, pending=[dict(j, G=j["G"] is not None) for j in stream["pending"]])
        shared["pending"] = {str(i): {str(k): g for k, g in enumerate(j["G"])}
                             for i, j in enumerate(stream["pending"]) if j["G"] is not None}
    if sd["residual"] is not None:
        mine["residual"] = {str(k): t for k, t in enumerate(sd["residual"])}
    mine["local_counts"] = json.dumps({k: sd[k] for k in ("local_skips", "outer_steps", "outer_skips")})
    if own_params:
        mine["params"] = {str(i): p.detach() for i, p in enumerate(_params(opt))}
    return shared


def save(path: str, model: torch.nn.Module, opt) -> None:
    """Save a model and its LionCub optimizer as one torch.distributed.checkpoint (DCP) directory.

    The model is written once (replicated); each rank's momentum, statistics and (with local steps) residuals
    go into that rank's own file. A save that did not finish cannot be loaded (DCP writes its metadata last).

    Args:
        path: the checkpoint directory.
        model: the model the optimizer trains (its `state_dict()` is saved).
        opt: the `lioncub.LionCub` optimizer.

    Example:
        Every rank of the optimizer's process group calls it (a collective):

            lioncub.checkpoint.save(f"ckpt/{step}", model, opt)
    """
    sd = opt.state_dict()
    extra = sd["lioncub"]
    meta = dict(format=FORMAT, world_size=opt.world_size, step=extra["step"], method=extra["method"],
                levels=extra["levels"], dense_warmup=extra.get("dense_warmup", 0),
                momenta_identical=bool(extra["momenta_identical"]), param_groups=sd["param_groups"],
                shapes=[list(p.shape) for p in _params(opt)], node_size=opt.node_size)
    momenta = {str(i): opt.state[p]["exp_avg"] for i, p in enumerate(_params(opt)) if "exp_avg" in opt.state[p]}
    mine = {"exp_avg": momenta, "stats": json.dumps(extra["stats"])}
    if "momentum_shards" in extra:
        mine["momentum_shards"] = {str(k): t for k, t in enumerate(extra["momentum_shards"])}
    shared = _local_entries(opt, meta, mine) if opt.local is not None else {}
    state = {"model": model.state_dict(),
             "lioncub": {"meta": json.dumps(meta, default=_jsonable), **({"local": shared} if shared else {})},
             f"rank{opt.rank}": mine}
    _dcp(dcp.save, state, path, opt)


def load(path: str, model: torch.nn.Module, opt) -> dict:
    """Load a checkpoint written by `save` into a model and a LionCub optimizer, on any number of ranks.

    On the saved world size every rank reads its own momentum (bit-exact). On another, every rank takes rank
    0's momenta if they were identical, else the average of all the saved ranks' momenta, and logs which.
    Checkpoints of the node layout or with local steps resume on the same world (and node) size only.

    Args:
        path: the directory `save` wrote.
        model: the model, built as for the saved run.
        opt: the `lioncub.LionCub` optimizer, built as for the saved run.

    Returns:
        What it did: `{"saved_world_size": int, "world_size": int, "momenta": "own" | "rank0" | "average",
        "step": int}`.

    Example:
        Every rank, after building the model and the optimizer:

            info = lioncub.checkpoint.load("ckpt/1000", model, opt)
            print(info["step"], info["momenta"])
    """
    meta = _load_model_and_meta(path, model, opt)
    if meta.get("node_size", 1) > 1 or opt.node_size > 1:
        return _load_shards(path, opt, meta)
    saved_n, n, rank = meta["world_size"], opt.world_size, opt.rank
    _check_local(path, meta, opt)
    if saved_n == n:
        how, sources = "own", [rank]
    elif meta["momenta_identical"]:
        how, sources = "rank0", [0]
    else:
        how, sources = "average", list(range(saved_n))
    momenta, stats = _read_momenta(path, opt, how, sources)
    extra = dict(step=meta["step"], world_size=n, rank=rank, method=meta["method"], levels=meta["levels"],
                 dense_warmup=meta["dense_warmup"],
                 momenta_identical=meta["momenta_identical"] if how == "own" else True)
    if stats is not None:
        extra["stats"] = stats
    if opt.local is not None:
        extra["local"] = _read_local(path, opt, meta["local"])
    opt.load_state_dict({"state": {int(i): {"exp_avg": m} for i, m in momenta.items()},
                         "param_groups": _groups(meta), "lioncub": extra})
    if how != "own":
        opt.stats = CommStats(steps=meta["step"])
        say = log.info if how == "rank0" else log.warning
        if rank == 0:
            say("lioncub.checkpoint: %s was saved by %d rank(s) and resumes on %d: %s", path, saved_n, n,
                "their momenta were identical, every rank takes rank 0's" if how == "rank0" else
                "each rank had its own momentum; every rank starts from their average (the policy for a "
                "different world size)")
    return dict(saved_world_size=saved_n, world_size=n, momenta=how, step=meta["step"])


def _load_model_and_meta(path: str, model, opt) -> dict:
    """Load the model (DCP loads in place; load_state_dict then checks every key) and return the checked
    metadata."""
    head = {"model": model.state_dict(), "lioncub": {"meta": ""}}
    _dcp(dcp.load, head, path, opt)
    model.load_state_dict(head["model"])
    meta = json.loads(head["lioncub"]["meta"])
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a lioncub checkpoint of format {FORMAT} (got {meta.get('format')!r})")
    shapes = [list(p.shape) for p in _params(opt)]
    if meta["shapes"] != shapes:
        raise ValueError(f"{path}: the checkpoint's optimizer has parameters of shapes {meta['shapes']}, this one "
                         f"{shapes}: build the model and the optimizer as for the saved run")
    return meta


def _check_local(path: str, meta: dict, opt) -> None:
    saved = meta.get("local")
    if (saved is None) != (opt.local is None):
        raise ValueError(f"{path}: saved with local_steps={saved and saved['local_steps']}; this optimizer has "
                         f"local_steps={opt.local_steps}: resume with the same options")
    if saved is None:
        return
    if saved["buckets"] != [b.n for b in opt.engine.buckets]:
        raise ValueError(f"{path}: its local-step state is in buckets of {saved['buckets']} elements, this optimizer's "
                         f"are {[b.n for b in opt.engine.buckets]}: build it with the saved run's bucket_mb")
    if meta["world_size"] != opt.world_size:
        raise ValueError(f"{path}: saved by {meta['world_size']} ranks with local steps; this optimizer has "
                         f"{opt.world_size}: each rank's residuals (and parameters between outer steps) are its own, "
                         f"so it resumes on the same world size only")


@torch.no_grad()
def _read_local(path: str, opt, saved: dict) -> dict:
    """This rank's local-step state (opt.local.state_dict()'s form); its own parameters, if saved, go straight
    into the optimizer's parameters (the model was loaded with one rank's)."""
    buckets, params = opt.engine.buckets, _params(opt)
    flat = {str(k): torch.empty(b.n, dtype=torch.float32, device=b.p.device) for k, b in enumerate(buckets)}
    shared = {name: {k: torch.empty_like(t) for k, t in flat.items()} for name in ("anchor", "velocity") if saved[name]}
    mine = {"local_counts": ""}
    if saved["residual"]:
        mine["residual"] = {k: torch.empty_like(t) for k, t in flat.items()}
    if saved["own_params"]:
        mine["params"] = {str(i): torch.empty_like(p) for i, p in enumerate(params)}
    stream = saved.get("stream")
    if stream is not None:
        shared["pending"] = _pending_buffers(opt, stream)
    part = {"lioncub": {"local": shared}, f"rank{opt.rank}": mine} if shared else {f"rank{opt.rank}": mine}
    _dcp(dcp.load, part, path, opt)
    for i, t in mine.get("params", {}).items():
        params[int(i)].copy_(t)

    def listed(d):
        return None if d is None else [d[str(k)] for k in range(len(buckets))]

    out = dict(local_steps=saved["local_steps"], outer=saved["outer"], anchor=listed(shared.get("anchor")),
               velocity=listed(shared.get("velocity")), residual=listed(mine.get("residual")),
               **json.loads(mine["local_counts"]))
    if stream is not None:
        got = shared["pending"]
        out["stream"] = dict(stream, pending=[dict(j, G=[got[str(i)][str(k)] for k in range(len(got[str(i)]))]
                                                   if j["G"] else None) for i, j in enumerate(stream["pending"])])
    return out


def _pending_buffers(opt, stream: dict) -> dict:
    """Buffers for the saved agreed updates of the streamed exchanges in flight (fp32, one per bucket of the
    exchange's fragment)."""
    stream_ = opt.local.stream
    if stream_ is None or stream["fragments"] != stream_.F:
        return {}  # (opt.load_state_dict refuses the options with its one-line error)
    buckets = opt.engine.buckets
    return {str(i): {str(j): torch.empty(buckets[k].n, dtype=torch.float32, device=buckets[k].p.device)
                     for j, k in enumerate(stream_.fragments[p["fragment"]])}
            for i, p in enumerate(stream["pending"]) if p["G"]}


def _read_momenta(path: str, opt, how: str, sources: list) -> tuple[dict, dict | None]:
    """({parameter index: momentum}, this rank's saved stats or None): the saved ranks `sources`' momenta,
    read a few ranks at a time, and for `how` == "average" their fp32 mean (summed in rank order)."""
    params = _params(opt)
    with_state = [i for i, p in enumerate(params) if "exp_avg" in opt.state[p]]
    acc = stats = None
    for first in range(0, len(sources), _LOAD_RANKS_AT_ONCE):
        chunk = sources[first : first + _LOAD_RANKS_AT_ONCE]
        part = {f"rank{r}": {"exp_avg": {str(i): torch.empty_like(opt.state[params[i]]["exp_avg"])
                                         for i in with_state}, "stats": ""} for r in chunk}
        _dcp(dcp.load, part, path, opt)
        if how == "own":
            stats = json.loads(part[f"rank{opt.rank}"]["stats"])
        for r in chunk:
            loaded = part[f"rank{r}"]["exp_avg"]
            if how != "average":
                acc = loaded
            elif acc is None:
                acc = {i: m.float() for i, m in loaded.items()}
            else:
                for i, m in loaded.items():
                    acc[i] += m.float()
    if how == "average":
        acc = {i: (m / len(sources)).to(opt.state[params[int(i)]]["exp_avg"].dtype) for i, m in acc.items()}
    return acc, stats


def _groups(meta: dict) -> list:
    return [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]


def _load_shards(path: str, opt, meta: dict) -> dict:
    """The hierarchical layout: each rank reads its own momentum shards (same world and node size only)."""
    saved = (meta["world_size"], meta.get("node_size", 1))
    if saved != (opt.world_size, opt.node_size):
        raise ValueError(f"{path}: saved by {saved[0]} ranks in nodes of {saved[1]}; this optimizer has "
                         f"{opt.world_size} in nodes of {opt.node_size}: a hierarchical optimizer's momentum shards "
                         f"resume on the same layout only")
    _check_local(path, meta, opt)
    buckets = opt.engine.buckets
    part = {f"rank{opt.rank}": {"momentum_shards": {str(k): torch.empty_like(b.m) for k, b in enumerate(buckets)},
                                "stats": ""}}
    _dcp(dcp.load, part, path, opt)
    mine = part[f"rank{opt.rank}"]
    shards = [mine["momentum_shards"][str(k)] for k in range(len(buckets))]
    extra = dict(step=meta["step"], world_size=opt.world_size, rank=opt.rank, method=meta["method"],
                 levels=meta["levels"], dense_warmup=meta["dense_warmup"], momenta_identical=meta["momenta_identical"],
                 node_size=opt.node_size, momentum_shards=shards, stats=json.loads(mine["stats"]))
    if opt.local is not None:
        extra["local"] = _read_local(path, opt, meta["local"])
    opt.load_state_dict({"state": {}, "param_groups": _groups(meta), "lioncub": extra})
    return dict(saved_world_size=saved[0], world_size=opt.world_size, momenta="own", step=meta["step"])


__all__ = ["load", "save"]
