"""The built-in models' default learning rates (imported by training, and by autotune, which imports no torch)."""

# Each is the best mean final loss of a measured sweep (4 ranks, batch 16 x 64 per rank;
# research/notebook/BENCHMARKS.md, "Default learning rate"), except those in TO_BE_MEASURED. It falls with width: a
# sign update moves every weight by lr, so a wider layer's output moves more per step. The MLP's is not swept.
DEFAULT_LR = {"char-tiny": 5e-4, "char-small": 2.5e-4, "char-medium": 1.25e-4, "mlp": 5e-4,
              "byte-30m": 6e-5, "byte-gpt2-small": 4e-5}

# Placeholders, not measured: the byte models' sweeps run on a GPU (research/gpu/gpu_evidence.sh;
# research/notebook/GPU_CHECK-notes.md, "Evidence where users train"), which picks the best of 0.5x, 1x and 2x
# these by a rule fixed in advance (research/lr_sweep.py). Until its result is committed here, they are guesses
# from the char models' trend (the best lr halved from width 128 to 256 and again to 384; these are 640 and 768 wide).
TO_BE_MEASURED = frozenset({"byte-30m", "byte-gpt2-small"})
