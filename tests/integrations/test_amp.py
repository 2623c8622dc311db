"""fp16 autocast + lioncub.GradScaler with one rank overflowing: every rank skips that step, every
rank's scale is updated identically, no hang, replicas identical; overlap or not, bit-identical. A plain
torch.amp.GradScaler is refused on every rank (never a hang). bf16 autocast trains without a scaler."""

import pytest
import safe_cases
import torch

from lioncub.comm.spawn import spawn


def _check_overflow_skipped_everywhere(reports, methods, overlapped=2):
    for method in methods:
        for overlap in (True, False):
            key = (method, overlap)
            r0 = reports[0][key]
            assert reports[1][key]["local_inf"][1]  # rank 1 overflowed
            if not (method == "allreduce" and overlap):  # (there backward averaged rank 1's inf into rank 0's)
                assert not r0["local_inf"][1]
            for rank, report in enumerate(reports):
                r = report[key]
                assert r["changed"] == [True, False, True, True], (key, rank)  # every rank skipped step 2
                assert r["opt_steps"] == 3, (key, rank)
                assert r["scales"] == r0["scales"] and r["trackers"] == r0["trackers"], (key, rank)
                assert r["replicas_equal"], (key, rank)
                other = report[(method, not overlap)]
                assert torch.equal(r["params"], other["params"]) and torch.equal(r["momenta"], other["momenta"]), key
            assert r0["scales"][1] == r0["scales"][0] / 2  # backed off once, on both ranks
            if overlap and method != "allreduce":
                # step 1 links the scaler (exchanged again); from then on backward divides the scale out
                assert r0["overlapped"] == overlapped, key


def test_one_rank_overflowing_skips_the_step_on_every_rank():
    methods = ("vote-1bit", "l1-pbit", "allreduce")
    reports = spawn(safe_cases.amp_cases, 2, methods, timeout=120)
    _check_overflow_skipped_everywhere(reports, methods)


def test_one_rank_overflowing_skips_the_step_on_every_rank_hierarchical():
    reports = spawn(safe_cases.amp_cases, 4, ("vote-1bit+hier",), timeout=120)
    _check_overflow_skipped_everywhere(reports, ("vote-1bit+hier",))


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_scaler_with_unscale_and_clipping(max_norm):
    methods = ("vote-pbit", "allreduce") if max_norm < 1 else ("vote-pbit",)
    reports = spawn(safe_cases.amp_cases, 2, methods, max_norm, timeout=120)
    # clipping that bites makes step() exchange the clipped gradients again; clipping that does not keeps
    # the overlap (the norm travelled with backward's control message)
    _check_overflow_skipped_everywhere(reports, methods, overlapped=0 if max_norm < 1 else 2)


def test_plain_torch_grad_scaler_is_refused_on_every_rank():
    reports = spawn(safe_cases.plain_torch_scaler, 2, timeout=60)
    for r in reports:
        assert "lioncub.GradScaler" in r["error"]


@pytest.mark.parametrize("method", ["vote-1bit", "allreduce"])
def test_bf16_autocast_trains_without_a_scaler(method):
    reports = spawn(safe_cases.bf16_run, 2, method, timeout=60)
    for r in reports:
        assert r["replicas_equal"] and r["skipped"] == 0 and r["overlapped"] == 6
        assert r["losses"][-1] < r["losses"][0]


@pytest.mark.parametrize("method", ["vote-1bit", "allreduce"])
def test_scaler_and_clipping_inside_ddp(method):
    """attach_ddp: .grad is DDP's (local) and the buckets hold copies; unscaling and clipping reach both."""
    reports = spawn(safe_cases.ddp_clip_amp, 2, method, timeout=120)
    for r in reports:
        alone, hooked = r
        assert alone["steps"] == hooked["steps"] == 3 and alone["scale"] == hooked["scale"] == 512.0
        assert alone["replicas_equal"] and hooked["replicas_equal"]
        assert alone["norms"][0] == hooked["norms"][0] and alone["norms"][2:] == hooked["norms"][2:]
        assert torch.equal(alone["params"], hooked["params"]) and torch.equal(alone["momenta"], hooked["momenta"])
