"""The node layout's pieces: process groups of nodes, and a bucket's exchange when a node votes as one.

Ranks form nodes of G (node-major, as torchrun numbers them: rank = node * G + local rank). Per bucket of
n parameters, padded to G shards of S = lioncub.comm.wire.shard_elements(n, G):

1. inside the node, a reduce-scatter of the gradients (over NVLink/PCIe) leaves each local rank the node's
   mean gradient of its shard;
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


def shard_offsets(offsets: list[int], start: int, size: int) -> list[int]:
    """The segment boundaries (one segment per parameter tensor) of the shard [start, start + size) of a
    bucket with boundaries `offsets`, relative to the shard; the padding past the last parameter is one
    more segment."""
    end = start + size
    inner = [o - start for o in offsets if start < o < end]
    bounds = [0] + inner + [size]
    return [b for i, b in enumerate(bounds) if i == 0 or b > bounds[i - 1]]


class ShardExchange:
    """One bucket's exchange on this rank when nodes vote: its shard's mean gradient (`grad`), the method's
    exchange of the shard across nodes (`inner`, whose encode pipeline fills `code`) and the node's
    all-gather of the agreed codes."""

    def __init__(self, spec, b, nodes: Nodes, levels: int, grad_wire_dtype: str, group=None):
        G, S = nodes.size, b.shard
        self.nodes, self.shard, self.group = nodes, S, group
        device, dtype = b.g.device, b.g.dtype
        wire_dtype = torch.bfloat16 if grad_wire_dtype == "bfloat16" and dtype == torch.float32 else dtype
        self.grad = torch.zeros(S, dtype=dtype, device=device)
        self._send = None if wire_dtype == dtype else torch.empty(G * S, dtype=wire_dtype, device=device)
        self._recv = self.grad if wire_dtype == dtype else torch.empty(S, dtype=wire_dtype, device=device)
        self.offsets = shard_offsets(b.offsets, nodes.local * S, S)  # of this rank's shard
        self.inner = spec.exchange(S, device, nodes.cross, levels=levels)
        self.layout, self.code = self.inner.layout, self.inner.code
        # the encode pipeline (steps 1 and 2) runs on the shard
        self.prepare, self.pack, self.encode = self.inner.prepare, self.inner.pack, self.inner.encode
        result = self.inner.result()
        self._gathered = torch.empty(G * result.numel() * result.element_size(), dtype=torch.uint8, device=device)
        self.collectives = spec.hierarchical_collectives(b.n, nodes.size * nodes.count, G, levels,
                                                         str(wire_dtype).removeprefix("torch."))

    def reduce(self, g_full: torch.Tensor) -> torch.Tensor:
        """Step 1 of the layout: `grad` <- the node's mean of this rank's shard of the padded bucket gradient."""
        src = g_full if self._send is None else self._send.copy_(g_full)
        transport.call("reduce_scatter (hierarchical gradients)", transport.reduce_scatter, self._recv, src,
                       group=self.nodes.intra)
        if self._recv is not self.grad:
            self.grad.copy_(self._recv)
        return self.grad.div_(self.nodes.size)

    def __call__(self) -> list:
        """Steps 2 and 3 (after `pack` filled `code`): the agreed code of every shard of the bucket."""
        self.inner()
        return [self.inner.code_from(r) for r in self.nodes.gather("all_gather_into_tensor (hierarchical codes)",
                                                                   self.inner.result(), self._gathered)]

    def apply_shards(self, b, codes: list, h, deferred: bool) -> None:
        """Every shard's update on the padded parameters; with `deferred`, the momentum update of this rank's
        shard that `pack` left out (from the node's mean gradient)."""
        S, mine = self.shard, self.nodes.local
        for s, code in enumerate(codes):
            self.inner.apply(b.p_full[s * S : (s + 1) * S], code, lr=h.lr, wd=h.wd,
                             momentum=(self.grad, b.m, h.beta2) if deferred and s == mine else None)

    def pieces(self, b, codes: list) -> list[tuple]:
        """(code, elements) of every shard, the padding left out (what lioncub.optim.agreement reads)."""
        S = self.shard
        return [(code, max(0, min(S, b.n - s * S))) for s, code in enumerate(codes)]


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
        self.collective = wire.Collective("allgather", nodes.size * nbytes, "uint8", "node")

    def lion_step(self, b, h) -> None:
        """Lion on the (averaged) gradient of bucket b: this rank's shard updates its momentum, every shard
        its parameters."""
        S, mine = b.shard, self.nodes.local
        self.x.pack(b.g_full[mine * S : (mine + 1) * S], b.m, None, beta1=h.beta1, beta2=h.beta2, offsets=None)
        for s, code in enumerate(self.nodes.gather("all_gather_into_tensor (hierarchical signs)", self.x.code,
                                                   self._gathered)):
            self.x.apply(b.p_full[s * S : (s + 1) * S], code, lr=h.lr, wd=h.wd)
