"""The network the collectives run on: the cluster's topology and links (cluster.py), the flow-level network that
shares them (network.py), and the SimPy internals it relies on, fenced in one module (engine.py)."""
