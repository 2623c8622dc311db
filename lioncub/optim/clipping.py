"""Clipping and the overlapped exchange (LionCub.clip_grad_norm_; issue 51).

A compressed step's codes are formed bucket by bucket during backward, before the gradients' norm, and so the
clip coefficient s, is known. Exchanging the clipped gradients again in step() costs the overlap, and no
correction is exact for every method at a small cost: a sign vote changes only where sign(m) != sign(g) and
(1-b1) s |g| <= b1 |m| < (1-b1) |g| (a sparse correction, exposed after backward), but l1-pbit's levels are
c / mean|c| per tensor, and its scale moves with s for every element.

So by default a pass's codec reads the previous step's coefficient s' (the norm changes slowly from step to step),
c = b1 m + (1-b1) s' g, while the momentum update, the norm and .grad take this step's s: exact where s = s' (no
clipping; step 1, whose momentum is zero, for any s), and a vote that weighs g against m by s'/s otherwise.
`clip_grad_norm_(..., exact=True)` keeps the exact clip at the cost of the second exchange. What the approximation
costs in loss: research/notebook/results/clip-overlap.
"""

from __future__ import annotations


def clipped_beta1(beta1: float, coef: float) -> float:
    """The beta1 whose c' = beta1' m + (1 - beta1') g is c = beta1 m + (1 - beta1) coef g divided by
    beta1 + (1 - beta1) coef > 0: a positive factor that no codec sees (they read sign(c), or c / mean|c| per
    tensor), so the codec reads coef * g without a pass over g."""
    return beta1 if coef == 1.0 else beta1 / (beta1 + (1 - beta1) * coef)


class CarriedClip:
    """The coefficient the last clip_grad_norm_ carries to the next step's pass."""

    def __init__(self):
        self.step, self.coef = 0, 1.0

    def record(self, step: int, coef: float, exact: bool) -> None:
        """Step `step` was clipped by `coef` (1: not clipped); an exact clip carries none."""
        self.step, self.coef = step, 1.0 if exact else coef

    def for_pass(self, step: int) -> float:
        """The coefficient a pass for step `step` applies in its codec: the previous step's, else 1."""
        return self.coef if self.step == step - 1 else 1.0
