import os
import sys

# spawned ranks import the scenario modules in tests/ by name
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.dirname(__file__)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
