"""Wire formats and their arithmetic: p-bit fields, codecs, collectives, bytes (pure Python, no torch: shared by
lioncub.methods, the optimizer and the simulator).

p-bit field packing
-------------------
Each rank contributes a non-negative integer `v <= max_value` per element (a vote 0/1/2, or an L1 level
shifted to 0..2s). Elements are packed into integer words, `per_word` fields of `width` bits each, and
the words are summed by a native integer SUM all-reduce. The width is chosen so that the sum of N
contributions fits in one field:

    N * max_value < 2**width        (so a field never carries into its neighbour)

and the fields of a word occupy at most the word's non-negative range (`usable` bits: 8 for uint8,
31 for int32, 63 for int64), so the summed word never overflows or changes sign:

    sum_j N*max_value * 2**(width*j) < 2**(width*per_word) <= 2**usable.

The word type is the one that gives the fewest bits per element for this width.

Layout is planar: with `W = ceil(n / per_word)` words (rounded up to a multiple of 16), element `i`
lives in word `i % W`, field `i // W` (bits `width*(i//W) ...`). Packing is then `per_word` shifted
adds of contiguous slices, which is fast in torch and gives coalesced loads in a GPU kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_FIELD_WIDTH = 32
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}

WORD_ALIGN = 16
# (word bits, usable bits, dtype name); the dtypes are native SUM types in both NCCL and Gloo.
WORD_TYPES = ((8, 8, "uint8"), (32, 31, "int32"), (64, 63, "int64"))


@dataclass(frozen=True)
class FieldLayout:
    width: int  # bits per field
    per_word: int  # fields per word
    word_bits: int  # 8, 32 or 64
    dtype: str  # torch/numpy dtype name of the word
    max_value: int  # largest value one rank contributes to a field
    world_size: int

    @property
    def bits_per_element(self) -> float:
        return self.word_bits / self.per_word

    def words(self, n: int) -> int:
        """Words for n elements, rounded up to a multiple of 16 so that every field plane of a bucket
        starts on a 16-element boundary (aligned vector access in the kernels)."""
        return -(-n // (self.per_word * WORD_ALIGN)) * WORD_ALIGN

    def nbytes(self, n: int) -> int:
        return self.words(n) * self.word_bits // 8


def field_layout_for(max_value: int, world_size: int) -> FieldLayout:
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    width = (world_size * max_value).bit_length()
    if width > MAX_FIELD_WIDTH:
        raise ValueError(
            f"a field for {world_size} ranks x values up to {max_value} needs {width} bits "
            f"(max {MAX_FIELD_WIDTH}); use fewer levels"
        )
    best = None
    for word_bits, usable, dtype in WORD_TYPES:
        per_word = usable // width
        if per_word < 1:
            continue
        cand = FieldLayout(width, per_word, word_bits, dtype, max_value, world_size)
        if best is None or cand.bits_per_element < best.bits_per_element:
            best = cand
    assert best is not None
    return best


def result_planes(world_size: int) -> int:
    """Bit planes the 1-bit allreduce all-gathers: the majority sign, plus a 'not a tie' plane when N is
    even (a sum of an odd number of +-1 votes is never zero)."""
    return 2 if world_size % 2 == 0 else 1


@dataclass(frozen=True)
class Codec:
    """What the codec kernels do for a compressed method (lioncub.kernels implements each variant).

    kind "signs": c -> one packed bit per element (the 1-bit methods), decoded as a majority sign.
    kind "fields": c -> a p-bit field value per element, summed by an integer all-reduce; `values` is
    "vote" (sign(c) + 1, in {0, 1, 2}) or "l1" (L1 level q + s, in [0, 2s]); `decode` turns the sum f of
    N values into U: "sign" (sign(f - N*offset)) or "mean" ((f - N) / N).
    """

    kind: str
    values: str = ""
    decode: str = ""

    @property
    def l1(self) -> bool:
        return self.values == "l1"

    def offset(self, world_size: int, levels: int) -> int:
        """The summed field value that means U = 0."""
        return world_size * (levels if self.l1 else 1)


SIGNS = Codec("signs")


@dataclass(frozen=True)
class Collective:
    """One collective call. `nbytes` follows the simulator's SIZE convention: the bytes of each rank's
    whole buffer (all-reduce input, all-to-all send buffer, all-gather output, reduce-scatter input).
    `scope` is the group it runs on: "world" (every data-parallel rank), or in the hierarchical layout
    "node" (the G ranks of one node, over the fast links) or "cross" (the N/G ranks with the same local
    rank, one per node)."""

    op: str  # "allreduce" | "allgather" | "alltoall" | "reducescatter"
    nbytes: int
    dtype: str
    scope: str = "world"

    def group_size(self, world_size: int, node_size: int = 1) -> int:
        """Ranks in this collective's group."""
        if self.scope == "node":
            return node_size
        if self.scope == "cross":
            return world_size // node_size
        return world_size


# Each step of more than one rank agrees, in one tiny all-reduce, how many ranks saw a non-finite gradient,
# the sum of the ranks' squared gradient norms (for LionCub.clip_grad_norm_) and how many parameters got no
# gradient: [count, sum, unused] in float64.
CONTROL = Collective("allreduce", 24, "float64")
SAME_GRADIENTS = Collective("allreduce", 32, "float64")  # once, on the first compressed step (Engine.check_replicas)


def usage_collective(params: int) -> Collective:
    """The flags of which parameters any rank used, sent on a step where some rank left some without a
    gradient (LionCub then leaves the parameters no rank used untouched, as torch optimizers skip .grad None)."""
    return Collective("allreduce", 4 * params, "int32")


def momentum_sync_collectives(n: int) -> list[Collective]:
    return [Collective("allreduce", 4 * n, "float32")]


def auto_bucket_mb(total_bytes: float) -> float:
    """LionCub's default bucket size for parameters of `total_bytes` bytes: about 8 buckets, so that the
    exchange of the first ones overlaps the rest of backward, each between 1 MiB (DDP's first bucket: fewer
    bytes and the per-collective costs dominate) and 25 MiB (DDP's bucket_cap_mb)."""
    return min(25.0, max(1.0, total_bytes / 8 / 2**20))


def cut_buckets(nbytes: list[int], bucket_bytes: float) -> list[list[int]]:
    """LionCub's buckets of tensors of `nbytes` bytes each, given in backward's order (the last parameter first):
    the indices of each bucket, which closes once it holds at least `bucket_bytes` (at a tensor's boundary)."""
    out, current, size = [], [], 0
    for i, n in enumerate(nbytes):
        current.append(i)
        size += n
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


STEP_RUN_MB = 64.0  # when nothing overlaps, step() exchanges adjacent automatic buckets as one, up to this size


def bus_factor(op: str, ranks: int) -> float:
    """Bytes each rank sends per byte of the collective's SIZE with a bandwidth-optimal algorithm (the
    nccl-tests bus-bandwidth factor): 2(p-1)/p for all-reduce, (p-1)/p for all-gather, reduce-scatter and
    all-to-all, 1 for broadcast and reduce."""
    p = ranks
    if op == "allreduce":
        return 2 * (p - 1) / p
    if op in ("allgather", "reducescatter", "alltoall"):
        return (p - 1) / p
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def traffic(collectives: list[Collective], world_size: int, node_size: int = 1) -> tuple[int, int]:
    """(bytes sent, bytes received) per rank with bandwidth-optimal algorithms (node_size: G of the
    hierarchical layout, for collectives scoped to a node or across nodes)."""
    total = sum(bus_factor(c.op, c.group_size(world_size, node_size)) * c.nbytes for c in collectives)
    return int(total), int(total)


SHARD_ALIGN = 64  # elements: every shard of a bucket starts on a 64-element (cache-line, whole-byte) boundary


def shard_elements(n: int, node_size: int) -> int:
    """Elements of each of the G shards of an n-element bucket in the hierarchical layout (the last shard
    is padded with zeros): ceil(n / G) rounded up to SHARD_ALIGN."""
    per = -(-n // node_size)
    return -(-per // SHARD_ALIGN) * SHARD_ALIGN
