"""Under lioncub.attach_ddp a clip of .grad after backward (torch.nn.utils.clip_grad_norm_, the Hugging Face
Trainer's max_grad_norm) cannot reach the update, whose vote was taken during backward: LionCub says so once,
naming opt.clip_grad_norm_, instead of ignoring it silently."""

import ddp_clip_cases
import pytest

from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("clip, warned", [("torch", True), ("none", False), ("lioncub", False)])
def test_a_clip_of_grad_after_backward_is_reported_once(clip, warned):
    for messages in spawn(ddp_clip_cases.run, 2, clip, timeout=240):
        assert len(messages) == (1 if warned else 0), messages
        if warned:
            assert "opt.clip_grad_norm_(max_norm)" in messages[0]
