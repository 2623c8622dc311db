"""Training built-in models with any method: the loop, local ranks, torchrun and the lab."""
