"""Clusters: named presets and `make_cluster`."""

from __future__ import annotations

from lioncub.simulator import Cluster

CLUSTER_PRESETS = {
    "lab-100mbit-4x1": dict(nodes=4, gpus_per_node=1, bandwidth="100Mbit", latency="50us",
                            about="lioncub's emulated lab: 4 hosts at 100 Mbit/s"),
    "1gbe-8x1": dict(nodes=8, gpus_per_node=1, bandwidth="1Gbit", latency="50us",
                     about="8 single-GPU machines on 1 Gbit Ethernet"),
    "10gbe-4x8": dict(nodes=4, gpus_per_node=8, bandwidth="10Gbit", latency="20us",
                      about="4 servers of 8 GPUs on 10 Gbit Ethernet"),
    "25gbe-8x8": dict(nodes=8, gpus_per_node=8, bandwidth="25Gbit", latency="15us",
                      about="8 servers of 8 GPUs on 25 Gbit Ethernet"),
    "100gbe-16x8": dict(nodes=16, gpus_per_node=8, bandwidth="100Gbit", latency="10us",
                        about="16 servers of 8 GPUs on 100 Gbit Ethernet (TCP)"),
    "wan-1gbit-4x8": dict(nodes=4, gpus_per_node=8, bandwidth="1Gbit", latency="5ms",
                          about="4 sites of 8 GPUs joined by 1 Gbit/s at 5 ms"),
}


def make_cluster(preset: str | None = None, *, ranks: int | None = None, nodes: int | None = None,
                 gpus_per_node: int | None = None, bandwidth=None, latency=None, **extra) -> tuple[Cluster, str]:
    """(cluster, description): a preset, with any explicitly given field overriding it, or the fields.
    Defaults without a preset: 1 GPU per node, 10 Gbit/s, 20 us."""
    base: dict = {}
    if preset is not None:
        if preset not in CLUSTER_PRESETS:
            raise ValueError(f"unknown cluster preset {preset!r}; choose one of: {', '.join(CLUSTER_PRESETS)}")
        base = {k: v for k, v in CLUSTER_PRESETS[preset].items() if k != "about"}
    elif ranks is None and nodes is None:
        raise ValueError("describe the cluster: --preset NAME (" + ", ".join(CLUSTER_PRESETS)
                         + "), or --ranks N / --nodes N with --bandwidth and --latency")
    for name, v in (("ranks", ranks), ("nodes", nodes), ("gpus-per-node", gpus_per_node)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"--{name} must be a positive integer, got {v!r}")
    g = gpus_per_node if gpus_per_node is not None else base.get("gpus_per_node", 1)
    if ranks is not None:
        if ranks % g:
            raise ValueError(f"--ranks ({ranks}) must be a multiple of --gpus-per-node ({g})")
        if nodes is not None and nodes * g != ranks:
            raise ValueError(f"--ranks {ranks} != --nodes {nodes} x --gpus-per-node {g}")
        n = ranks // g
    else:
        n = nodes if nodes is not None else base["nodes"]
    kwargs = dict(bandwidth=bandwidth if bandwidth is not None else base.get("bandwidth", "10Gbit"),
                  latency=latency if latency is not None else base.get("latency", "20us"))
    kwargs.update({k: v for k, v in extra.items() if v is not None})
    cluster = Cluster(nodes=n, gpus_per_node=g, **kwargs)
    desc = cluster.describe() + (f" [preset {preset}]" if preset else "")
    return cluster, desc
