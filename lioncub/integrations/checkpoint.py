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

import glob
import json
import logging
import os
import pickle
import shutil
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp

from lioncub.optim.stats import CommStats

log = logging.getLogger("lioncub")
FORMAT = 1
WAIT_S = 120.0  # how long save / load wait for every rank to call them (then: the one-line error)
_CALLS: dict[tuple, int] = {}  # (the group's ranks) -> saves and loads so far: each call's name in the store


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (called on some ranks only, incomplete, unsafe)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that holds something other than plain data (a pickled object): refused, never run."""
_LOAD_RANKS_AT_ONCE = 8  # saved ranks whose momenta one dcp.load reads when averaging (bounds the memory)


def _group_of(opt):
    """The optimizer's process group if torch.distributed is initialised (None: a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return opt.process_group or dist.group.WORLD


def _dcp_save(state: dict, path: str, opt) -> None:
    """dcp.save on the optimizer's process group, or in a single process (quietly: torch warns that it assumes
    so)."""
    if _group_of(opt) is not None:
        dcp.save(state, checkpoint_id=path, process_group=opt.process_group)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state, checkpoint_id=path, no_dist=True)


class _SafeUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle (torch reads it with pickle.load): this reads it with only the classes DCP's
    metadata is made of, so a checkpoint folder someone else can write cannot run code in the job."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
               ("collections", "OrderedDict"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    METADATA = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "torch.distributed.checkpoint.metadata"
                                               and name in self.METADATA):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose .metadata is read by _SafeUnpickler (tensors are read with weights_only=True by
    torch already)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _SafeUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"{path}: refused to load: {exc} (lioncub loads checkpoints as plain "
                                        f"data only)") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner, but a non-tensor entry is read with torch.load(weights_only=True) (torch's own uses
    weights_only=False: any pickled object would run). The state dict is flat (dotted names)."""

    def __init__(self, path: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path = path

    def load_bytes(self, read_item, value) -> None:
        name = read_item.dest_index.fqn
        try:
            self.state_dict[name] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UnsafeCheckpointError(f"{self.path}: refused to load the entry {name!r}, which is not plain data "
                                        f"({first}): lioncub loads checkpoints as plain data only") from None


def _dcp(fn, state: dict, path: str, opt) -> None:
    assert fn is dcp.load
    load_dcp(state, path, _group_of(opt))


def load_dcp(state: dict, path: str, process_group=None) -> None:
    """dcp.load as plain data: DCP's .metadata read with an allow-list of its own classes, each non-tensor entry
    with torch.load(weights_only=True) (torch's DCP unpickles both without restriction). The nested dict is
    loaded under its dotted names (as dcp.save flattened it), tensors in place, other values put back.

    Args:
        state: the nested dict to load into, as for dcp.load.
        path: the checkpoint directory.
        process_group: the ranks that load it together (every one calls it); None: a single process.

    Raises:
        UnsafeCheckpointError: the checkpoint holds a pickled object (refused, never run).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.api import CheckpointException

    flat, where = flatten_state_dict(state)  # (the names dcp.save gave the entries)
    kwargs = dict(storage_reader=_SafeReader(path), planner=_SafePlanner(path))
    try:
        if process_group is not None:
            dcp.load(flat, process_group=process_group, **kwargs)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
                dcp.load(flat, no_dist=True, **kwargs)
    except CheckpointException as exc:  # (DCP gathers every rank's failure: ours say it in one line)
        for failure in exc.failures.values():
            err = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(err, CheckpointError):
                raise type(err)(str(err)) from None
        raise
    for name, keys in where.items():
        node = state
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = flat[name]


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


def save(path: str, model: torch.nn.Module, opt, extra: dict | None = None, *, timeout: float = WAIT_S) -> None:
    """Save a model, its LionCub optimizer and the script's own metadata as one torch.distributed.checkpoint
    (DCP) directory.

    The model is written once (replicated); each rank's momentum, statistics and (with local steps) residuals
    go into that rank's own file. The save is atomic: it is written beside `path` and put in its place once
    complete, so saving again to one folder replaces the old checkpoint only when the new one is whole (a save
    that dies midway leaves the old one), and prints no overwrite warning.

    Args:
        path: the checkpoint directory: on a filesystem every rank reads (a multi-node job: a shared one), or
            see docs/integrations.md for node-local disks.
        model: the model the optimizer trains (its `state_dict()` is saved).
        opt: the `lioncub.LionCub` optimizer.
        extra: the script's own metadata (step, config, best loss, ...): plain data that JSON holds (dicts with
            string keys, lists, strings, numbers, booleans, None); `load` returns it as `info["extra"]`.
        timeout: seconds to wait for every rank to call it; a rank that does not (a save under
            `if rank == 0:`) makes it raise `CheckpointError` in one line instead of hanging.

    Example:
        Every rank of the optimizer's process group calls it (a collective):

            lioncub.checkpoint.save(f"ckpt/{step}", model, opt, extra={"step": step, "config": config})
    """
    path = os.fspath(path)
    extra_json = _extra_json(extra)
    sd = opt.state_dict()
    lc = sd["lioncub"]
    meta = dict(format=FORMAT, world_size=opt.world_size, step=lc["step"], method=lc["method"],
                levels=lc["levels"], dense_warmup=lc.get("dense_warmup", 0),
                momenta_identical=bool(lc["momenta_identical"]), param_groups=sd["param_groups"],
                shapes=[list(p.shape) for p in _params(opt)], node_size=opt.node_size)
    momenta = {str(i): opt.state[p]["exp_avg"] for i, p in enumerate(_params(opt)) if "exp_avg" in opt.state[p]}
    mine = {"exp_avg": momenta, "stats": json.dumps(lc["stats"])}
    if "momentum_shards" in lc:
        mine["momentum_shards"] = {str(k): t for k, t in enumerate(lc["momentum_shards"])}
    shared = _local_entries(opt, meta, mine) if opt.local is not None else {}
    state = {"model": model.state_dict(),
             "lioncub": {"meta": json.dumps(meta, default=_jsonable), "extra": extra_json,
                         **({"local": shared} if shared else {})},
             f"rank{opt.rank}": mine}
    meet = _Meeting("save", path, opt, timeout)
    tmp = f"{path}.lioncub-saving-{meet.token}"
    _dcp_save(state, tmp, opt)
    seen = _visible(os.path.join(tmp, ".metadata"))  # rank 0 wrote it last: is this rank on rank 0's filesystem?
    if not seen:
        meet.count("unshared", 1)
    meet.barrier()  # (every rank has looked before any moves it)
    if opt.rank == 0 or not seen:  # on a shared filesystem rank 0 alone swaps the folders: no two ranks race on it
        _replace(path, tmp, meet.token)
    unshared = meet.finish("unshared")
    if not seen:
        log.warning("lioncub.checkpoint.save: rank %d does not see the .metadata that rank 0 wrote in %s: that "
                    "folder is not on a filesystem every rank shares, so this rank's files alone cannot be "
                    "loaded: copy every rank's files and rank 0's .metadata into one folder before resuming "
                    "(docs/integrations.md, Checkpoints)", opt.rank, path)
    elif unshared and opt.rank == 0:
        log.warning("lioncub.checkpoint.save: %d of %d ranks do not see %s/.metadata (a node-local disk?): gather "
                    "every rank's files and the .metadata into one folder before resuming", unshared,
                    opt.world_size, path)


def _extra_json(extra) -> str:
    """The script's metadata as JSON, checked to come back as it went in."""
    if extra is None:
        return "null"
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of plain data, got {type(extra).__name__}")
    try:
        text = json.dumps(extra, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"extra must hold plain data (dicts with str keys, lists, str, numbers, bool, None): "
                        f"{exc}") from None
    if json.loads(text) != extra:
        raise TypeError("extra must hold plain data that JSON gives back unchanged (dicts with str keys, lists "
                        "rather than tuples, str, numbers, bool, None)")
    return text


def _visible(file: str) -> bool:
    """Whether this rank sees `file` (opened, not stat'ed: NFS revalidates on open)."""
    try:
        with open(file, "rb"):
            return True
    except (FileNotFoundError, NotADirectoryError):
        return False


class _Meeting:
    """Every rank of the optimizer's group calls save / load, or none goes on: each rank names itself in
    torch.distributed's store and waits up to `timeout` seconds for the others (a DCP collective entered by some
    ranks only would hang). `token` is the same on every rank."""

    def __init__(self, what: str, path: str, opt, timeout: float, flag: bool = False):
        self.group = _group_of(opt)
        self.flagged = int(flag)
        if self.group is None:  # a single process
            self.token = uuid.uuid4().hex
            return
        import datetime
        import hashlib

        import torch.distributed as dist

        self.ranks = tuple(dist.get_process_group_ranks(self.group))
        key = (what, self.ranks)
        n = _CALLS.get(key, 0)
        sig = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:12]
        self.prefix = f"lioncub/checkpoint/{sig}/{what}{n}/"
        self.store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        if flag:
            self.store.add(self.prefix + "flag", 1)
        if me == self.ranks[0]:
            self.store.set(self.prefix + "token", uuid.uuid4().hex)
        self.store.set(self.prefix + str(me), "here")
        try:
            self.store.wait([self.prefix + "token"] + [self.prefix + str(r) for r in self.ranks],
                            datetime.timedelta(seconds=timeout))
        except (RuntimeError, dist.DistStoreError):
            here = [r for r in self.ranks if self.store.check([self.prefix + str(r)])]
            self.store.delete_key(self.prefix + str(me))  # (a later call starts afresh)
            if flag:
                self.store.add(self.prefix + "flag", -1)
            missing = sorted(set(self.ranks) - set(here))
            raise CheckpointError(_MISSING[what].format(path=path, here=_ranks(here), missing=_ranks(missing),
                                                        timeout=timeout)) from None
        _CALLS[key] = n + 1
        self.token = self.store.get(self.prefix + "token").decode()
        if what == "load":
            self.flagged = self.count("flag", 0)

    def count(self, name: str, add: int) -> int:
        return self.flagged if self.group is None else self.store.add(self.prefix + name, add)

    def barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def finish(self, name: str) -> int:
        """After every rank is done (a barrier): the count `name`."""
        if self.group is None:
            return 0
        self.barrier()
        return self.count(name, 0)


def _ranks(ranks) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks ({ranks[0]}..{ranks[-1]})"


_MISSING = {
    "save": ("lioncub.checkpoint.save({path!r}) was called on rank {here} but not on rank {missing} within "
             "{timeout:.0f} s: it is a collective, so call it on every rank (not under `if rank == 0:`): "
             "`lioncub.checkpoint.save(path, model, opt, extra={{...}})`; to save on rank 0 alone, "
             "`torch.save({{'model': model.state_dict(), 'optimizer': opt.state_dict()}}, path)` works (rank 0's "
             "momentum)"),
    "load": ("lioncub.checkpoint.load({path!r}) was called on rank {here} but not on rank {missing} within "
             "{timeout:.0f} s: it is a collective, so every rank calls it after building the model and the "
             "optimizer: `info = lioncub.checkpoint.load(path, model, opt)`"),
}


def _replace(path: str, tmp: str, token: str) -> None:
    """Put the finished save `tmp` in `path`'s place (rank 0, and ranks that do not see rank 0's files: there the
    first rank to get here on each filesystem does it, by an exclusive lock file), moving the old checkpoint aside
    first and deleting it last, so that some complete checkpoint is on disk at every moment; `load` finds the new
    one if a job dies between the two renames."""
    lock = os.path.join(tmp, ".lioncub-replacing")
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except (FileExistsError, FileNotFoundError):
        return  # another rank on this filesystem does it (or did)
    old = None
    if os.path.lexists(path):
        old = f"{path}.lioncub-old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    os.remove(os.path.join(path, ".lioncub-replacing"))
    for stale in sorted({old} - {None} | set(glob.glob(glob.escape(path) + ".lioncub-*"))):
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)  # the old one, and any that a save died writing
        elif os.path.lexists(stale):
            os.remove(stale)


def _complete(path: str) -> str | None:
    """The checkpoint to read for `path`: itself if complete (DCP writes .metadata last), else the newest
    complete one a save left beside it when it died between its two renames (said in the log); None if none."""
    if _visible(os.path.join(path, ".metadata")):
        return path
    left = [p for p in glob.glob(glob.escape(path) + ".lioncub-saving-*") + glob.glob(glob.escape(path) +
            ".lioncub-old-*") if _visible(os.path.join(p, ".metadata"))]
    if not left:
        return None
    newest = max(left, key=lambda p: ("saving" in os.path.basename(p), os.path.getmtime(os.path.join(p, ".metadata"))))
    log.warning("lioncub.checkpoint.load: %s is incomplete (a save died while replacing it); loading %s", path,
                newest)
    return newest


def load(path: str, model: torch.nn.Module, opt, *, timeout: float = WAIT_S) -> dict:
    """Load a checkpoint written by `save` into a model and a LionCub optimizer, on any number of ranks.

    On the saved world size every rank reads its own momentum (bit-exact). On another, every rank takes rank
    0's momenta if they were identical, else the average of all the saved ranks' momenta, and logs which.
    Checkpoints of the node layout or with local steps resume on the same world (and node) size only. Every
    entry is read as plain data (DCP's metadata with an allow-list, values with `torch.load(weights_only=True)`):
    a checkpoint that carries a pickled object is refused (`UnsafeCheckpointError`), never run.

    Args:
        path: the directory `save` wrote.
        model: the model, built as for the saved run.
        opt: the `lioncub.LionCub` optimizer, built as for the saved run.
        timeout: seconds to wait for every rank to call it (then `CheckpointError`, never a hang).

    Returns:
        What it did, and the script's metadata: `{"saved_world_size": int, "world_size": int,
        "momenta": "own" | "rank0" | "average", "step": int, "extra": what save's `extra` was (or None)}`.

    Example:
        Every rank, after building the model and the optimizer:

            info = lioncub.checkpoint.load("ckpt/1000", model, opt)
            start = info["extra"]["step"]
    """
    path = os.fspath(path)
    found = _complete(path)
    meet = _Meeting("load", path, opt, timeout, flag=found is None)
    if meet.flagged:
        where = "this rank" if found is None else f"{meet.flagged} rank(s)"
        raise CheckpointError(f"{path}: no complete checkpoint on {where} (no .metadata, which rank 0 writes last): "
                              f"the save did not finish, or the folder is on a disk some ranks do not share "
                              f"(copy every rank's files and the .metadata into one folder every rank reads)")
    return _load(found, model, opt)


def _load(path: str, model: torch.nn.Module, opt) -> dict:
    meta, script = _load_model_and_meta(path, model, opt)
    if meta.get("node_size", 1) > 1 or opt.node_size > 1:
        return dict(_load_shards(path, opt, meta), extra=script)
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
    return dict(saved_world_size=saved_n, world_size=n, momenta=how, step=meta["step"], extra=script)


def _load_model_and_meta(path: str, model, opt) -> tuple[dict, object]:
    """Load the model (DCP loads in place; load_state_dict then checks every key) and return the checked
    metadata and the script's own."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    head = {"model": model.state_dict(), "lioncub": {"meta": ""}}
    entries = _SafeReader(path).read_metadata().state_dict_metadata
    if isinstance(entries.get("lioncub.extra"), BytesStorageMetadata):  # (checkpoints before 0.2 have none)
        head["lioncub"]["extra"] = ""
    _dcp(dcp.load, head, path, opt)
    model.load_state_dict(head["model"])
    extra = json.loads(head["lioncub"].get("extra", "null"))
    meta = json.loads(head["lioncub"]["meta"])
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a lioncub checkpoint of format {FORMAT} (got {meta.get('format')!r})")
    shapes = [list(p.shape) for p in _params(opt)]
    if meta["shapes"] != shapes:
        raise ValueError(f"{path}: the checkpoint's optimizer has parameters of shapes {meta['shapes']}, this one "
                         f"{shapes}: build the model and the optimizer as for the saved run")
    return meta, extra


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


__all__ = ["CheckpointError", "UnsafeCheckpointError", "load", "load_dcp", "save"]
