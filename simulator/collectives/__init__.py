"""Collectives on the network: the entry points (simulate.py: a primitive, a lioncub composite, raw transfers).

Where things live: the rank API an algorithm is written against (ranks.py) and its steady states (steady.py); the
algorithms, each one record (algorithm.py) next to its program, a SimPy process that reads like the protocol, and
its lower bound (rings.py, doubling.py, trees.py, alltoall.py), and their registry (registry.py); the symmetry
that lets representative ranks stand for all (symmetry.py) and the sub-groups of the hierarchical layout
(groups.py); running one primitive and the memo of results (primitive.py, results.py); `auto` (choose.py) and
the building blocks of its bounds (bounds.py).
"""
