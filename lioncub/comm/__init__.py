"""Communication plumbing under the optimizer: the wire format (pure Python, shared with the simulator),
the collective calls and their errors, and process-group set-up. Nothing here imports torch at package
import time."""
