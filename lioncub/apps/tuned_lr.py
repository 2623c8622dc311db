"""The built-in models' default learning rates (imported by training, and by autotune, which imports no torch)."""

# Each is the best mean final loss of a measured sweep (4 ranks, batch 16 x 64 per rank; docs/BENCHMARKS.md,
# "Default learning rate"). It falls with width: a sign update moves every weight by lr, so a wider layer's output
# moves more per step. The MLP's is not swept.
DEFAULT_LR = {"char-tiny": 5e-4, "char-small": 2.5e-4, "char-medium": 1.25e-4, "mlp": 5e-4}
