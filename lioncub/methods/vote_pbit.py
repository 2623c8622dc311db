"""vote-pbit: Lion Cub's p-bit all-reduce of votes. Each rank adds sign(c) + 1 into fields of
ceil(log2(2N+1)) bits with one native integer SUM all-reduce; U = sign(sum of signs). A rank whose c is
exactly zero abstains."""

from __future__ import annotations

from lioncub.comm import wire
from lioncub.methods.base import FieldMethod


class VotePbit(FieldMethod):
    name = "vote-pbit"
    summary = "p-bit SUM all-reduce of votes: U = sign(sum of signs)"
    codec = wire.Codec("fields", values="vote", decode="sign")


METHOD = VotePbit()
