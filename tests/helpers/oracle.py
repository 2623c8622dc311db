"""An independent re-derivation of the update each method must apply, from all ranks' gradients and
momenta, written per parameter tensor with plain torch ops (no lioncub code). Used as the test oracle."""

from __future__ import annotations

import torch


def direction(g, m, b1):
    return torch.mul(m.float(), b1).add_(g.float(), alpha=1 - b1)


def one_bit_vote(c, index_offset, rank, step):
    """+1 / -1; a zero votes + iff (global index + rank + step) is even."""
    idx = torch.arange(c.numel()) + index_offset
    tie_break = torch.where((idx + rank + step) % 2 == 0, 1.0, -1.0)
    return torch.where(c > 0, 1.0, torch.where(c < 0, -1.0, tie_break))


def l1_quantize(c, s):
    mean = c.double().abs().mean()
    if mean == 0:
        return torch.zeros_like(c)
    k = torch.tensor(float(s / 2 / mean), dtype=torch.float32)
    return torch.clamp(torch.round(c * k), -s, s)


def mean_gradient(grads, dtype=torch.float32):
    """The baseline's averaged gradient: summed and divided in fp32, stored in the parameter dtype."""
    return torch.stack([g.float() for g in grads]).sum(0).div_(len(grads)).to(dtype).float()


def expected_update(method, grads, moms, b1, step, levels=0, index_offsets=None, dtype=torch.float32):
    """U for one parameter tensor. grads, moms: lists over ranks (flat tensors). index_offsets: the
    tensor's offset inside its bucket (1-bit zero tie-break uses bucket-global indices)."""
    N = len(grads)
    if N == 1:  # world size 1 is plain single-process Lion, whatever the method
        return torch.sign(direction(grads[0], moms[0], b1))
    if method == "allreduce":
        return torch.sign(direction(mean_gradient(grads, dtype), moms[0], b1))
    cs = [direction(g, m, b1) for g, m in zip(grads, moms)]
    if method in ("vote-1bit", "vote-allgather"):
        total = sum(one_bit_vote(c, index_offsets, r, step) for r, c in enumerate(cs))
        return torch.sign(total)
    if method == "vote-pbit":
        return torch.sign(sum(torch.sign(c) for c in cs))
    if method == "avg-pbit":
        return sum(torch.sign(c) for c in cs) / N
    if method == "l1-pbit":
        return torch.sign(sum(l1_quantize(c, levels) for c in cs))
    raise ValueError(method)


def expected_params(p, update, lr, wd):
    p32 = p.float()
    if wd:
        p32 = p32 * (1 - lr * wd)
    return (p32 - lr * update).to(p.dtype)
