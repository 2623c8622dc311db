"""Traffic between the ranks of one lab host stays on the host (its loopback), as NVLink keeps a node's traffic
off its NIC; traffic between hosts crosses the shaped link, and the link counters see all of it. Asserts on
bytes, never on times, so a busy machine cannot break it."""

from __future__ import annotations

import pytest
from repo import HELPERS

from lioncub.apps.lab import Lab, missing_privileges, netns

WHY = missing_privileges()
RANK = str(HELPERS / "lab_rank.py")
pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(WHY is not None, reason=WHY or ""),
    pytest.mark.timeout(180),
]

LOCAL = 16 << 20  # bytes each host's two ranks all-reduce between themselves
LINK = 4 << 20  # bytes rank 0 (host 0) and rank 2 (host 1) all-reduce across the link
CONTROL = 64 << 10  # what barriers and the like may move through a link meanwhile


def delta(marks: list[dict], a: int, b: int, key: str) -> int:
    return marks[b][key] - marks[a][key]


def test_ranks_of_one_host_talk_over_loopback_and_only_cross_host_traffic_uses_the_link():
    with Lab(hosts=2, ranks_per_host=2, bandwidth="200Mbit") as lab:
        before = lab.link_counters()
        out = lab.run([RANK, "link_traffic", str(LOCAL), str(LINK)], timeout=150)
        after = lab.link_counters()
    reports = {r.host: r.result for r in out if r.result}
    assert sorted(reports) == [0, 1]
    for host, got in reports.items():
        link, lo = got["link"], got["lo"]
        # phase 1 (marks 0 -> 1): a 2-rank ring all-reduce of LOCAL bytes: each rank sends LOCAL bytes, all of
        # them on the loopback, almost nothing on the link
        assert delta(lo, 0, 1, "tx_bytes") >= 2 * LOCAL, (host, lo)
        for key in ("tx_bytes", "rx_bytes", "veth_tx_bytes", "veth_rx_bytes"):
            assert delta(link, 0, 1, key) < CONTROL, (host, key, link)
        # phase 2 (marks 2 -> 3): the 2-rank all-reduce of LINK bytes across the link: each host receives
        # LINK bytes of payload (its rank has them all when the collective returns), in frames of 1514 bytes
        # per 1448 of TCP payload, plus the ACKs of what it sent; the loopback stays quiet
        assert LINK * 1514 / 1448 <= delta(link, 2, 3, "rx_bytes") <= 1.15 * LINK, (host, link)
        assert LINK <= delta(link, 2, 3, "veth_rx_bytes") <= delta(link, 2, 3, "rx_bytes"), (host, link)
        assert delta(lo, 2, 3, "tx_bytes") < CONTROL, (host, lo)
    # the whole run, read from outside: each host sent its LINK bytes and little else, never the 16 MiB
    for b, a in zip(before, after):
        for d in ("tx", "rx"):
            assert LINK <= a[f"{d}_bytes"] - b[f"{d}_bytes"] <= 1.15 * LINK + 2 * CONTROL, (b, a)
    # the counters a rank reads are the ones the lab reads from outside
    for host, got in reports.items():
        last = got["link"][-1]
        assert set(last) == set(after[host]) and all(last[k] <= after[host][k] for k in last)


def test_link_counters_account_frames_the_way_the_shaper_does():
    with Lab(hosts=2, bandwidth="200Mbit") as lab:
        before = lab.link_counters()
        lab.measure_rate(8_000_000)
        after = lab.link_counters()
    sent = {k: after[0][k] - before[0][k] for k in after[0]}
    got = {k: after[1][k] - before[1][k] for k in after[1]}
    # 8 MB of TCP payload is 5525 full frames of 1514 bytes; the veth sees them as GSO bursts (one header
    # per burst), or as the frames themselves where the kernel does no GSO
    assert 8_000_000 * 1514 / 1448 <= sent["tx_bytes"] <= 1.05 * 8_000_000, sent
    assert sent["tx_frames"] >= 8_000_000 / 1448 and sent["veth_tx_packets"] <= sent["tx_frames"], sent
    assert 8_000_000 <= sent["veth_tx_bytes"] <= sent["tx_bytes"], sent
    assert got["rx_bytes"] >= sent["tx_bytes"] - netns.FRAME * 4, (sent, got)  # what went up came down
