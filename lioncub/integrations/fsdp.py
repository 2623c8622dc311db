"""LionCub on a model sharded by FSDP2: HSDP with a compressed vote across nodes.

    mesh = init_device_mesh("cuda", (nodes, G), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])        # shard inside the node only
    fully_shard(model, mesh=mesh["shard"])
    opt = lioncub.LionCub(model.parameters(), method="vote-1bit")
    lioncub.attach_fsdp(model, opt, mesh)            # before the first backward

FSDP2 reduce-scatters each unit's gradients inside the node, which leaves each rank the node's mean of its
shard; LionCub's method then runs across the replicate group on that shard (one bucket per unit, voted as soon
as its reduce-scatter is done), and the agreed update is applied to FSDP's shards in place. The momentum lives
with the shard: parameters, gradients and momenta take 1/G of their unsharded memory. The arithmetic is the
hierarchical layout's (LionCub(node_size=G) on the unsharded model, with the same units as buckets), bit
for bit. Sharding on the 2-D mesh itself (FSDP2's native HSDP) would make FSDP all-reduce the gradients across
nodes as well: shard on mesh["shard"], and LionCub's vote replaces that all-reduce.

With a 1-D mesh over every rank (plain FSDP), there are no replicas to vote: the dense method
(`method="allreduce"`) runs plain Lion on the reduce-scattered gradient, with sharded momenta.
"""

from __future__ import annotations

from lioncub.optim.sharded import Sharding


def units(model) -> list:
    """Each FSDP2 unit's own parameters (not those of the units inside it), in its reduce-scatter's order."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    out = []
    for m in modules:
        inner = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule) for p in sub.parameters()}
        own = [p for p in m.parameters() if id(p) not in inner]
        if own:
            out.append((m, own))
    return out


def _shard_mesh(mesh):
    if mesh.ndim == 1:
        return mesh, None
    if mesh.ndim == 2 and mesh.mesh_dim_names == ("replicate", "shard"):
        return mesh["shard"], mesh["replicate"]
    raise ValueError(f"attach_fsdp needs the 2-D mesh (replicate, shard) of HSDP, or a 1-D mesh; got one of "
                     f"{mesh.ndim} dimensions named {mesh.mesh_dim_names}")


def attach_fsdp(model, opt, mesh) -> None:
    """Train an FSDP2-sharded model with LionCub: HSDP with the method across nodes on each rank's shard.

    FSDP2's reduce-scatter inside the node leaves each rank its shard of the node's mean gradient; LionCub's
    method runs across the mesh's "replicate" dimension on that shard and applies the agreed update to FSDP's
    shards in place. Bit-identical to `LionCub(node_size=G)` on the unsharded model with the same units as
    param groups; parameters, gradients and momenta take 1/G of a replica's memory.

    Args:
        model: the model after `fully_shard`, each unit sharded on `mesh["shard"]` only.
        opt: a `lioncub.LionCub` built on `model.parameters()` (or a framework's wrapper of one).
        mesh: the 2-D `DeviceMesh` of HSDP with dims `("replicate", "shard")`, or a 1-D mesh over every rank
            (plain FSDP: only `method="allreduce"`, there are no replicas to vote).

    Raises:
        ValueError: no FSDP2 units, a unit sharded on another mesh, a mesh of another shape, or a compressed
            method on a 1-D mesh.

    Example:
        Once, after `fully_shard` and before the first backward:

            mesh = init_device_mesh("cuda", (nodes, G), mesh_dim_names=("replicate", "shard"))
            for block in model.blocks:
                fully_shard(block, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
            opt = lioncub.LionCub(model.parameters(), method="vote-1bit")
            lioncub.attach_fsdp(model, opt, mesh)
    """
    from lioncub.integrations.ddp import unwrap_optimizer

    opt = unwrap_optimizer(opt)
    shard_mesh, replicate_mesh = _shard_mesh(mesh)
    found = units(model)
    if not found:
        raise ValueError("attach_fsdp: the model has no FSDP2 units (torch.distributed.fsdp.fully_shard)")
    ranks = shard_mesh.mesh.flatten().tolist()
    for module, params in found:
        for p in params:
            placed = getattr(p, "device_mesh", None)
            if placed is None or placed.mesh.flatten().tolist() != ranks or placed.ndim != 1:
                raise ValueError(
                    f"attach_fsdp: {type(module).__name__}'s parameters are not sharded on the mesh's shard dimension "
                    f"(ranks {ranks}); shard each unit with fully_shard(module, mesh=mesh['shard']) (on the 2-D mesh "
                    f"itself FSDP2 would all-reduce the gradients across nodes, which LionCub's vote replaces)")
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    if replicas == 1 and not opt.spec.dense:
        raise ValueError(f"method={opt.spec.name!r} votes across replicas, and FSDP over every rank leaves one: use "
                         f"HSDP (a (nodes, G) mesh with dims ('replicate', 'shard'), fully_shard on mesh['shard']), "
                         f"or method='allreduce'")
    for module, _ in found:  # the same reduce-scatter layout whichever parameters get gradients
        module.set_reduce_scatter_unused_params(True, recurse=False)
    opt.use_sharding(Sharding(
        units=tuple(tuple(params) for _, params in found), shard_group=shard_mesh.get_group(),
        size=shard_mesh.size(), local=shard_mesh.get_local_rank(),
        replicate_group=replicate_mesh.get_group() if replicate_mesh is not None else None, replicas=replicas,
        replica=replicate_mesh.get_local_rank() if replicate_mesh is not None else 0))


__all__ = ["attach_fsdp", "units"]
