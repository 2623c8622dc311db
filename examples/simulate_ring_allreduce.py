"""A ring all-reduce on a small cluster, simulated, beside its closed form (expected output: the .out file beside
this script, checked by tests/simulator/test_simulator_example.py).

N nodes of one rank each, on one switch with NICs of B bytes/s and a one-way latency L; the `ideal` backend (no
software overheads, free reductions, no pipelining). The ring's reduce-scatter and all-gather take N-1 steps each,
every step moving one chunk of S/N bytes to the next rank, so an all-reduce of S bytes takes

    T = 2(N-1)/N * S/B + 2(N-1) * L

and every rank sends 2(N-1)/N * S bytes in 2(N-1) messages. The simulator, a flow-level SimPy model, reproduces it
exactly. Run: python examples/simulate_ring_allreduce.py
"""

from lioncub.simulator import Cluster, simulate_collective

SIZE = 64 * 2**20  # S, bytes
BANDWIDTH = 10e9  # bits/s: B = 1.25e9 bytes/s
LATENCY = 50e-6  # L, seconds


def closed_form(nodes: int) -> float:
    return 2 * (nodes - 1) / nodes * SIZE / (BANDWIDTH / 8) + 2 * (nodes - 1) * LATENCY


def main() -> None:
    print("ring all-reduce of 64 MiB, 10 Gbit/s NICs, 50 us latency, ideal backend")
    print("closed form: T = 2(N-1)/N * S/B + 2(N-1) * L")
    print(f"{'nodes':>5}  {'simulated':>13}  {'closed form':>13}  {'sent/rank':>10}  {'messages':>8}")
    for nodes in (2, 4, 8, 16):
        cluster = Cluster(nodes=nodes, bandwidth=BANDWIDTH, latency=LATENCY)
        r = simulate_collective(cluster, "allreduce", "ring", SIZE, backend="ideal")
        print(f"{nodes:>5}  {r.seconds * 1e3:>10.6f} ms  {closed_form(nodes) * 1e3:>10.6f} ms  "
              f"{r.bytes_sent_per_rank / 2**20:>6.1f} MiB  {r.messages:>8}")


if __name__ == "__main__":
    main()
