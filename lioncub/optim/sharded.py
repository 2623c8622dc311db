"""The memory of a model sharded by FSDP2 (lioncub.integrations.fsdp): FSDP keeps this rank's shard of every
parameter and of every gradient; LionCub keeps the momentum of that shard only, one bucket per FSDP unit, laid
out as the unit's reduce-scatter output (lioncub.optim.buckets.RowShards), and updates FSDP's shards in place.

A bucket's gradient is FSDP's own: after a unit's reduce-scatter every parameter's .grad (a DTensor) is a view
into one flat buffer of the shard, which `capture` takes (and checks against the layout), so nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lioncub import kernels
from lioncub.comm import transport, wire
from lioncub.comm.transport import allreduce_mean_
from lioncub.optim import schedules
from lioncub.optim.buckets import DTYPES, BucketSet, RowShards, bounds, version_of
from lioncub.optim.layout import ShardLayout


@dataclass(frozen=True)
class Sharding:
    """What LionCub needs of an FSDP2 sharding: the units (each unit's parameters, in its reduce-scatter's
    order), the shard group (a node: G ranks, this rank's index `local`) and the replicate group (the ranks
    with this rank's shard on every node, `replicas` of them, this rank's index `replica`; None for one)."""

    units: tuple
    shard_group: object
    size: int
    local: int
    replicate_group: object
    replicas: int
    replica: int


class ShardedBucket:
    """One FSDP unit on this rank: `m` the momentum of its shard; `g` the shard's gradient (FSDP's buffer, set
    by each backward); the parameters' shards live in FSDP (`param_view`)."""

    def __init__(self, group_index, params, shards: RowShards, local: int, m, order: float):
        self.group_index, self.params, self.order = group_index, params, order
        self.shards, self.local, self.m = shards, local, m
        self.n = self.shard = shards.size
        self.p = None  # (no flat copy of the parameters: FSDP's shards are updated in place)
        self.base = None  # (nor one buffer of all units: runs of buckets leave them alone)
        self.g: torch.Tensor | None = None
        self.offsets = [shards.where(i, local)[0] for i in range(len(params))] + [shards.size]

    def param_view(self, i: int) -> torch.Tensor:
        """Parameter i's rows on this rank: a view of FSDP's storage."""
        return self.params[i].to_local().reshape(-1)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the parameters into `out` (the padding zero)."""
        out.zero_()
        for i in range(len(self.params)):
            at, n = self.shards.where(i, self.local)
            if n:
                out[at : at + n].copy_(self.param_view(i))
        return out

    def scatter(self, src: torch.Tensor) -> None:
        for i in range(len(self.params)):
            at, n = self.shards.where(i, self.local)
            if n:
                self.param_view(i).copy_(src[at : at + n])


class ShardedBucketSet(BucketSet):
    """The buckets of a model sharded by FSDP2: one per unit, in the order backward reduce-scatters them."""

    def __init__(self, param_groups: list, state, sharding: Sharding):
        self.param_groups, self.node_size = param_groups, sharding.size
        self.private, self.copies = True, False  # .grad is FSDP's; the buckets hold it, not a copy
        self.buckets: list = []
        self.where: dict[int, tuple[int, int]] = {}
        self.unused: set[tuple[int, int]] = set()
        self._had_grad: set[int] = set()
        self._touched: list[list[bool]] | None = []
        group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
        managed = {id(p) for unit in sharding.units for p in unit}
        if managed != set(group_of):
            raise ValueError(f"the optimizer's parameters ({len(group_of)}) are not the FSDP model's ({len(managed)}): "
                             f"build LionCub on model.parameters() of the model fully_shard wrapped")
        units = list(sharding.units)[::-1]  # backward reduce-scatters the last unit first
        for order, params in enumerate(units):
            groups = {group_of[id(p)] for p in params}
            if len(groups) > 1:
                raise ValueError("an FSDP unit's parameters are in different param groups of LionCub: each unit "
                                 "(one fully_shard call) is one bucket, so give its parameters one group")
            dtype = params[0].dtype
            if dtype not in DTYPES or any(p.dtype != dtype for p in params):
                raise ValueError(f"LionCub supports fp32, bf16 and fp16 parameters of one dtype per FSDP unit, not "
                                 f"{sorted({str(p.dtype) for p in params})}")
            shards = RowShards([p.shape for p in params], bounds(params), sharding.size)
            m = torch.zeros(shards.size, dtype=dtype, device=params[0].to_local().device)
            self.buckets.append(ShardedBucket(groups.pop(), params, shards, sharding.local, m, order))
        self._index(self.buckets, 0)

    @property
    def device(self):
        return self.buckets[0].m.device if self.buckets else torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return any(b.m.is_cuda for b in self.buckets)

    def add_group(self, gi: int, state) -> int:
        raise ValueError("LionCub over an FSDP model takes its buckets from the model's units: param groups cannot "
                         "be added after lioncub.attach_fsdp")

    def keep_private(self) -> None:
        raise ValueError("a model sharded by FSDP2 cannot also be wrapped in torch DDP")

    def zero(self, set_to_none: bool = False) -> None:
        """(.grad is FSDP's: LionCub.zero_grad clears it as torch does.)"""
        self._touched = [[False] * len(b.params) for b in self.buckets] if set_to_none else None
        self.unused = set()
        for b in self.buckets:
            b.g = None

    @torch.no_grad()
    def capture(self, p, k: int, i: int) -> None:
        b = self.buckets[k]
        if b.g is None and p.grad is not None:
            b.g = _flat_grad(b, i)

    @torch.no_grad()
    def collect(self, k: int | None = None) -> None:
        for kk in range(len(self.buckets)) if k is None else (k,):
            b = self.buckets[kk]
            for i, p in enumerate(b.params):
                if self._touched is not None and not self._touched[kk][i] and p.grad is None:
                    self.unused.add((kk, i))
                if b.g is None and p.grad is not None:
                    b.g = _flat_grad(b, i)
            if b.g is None:  # no gradient in this unit on this rank
                b.g = torch.zeros(b.n, dtype=b.m.dtype, device=b.m.device)

    def adopt_moved_params(self) -> None:
        pass

    def as_exchanged(self, versions) -> bool:
        return self.versions() == list(versions)

    def versions(self) -> list:
        return [version_of(b.g) for b in self.buckets]

    @torch.no_grad()
    def scale_(self, factor, buffers_only: bool = False) -> None:
        for b in self.buckets:
            if b.g is not None:
                b.g.mul_(factor.to(b.g.device) if isinstance(factor, torch.Tensor) else factor)


def _flat_grad(b: ShardedBucket, i: int) -> torch.Tensor:
    """The flat buffer of the shard's gradients that parameter i's .grad is a view of, checked against the
    layout: every parameter's .grad at its place, in one buffer of the shard's size."""
    grads = [p.grad.to_local() if p.grad is not None else None for p in b.params]
    base = grads[i]
    flat = torch.empty(0, dtype=base.dtype, device=base.device).set_(base.untyped_storage(), 0, (b.n,))
    ok = base.untyped_storage().nbytes() >= b.n * base.element_size() and base.dtype == b.m.dtype
    for j, g in enumerate(grads):
        at, n = b.shards.where(j, b.local)
        ok = ok and (g is None or (g.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                                   and g.storage_offset() == at and g.numel() == n and g.is_contiguous()))
    if not ok:
        raise ValueError("FSDP2 laid this unit's gradients out otherwise than LionCub expects (one flat buffer of the "
                         "shard, each parameter's rows at their place): was the unit sharded on the shard mesh, with "
                         "reduce_scatter_unused_params (lioncub.attach_fsdp sets it)?")
    return flat


class ShardedLayout(ShardLayout):
    """A model sharded by FSDP2 inside each node (lioncub.optim.sharded): FSDP's reduce-scatter gave each rank
    the node's mean of its shard, the replicas of a shard (one per node) vote on it, and each rank updates
    FSDP's shard in place (FSDP all-gathers the parameters for the next forward). The arithmetic of NodeLayout
    on the same ranks, without its reduce-scatter and all-gather."""

    codec_reads_local = True  # the shard's gradient is the node's mean already

    def __init__(self, group, sharding: Sharding):
        super().__init__(group)
        self.sharding, self.node_size, self.local = sharding, sharding.size, sharding.local
        self.cross = sharding.replicate_group
        self._scratch: dict = {}

    @property
    def voters(self) -> int:
        return self.sharding.replicas

    @property
    def voter(self) -> int:
        return self.sharding.replica

    def with_group(self, group) -> ShardedLayout:
        return ShardedLayout(group, self.sharding)

    def same_gradients(self, fingerprint, device) -> tuple[None, list]:
        """Not told here: the buckets hold shards of the node's mean (FSDP's reduce-scatter)."""
        return None, []

    def same_parameters(self, buckets) -> None:
        """Not told here: each rank of a node holds another shard (and FSDP2 holds the parameters)."""
        return None

    def norm_copies(self, dense: bool) -> int:
        """Each node's shards partition its mean gradient, so the world's sum counts every node's mean once:
        the norm is the RMS over nodes of the node means' norms (dense: of the one mean every node holds)."""
        return self.voters

    def exchange(self, spec, b, levels: int, wire_dtype: str):
        x = ReplicaMean(b, self.cross, self.voters, wire_dtype) if spec.dense else spec.exchange(
            b.n, b.m.device, self.cross, levels=levels, world_size=self.voters)
        x.collectives = [wire.Collective(c.op, c.nbytes, c.dtype, "cross") for c in x.collectives]
        return x

    def codec_input(self, b, x, local, inv_scale=None) -> tuple:
        """The node's mean of this rank's shard, as FSDP's reduce-scatter left it (`local`: divided by the loss
        scale)."""
        return local, b.shards.segments(self.local), 0.0

    def _piece(self, b) -> torch.Tensor:
        key = (b.m.dtype, b.m.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < b.n:
            buf = self._scratch[key] = torch.empty(b.n, dtype=b.m.dtype, device=b.m.device)
        return buf[: b.n]

    def apply(self, b, x, code, h, deferred: bool = False) -> None:
        piece = b.gather(self._piece(b))
        x.apply(piece, code, lr=h.lr, wd=h.wd, momentum=(b.g, b.m, h.beta2) if deferred else None)
        b.scatter(piece)

    def dense_step(self, buckets, skip=None) -> list:
        for b in buckets:
            h = buckets.hyper(b)
            piece = b.gather(self._piece(b))
            kernels.lion_step(piece, b.g, b.m, lr=h.lr, wd=h.wd, beta1=h.beta1, beta2=h.beta2, skip=skip)
            b.scatter(piece)
        return []

    def sync_momentum(self, buckets) -> list:
        if self.voters > 1:
            for b in buckets:
                allreduce_mean_(b.m, self.cross, torch.float32)
        return self.sync_collectives(buckets)

    def sync_collectives(self, buckets) -> list:
        if self.voters == 1:
            return []
        return [wire.Collective(c.op, c.nbytes, c.dtype, "cross") for b in buckets
                for c in wire.momentum_sync_collectives(b.shard)]

    def agreement(self, codec, buckets, xs, codes, levels: int) -> float | None:
        """Over every shard of the node (this rank reads its own; the node adds the sums up)."""
        total = count = 0.0
        for b, x, code in zip(buckets, xs, codes):
            got = schedules.bucket_sums(codec, code, b.n, self.voters, levels, x.layout)
            if got is None or codec is None or self.voters < 2:
                return None
            total, count = total + got[0], count + got[1]
        sums = torch.tensor([total, count], dtype=torch.float64, device=buckets.device)
        transport.call("all_reduce (agreement)", dist.all_reduce, sums, group=self.sharding.shard_group)
        total, count = sums.tolist()
        return min(1.0, total / count) if count else None

    def describe(self) -> str:
        return f", fsdp={self.voters}x{self.node_size}"


class ReplicaMean:
    """The dense method on a shard: the node means averaged over the replicas (the mean over every rank),
    reading the bucket's gradient when it runs (FSDP gives a new buffer every backward)."""

    layout = None

    def __init__(self, b, group, replicas: int, wire_dtype: str):
        self.b, self.group, self.replicas = b, group, replicas
        self.wire_dtype = getattr(torch, wire_dtype)
        self.collectives = [wire.Collective("allreduce", wire.DTYPE_BYTES[wire_dtype] * b.n, wire_dtype)] \
            if replicas > 1 else []

    def __call__(self):
        if self.replicas > 1:
            allreduce_mean_(self.b.g, self.group, self.wire_dtype)
        return self.b.g
