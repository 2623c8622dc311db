import os
import sys

# For research/tests and research/gpu: research is not installed, so it imports from the repository root, here
# and in spawned processes (which get PYTHONPATH from here); tests/helpers holds the shared test helpers (repo.REPO)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [ROOT, os.path.join(ROOT, "tests", "helpers")]
for p in reversed(PATHS):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in PATHS])
