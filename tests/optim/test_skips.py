"""lioncub.optim.engine.DeviceSkips: a step's skip decided on the device is counted once its flag has arrived."""

import torch

from lioncub.optim.engine import DeviceSkips


class FakeArrival:
    """A CUDA event's face: query() says whether the copy behind it has completed."""

    def __init__(self):
        self.done, self.waited = False, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True


def test_flags_count_once_arrived_in_order_and_wait_takes_all():
    s = DeviceSkips()
    events = [FakeArrival() for _ in range(3)]
    for step, (flag, ev) in enumerate(zip((1, 0, 1), events), 1):
        s.pending.append((step, torch.tensor(flag, dtype=torch.int32), ev))
    assert s.arrived() == [] and len(s.pending) == 3  # nothing has arrived: nothing is read, nobody waits
    events[1].done = True
    assert s.arrived() == [] and len(s.pending) == 2  # step 2 arrived, not skipped
    events[2].done = True
    assert s.arrived() == [3] and [p[0] for p in s.pending] == [1]
    assert s.arrived(wait=True) == [1] and events[0].waited and not s.pending


def test_cpu_flags_are_known_at_once():
    s = DeviceSkips()
    s.add(4, torch.tensor(1, dtype=torch.int32))
    s.add(5, torch.tensor(0, dtype=torch.int32))
    assert s.arrived() == [4] and not s.pending
