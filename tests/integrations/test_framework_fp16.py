"""fp16 in Hugging Face Trainer, accelerate and Lightning: given the torch.amp.GradScaler each makes on a GPU,
lioncub.integrations puts lioncub.GradScaler in its place; with fp16 autocast on 2 Gloo ranks and rank 1
overflowing at one step, every rank skips that step, the scale halves on every rank, and the parameters and
momenta are identical across ranks and equal to the oracle's (framework_fp16_cases: the same batches with no
scaler, that step left out)."""

import framework_fp16_cases as cases
import pytest
import torch

from lioncub.comm.spawn import spawn

CASES = {"accelerate": (cases.accelerate_run, (), None),
         "hf-trainer": (cases.hf_trainer_run, (0.0,), None),
         "hf-trainer-unscaled-to-clip": (cases.hf_trainer_run, (1e9,), None),
         "hf-trainer-clipping": (cases.hf_trainer_run, (1.0,), None),
         "lightning": (cases.lightning_run, (), cases.LIGHTNING_ENV)}


@pytest.mark.parametrize("case", list(CASES))
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(case):
    """hf-trainer-unscaled-to-clip: the Trainer unscales before step() (accelerate's clip_grad_norm_, a norm
    that never bites); hf-trainer-clipping: its default max_grad_norm=1.0, which bites, so the oracle (no
    clipping) does not apply there: every rank still skips the same step and the replicas stay identical."""
    fn, args, env = CASES[case]
    reports = spawn(fn, 2, *args, timeout=240, env=env)
    k, s = cases.OVERFLOW_STEP, cases.INIT_SCALE
    expected_changed = [step != k for step in range(1, cases.STEPS + 1)]
    expected_scales = [s if step < k else s / 2 for step in range(1, cases.STEPS + 1)]
    assert reports[1]["local_inf"][k - 1] and not any(reports[0]["local_inf"])  # only rank 1 overflowed
    for rank, r in enumerate(reports):
        assert r["swapped"], rank
        assert r["changed"] == expected_changed, (rank, r["changed"])
        assert r["scales"] == expected_scales, (rank, r["scales"])
        assert torch.equal(r["params"], reports[0]["params"]), rank  # (vote-1bit: each rank keeps its own momentum)
        if case != "hf-trainer-clipping":
            assert torch.equal(r["params"], r["oracle_params"]), rank
            assert torch.equal(r["momenta"], r["oracle_momenta"]), rank
        if "skipped" in r:  # accelerate's own account (AcceleratedOptimizer.step_was_skipped)
            assert r["skipped"] == [not c for c in expected_changed], rank


def test_the_replacement_keeps_the_torch_scalers_settings_and_state():
    from types import SimpleNamespace

    from lightning.pytorch.plugins import MixedPrecision

    from lioncub.integrations import replace_grad_scaler
    from lioncub.integrations.amp import GradScaler

    old = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    old.load_state_dict({**old.state_dict(), "scale": 32.0, "_growth_tracker": 2})  # as after a resume
    accelerator, prepared = SimpleNamespace(scaler=old, device=torch.device("cpu")), SimpleNamespace(scaler=old)
    new = replace_grad_scaler(accelerator, prepared)
    assert isinstance(new, GradScaler) and accelerator.scaler is new and prepared.scaler is new
    assert new.state_dict() == old.state_dict() == {"scale": 32.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                                    "growth_interval": 3, "_growth_tracker": 2}
    assert replace_grad_scaler(accelerator) is new  # already LionCub's: left as it is

    off = replace_grad_scaler(SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=False), device="cpu"))
    assert isinstance(off, GradScaler) and not off.is_enabled()
    assert replace_grad_scaler(MixedPrecision("bf16-mixed", "cpu")) is None  # bf16: no scaler, nothing to do
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    assert isinstance(replace_grad_scaler(SimpleNamespace(precision_plugin=plugin)), GradScaler)
    assert plugin.scaler.get_scale() == 2.0**16
    with pytest.raises(ValueError, match="not a torch.amp.GradScaler"):
        replace_grad_scaler(SimpleNamespace(scaler=object(), device="cpu"))
    with pytest.raises(ValueError, match="expected an accelerate Accelerator"):
        replace_grad_scaler(object())
