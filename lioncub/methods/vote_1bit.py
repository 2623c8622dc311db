"""vote-1bit: Lion Cub's 1-bit all-reduce. An all-to-all sends each rank its chunk of everyone's packed
signs, each rank votes on its chunk (bit-sliced popcount), and an all-gather returns the packed result:
2(N-1)/N bits per parameter per rank, plus a not-a-tie plane when N is even (so a tie can mean "no update")."""

from __future__ import annotations

from lioncub.comm import wire
from lioncub.methods.base import Exchange, LazyModule, Method

torch = LazyModule("torch")
kernels = LazyModule("lioncub.kernels")
transport = LazyModule("lioncub.comm.transport")


def chunk_bytes(n: int, world_size: int) -> int:
    """Bytes of one rank's chunk of a 1-bit vector padded to a multiple of 8*N elements."""
    return -(-n // (8 * world_size))


class Vote1Bit(Method):
    name = "vote-1bit"
    summary = "1-bit all-reduce: all-to-all of packed signs, vote per chunk, all-gather of the result"
    codec = wire.SIGNS

    def collectives(self, n, world_size, levels=0, grad_dtype="float32"):
        N = world_size
        if N == 1:
            return []
        chunk = chunk_bytes(n, N)
        return [wire.Collective("alltoall", N * chunk, "uint8"),
                wire.Collective("allgather", N * chunk * wire.result_planes(N), "uint8")]

    def agreed_bytes(self, n, world_size, levels=0):
        return world_size * chunk_bytes(n, world_size) * wire.result_planes(world_size)

    def wire_bits_per_element(self, world_size, levels=0):
        if world_size == 1:
            return 0.0
        return wire.bus_factor("alltoall", world_size) * (1 + wire.result_planes(world_size))

    def codec_bytes_per_element(self, world_size, levels=0, grad_dtype="float32"):
        N = world_size
        if N == 1:
            return 0.0
        planes = wire.result_planes(N)
        # read m and g; write own bits; vote on own chunk (read N chunks, write planes); read the gathered planes
        return 8.0 + 1 / 8 + 1 / 8 + planes / (8 * N) + planes / 8

    def exchange(self, n, device, group=None, *, levels=0, grad_wire_dtype="float32", grads=None, world_size=None):
        return OneBitAllreduce(self, n, device, group, world_size)


class OneBitAllreduce(Exchange):
    def __init__(self, method, n, device, group, world_size):
        super().__init__(method, n, group, 0, world_size)
        N = self.N
        self.chunk = chunk_bytes(n, N)
        self.planes = wire.result_planes(N)
        u8 = dict(dtype=torch.uint8, device=device)
        self.code = torch.zeros(N * self.chunk, **u8)
        self.recv = torch.empty(N * self.chunk, **u8)
        self.mine = torch.empty(self.planes * self.chunk, **u8)
        self.gathered = torch.empty(N * self.planes * self.chunk, **u8)

    def vote(self):
        c = self.chunk
        kernels.vote(self.recv.view(self.N, c), self.mine[:c], self.mine[c:] if self.planes == 2 else None)

    def agreed(self):
        return self.code_from(self.gathered)

    def result(self):
        return self.gathered

    def code_from(self, result):
        rows = result.view(self.N, self.planes, self.chunk)
        return rows[:, 0].reshape(-1), rows[:, 1].reshape(-1) if self.planes == 2 else None

    def __call__(self):
        transport.call("all_to_all_single (1-bit votes)", transport.all_to_all, self.recv, self.code,
                       group=self.group)
        self.vote()
        transport.call("all_gather_into_tensor (1-bit result)", transport.all_gather,
                       self.gathered, self.mine, group=self.group)
        return self.agreed()


METHOD = Vote1Bit()
