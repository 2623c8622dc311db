"""The built-in models' default learning rates and the AdamW-to-Lion conversion (imported by training, and by
autotune, which imports no torch)."""

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

# Coming from AdamW: Lion's lr is AdamW's divided by lr_divisor and its weight decay AdamW's times wd_factor (the
# Lion paper's rule of thumb: 3-10x each, so the decay per step lr x wd stays about the same). Measured, not
# assumed: the best cell of a sweep of Lion against the best-tuned AdamW (research/adamw_to_lion.py; the result
# file below; at 1000 steps /10 is again the best lr and 1x-10x are within noise, 30x worse), checked against these
# by research/tests/test_adamw_to_lion.py; docs/methods.md, "Coming from AdamW".
ADAMW_TO_LION = dict(
    lr_divisor=10, wd_factor=3,
    measured="char-tiny, 300 steps, 3 seeds, batch 16 x 64 tokens, one process, held-out loss; /10 again best at "
             "1000 steps",
    result="research/notebook/results/adamw-to-lion/char-tiny.json",
)
ADAMW_DEFAULT_WD = 0.1  # the AdamW weight decay the sweep ran at (and nanoGPT's), assumed when none is given


def lion_from_adamw(lr: float, weight_decay: float | None = None) -> tuple[float, float]:
    """(Lion's lr, Lion's weight decay) for a model that trains well with AdamW at `lr` and `weight_decay`
    (default ADAMW_DEFAULT_WD): lr / ADAMW_TO_LION's lr_divisor, weight decay x its wd_factor."""
    wd = ADAMW_DEFAULT_WD if weight_decay is None else weight_decay
    if not lr > 0 or not wd >= 0:
        raise ValueError(f"AdamW's lr must be > 0 and its weight decay >= 0, got lr {lr!r}, weight decay {wd!r}")
    return lr / ADAMW_TO_LION["lr_divisor"], wd * ADAMW_TO_LION["wd_factor"]
