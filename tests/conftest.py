import os
import sys

# spawned ranks import the scenario modules in tests/ by name
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.dirname(__file__)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# the python-src corpus (lioncub.apps.train.corpus) is built once per session into a temporary cache, not ~/.cache,
# unless LIONCUB_CACHE names one already (spawned ranks and subprocesses inherit it)
if not os.environ.get("LIONCUB_CACHE"):
    import tempfile

    os.environ["LIONCUB_CACHE"] = tempfile.mkdtemp(prefix="lioncub-test-cache-")
