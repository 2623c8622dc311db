"""The outer step of local steps (lioncub.optim.local): the ranks agree on one update from their pseudo-
gradients, through the registered method's codec, with error feedback; then the outer optimizer moves the
anchor that every replica restarts from.

Per bucket, on rank i (fp32, whatever the parameters' dtype):

    delta_i = anchor - p_i                      the pseudo-gradient (the parameters' change since the anchor)
    e_i     = delta_i + r_i                     with the residual r_i that compression dropped last time
    a_i,t   = mean |e_i| over tensor t          this rank's scale of each parameter tensor
    s_t     = (1/N) sum_i a_i,t                 the agreed scale (an all-gather of the scales, summed in rank
                                                order on every rank: the same bits everywhere)
    code    = the method's codec of e_i (beta1 = 0, so the codec's c is e_i; no momentum update)
    G       = s_t * U                           U: the agreed update the codec decodes (a vote's sign, avg-pbit's
                                                mean sign, l1-pbit's sign of the summed levels)
    r_i    <- e_i - C_i(e_i)                    C_i: what rank i's own message stands for: a_i,t * sign(e_i) for
                                                the sign codecs, q * 2 a_i,t / s (q its L1 levels) for l1-pbit

The dense method (the baseline, DiLoCo's outer all-reduce) averages delta_i in fp32: G = mean_i delta_i, no
residual. One rank: G = delta. The outer optimizer (`Outer`) then takes the anchor to its next value:

    avg[:LR[:MU]]        v <- MU v + G; anchor -= LR v                (LR 1, MU 0: parameter averaging)
    nesterov[:LR[:MU]]   v <- MU v + G; anchor -= LR (G + MU v)       (DiLoCo's outer SGD: LR 0.7, MU 0.9)
    sign[:LR[:MU]]       v <- MU v + G; anchor -= LR H lr sign(G + MU v)   (a Lion-like step of H inner steps'
                                                                       reach, lr the group's; LR 0.5, MU 0.9)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lioncub.comm import transport, wire

OUTERS = {"avg": (1.0, 0.0), "nesterov": (0.7, 0.9), "sign": (0.5, 0.9)}


@dataclass(frozen=True)
class Outer:
    """The outer optimizer: kind (one of OUTERS), its learning rate and momentum."""

    kind: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9

    def __str__(self) -> str:
        return f"{self.kind}:{self.lr:g}:{self.momentum:g}"


def parse_outer(spec) -> Outer:
    """An Outer from "kind[:LR[:MU]]" (or an Outer); a clear ValueError otherwise."""
    if isinstance(spec, Outer):
        return spec
    kind, *rest = str(spec).split(":")
    if kind not in OUTERS or len(rest) > 2:
        raise ValueError(f"outer must be 'kind[:LR[:MU]]' with kind one of {', '.join(OUTERS)}, got {spec!r}")
    try:
        values = [float(v) for v in rest]
    except ValueError:
        raise ValueError(f"outer {spec!r}: LR and MU must be numbers") from None
    lr, mu = (values + list(OUTERS[kind])[len(values):])[:2]
    if not lr > 0 or not 0 <= mu < 1:
        raise ValueError(f"outer {spec!r}: LR must be > 0 and MU in [0, 1)")
    return Outer(kind, lr, mu)


def segment_mean_abs(e: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """float64 mean |e| of each segment [offsets[j], offsets[j+1])."""
    return torch.stack([e[s:t].abs().sum(dtype=torch.float64) / (t - s) for s, t in zip(offsets[:-1], offsets[1:])])


def expand(values: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """One fp32 value per segment, repeated over the segment's elements."""
    sizes = torch.tensor([t - s for s, t in zip(offsets[:-1], offsets[1:])], device=values.device)
    return torch.repeat_interleave(values.float(), sizes)


def local_value(codec, e: torch.Tensor, scale: torch.Tensor, mult, offsets: list[int], levels: int) -> torch.Tensor:
    """C_i(e): what this rank's message of e stands for (see the module's docstring)."""
    if codec.l1:  # the codec's own levels: q = clamp(rint(e * mult_t), -s, s), standing for q / mult_t
        out = e.clone()
        for m, s, t in zip(mult.tolist(), offsets[:-1], offsets[1:]):
            if m > 0:
                out[s:t].mul_(m).round_().clamp_(-levels, levels).div_(m)
            else:
                out[s:t].zero_()
        return out
    return torch.sign(e).mul_(expand(scale, offsets))


class OuterExchange:
    """The buffers and collectives of the outer step, per bucket of the engine, among `voters` ranks of `group`
    (default: the engine's; the node layout: one rank per node, lioncub.optim.local)."""

    def __init__(self, engine, error_feedback: bool, group=None, voters: int | None = None):
        self.engine, self.spec = engine, engine.spec
        self.group = engine.group if voters is None else group
        self.voters = engine.world_size if voters is None else voters
        self.error_feedback = error_feedback and not self.spec.dense
        buckets = engine.buckets
        for b in buckets:
            if b.offsets[0] != 0 or b.offsets[-1] != b.n:
                raise ValueError("local steps need buckets whose tensors fill them")
        f32 = [dict(dtype=torch.float32, device=b.p.device) for b in buckets]
        self.delta = [torch.zeros(b.n, **kw) for b, kw in zip(buckets, f32)]
        self.residual = [torch.zeros(b.n, **kw) for b, kw in zip(buckets, f32)] if self.error_feedback else None
        self.update = [torch.zeros(b.n, **kw) for b, kw in zip(buckets, f32)] if not self.spec.dense else None
        self.xs = None  # built on the first outer step, for the engine's process group then

    def received(self) -> list:
        """The buffers that receive an agreed G voted by another rank (lioncub.optim.local's node layout)."""
        return self.delta if self.spec.dense else self.update

    def _exchanges(self):
        e = self.engine
        if self.xs is None:
            self.xs = [self.spec.exchange(b.n, b.p.device, self.group, levels=e.levels, grad_wire_dtype="float32",
                                          grads=d) for b, d in zip(e.buckets, self.delta)]
        return self.xs

    def pseudo_gradients(self, anchors, ks=None) -> None:
        """delta (+ the residual) of buckets `ks` (default: all), into self.delta."""
        for k in range(len(self.delta)) if ks is None else ks:
            d = self.delta[k]
            torch.sub(anchors[k], self.engine.buckets[k].p.float(), out=d)
            if self.residual is not None:
                d.add_(self.residual[k])

    def agree(self, anchors) -> tuple[list | None, list]:
        """The agreed outer gradient G of every bucket (None if some rank's pseudo-gradient is not finite:
        the outer step is skipped everywhere), and the collectives it took."""
        self.pseudo_gradients(anchors)
        return self.agree_taken(range(len(self.delta)), self.engine.steps)

    def agree_taken(self, ks, step: int) -> tuple[list | None, list]:
        """agree() for buckets `ks` whose pseudo-gradients are already in self.delta, as at step `step` (the
        streamed outer steps, lioncub.optim.streaming, run this on their communication thread). G[k] holds
        bucket k's for k in ks."""
        if self.voters == 1:
            return (self.delta if all(torch.isfinite(self.delta[k]).all() for k in ks) else None), []
        if self.spec.dense:
            return self._dense(ks)
        return self._compressed(ks, step)

    def _dense(self, ks):
        xs, e = self._exchanges(), self.engine
        ok = all(bool(torch.isfinite(self.delta[k]).all()) for k in ks)
        bad = transport.any_rank(not ok, self.group, e.buckets.device, "outer non-finite")
        collectives = [wire.Collective("allreduce", 4, "int32")]
        if bad:
            return None, collectives
        for k in ks:
            xs[k]()
            collectives += xs[k].collectives
        return self.delta, collectives

    def _scales(self, mine: list, ok: bool):
        """All-gather [non-finite flag, this rank's scales]; (ranks with a non-finite pseudo-gradient, the
        agreed scales per bucket), summed in rank order on every rank alike."""
        msg = torch.cat([torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=mine[0].device), *mine])
        rows = torch.empty(self.voters * msg.numel(), dtype=torch.float64, device=msg.device)
        transport.call("all_gather_into_tensor (outer scales)", transport.all_gather, rows, msg, group=self.group)
        rows = rows.view(self.voters, -1)
        total = rows[0].clone()
        for r in rows[1:]:
            total += r
        total[1:] /= self.voters
        out, at = [], 1
        for m in mine:
            out.append(total[at : at + m.numel()])
            at += m.numel()
        collective = wire.Collective("allgather", rows.numel() * 8, "float64")
        return int(total[0].item()), out, collective

    def _compressed(self, ks, step: int):
        e, xs = self.engine, self._exchanges()
        buckets = [e.buckets[k] for k in ks]
        prepared = [xs[k].prepare(self.delta[k], self.delta[k], beta1=0.0, offsets=b.offsets)
                    for k, b in zip(ks, buckets)]
        mine = [segment_mean_abs(self.delta[k], b.offsets) for k, b in zip(ks, buckets)]
        ok = all(bool(flag) for flag, _ in prepared) and all(bool(torch.isfinite(m).all()) for m in mine)
        bad, scales, collective = self._scales(mine, ok)
        collectives = [collective]
        if bad:
            return None, collectives
        parity = e.zero_parity(step)
        for j, (k, b, (_, mult)) in enumerate(zip(ks, buckets, prepared)):
            x, d = xs[k], self.delta[k]
            x.pack(d, d, mult, beta1=0.0, beta2=0.0, offsets=b.offsets, zero_parity=parity, update_momentum=False)
            code = x()
            collectives += x.collectives
            u = self.update[k].zero_()
            x.apply(u, code, lr=-1.0, wd=0.0)  # u = 0 + U
            u.mul_(expand(scales[j], b.offsets))
            if self.residual is not None:
                self.residual[k].copy_(d).sub_(local_value(x.codec, d, mine[j], mult, b.offsets, x.levels))
        return self.update, collectives


def outer_update(outer: Outer, anchor, velocity, G, *, inner_reach: float) -> None:
    """Move one bucket's anchor by the outer optimizer (module docstring); `inner_reach` is H * lr."""
    if velocity is not None:
        velocity.mul_(outer.momentum).add_(G)
    if outer.kind == "avg":
        anchor.sub_(velocity if velocity is not None else G, alpha=outer.lr)
        return
    direction = G if velocity is None else G.add(velocity, alpha=outer.momentum)
    if outer.kind == "sign":
        anchor.sub_(torch.sign(direction), alpha=outer.lr * inner_reach)
    else:
        anchor.sub_(direction, alpha=outer.lr)
