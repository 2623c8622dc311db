import os
import sys

# the shared helpers (oracles, multi-rank scenarios) and the root's modules are imported by name, also by
# spawned ranks, which get sys.path and PYTHONPATH from here
HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = [os.path.join(HERE, "helpers"), os.path.join(HERE, "golden"), HERE]
for p in reversed(PATHS):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in PATHS])
