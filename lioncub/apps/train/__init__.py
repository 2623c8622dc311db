"""Training built-in models with any method: the loop, local ranks, torchrun and the lab."""

DDP_LION = "ddp+lion"  # the baseline users run today: the model in torch DDP, plain Lion on every rank
