"""A probe of what everyday training scripts do with an optimizer (issue 28's held-out probe), on 2 Gloo ranks:
every case behaves as with a torch optimizer, or is refused in one line, and the replicas stay identical."""

import everyday_cases
import pytest

from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit"])
def test_everyday_optimizer_use(method):
    for r in spawn(everyday_cases.everyday, 2, method, timeout=300):
        s = r["schedulers"]
        assert all(v["same"] for v in s.values()), s
        assert s["cosine"]["lr"] == pytest.approx(0.0, abs=1e-12)  # T_max reached
        assert s["plateau"]["lr"] < everyday_cases.LR and s["sequential"]["lr"] < everyday_cases.LR
        assert r["closure"]
        assert r["edits"] == dict(frozen=True, same=True)
        assert r["hooks"] == ["pre", "post"] * 2
        assert r["state_round_trip"] == dict(exact=True, same=True)
        assert r["frozen_and_tied"] == dict(untouched=True, same=True, still_tied=True)
        assert r["accumulate_and_clip"] and r["bf16_compile_swa"]
        refused = r["refusals"]
        assert "empty parameter list" in refused["empty"]
        assert "more than one parameter group" in refused["duplicate"]
        assert "lioncub.GradScaler" in refused["torch_scaler"]
        assert all("\n" not in v for v in refused.values())
