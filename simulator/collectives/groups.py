"""Collectives on sub-groups of the ranks: the hierarchical layout's node and cross groups.

In LionCub's hierarchical layout (nodes of G ranks, numbered node-major) a collective runs on one of two
kinds of group, all groups of the kind at once:

* "node": the G ranks of one node (rank = node * G + i), over the intra-node ports. No link is shared
  between two nodes' groups, so all of them take as long as one node alone: the fast path simulates one
  node as a one-node cluster (`node_cluster`).
* "cross": the N/G ranks with the same local index, one per node (rank = m * G + l). The G groups run at
  once and their flows SHARE every NIC and leaf uplink: G flows per NIC.

The exact run (`exact=True`) is literally that: every rank of every group on the full cluster, each
running the algorithm unchanged through a `GroupRank`, which shows it its group (p = group size, r =
index in the group, `cluster` = the group's own topology) and translates peers to global ranks, so the
messages travel on the real links.

Fast path for cross groups (`CrossGroup`): permuting the local indices inside every node maps the cluster
onto itself as far as cross traffic goes (it uses only NIC, leaf and per-rank host links) and maps group
l onto group l+1, so the G groups do the same thing at the same times and every flow of group 0 has G-1
images at its rate on each NIC and leaf link it crosses (and none on its per-rank links). Group 0 is
simulated alone on its own cluster (N/G nodes of one rank, the same links and latencies) where each of
its flows counts G times on NIC and leaf links (`Cluster.nic_share`, network.py): the same max-min
allocation as the G groups together. Every device of the simulator at cluster scale then applies to it
as to any cluster of one rank per node (representative ranks, tree classes, trains, steady states), so
a 100,000-rank cluster with 8 ranks per node costs what 12,500 nodes of one rank do. Tests check it
against the exact run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..net.cluster import Cluster


@dataclass(frozen=True)
class Groups:
    """All groups of one scope ("node" or "cross") on a cluster with `node_size` ranks per node."""

    scope: str
    node_size: int

    def size(self, cluster: Cluster) -> int:
        return self.node_size if self.scope == "node" else cluster.nodes

    def index(self, r: int) -> int:
        """Rank r's index in its group."""
        node, local = divmod(r, self.node_size)
        return local if self.scope == "node" else node

    def member(self, r: int, i: int) -> int:
        """The global rank of member i of rank r's group."""
        node, local = divmod(r, self.node_size)
        return node * self.node_size + i if self.scope == "node" else i * self.node_size + local

    def topology(self, cluster: Cluster) -> Cluster:
        """One group as its own cluster: what the algorithm sees (hop kinds, ranks per node, leaves), what
        the fast path simulates and what `auto` bounds."""
        return node_cluster(cluster) if self.scope == "node" else cross_cluster(cluster)


@dataclass(frozen=True)
class CrossGroup(Cluster):
    """One cross group (one rank per node) of a cluster with `share` ranks per node: its NIC and leaf links
    also carry the other share-1 groups' identical flows."""

    share: int = 1

    @property
    def nic_share(self) -> int:
        return self.share


def cross_cluster(cluster: Cluster) -> CrossGroup:
    """The cross group of local index 0 of `cluster`, as its own cluster (module docstring)."""
    fields = {k: getattr(cluster, k) for k in Cluster.__dataclass_fields__}
    return CrossGroup(**{**fields, "gpus_per_node": 1}, share=cluster.gpus_per_node)


def whole_cluster(cross: CrossGroup) -> tuple[Cluster, Groups]:
    """The cluster `cross_cluster` took `cross` from, and its cross groups: where every group runs at once."""
    fields = {k: getattr(cross, k) for k in Cluster.__dataclass_fields__}
    return Cluster(**{**fields, "gpus_per_node": cross.share}), Groups("cross", cross.share)


def node_cluster(cluster: Cluster) -> Cluster:
    """One node of `cluster` alone: what a node-scoped collective runs on (all nodes take as long)."""
    return replace(cluster, nodes=1, topology="switch", nodes_per_leaf=None, oversubscription=1.0)


class GroupRank:
    """A rank as an algorithm running on its group sees it: r and p in the group, peers translated to
    global ranks; everything else is the underlying Rank's."""

    def __init__(self, rank, groups: Groups, cluster: Cluster):
        self.rank = rank
        self.groups = groups
        self.r = groups.index(rank.r)
        self.p = groups.size(cluster)
        self.cluster = groups.topology(cluster)
        self.finished = 0.0

    def __getattr__(self, name):
        return getattr(self.rank, name)

    def _g(self, i: int) -> int:
        return self.groups.member(self.rank.r, i)

    def send(self, dst, nbytes, tag):
        return self.rank.send(self._g(dst), nbytes, tag)

    def recv(self, src, tag, nbytes):
        return self.rank.recv(self._g(src), tag, nbytes)

    def sendrecv(self, dst, src, nbytes, tag, recv_bytes=None):
        return self.rank.sendrecv(self._g(dst), self._g(src), nbytes, tag, recv_bytes)

    def send_each(self, msgs):
        return self.rank.send_each([(self._g(d), nb, tag) for d, nb, tag in msgs])

    def arrive_at(self, dst, tag, t):
        return self.rank.arrive_at(self._g(dst), tag, t)

    def exchange(self, sends, recvs):
        return self.rank.exchange([(self._g(d), nb, tag) for d, nb, tag in sends],
                                  [(self._g(s), tag, nb) for s, tag, nb in recvs])
