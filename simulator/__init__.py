"""lioncub.simulator: a SimPy model of an Ethernet cluster that predicts collective and training-step times.

Pure Python (SimPy, no torch): usable on a laptop before launching a job.

    from lioncub.simulator import Cluster, simulate_collective, simulate_step
    cluster = Cluster.for_ranks(64, gpus_per_node=8, bandwidth="10Gbit", latency="50us")
    simulate_collective(cluster, "allreduce", "ring", "256MiB", backend="nccl").seconds
    simulate_step(cluster, method="vote-1bit", params="1.3B", momentum_sync=100, compute_seconds=0.3).speedup
    simulate_step(cluster, StepSpec("vote-1bit", params="1.3B", momentum_sync=100, compute_seconds=0.3)).speedup

The package by job: net/ (the cluster, the flow-level network, the SimPy internals it relies on), collectives/
(the rank API, the algorithms and their registry, `auto`), step/ (the training step, local steps, the sharded
layout, shared devices); profiles.py (how a library runs on the wire: plain data) and units.py (the unit strings a
person types) are the leaves everything reads.
"""

from .collectives.simulate import (
    ALGORITHMS,
    OPS,
    Cache,
    CollectiveResult,
    best_algorithm,
    simulate_collective,
    simulate_transfers,
)
from .net.cluster import Cluster
from .profiles import BUILTIN, BackendProfile, get_profile, tcp_efficiency
from .step.model import StepResult, StepSpec, simulate_step
from .sweep import sweep

__all__ = [
    "ALGORITHMS",
    "BUILTIN",
    "BackendProfile",
    "Cache",
    "Cluster",
    "CollectiveResult",
    "OPS",
    "StepResult",
    "StepSpec",
    "best_algorithm",
    "get_profile",
    "simulate_collective",
    "simulate_step",
    "simulate_transfers",
    "sweep",
    "tcp_efficiency",
]
