"""allreduce: the baseline. Ranks average their gradients (one SUM all-reduce per bucket, fp32 or bf16 on the
wire) and run plain Lion on the mean, so every rank holds the same momentum."""

from __future__ import annotations

from lioncub.comm import wire
from lioncub.methods.base import Exchange, LazyModule, Method

torch = LazyModule("torch")
transport = LazyModule("lioncub.comm.transport")


class Allreduce(Method):
    name = "allreduce"
    summary = "average fp32 (or bf16) gradients, plain Lion: the baseline"
    codec = None

    def collectives(self, n, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1:
            return []
        return [wire.Collective("allreduce", wire.DTYPE_BYTES[grad_dtype] * n, grad_dtype)]

    def hierarchical_collectives(self, n, world_size, node_size, levels=0, grad_dtype="float32"):
        raise ValueError("the hierarchical layout is for the compressed methods; allreduce averages gradients "
                         "(NCCL and Gloo choose their own hierarchy)")

    def wire_bits_per_element(self, world_size, levels=0):
        return wire.bus_factor("allreduce", world_size) * 32 if world_size > 1 else 0.0

    def codec_bytes_per_element(self, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1 or grad_dtype == "float32":
            return 0.0
        return 12.0  # cast down (4 + 2) and back up (2 + 4)

    def exchange(self, n, device, group=None, *, levels=0, grad_wire_dtype="float32", grads=None, world_size=None):
        return GradientMean(self, n, group, grad_wire_dtype, grads, world_size)


class GradientMean(Exchange):
    """Average the bucket's gradients over the group in place."""

    def __init__(self, method, n, group, wire_dtype: str, grads, world_size):
        super().__init__(method, n, group, 0, world_size)
        self.collectives = method.collectives(n, self.N, grad_dtype=wire_dtype)
        self.code, self.wire_dtype = grads, getattr(torch, wire_dtype)

    def __call__(self):
        transport.allreduce_mean_(self.code, self.group, self.wire_dtype)
        return self.agreed()


METHOD = Allreduce()
