"""Plain single-process Lion (the update of lion-pytorch), for the baseline users run today: a model wrapped
in torch DDP, whose gradients DDP averages, and this step on every rank."""

from __future__ import annotations

import torch

from lioncub import kernels


class Lion(torch.optim.Optimizer):
    """p <- p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m <- b2*m + (1-b2)*g, per parameter tensor."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                w, g, m = (_local(t) for t in (p, p.grad, state["exp_avg"]))
                kernels.lion_step(w.view(-1), g.reshape(-1), m.view(-1), lr=group["lr"],
                                  wd=group["weight_decay"], beta1=beta1, beta2=beta2)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard; Lion is elementwise), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
