"""avg-pbit: Distributed Lion's averaging over vote-pbit's transport: U = (sum of signs) / N."""

from __future__ import annotations

from lioncub.comm import wire
from lioncub.methods.base import FieldMethod


class AvgPbit(FieldMethod):
    name = "avg-pbit"
    summary = "p-bit SUM all-reduce of votes: U = (sum of signs) / N (Distributed Lion's averaging)"
    codec = wire.Codec("fields", values="vote", decode="mean")


METHOD = AvgPbit()
