"""lioncub.simulator: a SimPy model of an Ethernet cluster that predicts collective and training-step times.

Pure Python (SimPy, no torch): usable on a laptop before launching a job.

    from lioncub.simulator import Cluster, simulate_collective, simulate_step
    cluster = Cluster.for_ranks(64, gpus_per_node=8, bandwidth="10Gbit", latency="50us")
    simulate_collective(cluster, "allreduce", "ring", "256MiB", backend="nccl").seconds
    simulate_step(cluster, method="vote-1bit", params="1.3B", momentum_sync=100, compute_seconds=0.3).speedup

See docs/SIMULATOR.md for the model and its assumptions.
"""

from .cluster import Cluster
from .collectives import (
    ALGORITHMS,
    OPS,
    Cache,
    CollectiveResult,
    best_algorithm,
    simulate_collective,
    simulate_transfers,
)
from .profiles import BUILTIN, BackendProfile, get_profile, tcp_efficiency
from .step import StepResult, simulate_step
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
    "best_algorithm",
    "get_profile",
    "simulate_collective",
    "simulate_step",
    "simulate_transfers",
    "sweep",
    "tcp_efficiency",
]
