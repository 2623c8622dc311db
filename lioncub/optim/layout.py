"""Who a rank exchanges with, and how: the flat layout (every rank votes) or the node layout (the ranks of a
node average inside it and vote across nodes as one).

A layout knows the process group, this rank and the world size, builds each bucket's exchange for a method,
says what gradient the codec reads, applies an agreed code, takes a dense Lion step, averages the momenta
and counts bytes. Nothing outside this module asks which layout it has.

The node layout (`NodeLayout`; its process groups `Nodes`, a bucket's exchange `ShardExchange`): ranks form
nodes of G (node-major, as torchrun numbers them: rank = node * G + local rank). A bucket is sharded as FSDP2
shards parameters (lioncub.optim.buckets.RowShards): each parameter is split on dim 0 into G chunks of ceil(rows
/ G) rows, zero-padded to that many, and local rank j's shard is its chunk of every parameter. So a model
sharded with FSDP2 inside the node (lioncub.integrations.fsdp) holds exactly these shards, and the two run the
same arithmetic. Per bucket:

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
import time

import torch
import torch.distributed as dist

from lioncub import kernels, methods
from lioncub.comm import transport, wire
from lioncub.comm.transport import allreduce_mean_, equal_everywhere, group_rank_size
from lioncub.optim import schedules


class FlatLayout:
    """Every rank holds whole buckets and votes."""

    node_size = 1
    nodes = None  # the node layout's process groups (Nodes)

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
        """(whether every rank's whole gradients have this rank's `fingerprint` (Engine.check_replicas); its
        collectives). None with one rank."""
        if self.world_size == 1:
            return None, []
        return equal_everywhere(fingerprint, self.group, device), [wire.SAME_GRADIENTS]

    def same_parameters(self, buckets) -> bool | None:
        """Whether every rank holds the same parameters in `buckets` (Engine.start_equal): one 16-byte MAX
        all-reduce of (f, -f), f their bytes_fingerprint (the maximum equals the negated minimum exactly when
        every rank sent the same f), not counted in the statistics (a set-up collective, as the node-size
        agreement). None with one rank."""
        if self.world_size == 1:
            return None
        f = bytes_fingerprint(b.p for b in buckets)
        mine = torch.stack([f, -f])
        t = mine.to(buckets.device, copy=True)
        transport.call("all_reduce (same parameters)", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group)
        return torch.equal(t.cpu(), mine)

    def broadcast_parameters(self, buckets) -> None:
        """Every rank takes the parameters of the group's rank 0 (one broadcast per bucket)."""
        for b in buckets:
            transport.call("broadcast (parameters)", dist.broadcast, b.p, group=self.group, group_src=0)

    def clipped_pass(self, exchanges, factor: float) -> None:
        """clip_grad_norm_ multiplied the gradients by `factor` after a pass exchanged them: what that pass's
        deferred momentum update reads must be scaled alike. Here it reads the buckets' gradients, scaled."""

    def agreement(self, codec, buckets, xs, codes, levels: int) -> float | None:
        return schedules.agreement(codec, codes, [b.n for b in buckets], self.world_size, levels,
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
    vote (the module's docstring)."""

    def __init__(self, group, node_size: int):
        super().__init__(group)
        self.node_size = node_size
        self.nodes = Nodes(group, node_size)
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
        return ShardExchange(spec, b, self.nodes, levels, wire_dtype, self.group)

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

    def clipped_pass(self, exchanges, factor: float) -> None:
        """The deferred momentum update reads each exchange's node mean (`grad`, taken before the clip)."""
        for x in exchanges:
            x.grad.mul_(factor)

    def dense_step(self, buckets) -> list:
        """Each rank forms sign(c) of its shard with its momentum shard and the node all-gathers the signs
        (SignGather): bit-identical to Lion on the mean gradient."""
        for b in buckets.buckets[len(self._sign_gathers):]:  # (buckets are only ever appended)
            self._sign_gathers.append(SignGather(b, self.nodes))
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
        return schedules.agreement(codec, list(pieces), list(sizes), self.nodes.count, levels, list(layouts))

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


FINGERPRINT_PIECE = 1 << 20  # words per piece: bounds the int64 temporaries to 24 MiB


def bytes_fingerprint(tensors) -> torch.Tensor:
    """A 0-dim int64 fingerprint of the tensors' bytes: sum_j w_j (2j + 1) mod 2^64 over their words w_j (the
    int32 or int16 views, tensor after tensor). Exact integer arithmetic, so equal bytes give equal fingerprints
    in any summation order and on any device. It changes with any one word (2j + 1 is odd, so invertible mod
    2^64) and with a swap of two unequal words (below 2^31 words); other differences collide with a chance of
    about 2^-64."""
    total = torch.zeros((), dtype=torch.int64)
    at = 0
    for t in tensors:
        words = t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)
        for s in range(0, words.numel(), FINGERPRINT_PIECE):
            piece = words[s : s + FINGERPRINT_PIECE].long()
            odd = torch.arange(2 * (at + s) + 1, 2 * (at + s + piece.numel()), 2, dtype=torch.int64,
                               device=piece.device)
            total += piece.mul_(odd).sum().cpu()
        at += words.numel()
    return total


def make_layout(group, node_size, spec, device) -> FlatLayout:
    """The layout LionCub(node_size=...) asks for, checked: None the flat layout; G (or LOCAL, torchrun's
    LOCAL_WORLD_SIZE) nodes of G ranks. Every rank must call it together (the node layout agrees the node size
    and creates process groups)."""
    if node_size is None:
        return FlatLayout(group)
    if spec.dense:
        raise ValueError("node_size= (the node layout) is for the compressed methods (allreduce leaves its "
                         "hierarchy to NCCL/Gloo)")
    G = resolve_node_size(node_size)
    flat = FlatLayout(group)
    if flat.world_size == 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("node_size= (the node layout) needs torch.distributed initialised before LionCub is "
                             "built")
        return flat
    agree_node_size(group, G, device)
    return NodeLayout(group, G) if G > 1 else flat


# --- the node layout's pieces ----------------------------------------------------------------------------


LOCAL = "local"  # LionCub(node_size=LOCAL): nodes of torchrun's LOCAL_WORLD_SIZE ranks


def resolve_node_size(node_size) -> int:
    """G: `node_size`, or torchrun's LOCAL_WORLD_SIZE for LOCAL."""
    if node_size == LOCAL:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError(f"node_size={LOCAL!r} needs torchrun's LOCAL_WORLD_SIZE; give node_size=G (ranks per "
                             "node) elsewhere")
        try:
            node_size = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not a number of ranks per node") from None
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive integer or {LOCAL!r}, got {node_size!r}")
    return node_size


def agree_node_size(group, G: int, device="cpu") -> None:
    """Every rank must have the same G (nodes of different sizes would pair collectives wrongly and hang):
    one tiny all-reduce (on `device`: the parameters', as NCCL needs), before any group is built."""
    t = torch.tensor([G, -G], dtype=torch.int64, device=device)
    transport.call("all_reduce (node size)", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
    if t.tolist() != [G, -G]:
        raise ValueError(f"node_size: the ranks disagree on the node size (this rank: {G}, others up to "
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
            raise ValueError(f"node_size= (the node layout) needs a process group of every rank ({world}), got "
                             f"one of {N}")
        if N % G:
            raise ValueError(f"node_size={G}: {N} ranks do not form nodes of {G} (node_size / LOCAL_WORLD_SIZE)")
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
