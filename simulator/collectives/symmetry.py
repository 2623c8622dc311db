"""Rank translations that map the cluster and an algorithm onto themselves (speed, same result).

When the topology and the algorithm are invariant under a group of rank translations (cyclic shifts by
one node, or XOR with multiples of a node for recursive halving/doubling), only one representative rank
per orbit is simulated. A representative's receive from rank s is the image of a send by the
representative of s; its connections stand for their orbits, which load every link of a link orbit
equally (network.py). The result is the same as simulating every rank; a 1024-rank ring with 8 GPUs per
node runs 8 processes instead of 1024.
"""

from __future__ import annotations

from ..net.cluster import Cluster


def pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# symmetry
class Symmetry:
    """Rank translations r -> r + a*unit (mod p) ("cyclic") or r -> r XOR a*unit ("xor").

    `unit == p` is the trivial group: every rank is simulated."""

    def __init__(self, cluster: Cluster, unit: int, kind: str):
        self.cluster = cluster
        self.p = cluster.ranks
        self.unit = unit
        self.kind = kind
        g = cluster.gpus_per_node
        self._node_mod = unit // g
        self._leaf_mod = max(1, unit // (g * (cluster.nodes_per_leaf or cluster.nodes)))

    @classmethod
    def full(cls, cluster: Cluster) -> Symmetry:
        return cls(cluster, cluster.ranks, "cyclic")

    @classmethod
    def choose(cls, cluster: Cluster, kind: str | None) -> Symmetry:
        p, u = cluster.ranks, cluster.symmetry_unit()
        if kind is None or u >= p or p % u:
            return cls.full(cluster)
        if kind == "xor" and not (pow2(p) and pow2(u)):
            return cls.full(cluster)
        return cls(cluster, u, kind)

    @property
    def reps(self) -> range:
        return range(self.unit)

    @property
    def orbit_size(self) -> int:
        return self.p // self.unit

    def to_rep(self, src: int, dst: int) -> tuple[int, int]:
        """The group element mapping src to its representative, applied to (src, dst)."""
        base = src - src % self.unit
        if base == 0:
            return src, dst
        if self.kind == "cyclic":
            return src - base, (dst - base) % self.p
        return src ^ base, dst ^ base

    def image(self, r: int, a: int) -> int:
        """The a-th element of the group applied to rank r."""
        if self.kind == "cyclic":
            return (r + a * self.unit) % self.p
        return r ^ (a * self.unit)

    def canonical(self, link: tuple) -> tuple:
        kind, idx = link
        if kind in ("up", "down"):
            return (kind, idx % self._node_mod)
        if kind in ("leaf-up", "leaf-down"):
            return (kind, idx % self._leaf_mod)
        return (kind, idx % self.unit)  # gpu-*, host-*: per rank
