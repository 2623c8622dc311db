"""Who a rank exchanges with, and how: the flat layout (every rank votes) or the node layout (the ranks of a
node average inside it and vote across nodes as one; lioncub.optim.nodes).

A layout knows the process group, this rank and the world size, builds each bucket's exchange for a method,
says what gradient the codec reads, applies an agreed code, takes a dense Lion step, averages the momenta
and counts bytes. Nothing outside this module asks which layout it has.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lioncub import kernels
from lioncub.comm import wire
from lioncub.comm.transport import allreduce_mean_, equal_everywhere, group_rank_size
from lioncub.optim import agreement, nodes


class FlatLayout:
    """Every rank holds whole buckets and votes."""

    node_size = 1
    nodes = None  # the node layout's process groups (lioncub.optim.nodes.Nodes)

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world_size = group_rank_size(group)

    @property
    def voters(self) -> int:
        return self.world_size

    @property
    def voter(self) -> int:
        """This rank's place among the voters (the 1-bit codes' tie-break alternates over it)."""
        return self.rank

    def with_group(self, group) -> FlatLayout:
        return FlatLayout(group)

    def norm_copies(self, dense: bool) -> int | None:
        """For clipping: how many copies of the gradient the ranks' summed squares hold (the norm is the root
        of sum / copies: the RMS of the ranks' norms), or None where each rank's own sum is the norm (a dense
        step's mean gradient, held whole by every rank)."""
        return None if dense or self.world_size == 1 else self.world_size

    def exchange(self, spec, b, levels: int, wire_dtype: str):
        return spec.exchange(b.n, b.g.device, self.group, levels=levels, grad_wire_dtype=wire_dtype, grads=b.g)

    codec_reads_local = True  # the codec reads this rank's own gradient

    def codec_input(self, b, x, local, inv_scale=None) -> tuple:
        """(the gradient the codec reads, its segment boundaries, seconds spent communicating): here `local`,
        this rank's gradient of bucket b (already divided by the loss scale `inv_scale`)."""
        return local, b.offsets, 0.0

    def apply(self, b, x, code, h, deferred: bool = False) -> None:
        """p <- p(1 - lr wd) - lr U from the agreed code; with `deferred`, the momentum update `pack` left out."""
        x.apply(b.p, code, lr=h.lr, wd=h.wd, momentum=(b.g, b.m, h.beta2) if deferred else None)

    def momentum_piece(self, b, i: int):
        """The momentum of bucket b's parameter i that this rank holds."""
        return b.m[b.offsets[i] : b.offsets[i + 1]]

    def dense_step(self, buckets, skip=None) -> list:
        """Lion on gradients averaged over every rank (identical everywhere); returns its collectives. `skip`:
        kernels.nonfinite_flag's device flag (world size 1)."""
        for b in buckets:
            h = buckets.hyper(b)
            kernels.lion_step(b.p, b.g, b.m, lr=h.lr, wd=h.wd, beta1=h.beta1, beta2=h.beta2, skip=skip)
        return []

    def sync_momentum(self, buckets) -> list:
        """Average the momenta of every rank (a collective); returns what it put on the wire."""
        for b in buckets:
            allreduce_mean_(b.m, self.group, torch.float32)
        return self.sync_collectives(buckets)

    def sync_collectives(self, buckets) -> list:
        return [wire.Collective(c.op, c.nbytes, c.dtype, "world") for b in buckets
                for c in wire.momentum_sync_collectives(b.n)]

    def same_gradients(self, fingerprint: torch.Tensor, device) -> tuple[bool | None, list]:
        """(whether every rank's whole gradients have this rank's `fingerprint` (lioncub.optim.replicas); its
        collectives). None with one rank."""
        if self.world_size == 1:
            return None, []
        return equal_everywhere(fingerprint, self.group, device), [wire.SAME_GRADIENTS]

    def agreement(self, codec, buckets, xs, codes, levels: int) -> float | None:
        return agreement.agreement(codec, codes, [b.n for b in buckets], self.world_size, levels,
                                   [x.layout for x in xs])

    def traffic(self, collectives) -> tuple[int, int]:
        return wire.traffic(list(collectives), self.world_size, self.node_size)

    def node_bytes(self, collectives) -> int:
        """Bytes of `collectives` sent inside the node (NVLink/PCIe, not the NIC)."""
        return self.traffic([c for c in collectives if c.scope == "node"])[0]

    def momentum_shards(self, buckets) -> list | None:
        """The momenta a checkpoint must hold beside the parameters' state (none here: each is a parameter's)."""
        return None

    def check_resume(self, saved: dict, shards, buckets) -> None:
        """Raise if a checkpoint saved as `saved` (state_dict()["lioncub"]), with momentum `shards` or None,
        cannot resume on this layout."""
        if shards is not None:
            _mismatch(saved, shards, buckets, self)

    def describe(self) -> str:
        return ""


class ShardLayout(FlatLayout):
    """A layout in which each rank keeps the momentum of its shard of every bucket (`b.shards`, sharded over
    the G ranks of a node as FSDP2 shards parameters; this rank's shard `local`)."""

    local = 0

    def momentum_piece(self, b, i: int):
        """The momentum of parameter i's rows in this rank's shard (possibly none)."""
        at, n = b.shards.where(i, self.local)
        return b.m[at : at + n]

    def momentum_shards(self, buckets) -> list:
        """This rank's momentum shard of each bucket (in no parameter's state)."""
        return [b.m for b in buckets]

    def check_resume(self, saved: dict, shards, buckets) -> None:
        _mismatch(saved, shards, buckets, self)
        if shards is not None and saved.get("rank", self.rank) != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {saved['rank']}'s hierarchical checkpoint: each rank "
                             f"holds its own momentum shards and must load its own state_dict")


class NodeLayout(ShardLayout):
    """Nodes of `node_size` ranks: inside a node the gradients are averaged and the momenta sharded; the nodes
    vote (lioncub.optim.nodes)."""

    def __init__(self, group, node_size: int):
        super().__init__(group)
        self.node_size = node_size
        self.nodes = nodes.Nodes(group, node_size)
        self.local = self.nodes.local
        self._sign_gathers: list = []  # one per bucket, built on the first dense step

    @property
    def voters(self) -> int:
        return self.nodes.count

    @property
    def voter(self) -> int:
        return self.nodes.node

    def with_group(self, group) -> NodeLayout:
        return NodeLayout(group, self.node_size)

    def exchange(self, spec, b, levels: int, wire_dtype: str):
        if spec.dense:  # the dense warm-up averages whole buckets over every rank
            return super().exchange(spec, b, levels, wire_dtype)
        return nodes.ShardExchange(spec, b, self.nodes, levels, wire_dtype, self.group)

    codec_reads_local = False

    def codec_input(self, b, x, local, inv_scale=None) -> tuple:
        """The node's mean of this rank's shard (a reduce-scatter inside the node of the gradients as they
        are, then divided by the loss scale), and its segments."""
        t0 = time.perf_counter()
        g = x.reduce(b.g)
        if inv_scale is not None:
            g.mul_(inv_scale)
        return g, x.offsets, time.perf_counter() - t0

    def apply(self, b, x, code, h, deferred: bool = False) -> None:
        x.apply_shards(b, code, h, deferred)

    def dense_step(self, buckets) -> list:
        """Each rank forms sign(c) of its shard with its momentum shard and the node all-gathers the signs
        (nodes.SignGather): bit-identical to Lion on the mean gradient."""
        for b in buckets.buckets[len(self._sign_gathers):]:  # (buckets are only ever appended)
            self._sign_gathers.append(nodes.SignGather(b, self.nodes))
        for b, sg in zip(buckets, self._sign_gathers):
            sg.lion_step(b, buckets.hyper(b))
        return [sg.collective for sg in self._sign_gathers]

    def sync_momentum(self, buckets) -> list:
        for b in buckets:
            allreduce_mean_(b.m, self.nodes.cross, torch.float32)
        return self.sync_collectives(buckets)

    def sync_collectives(self, buckets) -> list:
        return [wire.Collective(c.op, c.nbytes, c.dtype, "cross") for b in buckets
                for c in wire.momentum_sync_collectives(b.shard)]

    def agreement(self, codec, buckets, xs, codes, levels: int) -> float | None:
        """Over every shard's agreed code: the vote of the N/G nodes, the padding left out."""
        pieces, sizes, layouts = zip(*[(piece, n, x.layout) for b, x, shards in zip(buckets, xs, codes)
                                       for piece, n in x.pieces(b, shards)])
        return agreement.agreement(codec, list(pieces), list(sizes), self.nodes.count, levels, list(layouts))

    def describe(self) -> str:
        return f", nodes={self.nodes.count}x{self.node_size}"


def _mismatch(saved: dict, shards, buckets, layout) -> None:
    saved_n, saved_g = saved.get("world_size", layout.world_size), saved.get("node_size", 1)
    if (saved_g, saved_n) != (layout.node_size, layout.world_size) or (
            shards is not None and [s.numel() for s in shards] != [b.shard for b in buckets]):
        raise ValueError(
            f"this checkpoint was saved with {saved_n} ranks in nodes of {saved_g}; this optimizer has "
            f"{layout.world_size} in nodes of {layout.node_size}: a hierarchical optimizer keeps momentum shards, "
            f"so resume it on the same layout (same world size, node size and buckets)")


def make_layout(group, hierarchical: bool, node_size: int | None, spec, device) -> FlatLayout:
    """The layout LionCub(hierarchical=..., node_size=...) asks for, checked; every rank must call it together
    (the node layout agrees the node size and creates process groups)."""
    if not hierarchical:
        if node_size is not None:
            raise ValueError("node_size applies only with hierarchical=True")
        return FlatLayout(group)
    if spec.dense:
        raise ValueError("hierarchical=True is for the compressed methods (allreduce leaves its hierarchy to "
                         "NCCL/Gloo)")
    G = nodes.resolve_node_size(node_size)
    flat = FlatLayout(group)
    if flat.world_size == 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("hierarchical=True needs torch.distributed initialised before LionCub is built")
        return flat
    nodes.agree_node_size(group, G, device)
    return NodeLayout(group, G) if G > 1 else flat
