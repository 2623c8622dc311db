"""What local steps cost in loss, as measured: the risk autotune gives a configuration with local steps.

The risk rule (risk_rule.py) is fitted on every-step methods; local steps change the algorithm (H inner steps on a
rank's own batch, then an outer step), so their risk is read from their own measurements instead: eval loss against
the allreduce baseline of the same seed, at equal tokens (research/notebook/BENCHMARKS.md, "Local steps"; raw JSON
in research/notebook/results/local-steps/, which tests/apps/test_autotune_local.py re-derives this table from). Each
row is one configuration with LionCub's default outer optimizer (`avg`): method, layout ("flat", or "hierarchical":
the node layout, nodes of 2 here), H, fragments and outer_delay (both None: not streamed).
"""

from __future__ import annotations

from .risk_rule import SCORE_PER_EXCESS, level_of

REGIME = "char-tiny, 4 ranks, batch 16 x 64 per rank, lr 5e-4, 400 steps"
STREAMED_BUCKET_MB = 0.25  # the streamed rows' bucket_mb (char-tiny's automatic buckets are 2, fewer than F = 5)

# (method, layout, H, fragments, outer_delay): (mean of loss / allreduce's - 1 over the seeds, its SE, seeds)
Key = tuple[str, str, int, int | None, int | None]
MEASURED: dict[Key, tuple[float, float | None, int]] = {
    ("vote-1bit", "flat", 2, None, None): (0.1004, 0.0308, 4),
    ("vote-1bit", "flat", 4, None, None): (0.1206, 0.0367, 4),
    ("vote-1bit", "flat", 10, None, None): (0.0762, 0.0066, 3),
    ("vote-1bit", "flat", 25, None, None): (0.1175, 0.0176, 4),
    ("vote-1bit", "flat", 10, 5, 1): (0.0879, 0.0090, 4),
    ("vote-1bit", "flat", 25, 5, 1): (0.1193, 0.0023, 4),
    ("vote-1bit", "flat", 25, 5, 3): (0.1438, 0.0181, 4),
    ("vote-1bit", "hierarchical", 4, None, None): (0.1003, 0.0535, 4),
    ("vote-1bit", "hierarchical", 10, None, None): (0.0553, 0.0030, 4),
    ("vote-1bit", "hierarchical", 25, None, None): (0.0693, 0.0088, 4),
    ("allreduce", "flat", 25, None, None): (0.1234, 0.0214, 4),
    ("l1-pbit", "flat", 25, None, None): (0.1385, None, 1),
}


def configurations(methods, layouts) -> list[Key]:
    """The measured configurations among these methods and layouts."""
    return [k for k in MEASURED if k[0] in methods and k[1] in layouts]


def local_risk(method: str, layout: str, H: int, fragments: int | None, outer_delay: int | None) -> dict:
    """The risk dict (risk_rule.risk's keys) of a local-step configuration: its measured loss excess, or, for one
    not measured, the worst measured one (measured: False)."""
    row = MEASURED.get((method, layout, H, fragments, outer_delay))
    measured = row is not None
    if row is None:
        row = max(MEASURED.values())
    excess, se, seeds = row
    score = max(0.0, SCORE_PER_EXCESS * excess)
    basis = (f"measured +{100 * excess:.1f}%" + (f" +- {100 * se:.1f} SE" if se is not None else "")
             + f" over {seeds} seed{'s' * (seeds > 1)} ({REGIME})") if measured else \
        f"not measured: the worst measured local-step excess, +{100 * excess:.1f}% ({REGIME})"
    return {"score": round(score, 4), "level": level_of(score), "excess": round(excess, 4), "unsynced_share": None,
            "measured": measured, "evidence": basis}
