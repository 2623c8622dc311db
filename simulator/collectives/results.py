"""CollectiveResult: what one simulated collective (or composite) returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lioncub.comm import wire

from ..profiles import PRIMITIVES


@dataclass
class CollectiveResult:
    """One simulated collective (or composite).

    seconds: from the call on all ranks until the last rank is done.
    bytes_sent_per_rank / bytes_received_per_rank: payload bytes of the busiest rank.
    parts: for composites, one dict per collective issued (op, algorithm, size_bytes, seconds, ...).
    candidates: with algorithm "auto", the simulated seconds of every algorithm simulated.
    pruned: with algorithm "auto", the candidates not simulated because a lower bound from the same
        mechanisms shows they cannot win: {algorithm: {lower_bound, chain, bytes, reason}}.
    timeline: if asked for, {rank: [(kind, start, end, peer, bytes), ...]} with kind send/recv/reduce.
    nic_bytes_per_node: payload bytes leaving a node through its NIC (to ranks of other nodes), from the
        simulated messages: all ranks' such bytes / nodes (every node's, for the algorithms with a rank
        symmetry: rings, all-to-alls, doubling; the mean over nodes for trees).
    messages: messages sent by all ranks together.
    simulated_ranks: processes simulated: every rank (exact), one per symmetry orbit, or one per class
        of ranks that behave alike (trees: sub-simulations).
    skipped_segments: steady segments (ring steps, pairwise exchanges) fast-forwarded, not simulated.
    """

    op: str
    algorithm: str
    backend: str
    ranks: int
    size_bytes: float
    seconds: float
    bytes_sent_per_rank: float
    bytes_received_per_rank: float
    parts: list[dict] = field(default_factory=list)
    candidates: dict[str, float] | None = None
    pruned: dict[str, dict] | None = None
    timeline: dict[int, list[tuple]] | None = None
    nic_bytes_per_node: float = 0.0
    messages: int = 0
    simulated_ranks: int = 0
    skipped_segments: int = 0  # steady segments fast-forwarded (ring steps, exchanges)
    wall_seconds: float = 0.0

    @property
    def algbw(self) -> float:
        """size_bytes / seconds, bytes per second (nccl-tests' algbw)."""
        return self.size_bytes / self.seconds if self.seconds > 0 else math.inf

    @property
    def busbw(self) -> float | None:
        """algbw times nccl-tests' bus factor (primitives only), bytes per second."""
        return self.algbw * wire.bus_factor(self.op, self.ranks) if self.op in PRIMITIVES else None

    def to_dict(self) -> dict:
        d = {
            "op": self.op,
            "algorithm": self.algorithm,
            "backend": self.backend,
            "ranks": self.ranks,
            "size_bytes": self.size_bytes,
            "seconds": self.seconds,
            "bytes_sent_per_rank": self.bytes_sent_per_rank,
            "bytes_received_per_rank": self.bytes_received_per_rank,
            "algbw_bytes_per_s": self.algbw if self.seconds > 0 else None,
            "busbw_bytes_per_s": self.busbw if self.seconds > 0 else None,
            "parts": self.parts,
            "candidates": self.candidates,
            "pruned": self.pruned,
            "nic_bytes_per_node": self.nic_bytes_per_node,
            "messages": self.messages,
            "simulated_ranks": self.simulated_ranks,
            "skipped_segments": self.skipped_segments,
        }
        if self.timeline is not None:
            d["timeline"] = {
                str(r): [dict(zip(("kind", "start", "end", "peer", "bytes"), e)) for e in evs]
                for r, evs in self.timeline.items()
            }
        return d


CONTROL = f"control {wire.CONTROL.op}"  # how StepResult.collectives lists the step's control message


def tally(colls: list, what: str, alg: str, nbytes, seconds: float, per_step: float = 1.0, count: int = 1) -> None:
    """Count one more issue of a collective in a StepResult.collectives list (rows by what, size, algorithm)."""
    for c in colls:
        if c["what"] == what and c["size_bytes"] == nbytes and c["algorithm"] == alg:
            c["count"] += count
            return
    colls.append({"what": what, "algorithm": alg, "size_bytes": nbytes, "seconds": seconds,
                  "per_step": per_step, "count": count})
