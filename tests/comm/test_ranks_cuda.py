"""LionCub on device tensors, several Gloo ranks sharing the one GPU (`pytest -m cuda`; NCCL would need one GPU
per rank): fp32, bf16 and fp16 groups, several buckets, every method, on LIONCUB_KERNELS=triton and =torch.
Replicas identical, parameters finite and moved, no step skipped, the Triton backend really ran; the Triton
kernels and the torch twins end on the same parameters and momenta (asserted in the CPU rehearsal, where the
interpreter reproduces the twins exactly; on a GPU reported, since a rounding-level flip is allowed there)."""

from __future__ import annotations

import pytest
from cuda_cases import CFG, DEVICE, TRITON_OPS, TWINS, ranks_body, report

from lioncub import methods
from lioncub.comm.spawn import spawn

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("world_size", CFG["ranks"]["world_sizes"])
def test_every_method_keeps_the_replicas_identical_on_the_device(world_size):
    rc, names = CFG["ranks"], list(methods.NAMES)
    cfg = dict(device=DEVICE.type, backends=["triton", "torch"], methods=names, steps=rc["steps"],
               shapes=rc["shapes"], bf16=rc["bf16"], fp16=rc["fp16"], bucket_mb=rc["bucket_mb"],
               sync_every=rc["sync_every"])
    reports = spawn(ranks_body, world_size, cfg, timeout=600, pg_timeout=600)
    assert set(reports[0]) == {f"{b} {m}" for b in cfg["backends"] for m in names}
    for key in reports[0]:
        per = [rep[key] for rep in reports]
        assert all(p["replicas_equal"] for p in per), f"{world_size} ranks, {key}: replicas differ"
        assert all(p["finite"] for p in per) and per[0]["moved"] > per[0]["elements"] // 2, key
        assert max(p["skipped"] for p in per) == 0, key
        assert per[0]["ran"] == (TRITON_OPS if key.startswith("triton ") else TWINS), key
    same = {m: reports[0][f"triton {m}"]["digest"] == reports[0][f"torch {m}"]["digest"] for m in names}
    report(f"{world_size} ranks: Triton and torch twins give the same parameters after {rc['steps']} steps",
           target=all(same.values()), methods=same,
           step_ms={k: round(max(r[k]["step_ms"] for r in reports), 3) for k in reports[0]})
    if DEVICE.type == "cpu":
        assert all(same.values()), same
