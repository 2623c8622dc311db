"""The collectives of one bucket, per method: what LionCub.step puts on the wire.

* allreduce       one SUM all-reduce of the gradients (fp32 or bf16 on the wire)
* vote-allgather  all-gather of every rank's packed signs; each rank counts all N votes
* vote-1bit       all-to-all of packed sign chunks; each rank votes on its own chunk; all-gather of the
                  packed result (plus a not-a-tie plane when N is even, so a tie can mean "no update")
* *-pbit          one SUM all-reduce of integer words holding p-bit fields (see lioncub.wire)

Every collective goes through `call`, which turns a backend failure (a dead or stalled peer, a network
error, a process-group timeout) into a CommError that says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lioncub import kernels, wire

# torch >= 2.10 renames all_gather_into_tensor to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommError(RuntimeError):
    """A collective failed: a peer rank died or stalled, or the network broke."""


def group_rank_size(group=None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def call(name: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CommError(
            f"lioncub: {name} failed on rank {rank}: a peer rank died or stalled past the process-group "
            f"timeout, or the network failed. Original error: {exc}"
        ) from exc


def traffic(collectives: list[wire.Collective], world_size: int) -> tuple[int, int]:
    """(bytes sent, bytes received) per rank with bandwidth-optimal algorithms."""
    N, total = world_size, 0.0
    for c in collectives:
        factor = 2 * (N - 1) / N if c.op == "allreduce" else (N - 1) / N
        total += factor * c.nbytes
    return int(total), int(total)


class BucketWire:
    """Exchange buffers and collectives of one bucket of n elements."""

    def __init__(self, method: str, n: int, device, group=None, levels: int = 0,
                 grad_wire_dtype: torch.dtype = torch.float32):
        self.method, self.n, self.group, self.levels = method, n, group, levels
        self.rank, self.N = group_rank_size(group)
        self.layout = None
        self.collectives = wire.vote_collectives(
            method, n, self.N, levels or None, str(grad_wire_dtype).removeprefix("torch."))
        N = self.N
        u8 = dict(dtype=torch.uint8, device=device)
        if method == "vote-1bit":
            self.chunk = wire.onebit_chunk_bytes(n, N)
            self.planes = wire.result_planes(N)
            self.code = torch.zeros(N * self.chunk, **u8)
            self.recv = torch.empty(N * self.chunk, **u8)
            self.mine = torch.empty(self.planes * self.chunk, **u8)
            self.gathered = torch.empty(N * self.planes * self.chunk, **u8)
        elif method == "vote-allgather":
            nbytes = -(-n // 8)
            self.code = torch.zeros(nbytes, **u8)
            self.gathered = torch.empty(N * nbytes, **u8)
            self.sign = torch.empty(nbytes, **u8)
            self.nonzero = torch.empty(nbytes, **u8) if N % 2 == 0 else None
        elif method in wire.PBIT_METHODS:
            self.layout = wire.field_layout(method, N, levels or None)
            self.code = torch.zeros(self.layout.words(n), dtype=getattr(torch, self.layout.dtype),
                                    device=device)
        elif method != "allreduce":
            raise ValueError(f"unknown method {method!r}")

    def exchange(self):
        """Run the collectives on self.code; return the agreed code for kernels.unpack_apply."""
        g, N = self.group, self.N
        if self.method == "vote-1bit":
            call("all_to_all_single (1-bit votes)", dist.all_to_all_single, self.recv, self.code, group=g)
            c = self.chunk
            kernels.vote(self.recv.view(N, c), self.mine[:c], self.mine[c:] if self.planes == 2 else None)
            call("all_gather_into_tensor (1-bit result)", _all_gather,
                 self.gathered, self.mine, group=g)
            rows = self.gathered.view(N, self.planes, c)
            sign = rows[:, 0].reshape(-1)
            return sign, rows[:, 1].reshape(-1) if self.planes == 2 else None
        if self.method == "vote-allgather":
            call("all_gather_into_tensor (1-bit votes)", _all_gather,
                 self.gathered, self.code, group=g)
            kernels.vote(self.gathered.view(N, -1), self.sign, self.nonzero)
            return self.sign, self.nonzero
        call(f"all_reduce ({self.method} fields)", dist.all_reduce, self.code, group=g)
        return self.code


def allreduce_mean_(tensor: torch.Tensor, group=None, wire_dtype: torch.dtype = torch.float32) -> None:
    """Average a float tensor over the group in place, summing in `wire_dtype`."""
    _, N = group_rank_size(group)
    buf = tensor if tensor.dtype == wire_dtype else tensor.to(wire_dtype)
    call(f"all_reduce ({wire_dtype})", dist.all_reduce, buf, group=group)
    buf.div_(N)
    if buf is not tensor:
        tensor.copy_(buf)


def agree_count(local: int, group=None, device="cpu") -> int:
    """Sum of a small integer over all ranks (the step's control message)."""
    flag = torch.tensor([local], dtype=torch.int32, device=device)
    call("all_reduce (control)", dist.all_reduce, flag, group=group)
    return int(flag.item())


def composite_op(method: str, n_elements: int, group=None, levels: int | None = None,
                 device="cpu") -> Callable[[], None]:
    """One bucket's collectives exactly as LionCub.step runs them, on a realistic random payload.

    Used by `lioncub lab bench` and calibration to time the real transport. For "momentum-sync" and
    "allreduce" it is the fp32 all-reduce of the bucket.
    """
    if method in ("momentum-sync", "allreduce"):
        buf = torch.randn(n_elements, device=device)
        return lambda: allreduce_mean_(buf, group)
    wire.check_method(method)
    rank, N = group_rank_size(group)
    lv = (levels or wire.default_levels(N)) if method == "l1-pbit" else 0
    bw = BucketWire(method, n_elements, device, group, lv)
    gen = torch.Generator().manual_seed(1234 + rank)
    g = torch.randn(n_elements, generator=gen).to(device)
    m = torch.randn(n_elements, generator=gen).to(device)
    offsets = [0, n_elements]
    _, mult = kernels.prepass(method, g, m, beta1=0.9, offsets=offsets, levels=lv)
    kernels.quantize_pack(method, g, m, bw.code, beta1=0.9, beta2=0.99, layout=bw.layout, mult=mult,
                          offsets=offsets, levels=lv)
    return lambda: bw.exchange()
