"""What each communication method puts on the wire (pure Python: shared by the optimizer and the simulator).

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

METHODS = ("allreduce", "vote-allgather", "vote-1bit", "vote-pbit", "avg-pbit", "l1-pbit")
PBIT_METHODS = ("vote-pbit", "avg-pbit", "l1-pbit")
ONEBIT_METHODS = ("vote-allgather", "vote-1bit")
MAX_FIELD_WIDTH = 32

WORD_ALIGN = 16
# (word bits, usable bits, dtype name); the dtypes are native SUM types in both NCCL and Gloo.
WORD_TYPES = ((8, 8, "uint8"), (32, 31, "int32"), (64, 63, "int64"))


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    return method


def default_levels(world_size: int) -> int:
    """Lion Cub's default number of L1 levels: the int8-safe s = floor(127/N), at least 1."""
    return max(1, 127 // max(1, world_size))


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


def field_layout(method: str, world_size: int, levels: int | None = None) -> FieldLayout:
    """The packing used by a p-bit method at this world size."""
    check_method(method)
    if method in ("vote-pbit", "avg-pbit"):
        return field_layout_for(2, world_size)
    if method == "l1-pbit":
        s = default_levels(world_size) if levels is None else levels
        if not isinstance(s, int) or s < 1:
            raise ValueError(f"levels must be a positive integer, got {levels!r}")
        return field_layout_for(2 * s, world_size)
    raise ValueError(f"method {method!r} does not use p-bit fields")


def onebit_chunk_bytes(n: int, world_size: int) -> int:
    """Bytes of one rank's chunk of a 1-bit vector padded to a multiple of 8*N elements."""
    return -(-n // (8 * world_size))


def result_planes(world_size: int) -> int:
    """Bit planes the 1-bit allreduce all-gathers: the majority sign, plus a 'not a tie' plane when N is
    even (a sum of an odd number of +-1 votes is never zero)."""
    return 2 if world_size % 2 == 0 else 1


# Composite ops (`lioncub simulate collective --op vote-1bit`, `lioncub lab bench --op vote-1bit`) take a
# SIZE that is the bytes of the fp32 bucket they synchronize: n = SIZE // 4 parameters.
COMPOSITE_OPS = METHODS + ("momentum-sync",)


def composite_elements(nbytes: int) -> int:
    return max(1, nbytes // 4)


@dataclass(frozen=True)
class Collective:
    """One collective call. `nbytes` follows the simulator's SIZE convention: the bytes of each rank's
    whole buffer (all-reduce input, all-to-all send buffer, all-gather output)."""

    op: str  # "allreduce" | "allgather" | "alltoall"
    nbytes: int
    dtype: str


def vote_collectives(
    method: str, n: int, world_size: int, levels: int | None = None, grad_dtype: str = "float32"
) -> list[Collective]:
    """The collectives one bucket of `n` elements costs per step (excluding the step's control message)."""
    check_method(method)
    N = world_size
    if N == 1:
        return []
    if method == "allreduce":
        size = {"float32": 4, "bfloat16": 2, "float16": 2}[grad_dtype]
        return [Collective("allreduce", size * n, grad_dtype)]
    if method == "vote-allgather":
        return [Collective("allgather", N * -(-n // 8), "uint8")]
    if method == "vote-1bit":
        chunk = onebit_chunk_bytes(n, N)
        return [
            Collective("alltoall", N * chunk, "uint8"),
            Collective("allgather", N * chunk * result_planes(N), "uint8"),
        ]
    lay = field_layout(method, N, levels)
    return [Collective("allreduce", lay.nbytes(n), lay.dtype)]


# Each compressed step first agrees, in one tiny all-reduce, whether any rank saw a non-finite gradient.
CONTROL = Collective("allreduce", 4, "int32")


def momentum_sync_collectives(n: int) -> list[Collective]:
    return [Collective("allreduce", 4 * n, "float32")]


def wire_bits_per_element(method: str, world_size: int, levels: int | None = None) -> float:
    """Bits each rank sends per parameter per step with bandwidth-optimal collectives (large n)."""
    N = world_size
    if N == 1:
        return 0.0
    f = (N - 1) / N
    if method == "allreduce":
        return 2 * f * 32
    if method == "vote-allgather":
        return f * N
    if method == "vote-1bit":
        return f * (1 + result_planes(N))
    return 2 * f * field_layout(method, N, levels).bits_per_element
