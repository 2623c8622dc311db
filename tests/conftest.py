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


# --- tests marked `cuda` (what `make gpu-check` runs: `pytest -m cuda`) -------------------------------------
# They run where torch sees a GPU, and in the rehearsal without one, LIONCUB_TEST_DEVICE=cpu TRITON_INTERPRET=1
# (CPU tensors, the Triton interpreter, tiny sizes: tests/helpers/cuda_cases.py); elsewhere they are skipped.
def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("LIONCUB_TEST_DEVICE") == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return  # the rehearsal on CPU tensors
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False); rehearse on CPU tensors "
                                   "with LIONCUB_TEST_DEVICE=cpu TRITON_INTERPRET=1")
    for item in cuda_items:
        item.add_marker(skip)
