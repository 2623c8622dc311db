import os
import sys

# as research/tests/conftest.py: the repository root (research is not installed) and tests/helpers (repo.REPO)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = [ROOT, os.path.join(ROOT, "tests", "helpers")]
for p in reversed(PATHS):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in PATHS])
