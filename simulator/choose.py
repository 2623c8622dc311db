"""`algorithm="auto"`: the fastest algorithm the backend offers for an op."""

from __future__ import annotations

from .registry import ALGORITHMS, valid
from .runner import _primitive


def best_algorithm(cluster, profile, op, nbytes, cache=None, use_symmetry=True):
    """(algorithm, {candidate: seconds}) of the fastest algorithm the profile offers for `op`."""
    cands = [a for a in profile.candidates(op) if valid(op, a, cluster)]
    if not cands:
        cands = [a for a in ALGORITHMS[op] if valid(op, a, cluster)]
    times = {a: _primitive(cluster, profile, op, a, nbytes, cache, use_symmetry=use_symmetry).seconds
             for a in cands}
    best = min(cands, key=lambda a: (times[a], cands.index(a)))
    return best, times
