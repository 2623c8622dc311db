"""When to average the ranks' momenta (selective momentum synchronization).

A schedule (a `Schedule`) answers `should_sync(step)` for step = 1, 2, ... It is a pure function of the step,
so every rank decides the same way without talking. `Adaptive` decides from the ranks' agreement, a function
of the agreed code that is identical on every rank (`agreement`, below), so it too decides alike without
talking.

The agreement: how much the ranks agreed on a step, read off the agreed code (no extra communication).

The statistic is a function of the agreed code alone, which is identical on every rank, so every rank
computes the same number (`LionCub.stats.last_agreement`) and can take decisions on it without talking
(`momentum_sync="adaptive"`). It is computed in torch on a strided sample of the code (about
`SAMPLE` elements per bucket), beside the kernels, whose fast path it does not touch.

* p-bit fields of votes (vote-pbit, avg-pbit): the vote margin |sum of signs| / N, averaged over the
  sampled coordinates (1: every rank voted the same sign everywhere; 0: every coordinate tied).
* p-bit fields of L1 levels (l1-pbit): |sum of levels| / (N s), the same margin weighted by each rank's
  magnitude level (1: every rank at its top level with the same sign).
* 1-bit votes (vote-1bit, vote-allgather): the agreed code holds only the majority sign and, for an even
  N, the not-a-tie plane, so the margin is not there; the tie fraction is. With independent fair-coin votes
  a share t0 = C(N, N/2) / 2^N of the coordinates tie (0.5 at N = 2, 0.375 at N = 4, 0.27 at N = 8), with
  unanimous ranks none: agreement = 1 - ties / t0, clipped to [0, 1]. For an odd N nothing in the code
  tells a 3:2 vote from a 5:0 one, and the statistic is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lioncub.methods.base import LazyModule

torch = LazyModule("torch")  # (only the agreement statistic needs it: the schedules are pure Python)


class Schedule:
    """What LionCub asks a momentum-sync schedule. Subclasses define `should_sync` (a function of the step)
    and `rate`; a schedule that decides from the step's agreement (Adaptive) overrides `decide`, one with a
    dense start `start_steps`, one with state `state_dict` / `load_state_dict`."""

    def should_sync(self, step: int) -> bool:
        raise NotImplementedError

    def rate(self, steps: int | None = None) -> float:
        """The share of steps that sync (over `steps` steps where it depends on the run's length)."""
        raise NotImplementedError

    def sync_steps(self, steps: int) -> list[int]:
        """The steps in 1..steps after which the momenta are averaged (as far as the step alone decides)."""
        return [t for t in range(1, steps + 1) if self.should_sync(t)]

    def start_steps(self, betas) -> int:
        """Steps at the start that run the dense method (averaged gradients, one momentum)."""
        return 0

    def decide(self, step: int, agreement: float | None, step_bytes: float, sync_bytes: float) -> bool:
        """Whether to sync after compressed step `step`, given what it agreed and sent (identical on every
        rank) and what a sync costs."""
        return self.should_sync(step)

    def spend(self, nbytes: float) -> None:
        """Charge the bytes of a dense start step (a schedule with a byte budget counts them)."""

    def state_dict(self) -> dict | None:
        """What a resumed run needs to decide as the uninterrupted one (None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass(frozen=True)
class EveryK(Schedule):
    """Average momenta after every k-th step.

    Args:
        k: the interval, in steps (an int >= 1).

    Example:
        >>> from lioncub import EveryK
        >>> EveryK(20).sync_steps(60)
        [20, 40, 60]
    """

    k: int

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"momentum sync interval must be a positive integer, got {self.k!r}")

    def should_sync(self, step: int) -> bool:
        return step % self.k == 0

    def rate(self, steps: int | None = None) -> float:
        return 1.0 / self.k

    def sync_steps(self, steps: int) -> list[int]:
        return list(range(self.k, steps + 1, self.k))


@dataclass(frozen=True)
class FirstSteps(Schedule):
    """Every k-th step, but only during the first `until` steps (sync early, then run free).

    Args:
        k: the interval, in steps (an int >= 1).
        until: the last step that may sync (>= 0).

    Example:
        >>> from lioncub import FirstSteps
        >>> FirstSteps(10, until=30).sync_steps(100)
        [10, 20, 30]
    """

    k: int
    until: int

    def __post_init__(self):
        EveryK(self.k)
        if self.until < 0:
            raise ValueError(f"until must be >= 0, got {self.until}")

    def should_sync(self, step: int) -> bool:
        return step <= self.until and step % self.k == 0

    def rate(self, steps: int | None = None) -> float:
        if steps is None:
            return 0.0
        return min(steps, self.until) // self.k / max(steps, 1)

    def sync_steps(self, steps: int) -> list[int]:
        return list(range(self.k, min(self.until, steps) + 1, self.k))


@dataclass(frozen=True)
class Geometric(Schedule):
    """Dense early, sparser later: syncs at T_1, T_2, ... with T_0 = 0 and
    T_{j+1} = T_j + max(1, floor(growth ** (j / k))), optionally capped at max_interval. With growth 2
    the interval doubles every k syncs (the Lion Cub authors' geometric schedule).

    Args:
        k: the syncs per doubling of the interval (> 0; with growth 2).
        growth: the interval's growth per k syncs (>= 1).
        max_interval: the longest interval, in steps (None: no cap).

    Example:
        >>> from lioncub import Geometric
        >>> Geometric(k=2).sync_steps(20)
        [1, 2, 4, 6, 10, 15]
    """

    k: float = 1.0
    growth: float = 2.0
    max_interval: int | None = None

    def __post_init__(self):
        if self.k <= 0 or self.growth < 1:
            raise ValueError("Geometric needs k > 0 and growth >= 1")
        if self.max_interval is not None and self.max_interval < 1:
            raise ValueError("max_interval must be >= 1")

    def interval(self, j: int) -> int:
        """T_{j+1} - T_j."""
        step = max(1, int(self.growth ** (j / self.k)))
        return min(step, self.max_interval) if self.max_interval else step

    def should_sync(self, step: int) -> bool:
        t, j = 0, 0
        while t < step:
            t += self.interval(j)
            j += 1
        return t == step

    def sync_steps(self, steps: int) -> list[int]:
        out, t, j = [], 0, 0
        while True:
            t += self.interval(j)
            j += 1
            if t > steps:
                return out
            out.append(t)

    def rate(self, steps: int | None = None) -> float:
        steps = steps or 10_000
        return len(self.sync_steps(steps)) / steps


ADAPTIVE_THRESHOLD = 0.5  # agreement (`agreement`) below which Adaptive syncs; from the convergence map
ADAPTIVE_BUDGET = 1.0  # the guard's bytes at most this many times the method's own bytes (total <= 2x)


def momentum_lead_step(beta1: float, beta2: float) -> int:
    """The first step t at which Lion's c = b1 m + (1 - b1) g leans on the momentum at least as much as on
    the gradient. The momentum starts at zero, so after t steps of a steady gradient |m| = (1 - b2^t)|g|:
    the first t with b1 (1 - b2^t) >= 1 - b1 (12 for Lion's (0.9, 0.99), 3 for (0.95, 0.98)). Before it, c
    is mostly each rank's own current gradient, a vote on it is as noisy as a vote can be, and averaging
    the momenta cannot help. 0 when b1 <= 1/2: c never leans on the momentum."""
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {(beta1, beta2)}")
    if beta1 <= 0.5:
        return 0
    if beta2 == 0.0:
        return 1
    t = max(1, math.ceil(math.log(1.0 - (1.0 - beta1) / beta1) / math.log(beta2)))
    while t > 1 and beta1 * (1.0 - beta2 ** (t - 1)) >= 1.0 - beta1:  # (the logarithms' rounding)
        t -= 1
    while beta1 * (1.0 - beta2**t) < 1.0 - beta1:
        t += 1
    return t


class Adaptive(Schedule):
    """The adaptive guard: a dense start, then momentum syncs where the ranks agree little, within a byte
    budget.

    * The start: the first `start` steps run the dense method (averaged gradients, one momentum), as
      LionCub(dense_warmup=...) does. By default (`start=None`) it lasts until the momentum leads Lion's
      interpolation (momentum_lead_step of the optimizer's betas: 12 steps for (0.9, 0.99)); before that
      the vote is on each rank's raw gradient, and on the convergence benchmarks that is when a compressed
      run falls behind the baseline for good, while later dense steps do not undo it (research/notebook/BENCHMARKS.md).
      `start=0`: no start.
    * The syncs: each compressed step the optimizer calls `decide(step, agreement, step_bytes, sync_bytes)`:
      `agreement` is the step's statistic (LionCub.stats.last_agreement, identical on every rank; None
      where the code carries none), `step_bytes` what the method itself sent this step and `sync_bytes`
      what a momentum sync costs. The schedule keeps an exponential average of the agreement (`smoothing`)
      and syncs when it is below `threshold` and the byte credit covers a sync.
    * The budget: every compressed step adds budget x step_bytes to the credit; the start's dense steps
      (`spend`) and the syncs take from it. LionCub passes the bytes that leave the node (all of them in
      the flat layout), so in the hierarchical layout the node's own traffic earns no syncs. So the
      guard's bytes never exceed `budget` times what the method itself sends (budget 1: at most 2x plain
      vote-1bit's bytes in all, once the run is long enough to earn back the start: about 270 steps for
      vote-1bit at N = 4 with the default start, whose dense steps cost 21 of its steps each; until then
      it makes no syncs). Where the code carries no agreement (1-bit votes of an odd number of ranks) it
      syncs whenever the credit allows.
    Its state (the average and the credit) is in LionCub.state_dict, so a resumed run decides as the
    uninterrupted one.

    Args:
        threshold: the smoothed agreement below which a sync is due, in [0, 1].
        budget: the syncs' and the start's bytes, at most this many times the method's own (> 0).
        smoothing: the exponential average's weight of the past, in [0, 1).
        start: the dense start's length in steps (None: until the momentum leads, `momentum_lead_step`).

    Example:
        >>> from lioncub import Adaptive
        >>> Adaptive().start_steps([(0.9, 0.99)])
        12
        >>> Adaptive(threshold=0.4, start=0)
        Adaptive(threshold=0.4, budget=1, start=0)
    """

    def __init__(self, threshold: float = ADAPTIVE_THRESHOLD, budget: float = ADAPTIVE_BUDGET,
                 smoothing: float = 0.9, start: int | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"adaptive threshold must be in [0, 1], got {threshold!r}")
        if not budget > 0:
            raise ValueError(f"adaptive budget must be > 0, got {budget!r}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"adaptive smoothing must be in [0, 1), got {smoothing!r}")
        if start is not None and (isinstance(start, bool) or start != int(start) or start < 0):
            raise ValueError(f"adaptive start must be an int >= 0 (steps), got {start!r}")
        self.threshold, self.budget, self.smoothing = float(threshold), float(budget), float(smoothing)
        self.start = None if start is None else int(start)
        self.credit, self.average = 0.0, None

    def start_steps(self, betas) -> int:
        """The dense start's length for an optimizer whose param groups have these (beta1, beta2)."""
        if self.start is not None:
            return self.start
        return max((momentum_lead_step(*b) for b in betas), default=0)

    def spend(self, nbytes: float) -> None:
        """Charge a dense start step's bytes to the credit."""
        self.credit -= nbytes

    def decide(self, step: int, agreement: float | None, step_bytes: float, sync_bytes: float) -> bool:
        self.credit += self.budget * step_bytes
        if agreement is not None:
            a = float(agreement)
            self.average = a if self.average is None else self.smoothing * self.average + (1 - self.smoothing) * a
        low = self.average is None or self.average < self.threshold
        if low and sync_bytes > 0 and self.credit >= sync_bytes:
            self.credit -= sync_bytes
            return True
        return False

    def should_sync(self, step: int) -> bool:  # the optimizer calls decide(); nothing is due by the step alone
        return False

    def rate(self, steps: int | None = None) -> float:
        """The most syncs per step for vote-1bit (about 2.25 bits per parameter against 48 for an fp32
        momentum all-reduce at N = 4), were the whole budget spent on syncs: budget / 21."""
        return self.budget / 21

    def state_dict(self) -> dict:
        return dict(credit=self.credit, average=self.average)

    def load_state_dict(self, state: dict) -> None:
        self.credit, self.average = float(state["credit"]), state["average"]

    def __eq__(self, other) -> bool:
        return isinstance(other, Adaptive) and (self.threshold, self.budget, self.smoothing, self.start) == (
            other.threshold, other.budget, other.smoothing, other.start)

    def __repr__(self) -> str:
        start = "" if self.start is None else f", start={self.start}"
        return f"Adaptive(threshold={self.threshold:g}, budget={self.budget:g}{start})"


class Never(Schedule):
    def should_sync(self, step: int) -> bool:
        return False

    def rate(self, steps: int | None = None) -> float:
        return 0.0

    def sync_steps(self, steps: int) -> list[int]:
        return []

    def __repr__(self) -> str:
        return "Never()"


def resolve(spec) -> Schedule:
    """None -> Never, int K -> EveryK(K), its text -> parse(text), a Schedule -> itself."""
    if spec is None or spec is False:
        return Never()
    if isinstance(spec, bool):
        raise ValueError("momentum_sync=True is ambiguous: pass an interval K or a schedule")
    if isinstance(spec, int):
        return EveryK(spec)
    if isinstance(spec, str):
        return resolve(parse(spec))
    if isinstance(spec, Schedule):
        return spec
    raise ValueError(
        f"momentum_sync must be None, a positive int K, a schedule (EveryK, FirstSteps, Geometric, Adaptive, or a "
        f"subclass of lioncub.optim.schedules.Schedule) or its text ('every:K', 'first:K:M', 'geometric:K', "
        f"'adaptive'); got {spec!r}"
    )


def parse(spec: str):
    """Schedules as a person types them: "none", "K" or "every:K", "first:K:M" (every K steps during the
    first M), "geometric:K" (interval doubles every K syncs), "adaptive", "adaptive:T", "adaptive:T:B" or
    "adaptive:T:B:S" (a dense start of S steps, by default until the momentum leads; then sync when the
    agreement is below T; all within B times the method's bytes; see Adaptive).

    Args:
        spec: the text (case and surrounding spaces ignored).

    Returns:
        The Schedule, or None for "none"; `describe` is the inverse.

    Example:
        >>> from lioncub.optim import schedules
        >>> schedules.parse("every:20")
        EveryK(k=20)
        >>> schedules.parse("first:10:500")
        FirstSteps(k=10, until=500)
    """
    text = str(spec).strip().lower()
    if text in ("", "none", "never", "off"):
        return None
    kind, _, rest = text.partition(":")
    try:
        if not rest and kind.isdigit():
            return EveryK(int(kind))
        args = [float(a) if "." in a else int(a) for a in rest.split(":")] if rest else []
        if kind == "every":
            return EveryK(*args)
        if kind == "first":
            return FirstSteps(*args)
        if kind == "geometric":
            return Geometric(*args)
        if kind == "adaptive":
            if len(args) > 3:
                raise ValueError("adaptive takes at most T:B:S")
            return Adaptive(*[float(a) for a in args[:2]], start=args[2] if len(args) == 3 else None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad momentum-sync schedule {spec!r}: {exc}") from None
    raise ValueError(f"bad momentum-sync schedule {spec!r}: use none, K, every:K, first:K:M, geometric:K or "
                     "adaptive[:T[:B[:S]]]")


def describe(schedule) -> str:
    """The inverse of parse."""
    if schedule is None or isinstance(schedule, Never):
        return "none"
    if isinstance(schedule, EveryK):
        return f"every:{schedule.k}"
    if isinstance(schedule, FirstSteps):
        return f"first:{schedule.k}:{schedule.until}"
    if isinstance(schedule, Geometric):
        return f"geometric:{schedule.k:g}"
    if isinstance(schedule, Adaptive):
        if schedule.start is not None:
            return f"adaptive:{schedule.threshold:g}:{schedule.budget:g}:{schedule.start}"
        if (schedule.threshold, schedule.budget) == (ADAPTIVE_THRESHOLD, ADAPTIVE_BUDGET):
            return "adaptive"
        return f"adaptive:{schedule.threshold:g}:{schedule.budget:g}"
    return repr(schedule)


# --- the agreement statistic ------------------------------------------------------------------------------

SAMPLE = 4096  # coordinates per bucket the statistic reads (strided; all of them in smaller buckets)
_POPCOUNT: dict = {}


def tie_share_at_random(world_size: int) -> float:
    """The share of ties among N independent fair-coin votes (0 for odd N)."""
    N = world_size
    return 0.0 if N % 2 else math.comb(N, N // 2) / 2**N


def _popcount_table(device) -> torch.Tensor:
    t = _POPCOUNT.get(device)
    if t is None:
        t = _POPCOUNT[device] = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32,
                                             device=device)
    return t


def bucket_sums(codec, code, n: int, world_size: int, levels: int = 0, layout=None,
                sample: int = SAMPLE) -> tuple[float, int] | None:
    """(sum of the per-coordinate statistic, coordinates read) for one bucket's agreed code, or None where
    the code carries no agreement information (1-bit votes of an odd number of ranks)."""
    N = world_size
    if n <= 0:
        return 0.0, 0
    if codec.kind == "signs":
        nonzero = code[1]
        if nonzero is None:
            return None
        full = n // 8  # whole bytes (the last partial byte and the padding are left out)
        if full == 0:
            return 0.0, 0
        stride = max(1, full * 8 // sample)
        picked = nonzero[:full:stride]
        ones = int(_popcount_table(picked.device)[picked.long()].sum())
        read = picked.numel() * 8
        ties = read - ones
        share = ties / read / tie_share_at_random(N)
        return max(0.0, 1.0 - share) * read, read
    W = code.numel()
    stride = max(1, (W * layout.per_word) // sample)
    idx = torch.arange(0, W, stride, device=code.device)
    words = code[idx]
    mask = (1 << layout.width) - 1
    offset = codec.offset(N, levels)
    scale = N * (levels if codec.l1 else 1)
    total, count = 0.0, 0
    for j in range(layout.per_word):
        valid = idx + j * W < n
        if not bool(valid.any()):
            break
        f = torch.bitwise_right_shift(words, layout.width * j).bitwise_and_(mask)[valid]
        total += float((f.double() - offset).abs_().sum()) / scale
        count += f.numel()
    return total, count


def agreement(codec, codes, sizes, world_size: int, levels: int = 0, layouts=None) -> float | None:
    """The step's agreement in [0, 1] over its buckets' agreed codes (weighted by coordinates read)."""
    if codec is None or world_size < 2:
        return None
    total, count = 0.0, 0
    for i, (code, n) in enumerate(zip(codes, sizes)):
        got = bucket_sums(codec, code, n, world_size, levels, None if layouts is None else layouts[i])
        if got is None:
            return None
        total, count = total + got[0], count + got[1]
    return min(1.0, total / count) if count else None
