"""A tiny TCP sender/receiver for checking a lab link's rate (no iperf needed).

    python -m lioncub.apps.lab.tcp recv PORT              # serves one transfer, then exits
    python -m lioncub.apps.lab.tcp send ADDR PORT BYTES [START_AT]   # prints {"bytes", "seconds", "bps", ...}

The sender times from its first byte to the receiver's acknowledgement that the last byte arrived,
on one clock, so the figure is what an application sees. START_AT (a time.monotonic() value, one
clock for every process on the machine) lets several senders start together.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def recv(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            total = 0
            while data := conn.recv(CHUNK):
                total += len(data)
            conn.sendall(total.to_bytes(8, "little"))


def send(addr: str, port: int, nbytes: int, start_at: float | None = None) -> dict:
    payload = memoryview(bytearray(min(nbytes, CHUNK)))
    with socket.create_connection((addr, port), timeout=120) as conn:
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.monotonic()))
        start = time.monotonic()
        left = nbytes
        while left:
            left -= conn.send(payload[: min(left, len(payload))])
        conn.shutdown(socket.SHUT_WR)
        got = int.from_bytes(conn.recv(8), "little")
        end = time.monotonic()
    if got != nbytes:
        raise RuntimeError(f"receiver got {got} bytes, sent {nbytes}")
    seconds = end - start
    return {"bytes": nbytes, "seconds": seconds, "bps": 8 * nbytes / seconds, "start": start, "end": end}


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(int(sys.argv[2]))
    else:
        start_at = float(sys.argv[5]) if len(sys.argv) > 5 else None
        print(json.dumps(send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), start_at)))
