"""The node layout's pieces: process groups of nodes, how a bucket is sharded in a node, and a bucket's
exchange when a node votes as one.

Ranks form nodes of G (node-major, as torchrun numbers them: rank = node * G + local rank). A bucket is
sharded as FSDP2 shards parameters (`RowShards`): each parameter is split on dim 0 into G chunks of
ceil(rows / G) rows, zero-padded to that many, and local rank j's shard is its chunk of every parameter. So a
model sharded with FSDP2 inside the node (lioncub.integrations.fsdp) holds exactly these shards, and the two
run the same arithmetic. Per bucket:

1. inside the node, a reduce-scatter of the gradients (over NVLink/PCIe) leaves each local rank the node's
   mean gradient of its shard (the sum in the wire dtype, divided by G in it, as FSDP2's average);
2. each local rank keeps the momentum of its shard only (G times less optimizer memory) and quantizes its
   shard; the ranks with the same local rank on every node (the "cross" group: N/G voters) run the method's
   own collectives on it, so only 1/G of each node's votes leave a rank and the fields are sized for N/G;
3. inside the node, an all-gather of the agreed codes, and every rank applies the whole update.

Every rank of a node applies the same G agreed codes, and the same local rank on every node receives the
same agreed code, so replicas stay bit-identical. The Lion direction of a shard is formed from the node's
mean gradient: a node votes as one voter with G times the batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lioncub import methods
from lioncub.comm import transport, wire


def resolve_node_size(node_size: int | None) -> int:
    """G: `node_size`, or torchrun's LOCAL_WORLD_SIZE."""
    if node_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("hierarchical=True needs node_size= (ranks per node) or torchrun's LOCAL_WORLD_SIZE")
        try:
            node_size = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not a number of ranks per node") from None
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive integer, got {node_size!r}")
    return node_size


def agree_node_size(group, G: int, device="cpu") -> None:
    """Every rank must have the same G (nodes of different sizes would pair collectives wrongly and hang):
    one tiny all-reduce (on `device`: the parameters', as NCCL needs), before any group is built."""
    t = torch.tensor([G, -G], dtype=torch.int64, device=device)
    transport.call("all_reduce (node size)", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
    if t.tolist() != [G, -G]:
        raise ValueError(f"hierarchical: the ranks disagree on the node size (this rank: {G}, others up to "
                         f"{t[0].item()} / down to {-t[1].item()}); give the same node_size= everywhere or run "
                         f"under torchrun")


class Nodes:
    """The process groups of the node layout over `group` (the optimizer's data-parallel group): `intra`
    (this rank's node) and `cross` (this local rank's peers on every node). Every rank of the world must
    build it at the same time (it creates process groups), so `group` must span the world."""

    def __init__(self, group, size: int):
        world = dist.get_world_size()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        N, G = len(ranks), size
        if N != world:
            raise ValueError(f"hierarchical=True needs a process group of every rank ({world}), got one of {N}")
        if N % G:
            raise ValueError(f"hierarchical: {N} ranks do not form nodes of {G} (node_size / LOCAL_WORLD_SIZE)")
        me = ranks.index(dist.get_rank())
        self.size, self.count = G, N // G
        self.node, self.local = divmod(me, G)
        self.intra = self.cross = None
        for k in range(self.count):  # every rank creates every group, in the same order
            pg = dist.new_group([ranks[k * G + j] for j in range(G)])
            if k == self.node:
                self.intra = pg
        for j in range(G):
            pg = dist.new_group([ranks[k * G + j] for k in range(self.count)])
            if j == self.local:
                self.cross = pg

    def gather(self, name: str, mine: torch.Tensor, out: torch.Tensor) -> list:
        """All-gather the flat tensor `mine` inside the node into the uint8 buffer `out`: the G ranks' copies,
        as views of mine's dtype."""
        transport.call(name, transport.all_gather, out, mine.view(torch.uint8), group=self.intra)
        n = mine.numel() * mine.element_size()
        return [out[s * n : (s + 1) * n].view(mine.dtype) for s in range(self.size)]


class RowShards:
    """FSDP2's sharding of a bucket over the G ranks of a node: parameter i (elements [offsets[i],
    offsets[i+1]) of the bucket, `shapes[i]`) is split on dim 0 into chunks of ceil(rows / G) rows (torch.chunk:
    the last chunks shorter, or empty), each padded with zeros to that many rows; shard j is chunk j of every
    parameter, in bucket order. `pieces[j]`: (bucket start, elements, shard offset) of each chunk's rows."""

    def __init__(self, shapes: list, offsets: list[int], G: int):
        self.G, self.offsets = G, offsets
        self.pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(G)]
        self.padded: list[int] = []  # per parameter: its elements in every shard
        at = 0
        for shape, start, end in zip(shapes, offsets[:-1], offsets[1:]):
            rows = shape[0] if len(shape) else 1
            cols = (end - start) // rows if rows else 0
            per = -(-rows // G)
            for j in range(G):
                lo, hi = min(j * per, rows), min((j + 1) * per, rows)
                self.pieces[j].append((start + lo * cols, (hi - lo) * cols, at))
            self.padded.append(per * cols)
            at += per * cols
        self.size = at

    def gather(self, flat: torch.Tensor, j: int, out: torch.Tensor) -> torch.Tensor:
        """Shard j of the bucket-ordered `flat` into `out` (its `size` elements; the padding zero)."""
        out.zero_()
        for start, n, at in self.pieces[j]:
            if n:
                out[at : at + n].copy_(flat[start : start + n])
        return out

    def scatter(self, shard: torch.Tensor, j: int, flat: torch.Tensor) -> None:
        """The real elements of shard j back into the bucket-ordered `flat`."""
        for start, n, at in self.pieces[j]:
            if n:
                flat[start : start + n].copy_(shard[at : at + n])

    def segments(self, j: int) -> list[int]:
        """The boundaries inside shard j of each parameter's chunk and, where there is one, its padding (one
        segment each: the L1 codec's scale is per segment)."""
        bounds = [0]
        for (_, n, at), padded in zip(self.pieces[j], self.padded):
            for end in (at + n, at + padded):
                if end > bounds[-1]:
                    bounds.append(end)
        return bounds

    def where(self, i: int, j: int) -> tuple[int, int]:
        """(shard offset, elements) of parameter i's rows in shard j."""
        _, n, at = self.pieces[j][i]
        return at, n


class ShardExchange:
    """One bucket's exchange on this rank when nodes vote: its shard's mean gradient (`grad`), the method's
    exchange of the shard across nodes (`inner`, whose encode pipeline fills `code`) and the node's
    all-gather of the agreed codes."""

    def __init__(self, spec, b, nodes: Nodes, levels: int, grad_wire_dtype: str, group=None):
        G, S = nodes.size, b.shard
        self.nodes, self.shards, self.group = nodes, b.shards, group
        device, dtype = b.g.device, b.g.dtype
        wire_dtype = torch.bfloat16 if grad_wire_dtype == "bfloat16" and dtype == torch.float32 else dtype
        self.grad = torch.zeros(S, dtype=dtype, device=device)
        self._send = torch.empty(G * S, dtype=wire_dtype, device=device)
        self._recv = self.grad if wire_dtype == dtype else torch.empty(S, dtype=wire_dtype, device=device)
        self._pieces = torch.empty(S, dtype=b.p.dtype, device=device)  # one shard of parameters, to update
        self.offsets = b.shards.segments(nodes.local)  # of this rank's shard
        self.inner = spec.exchange(S, device, nodes.cross, levels=levels)
        self.layout, self.code = self.inner.layout, self.inner.code
        # the encode pipeline (steps 1 and 2) runs on the shard
        self.prepare, self.pack, self.encode = self.inner.prepare, self.inner.pack, self.inner.encode
        result = self.inner.result()
        self._gathered = torch.empty(G * result.numel() * result.element_size(), dtype=torch.uint8, device=device)
        self.collectives = spec.hierarchical_collectives(b.n, nodes.size * nodes.count, G, levels,
                                                         str(wire_dtype).removeprefix("torch."), shard=S)

    def reduce(self, g: torch.Tensor) -> torch.Tensor:
        """Step 1 of the layout: `grad` <- the node's mean of this rank's shard of the bucket gradient g: the
        shards laid out rank after rank, summed in the wire dtype by a reduce-scatter, divided by G in it."""
        S = self.shards.size
        for j in range(self.nodes.size):
            self.shards.gather(g, j, self._send[j * S : (j + 1) * S])
        transport.call("reduce_scatter (hierarchical gradients)", transport.reduce_scatter, self._recv, self._send,
                       group=self.nodes.intra)
        self._recv.div_(self.nodes.size)
        if self._recv is not self.grad:
            self.grad.copy_(self._recv)
        return self.grad

    def __call__(self) -> list:
        """Steps 2 and 3 (after `pack` filled `code`): the agreed code of every shard of the bucket."""
        self.inner()
        return [self.inner.code_from(r) for r in self.nodes.gather("all_gather_into_tensor (hierarchical codes)",
                                                                   self.inner.result(), self._gathered)]

    def apply_shards(self, b, codes: list, h, deferred: bool) -> None:
        """Every shard's update on the parameters (gathered into one shard's buffer, updated, put back); with
        `deferred`, the momentum update of this rank's shard that `pack` left out (from the node's mean)."""
        mine = self.nodes.local
        for s, code in enumerate(codes):
            piece = self.shards.gather(b.p, s, self._pieces)
            self.inner.apply(piece, code, lr=h.lr, wd=h.wd,
                             momentum=(self.grad, b.m, h.beta2) if deferred and s == mine else None)
            self.shards.scatter(piece, s, b.p)

    def pieces(self, b, codes: list) -> list[tuple]:
        """(code, elements) of every shard (the padding inside each shard counted: it votes as c = 0)."""
        return [(code, self.shards.size) for code in codes]


class SignGather:
    """A dense step's node all-gather, on gradients averaged over every rank: each rank encodes sign(c) of its
    shard with its momentum shard (vote-pbit's 2-bit fields of one voter, through that method's own pipeline)
    and the node gathers them, so every rank applies every shard's: bit-identical to Lion on the mean."""

    SPEC = "vote-pbit"

    def __init__(self, b, nodes: Nodes):
        self.nodes = nodes
        self.x = methods.get(self.SPEC).exchange(b.shard, b.g.device, world_size=1)
        nbytes = self.x.code.numel() * self.x.code.element_size()
        self._gathered = torch.empty(nodes.size * nbytes, dtype=torch.uint8, device=b.g.device)
        self._shard = torch.empty(b.shard, dtype=b.g.dtype, device=b.g.device)
        self.collective = wire.Collective("allgather", nodes.size * nbytes, "uint8", "node")

    def lion_step(self, b, h) -> None:
        """Lion on the (averaged) gradient of bucket b: this rank's shard updates its momentum, every shard
        its parameters."""
        g = b.shards.gather(b.g, self.nodes.local, self._shard)
        self.x.pack(g, b.m, None, beta1=h.beta1, beta2=h.beta2, offsets=None)
        for s, code in enumerate(self.nodes.gather("all_gather_into_tensor (hierarchical signs)", self.x.code,
                                                   self._gathered)):
            piece = b.shards.gather(b.p, s, self._shard)
            self.x.apply(piece, code, lr=h.lr, wd=h.wd)
            b.shards.scatter(piece, s, b.p)
