"""The optimizer's memory: every parameter, gradient and momentum in flat per-dtype buffers, cut into buckets.

Each parameter's `.data` and `.grad` are views into the buffers (as DDP does with gradient_as_bucket_view), so
the codec kernels run once per bucket over contiguous memory and nothing is copied per step. A `.grad` that
was set to None or replaced still works, at the cost of a copy (`collect`). Under torch DDP (`keep_private`)
`.grad` belongs to DDP and the buckets hold copies of it.

Which parameters got no gradient: torch optimizers skip a parameter whose .grad is None. Here .grad stays a
view, so after `zero(set_to_none=True)` (and at construction) a hook notes which gradients backward writes;
`collect` finds the others whose gradient is None, or still the zero view (`unused`). The engine then agrees
across ranks which no rank used, and leaves those untouched.

The node layout shards each bucket over the G ranks of a node as FSDP2 shards parameters (`RowShards`). When
step() itself communicates, adjacent buckets are exchanged as one (`Run`, `plan`; below).
"""

from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch

from lioncub import kernels
from lioncub.comm import wire

# Every bucket starts on a multiple of this many elements: where the kernels start their pieces (64, CPU) and
# tiles (4096, GPU), so a run of adjacent buckets is cut exactly as each bucket is (`Run`). At most
# 16 KiB of fp32 padding per bucket.
BUCKET_ALIGN = 4096
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
log = logging.getLogger("lioncub")


class Hyper(NamedTuple):
    """A param group's hyperparameters as the kernels take them (read at every step: schedulers change lr)."""

    lr: float
    wd: float
    beta1: float
    beta2: float


class Bucket:
    """A contiguous run of whole parameters of one param group, dtype and device. `order` is where its
    gradients come in backward (0: first), relative to its group."""

    def __init__(self, group_index, params, p, g, m, offsets, order=0.0, shards=None, base=None, start=0):
        self.group_index, self.params, self.order = group_index, params, order
        self.base, self.start = base, start  # the flat (P, G, M) buffers it is a slice of, from `start` (flat layout)
        self.p, self.g, self.m = p, g, m  # flat views (m: this rank's shard in the node layout)
        self.offsets = offsets  # segment boundaries, one segment per parameter tensor
        self.n = p.numel()
        self.shards = shards  # node layout: how the node shards the bucket (RowShards)
        self.shard = m.numel()
        size = p.element_size()  # where each parameter's .data and .grad views start (checked every step)
        self.data_ptrs = [p.data_ptr() + size * s for s in offsets[:-1]]
        self.grad_ptrs = [g.data_ptr() + size * s for s in offsets[:-1]]

    def param_view(self, i: int) -> torch.Tensor:
        """Parameter i's elements, flat (a view of the bucket)."""
        return self.p[self.offsets[i] : self.offsets[i + 1]]

    def grad_in_place(self, i: int, param) -> bool:
        """Whether parameter i's .grad is still its view of the bucket."""
        grad = param.grad
        return grad is not None and grad.data_ptr() == self.grad_ptrs[i] and grad.numel() == param.numel()

    def segments(self):
        """(index, parameter, start, end) of each parameter in the bucket."""
        return ((i, p, s, e) for i, (p, s, e) in enumerate(zip(self.params, self.offsets[:-1], self.offsets[1:])))


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


class BucketSet:
    """The buckets of an optimizer's param groups, in the order backward produces their gradients.

    `node_size` G > 1 pads each bucket to G shards and keeps only this rank's shard of its momentum (the node
    layout); with G = 1 each parameter's momentum is a view too, stored as `state[p]["exp_avg"]`."""

    def __init__(self, param_groups: list, state, bucket_bytes: int, node_size: int = 1):
        self.param_groups, self.bucket_bytes, self.node_size = param_groups, bucket_bytes, node_size
        self.private = False  # .grad belongs to another owner (torch DDP, FSDP2)
        self.copies = False  # the buckets hold copies of .grad (torch DDP)
        self.warned_copies = False  # warn_if_copies_changed said it once
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, index in the bucket)
        self.unused: set[tuple[int, int]] = set()  # (bucket, index): no gradient on this rank this step
        self._seen: set[int] = set()
        self._had_grad: set[int] = set()  # parameters with a .grad when they were flattened
        self._touched: list[list[bool]] | None = []  # since the last zero(set_to_none=True): written by backward
        for gi in range(len(param_groups)):
            self.buckets += self._group_buckets(gi, state)
        self.buckets.sort(key=lambda b: b.order)  # stable: groups interleave by where their gradients come
        self._index(self.buckets, 0)

    def add_group(self, gi: int, state) -> int:
        """Flatten param group `gi` (added after construction) into new buckets, after the others (so that the
        existing buckets keep their places); returns how many."""
        new = self._group_buckets(gi, state)
        self._index(new, len(self.buckets))
        self.buckets += new
        return len(new)

    def _index(self, buckets: list, first: int) -> None:
        """Note where each parameter of `buckets` (from bucket index `first` on) is, and hook its gradient."""
        hook = _touch_hook(self)
        for k, b in enumerate(buckets, first):
            for i, p in enumerate(b.params):
                self.where[id(p)] = (k, i)
                p.register_post_accumulate_grad_hook(hook)
            if self._touched is not None:  # a gradient there before the optimizer was built counts as written
                self._touched.append([id(p) in self._had_grad for p in b.params])

    @torch.no_grad()
    def _group_buckets(self, gi: int, state) -> list[Bucket]:
        by_kind: dict[tuple, list] = {}
        for p in self.param_groups[gi]["params"]:
            if p.requires_grad and id(p) not in self._seen and p.numel() > 0:
                self._seen.add(id(p))
                by_kind.setdefault((p.device, p.dtype), []).append(p)
        out = []
        for (device, dtype), params in by_kind.items():
            if dtype not in DTYPES:
                raise ValueError(f"LionCub supports fp32, bf16 and fp16 parameters, not {dtype}")
            out += self._flatten(gi, params[::-1], dtype, device, state)  # backward's order, as DDP
        return out

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __getitem__(self, k: int) -> Bucket:
        return self.buckets[k]

    @property
    def device(self):
        return self.buckets[0].g.device if self.buckets else torch.device("cpu")

    @property
    def is_cuda(self) -> bool:
        return any(b.p.is_cuda for b in self.buckets)

    def hyper(self, b: Bucket) -> Hyper:
        group = self.param_groups[b.group_index]
        beta1, beta2 = group["betas"]
        return Hyper(group["lr"], group["weight_decay"], beta1, beta2)

    def _cut(self, params) -> list[list]:
        cuts = wire.cut_buckets([p.numel() * p.element_size() for p in params], self.bucket_bytes)
        return [[params[i] for i in ks] for ks in cuts]

    def _flatten(self, group_index, params, dtype, device, state) -> list[Bucket]:
        """Copy `params` into flat buffers (each bucket starting on a multiple of BUCKET_ALIGN), make each
        parameter's .data, .grad and momentum views into them, and cut them into buckets."""
        align, G = BUCKET_ALIGN, self.node_size
        # the node layout shards each bucket as FSDP2 does, its parameters in their group's order
        groups = [m[::-1] if G > 1 else m for m in self._cut(params)]
        starts, total, first = [], 0, [0]
        for members in groups:
            first.append(first[-1] + len(members))
            starts.append(total)
            total += -(-sum(p.numel() for p in members) // align) * align
        shards = [RowShards([p.shape for p in members], bounds(members), G) if G > 1 else None for members in groups]
        P = torch.zeros(total, dtype=dtype, device=device)
        Gr = torch.zeros(total, dtype=dtype, device=device)
        M = torch.zeros(total if G == 1 else sum(s.size for s in shards), dtype=dtype, device=device)
        buckets, m_start = [], 0
        for start, members, before, rows in zip(starts, groups, first, shards):
            ends = bounds(members)
            for p, lo in zip(members, ends):
                lo, n = start + lo, p.numel()
                P[lo : lo + n].copy_(p.data.reshape(-1))
                if p.grad is not None:
                    Gr[lo : lo + n].copy_(p.grad.reshape(-1))
                    self._had_grad.add(id(p))
                p.data = P[lo : lo + n].view_as(p)
                p.grad = Gr[lo : lo + n].view_as(p)
                if G == 1:  # (node layout: each rank holds a shard of the bucket's momenta, not whole ones)
                    state[p]["exp_avg"] = M[lo : lo + n].view_as(p)
            end = start + ends[-1]
            if G == 1:
                m = M[start:end]
            else:
                m = M[m_start : m_start + rows.size]
                m_start += rows.size
            buckets.append(Bucket(group_index, members, P[start:end], Gr[start:end], m, ends,
                                  before / len(params), rows, (P, Gr, M) if G == 1 else None, start))
        return buckets

    # --- gradients ---------------------------------------------------------------------------------------

    def keep_private(self) -> None:
        """From now on .grad belongs to another owner (torch DDP); the buckets keep their own copies, which
        `capture` (during backward) or `collect` fills."""
        self.private = self.copies = True
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    def zero(self, set_to_none: bool = False) -> None:
        """Zero the gradient buffers, keeping each .grad a view into them (unless private); with set_to_none,
        a gradient that backward then does not write counts as None (`unused`)."""
        self._touched = [[False] * len(b.params) for b in self.buckets] if set_to_none else None
        self.unused = set()
        for b in self.buckets:
            b.g.zero_()
            if not self.private:
                for i, p, s, e in b.segments():
                    if not b.grad_in_place(i, p):
                        p.grad = b.g[s:e].view_as(p)

    @torch.no_grad()
    def collect(self, k: int | None = None) -> None:
        """Bring every gradient of bucket k (default: all) into its view: None counts as zero, a replaced
        tensor is copied (under DDP: every .grad is copied); note those that are `unused`."""
        for kk in range(len(self.buckets)) if k is None else (k,):
            bucket = self.buckets[kk]
            for i, p, s, e in bucket.segments():
                if self._touched is not None and not self._touched[kk][i] and self._no_gradient(bucket, i, p, s, e):
                    self.unused.add((kk, i))
                if self.private:
                    _copy_grad(p, bucket.g[s:e])
                elif not bucket.grad_in_place(i, p):
                    if p.grad is not None and p.grad.is_sparse:
                        raise ValueError("LionCub does not support sparse gradients")
                    _copy_grad(p, bucket.g[s:e])
                    p.grad = bucket.g[s:e].view_as(p)

    def _no_gradient(self, b: Bucket, i: int, p, s: int, e: int) -> bool:
        """A gradient backward did not write: None, or (in the view) still all zero."""
        if p.grad is None:
            return True
        in_view = self.private or b.grad_in_place(i, p)
        return in_view and not bool((p.grad if self.private else b.g[s:e]).any())

    def used_flags(self) -> list[bool]:
        """Per parameter, in bucket order: whether this rank used it this step."""
        return [(k, i) not in self.unused for k, b in enumerate(self.buckets) for i in range(len(b.params))]

    def end_step(self) -> None:
        """A step took the gradients: nothing is tracked until the next zero(set_to_none=True)."""
        self._touched, self.unused = None, set()

    def touch(self, k: int, i: int) -> None:
        if self._touched is not None:
            self._touched[k][i] = True

    @torch.no_grad()
    def capture(self, p, k: int, i: int) -> None:
        """Copy parameter i of bucket k's final .grad into the bucket (private gradients only; called during
        backward, before DDP's own hook can touch .grad)."""
        if self.private:
            b = self.buckets[k]
            _copy_grad(p, b.g[b.offsets[i] : b.offsets[i + 1]])

    @torch.no_grad()
    def adopt_moved_params(self) -> None:
        """Frameworks sometimes replace a parameter's .data after the optimizer was built (accelerate's
        model.to("cpu:0") copies): bring the values back into the bucket and make .data its view again, so
        the update lands in the model."""
        for b in self.buckets:
            for (_, p, s, e), ptr in zip(b.segments(), b.data_ptrs):
                if p.data_ptr() == ptr:
                    continue
                view = b.p[s:e]
                if p.device != view.device or p.dtype != view.dtype:
                    raise ValueError(f"a parameter moved to {p.device}/{p.dtype} after LionCub was built on "
                                     f"{view.device}/{view.dtype}: build the optimizer after model.to(...)")
                view.copy_(p.data.reshape(-1))
                p.data = view.view_as(p)

    def versions(self) -> list[int]:
        """The gradient buffers' version counters (torch's in-place write counters)."""
        return [version_of(b.g) for b in self.buckets]

    def momentum_versions(self) -> list[int]:
        """The momentum buffers' version counters."""
        return [version_of(b.m) for b in self.buckets]

    def as_exchanged(self, versions) -> bool:
        """Whether the gradients are still those of `versions`, in their views (private copies: only the
        optimizer writes them, always)."""
        if self.private:
            return True
        for b, version in zip(self.buckets, versions):
            if version_of(b.g) != version:
                return False
            if not all(b.grad_in_place(i, p) for i, p in enumerate(b.params)):
                return False
        return True

    @torch.no_grad()
    def scale_(self, factor, buffers_only: bool = False) -> None:
        """Multiply every gradient by `factor` (a float or a 0-dim tensor): the buffers, and (private copies,
        unless `buffers_only`) .grad alike."""
        for b in self.buckets:
            b.g.mul_(factor.to(b.g.device) if isinstance(factor, torch.Tensor) else factor)
        if self.copies and not buffers_only:
            for b in self.buckets:
                for p in b.params:
                    if p.grad is not None:
                        p.grad.mul_(factor)

    def warn_if_copies_changed(self, step: int, samples: int = 16) -> None:
        """Under torch DDP the buckets hold copies of .grad made during backward, and the vote was taken from them:
        a .grad changed since (torch.nn.utils.clip_grad_norm_, a framework's max_grad_norm) does not reach the
        update. Say so, once. A clip scales every element, so a few elements of each parameter tell; the
        comparison waits for the device, so it runs on the first ten steps and every hundredth."""
        if self.warned_copies or not (step <= 10 or step % 100 == 0):
            return
        for b in self.buckets:
            for _, p, s, e in b.segments():
                if p.grad is None or p.grad.is_sparse or p.grad.dtype != b.g.dtype:
                    continue
                picked = slice(0, e - s, max(1, (e - s) // samples))
                if not torch.equal(p.grad.detach().reshape(-1)[picked], b.g[s:e][picked]):
                    log.warning("LionCub: .grad changed after backward (torch.nn.utils.clip_grad_norm_? a "
                                "framework's max_grad_norm?), but under torch DDP the vote was taken during backward, "
                                "so the change does not reach the update: clip with opt.clip_grad_norm_(max_norm) "
                                "between backward and step() (docs: Integrations, clipping).")
                    self.warned_copies = True
                    return

    def all_finite(self) -> bool:
        return kernels.all_finite([b.g for b in self.buckets])


def _copy_grad(p, view) -> None:
    if p.grad is None:
        view.zero_()
    else:
        view.copy_(p.grad.reshape(-1))


def _touch_hook(buckets: BucketSet):
    ref = weakref.ref(buckets)

    def hook(param):
        owner = ref()
        if owner is not None:
            owner.touch(*owner.where[id(param)])
    return hook


def bounds(members) -> list[int]:
    """The parameters' boundaries in a bucket of `members`."""
    bounds = [0]
    for p in members:
        bounds.append(bounds[-1] + p.numel())
    return bounds


def version_of(t: torch.Tensor | None) -> int | None:
    """torch's in-place write counter of a tensor (autograd's own check), None for no tensor."""
    return None if t is None else t._version


# --- runs: adjacent buckets exchanged as one when nothing can overlap ------------------------------------
#
# The automatic buckets (about 8 of 1-25 MiB, lioncub.comm.wire.auto_bucket_mb) are cut so that the first ones'
# exchange overlaps the rest of backward. When step() itself communicates (overlap=False, or gradients set
# without a backward), nothing overlaps and every extra bucket only adds its collectives' fixed costs, so
# step() exchanges runs of adjacent buckets of up to wire.STEP_RUN_MB as one.
#
# A run is its buckets' own memory: they lie back to back in one flat buffer per param group, dtype and device,
# each starting on a multiple of BUCKET_ALIGN elements, where the kernels start their pieces and tiles; a gap
# between two buckets is a segment of its own (zero gradient, zero momentum, no parameter). Every method's code
# is per coordinate and its L1 scales are per segment, so each coordinate gets the bits it gets when its bucket
# is exchanged alone, in fewer collectives (tested). Only the agreement statistic differs: it samples the run.
# The dense method's fp32 all-reduce of a run sums each coordinate in another order than its bucket's (the
# collective cuts its buffer into per-rank chunks), so a dense step over runs is equal to rounding, and, as
# always, identical on every rank.


class Run:
    """Buckets `members` (consecutive indices, back to back in memory) as one exchange: the fields of a
    Bucket that an exchange, the codec and the update read."""

    shards = None

    def __init__(self, buckets, members: list[int]):
        first, last = buckets[members[0]], buckets[members[-1]]
        P, G, M = first.base
        lo, hi = first.start, last.start + last.n
        self.members, self.group_index, self.order = tuple(members), first.group_index, first.order
        self.p, self.g, self.m = P[lo:hi], G[lo:hi], M[lo:hi]
        self.n = self.shard = hi - lo
        bounds, self._parts = [0], []  # _parts, in order: each bucket's index, None for the padding before one
        for k in members:
            b = buckets[k]
            at = b.start - lo
            if at > bounds[-1]:
                bounds.append(at)  # the padding before bucket k: a segment of its own
                self._parts.append(None)
            bounds += [at + o for o in b.offsets[1:]]
            self._parts.append(k)
        self.offsets = bounds

    def joined(self, per_bucket: list) -> torch.Tensor:
        """A per-segment tensor of the run from its buckets' (`per_bucket[k]`: one value per parameter tensor of
        bucket k), 0 for the padding between them."""
        zero = per_bucket[self.members[0]].new_zeros(1)
        return torch.cat([zero if k is None else per_bucket[k] for k in self._parts])


def plan(buckets, cap_bytes: int) -> list[list[int]] | None:
    """The runs of `buckets` (lists of bucket indices, ordered by their first bucket), each at most `cap_bytes`
    of parameters unless one bucket alone is larger; None where the buckets are not flat slices of shared
    buffers (node layout, FSDP). Param groups and dtypes interleave in backward's order, so a run collects the
    next buckets of its own buffer."""
    if not buckets or any(b.base is None for b in buckets):
        return None
    runs: list[list[int]] = []
    open_runs: dict[int, tuple[list[int], int]] = {}  # buffer -> (its latest run, that run's bytes)
    for k, b in enumerate(buckets):
        run, size = open_runs.get(id(b.base[0]), (None, 0))
        if run is not None and b.start == _align_up(buckets[run[-1]].start + buckets[run[-1]].n) \
                and size + _bytes(b) <= cap_bytes:
            run.append(k)
        else:
            run, size = [k], 0
            runs.append(run)
        open_runs[id(b.base[0])] = (run, size + _bytes(b))
    return runs


def _bytes(b) -> int:
    return b.n * b.p.element_size()


def _align_up(n: int) -> int:
    return -(-n // BUCKET_ALIGN) * BUCKET_ALIGN
