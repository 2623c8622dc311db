"""Clipping keeps the overlap (issue 51, item 2): opt.clip_grad_norm_ at a norm that bites leaves the vote taken
during backward standing (its codec read the previous step's coefficient; lioncub.optim.clipping), on every
rank alike; exact=True is the exact clip, bit for bit what the golden digests recorded before (tests/golden: the
*-clip cases call it)."""


import clip_overlap_cases as cases
import pytest
import safe_cases
import torch

from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("method,world", [("vote-1bit", 2), ("l1-pbit", 3), ("vote-pbit", 2), ("vote-1bit+hier", 4)])
def test_a_clip_that_bites_keeps_every_step_overlapped(method, world):
    for rank, r in enumerate(spawn(cases.both, world, method, (1e-3,) * 3, timeout=120)):
        approximate, exact = r[False], r[True]
        assert approximate["overlapped"] == 3 and exact["overlapped"] == 0, rank
        assert approximate["replicas_equal"] and exact["replicas_equal"], rank
        assert not approximate["warned"] and not exact["warned"], rank


@pytest.mark.parametrize("method,world", [("vote-1bit", 2), ("vote-1bit+hier", 4)])
def test_the_first_step_is_the_exact_clip(method, world):
    """Step 1's momentum is zero, so the vote is sign(g) for any coefficient: the same update, and the momentum
    takes the clipped gradient (in the node layout from the node's mean, scaled after the pass: to rounding)."""
    for rank, r in enumerate(spawn(cases.both, world, method, (1e-3,), timeout=120)):
        assert torch.equal(r[False]["params"], r[True]["params"]), rank
        torch.testing.assert_close(r[False]["momenta"], r[True]["momenta"], rtol=1e-5, atol=1e-12)


def test_a_step_that_stops_clipping_is_exchanged_again():
    """Step 3's pass read step 2's coefficient; step 3 does not clip: step() exchanges its gradients as they are,
    without the warning about gradients changed after backward."""
    for rank, r in enumerate(spawn(cases.run, 2, "vote-1bit", False, (1e-3, 1e-3, None, None), timeout=120)):
        assert r["overlapped"] == 3 and r["replicas_equal"] and not r["warned"], rank


def test_the_loss_scaler_and_a_clip_that_bites_keep_the_overlap():
    """lioncub.GradScaler + unscale_ + clip_grad_norm_(0.05), rank 1 overflowing at step 2: every rank skips
    it, and as many steps are overlapped as with a clip that does not bite (2 of the 3 taken: the step after
    the scale backed off is exchanged again; tests/integrations/test_amp.py, where the exact clip overlaps none)."""
    for rank, report in enumerate(spawn(safe_cases.amp_cases, 2, ("vote-pbit",), 0.05, False, timeout=120)):
        r = report[("vote-pbit", True)]
        assert r["changed"] == [True, False, True, True] and r["opt_steps"] == 3, rank
        assert r["replicas_equal"] and r["overlapped"] == 2, rank
