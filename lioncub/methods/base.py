"""What a communication method declares: its codec, its collectives for (n, N), its cost, its exchange.

The arithmetic (layouts, collectives, bytes) is pure Python, so the simulator and autotune cost a method
without importing torch; `exchange()` builds the torch side (buffers and collectives of one bucket) and
imports torch only when called.
"""

from __future__ import annotations

import importlib

from lioncub.comm import wire


class LazyModule:
    """A module imported on first attribute access, so a method module imports torch only when it runs."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


class Method:
    """One communication method. Subclasses set the class attributes and override what differs.

    name: the string users pass (`LionCub(method=...)`, `--method`).
    summary: one line for help texts.
    codec: what the codec kernels do (lioncub.comm.wire.Codec); None for a dense method, whose ranks average
        gradients and share one momentum (the baseline).
    max_value: the largest value one rank puts in a p-bit field (fields codecs), as a function of levels.
    """

    name: str = ""
    summary: str = ""
    codec: wire.Codec | None = None

    @property
    def dense(self) -> bool:
        return self.codec is None

    @property
    def uses_levels(self) -> bool:
        return self.codec is not None and self.codec.l1

    def resolve_levels(self, world_size: int, levels: int | None = None) -> int:
        """The L1 levels this method uses at this world size (0 if it has none); validates `levels`."""
        if levels is not None:
            raise ValueError(f"levels applies only to method='l1-pbit', not {self.name!r}")
        return 0

    def layout(self, world_size: int, levels: int = 0) -> wire.FieldLayout | None:
        """The p-bit field packing at this world size (None for methods without fields)."""
        return None

    def collectives(self, n: int, world_size: int, levels: int = 0,
                    grad_dtype: str = "float32") -> list[wire.Collective]:
        """The collectives one bucket of `n` elements costs per step (not the step's control message)."""
        raise NotImplementedError

    def agreed_bytes(self, n: int, world_size: int, levels: int = 0) -> int:
        """Bytes of the agreed code of n elements (what the hierarchical layout all-gathers inside a node)."""
        raise NotImplementedError

    def hierarchical_collectives(self, n: int, world_size: int, node_size: int, levels: int = 0,
                                 grad_dtype: str = "float32", shard: int | None = None) -> list[wire.Collective]:
        """The collectives of one n-element bucket in the hierarchical layout (G = node_size ranks per
        node, N / G nodes; `levels` as resolved for N / G voters): reduce-scatter the gradients inside
        the node (each local rank gets the node's mean of its shard: `shard` elements, by default about
        n / G, wire.shard_elements(n, G)), the method's own collectives on the shard across nodes, all-gather
        the agreed codes inside the node."""
        G = node_size
        if G < 1 or world_size % G:
            raise ValueError(f"{world_size} ranks cannot form nodes of {G}")
        S = wire.shard_elements(n, G) if shard is None else shard
        out = []
        if G > 1:
            out.append(wire.Collective("reducescatter", G * S * wire.DTYPE_BYTES[grad_dtype], grad_dtype, "node"))
        out += [wire.Collective(c.op, c.nbytes, c.dtype, "cross") for c in self.collectives(S, world_size // G, levels)]
        if G > 1:
            out.append(wire.Collective("allgather", G * self.agreed_bytes(S, world_size // G, levels), "uint8",
                                       "node"))
        return out

    def wire_bits_per_element(self, world_size: int, levels: int = 0) -> float:
        """Bits each rank sends per parameter per step with bandwidth-optimal collectives (large n)."""
        raise NotImplementedError

    def codec_bytes_per_element(self, world_size: int, levels: int = 0, grad_dtype: str = "float32") -> float:
        """Device-memory bytes the codec kernels move per parameter, beyond the Lion update's."""
        raise NotImplementedError

    def exchange(self, n: int, device, group=None, *, levels: int = 0, grad_wire_dtype: str = "float32",
                 grads=None, world_size: int | None = None):
        """The torch side of one bucket (an `Exchange`). world_size overrides the group's (calibration
        times the local work of a larger world in one process)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<method {self.name}>"


class FieldMethod(Method):
    """A method whose ranks add p-bit field values with one native integer SUM all-reduce per bucket."""

    def max_value(self, levels: int) -> int:
        return 2

    def layout(self, world_size: int, levels: int = 0) -> wire.FieldLayout:
        return wire.field_layout_for(self.max_value(levels), world_size)

    def collectives(self, n, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1:
            return []
        lay = self.layout(world_size, levels)
        return [wire.Collective("allreduce", lay.nbytes(n), lay.dtype)]

    def agreed_bytes(self, n, world_size, levels=0):
        return self.layout(world_size, levels).nbytes(n)

    def wire_bits_per_element(self, world_size, levels=0):
        if world_size == 1:
            return 0.0
        return wire.bus_factor("allreduce", world_size) * self.layout(world_size, levels).bits_per_element

    def codec_bytes_per_element(self, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1:
            return 0.0
        # read m and g to form the value; write the packed fields; read the summed fields
        return 8.0 + 2 * self.layout(world_size, levels).bits_per_element / 8

    def exchange(self, n, device, group=None, *, levels=0, grad_wire_dtype="float32", grads=None, world_size=None):
        return FieldSum(self, n, device, group, levels, world_size)


torch = LazyModule("torch")
dist = LazyModule("torch.distributed")
kernels = LazyModule("lioncub.kernels")
transport = LazyModule("lioncub.comm.transport")


class Exchange:
    """The torch side of one bucket of a method: its buffers, the encode pipeline and its collectives.

    The pipeline, written once here and used by the optimizer (in step() and during backward), the lab's
    probes and calibration:
      1. `prepare(g, m, ...)`: the pre-pass (reads only): whether g is finite, and the L1 multipliers;
      2. `pack(g, m, mult, ...)`: c = b1 m + (1 - b1) g quantized and packed into `code` (and the momentum
         update fused in, unless it is deferred until the ranks have agreed to take the step);
      3. `__call__()`: the collectives, with `vote()` (the local work between them) where the method has
         one; returns `agreed()`, the agreed code;
      4. `apply(p, code, ...)`: p <- p(1 - lr wd) - lr U from the agreed code (and a deferred momentum update).
    `encode` is steps 1 and 2 (one pass where step 1 is only the finite check). A dense method has no codec:
    its `code` is the gradients, which `__call__` averages in place. `layout` is the p-bit FieldLayout or None;
    `collectives` what one call puts on the wire.
    """

    layout = None

    def __init__(self, method: Method, n: int, group, levels: int, world_size: int | None):
        self.group, self.name, self.codec, self.levels = group, method.name, method.codec, levels
        self.N = world_size or transport.group_rank_size(group)[1]
        self.collectives = method.collectives(n, self.N, levels)

    def prepare(self, g, m, *, beta1: float, offsets: list[int]):
        """Step 1: (all of g finite, as a 0-dim bool tensor: nothing waits for the device; the L1 multipliers
        of the segments between `offsets`, or None)."""
        return kernels.prepass(self.codec, g, m, beta1=beta1, offsets=offsets, levels=self.levels)

    def pack(self, g, m, mult, *, beta1: float, beta2: float, offsets: list[int], zero_parity: int = 0,
             update_momentum: bool = True) -> None:
        """Step 2. `zero_parity`: which way a voter whose c is exactly 0 votes in 1-bit codes."""
        kernels.quantize_pack(self.codec, g, m, self.code, beta1=beta1, beta2=beta2, zero_parity=zero_parity,
                              layout=self.layout, mult=mult, offsets=offsets, levels=self.levels,
                              update_momentum=update_momentum)

    def encode(self, g, m, *, beta1: float, beta2: float, offsets: list[int], zero_parity: int = 0,
               update_momentum: bool = True):
        """Steps 1 and 2; returns step 1's finite flag. Without L1 scales step 1 is that check alone, which the
        quantize kernel takes in its own pass over g (no read of its own)."""
        if not self.codec.l1:
            return kernels.quantize_pack_checked(self.codec, g, m, self.code, beta1=beta1, beta2=beta2,
                                                 zero_parity=zero_parity, layout=self.layout, offsets=offsets,
                                                 levels=self.levels, update_momentum=update_momentum)
        ok, mult = self.prepare(g, m, beta1=beta1, offsets=offsets)
        self.pack(g, m, mult, beta1=beta1, beta2=beta2, offsets=offsets, zero_parity=zero_parity,
                  update_momentum=update_momentum)
        return ok

    def apply(self, p, code, *, lr: float, wd: float, momentum=None) -> None:
        """Step 4; momentum=(g, m, beta2) also applies the momentum update that `pack` left out."""
        kernels.unpack_apply(self.codec, p, code, lr=lr, wd=wd, world_size=self.N, levels=self.levels,
                             layout=self.layout, momentum=momentum)

    def vote(self) -> None:
        pass

    def agreed(self):
        return self.code

    def result(self):
        """The flat tensor that holds the agreed code after a call (what the hierarchical layout all-gathers
        inside a node); `code_from` reads a tensor laid out like it as a code for `apply`."""
        return self.code

    def code_from(self, result):
        return result

    def __call__(self):
        raise NotImplementedError


class FieldSum(Exchange):
    """One integer SUM all-reduce of the bucket's packed fields."""

    def __init__(self, method: FieldMethod, n, device, group, levels, world_size):
        super().__init__(method, n, group, levels, world_size)
        self.layout = method.layout(self.N, levels)
        self.code = torch.zeros(self.layout.words(n), dtype=getattr(torch, self.layout.dtype), device=device)

    def __call__(self):
        transport.call(f"all_reduce ({self.name} fields)", dist.all_reduce, self.code, group=self.group)
        return self.agreed()
