"""The "hsdp+..." configurations of `lioncub train`: the model sharded by FSDP2 inside each node.

Each transformer block and the model's root are FSDP2 units. "hsdp+lion" is FSDP2's own HSDP (the units on the
2-D mesh: a reduce-scatter inside the node, an all-reduce of the shards across nodes) with plain Lion on the
shards; "hsdp+<method>" shards on the node only and LionCub's method runs across the nodes
(lioncub.attach_fsdp)."""

from __future__ import annotations

import glob
import json
import os

import torch.distributed as dist

from lioncub.comm import wire
from lioncub.files import write_json
from lioncub.optim import LionCub


def node_size(cfg, world: int) -> int:
    """The ranks that shard the model: cfg.node_size, else torchrun's (or the lab's) LOCAL_WORLD_SIZE."""
    size = cfg.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if size < 1:
        raise ValueError(f"{cfg.method}: the node size is unknown: give --node-size (under torchrun it is "
                         "LOCAL_WORLD_SIZE)")
    check(cfg, world, size)
    return size


def check(cfg, world: int, size: int) -> None:
    """One-line errors, before any rank starts, for a layout FSDP or the method cannot run."""
    if world % size:
        raise ValueError(f"{cfg.method}: the node size {size} does not divide the world size {world}")
    if world // size < 2 and cfg.configuration.compressed:
        raise ValueError(f"{cfg.method} votes across nodes and {world} rank(s) in nodes of {size} make one: give "
                         f"several nodes (--node-size < --ranks), or use hsdp+allreduce")


def mesh_for(cfg, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError(f"{cfg.method} shards the model over ranks: run it on several ranks (--ranks, torchrun)")
    G = node_size(cfg, world)
    device = "cuda" if cfg.device.startswith("cuda") else "cpu"
    return init_device_mesh(device, (world // G, G), mesh_dim_names=("replicate", "shard"))


def shard(model, cfg, mesh):
    """fully_shard every block, then the root (embeddings, final norm and head)."""
    from torch.distributed.fsdp import fully_shard

    on = mesh if cfg.configuration.plain_lion else mesh["shard"]
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=on)
    fully_shard(model, mesh=on)  # (parameters stay fp32; amp="bf16" autocasts the forward as for DDP)
    return model


def attach(model, opt, cfg, mesh) -> None:
    if not cfg.configuration.plain_lion:
        from lioncub.integrations.fsdp import attach_fsdp

        attach_fsdp(model, opt, mesh)


def unit_params(model) -> list[int]:
    """Parameters of each FSDP unit `shard` makes, in forward order: the root's own (embeddings, final norm,
    head), then each block."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in getattr(model, "blocks", ())]
    return [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]


def fsdp_bytes(cfg, model, world: int) -> tuple[int, int]:
    """(across nodes, inside the node) bytes each rank sends per step for FSDP2's own collectives, by the ring
    formulas (wire.bus_factor; FSDP's collectives are not instrumented): inside the node, the gradients'
    reduce-scatter and the parameters' all-gathers, fp32: every unit's before forward, and again before
    backward but the root's (FSDP2 reshards every unit after forward except the root); across nodes, for
    hsdp+lion, FSDP's all-reduce of each shard (LionCub counts its own exchange)."""
    G = node_size(cfg, world)
    full = 4 * sum(p.numel() for p in model.parameters())
    gathered = 2 * full - 4 * unit_params(model)[0]
    node = int(wire.bus_factor("reducescatter", G) * full + wire.bus_factor("allgather", G) * gathered)
    nodes = world // G
    cross = int(wire.bus_factor("allreduce", nodes) * full / G) if cfg.configuration.plain_lion and nodes > 1 else 0
    return cross, node


def _plain_state(model, opt) -> dict:
    """hsdp+lion's model and Lion state as DCP wants them: FSDP2's DTensor shards (torch's state_dict helpers)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, opt_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": opt_state}


def _save_state(path: str, model, opt) -> None:
    if isinstance(opt, LionCub):
        from lioncub.integrations import checkpoint

        checkpoint.save(path, model, opt)
    else:  # hsdp+lion: plain Lion on FSDP2's shards, each rank writing its own
        import torch.distributed.checkpoint as dcp

        dcp.save(_plain_state(model, opt), checkpoint_id=path)


def _load_state(path: str, model, opt) -> None:
    if isinstance(opt, LionCub):
        from lioncub.integrations import checkpoint

        checkpoint.load(path, model, opt)
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from lioncub.integrations import checkpoint

    state = _plain_state(model, opt)  # the shards' shapes to load into
    checkpoint.load_dcp(state, path, dist.group.WORLD)  # as plain data: nothing in the folder runs
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save(directory: str, model, opt, step: int, rank: int, records: list) -> str:
    """A DCP checkpoint of the sharded model and its optimizer (LionCub: lioncub.checkpoint; hsdp+lion's Lion:
    torch's sharded state dicts) in directory/stepNNNNNNN, and rank 0's records beside it, written last: a
    checkpoint without them is incomplete and never resumed from."""
    path = os.path.join(directory, f"step{step:07d}")
    _save_state(path, model, opt)
    dist.barrier()
    if rank == 0:
        write_json(os.path.join(path, "records.json"), dict(step=step, records=records), indent=None)
    return path


def resume(directory: str, model, opt) -> tuple[int, list]:
    """(step, records) of the newest complete checkpoint that `save` wrote, loaded into model and opt."""
    done = sorted(p for p in glob.glob(os.path.join(directory, "step*"))
                  if os.path.isfile(os.path.join(p, "records.json")))
    if not done:
        return 0, []
    _load_state(done[-1], model, opt)
    with open(os.path.join(done[-1], "records.json")) as f:
        saved = json.load(f)
    return saved["step"], saved["records"]
