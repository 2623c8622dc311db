"""The lab: an emulated Ethernet cluster on one machine (network namespaces, veth, a bridge, tbf).

See docs/lab.md. Nothing here imports torch; only the ranks do.
"""

from .lab import Lab, check_latency
from .launch import RankResult, link_counters, report
from .netns import LabError, LabPermissionError, missing_privileges

__all__ = [
    "Lab",
    "LabError",
    "LabPermissionError",
    "RankResult",
    "check_latency",
    "link_counters",
    "missing_privileges",
    "report",
]
