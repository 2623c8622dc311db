"""The cluster: nodes of GPUs (one rank per GPU) joined by Ethernet through one switch or a leaf-spine fabric.

Links (all full duplex, so each direction is its own link with the full capacity):

* every node has one NIC port to its switch: `("up", node)` and `("down", node)`, `bandwidth` bits/s;
* leaf-spine: each leaf has one aggregate uplink to the spine layer per direction, `("leaf-up", leaf)` and
  `("leaf-down", leaf)`, of `nodes_per_leaf * bandwidth / oversubscription` (the spine switches and ECMP
  are folded into that one pipe); traffic between nodes of the same leaf does not use it;
* inside a node every GPU has a port to the node's fabric (NVLink/NVSwitch, PCIe or shared memory),
  `("gpu-up", rank)` and `("gpu-down", rank)`, of `intra_bandwidth` bits/s. Only messages between two GPUs
  of the same node use them: traffic to another node goes straight to the NIC (GPUDirect-style).

Latency is one way, host to host: `latency` between nodes (propagation + switching + stack), and
`intra_latency` inside a node. Ranks are numbered node-major: rank = node * gpus_per_node + local.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..units import format_rate, format_time, parse_rate, parse_time

TOPOLOGIES = ("switch", "leaf-spine")


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster. Numeric fields are SI (bits/s, seconds); strings with units are accepted too.

    Args:
        nodes: the number of nodes; ranks = nodes * gpus_per_node.
        gpus_per_node: ranks per node.
        bandwidth: NIC line rate per node, bits/s (nominal: framing overhead is the backend's business).
        latency: one-way host-to-host latency between nodes, seconds.
        intra_bandwidth: each GPU's port into its node's fabric, bits/s.
        intra_latency: one-way latency inside a node, seconds.
        topology: "switch" (one non-blocking switch) or "leaf-spine".
        nodes_per_leaf: leaf-spine only: the nodes under each leaf.
        oversubscription: leaf-spine only: each leaf's uplink carries nodes_per_leaf * bandwidth /
            oversubscription (2.0 means 2:1).

    Example:
        >>> c = Cluster(nodes=16, gpus_per_node=8, bandwidth="10Gbit", latency="1ms")
        >>> c.ranks, c.bandwidth, c.latency
        (128, 10000000000.0, 0.001)
    """

    nodes: int
    gpus_per_node: int = 1
    bandwidth: float = field(default=10e9)
    latency: float = field(default=20e-6)
    intra_bandwidth: float = field(default=800e9)
    intra_latency: float = field(default=2e-6)
    topology: str = "switch"
    nodes_per_leaf: int | None = None
    oversubscription: float = 1.0

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("bandwidth", parse_rate(self.bandwidth))
        set_("intra_bandwidth", parse_rate(self.intra_bandwidth))
        set_("latency", parse_time(self.latency))
        set_("intra_latency", parse_time(self.intra_latency))
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("bandwidth", "intra_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("latency", "intra_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; choose one of: {', '.join(TOPOLOGIES)}")
        if self.topology == "leaf-spine":
            npl = self.nodes_per_leaf
            if isinstance(npl, bool) or not isinstance(npl, int) or npl < 1:
                raise ValueError(f"leaf-spine needs nodes_per_leaf >= 1, got {npl!r}")
            if self.nodes % npl:
                raise ValueError(f"nodes ({self.nodes}) must be a multiple of nodes_per_leaf ({npl})")
            if not self.oversubscription > 0:
                raise ValueError(f"oversubscription must be positive, got {self.oversubscription!r}")
        else:
            set_("nodes_per_leaf", None)
            set_("oversubscription", 1.0)

    @classmethod
    def for_ranks(cls, ranks: int, gpus_per_node: int = 1, **kwargs) -> Cluster:
        """The cluster with `ranks` GPUs, `gpus_per_node` per node.

        Args:
            ranks: the number of ranks, a multiple of gpus_per_node.
            gpus_per_node: ranks per node.
            **kwargs: the other fields (bandwidth, latency, ...).

        Returns:
            Cluster(nodes=ranks // gpus_per_node, gpus_per_node=gpus_per_node, **kwargs).

        Example:
            >>> Cluster.for_ranks(64, gpus_per_node=8, bandwidth="10Gbit").nodes
            8
        """
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
        if ranks % gpus_per_node:
            raise ValueError(f"ranks ({ranks}) must be a multiple of gpus_per_node ({gpus_per_node})")
        return cls(nodes=ranks // gpus_per_node, gpus_per_node=gpus_per_node, **kwargs)

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def leaves(self) -> int:
        return self.nodes // self.nodes_per_leaf if self.topology == "leaf-spine" else 1

    @property
    def nic_share(self) -> int:
        """Flows on each NIC and leaf link per flow simulated: 1, except for one cross group of the
        hierarchical layout simulated alone (groups.CrossGroup), whose flows share them with G-1 others."""
        return 1

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def leaf_of(self, node: int) -> int:
        return node // self.nodes_per_leaf if self.topology == "leaf-spine" else 0

    def link_capacity(self, link: tuple) -> float:
        """Nominal capacity of a link in **bytes** per second."""
        kind = link[0]
        if kind in ("up", "down"):
            return self.bandwidth / 8.0
        if kind in ("leaf-up", "leaf-down"):
            return self.nodes_per_leaf * self.bandwidth / self.oversubscription / 8.0
        if kind in ("gpu-up", "gpu-down"):
            return self.intra_bandwidth / 8.0
        raise KeyError(link)

    def path(self, src: int, dst: int) -> tuple[list[tuple], float]:
        """Links a message from rank `src` to rank `dst` crosses, and its one-way latency."""
        ns, nd = self.node_of(src), self.node_of(dst)
        if ns == nd:
            return [("gpu-up", src), ("gpu-down", dst)], self.intra_latency
        links = [("up", ns)]
        ls, ld = self.leaf_of(ns), self.leaf_of(nd)
        if ls != ld:
            links += [("leaf-up", ls), ("leaf-down", ld)]
        links.append(("down", nd))
        return links, self.latency

    def hop(self, src: int, dst: int) -> str:
        """The kind of path from src to dst: "intra" (inside a node), "inter" (between nodes of one switch
        or leaf), "cross" (between leaves)."""
        ns, nd = self.node_of(src), self.node_of(dst)
        if ns == nd:
            return "intra"
        return "cross" if self.leaf_of(ns) != self.leaf_of(nd) else "inter"

    def symmetry_unit(self) -> int:
        """Smallest rank translation that maps the topology onto itself (one node; one leaf for
        leaf-spine, whose leaves must move as wholes)."""
        if self.topology == "leaf-spine":
            return self.gpus_per_node * self.nodes_per_leaf
        return self.gpus_per_node

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = self.ranks
        return d

    def describe(self) -> str:
        s = (
            f"{self.ranks} ranks ({self.nodes} nodes x {self.gpus_per_node}), "
            f"{format_rate(self.bandwidth)}, {format_time(self.latency)}"
        )
        if self.topology == "leaf-spine":
            s += f", leaf-spine {self.nodes_per_leaf} nodes/leaf {self.oversubscription:g}:1"
        return s
