"""l1-pbit: Lion Cub's L1 quantization. Each rank sends levels q = clamp(rint(c / mean|c| * s/2), -s, s)
per tensor in p-bit fields (one native integer SUM all-reduce); U = sign(sum of q). With s = 1 it is a
vote; more levels carry each rank's magnitude."""

from __future__ import annotations

from lioncub.comm import wire
from lioncub.methods.base import FieldMethod


def default_levels(world_size: int) -> int:
    """Lion Cub's default number of L1 levels: the int8-safe s = floor(127/N), at least 1."""
    return max(1, 127 // max(1, world_size))


class L1Pbit(FieldMethod):
    name = "l1-pbit"
    summary = "p-bit SUM all-reduce of L1 levels: U = sign(sum of q) (Lion Cub's default)"
    codec = wire.Codec("fields", values="l1", decode="sign")

    def max_value(self, levels: int) -> int:
        return 2 * levels

    def resolve_levels(self, world_size, levels=None):
        s = default_levels(world_size) if levels is None else levels
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"levels must be a positive integer, got {levels!r}")
        try:
            wire.field_layout_for(self.max_value(s), world_size)
        except ValueError as exc:
            top = (2 ** wire.MAX_FIELD_WIDTH - 1) // (2 * world_size)
            raise ValueError(f"levels={s} cannot fit for {world_size} ranks ({exc}); use levels <= {top}, "
                             f"or leave levels=None for {default_levels(world_size)}") from None
        return s

    def layout(self, world_size, levels=0):
        return super().layout(world_size, levels or default_levels(world_size))


METHOD = L1Pbit()
