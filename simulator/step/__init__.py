"""The training step: the step model and its spec (model.py), local steps (local.py), the sharded layout
(sharded.py), and the step on devices its ranks share (hosts.py: what they share; contention.py: the step's
processes on them)."""
