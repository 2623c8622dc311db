"""vote-allgather: naive majority vote. Every rank all-gathers everyone's packed signs and counts all N
votes itself: (N-1) bits per parameter per rank, growing with N (what Lion Cub shows gives no speedup)."""

from __future__ import annotations

from lioncub.comm import wire
from lioncub.methods.base import Exchange, LazyModule, Method

torch = LazyModule("torch")
kernels = LazyModule("lioncub.kernels")
transport = LazyModule("lioncub.comm.transport")


class VoteAllgather(Method):
    name = "vote-allgather"
    summary = "all-gather every rank's packed signs, each rank counts the majority"
    codec = wire.SIGNS

    def collectives(self, n, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1:
            return []
        return [wire.Collective("allgather", world_size * -(-n // 8), "uint8")]

    def agreed_bytes(self, n, world_size, levels=0):
        return wire.result_planes(world_size) * -(-n // 8)

    def wire_bits_per_element(self, world_size, levels=0):
        return wire.bus_factor("allgather", world_size) * world_size if world_size > 1 else 0.0

    def codec_bytes_per_element(self, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1:
            return 0.0
        return 8.0 + 1 / 8 + world_size / 8  # read m and g; write own bits; read everyone's bits to vote

    def exchange(self, n, device, group=None, *, levels=0, grad_wire_dtype="float32", grads=None, world_size=None):
        return SignAllgather(self, n, device, group, world_size)


class SignAllgather(Exchange):
    def __init__(self, method, n, device, group, world_size):
        super().__init__(method, n, group, 0, world_size)
        nbytes = -(-n // 8)
        u8 = dict(dtype=torch.uint8, device=device)
        self.code = torch.zeros(nbytes, **u8)
        self.gathered = torch.empty(self.N * nbytes, **u8)
        self.agreed_planes = torch.empty(wire.result_planes(self.N) * nbytes, **u8)  # sign [, not-a-tie]
        self.sign, self.nonzero = self.code_from(self.agreed_planes)

    def vote(self):
        kernels.vote(self.gathered.view(self.N, -1), self.sign, self.nonzero)

    def agreed(self):
        return self.sign, self.nonzero

    def result(self):
        return self.agreed_planes

    def code_from(self, result):
        nbytes = self.code.numel()
        return result[:nbytes], result[nbytes:] if result.numel() > nbytes else None

    def __call__(self):
        transport.call("all_gather_into_tensor (1-bit votes)", transport.all_gather,
                       self.gathered, self.code, group=self.group)
        self.vote()
        return self.agreed()


METHOD = VoteAllgather()
