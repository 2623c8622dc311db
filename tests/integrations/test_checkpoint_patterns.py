"""Checkpoints as scripts write them (issue 51 item 3): a save by rank 0 alone is refused in one line (never a
hang) and nanoGPT's own rank-0 torch.save works; the script's metadata in the same checkpoint; saving twice to one
folder is quiet and atomic; node-local disks said and handled; every load as plain data (DCP's pickles and
`lioncub train --resume` included)."""

from __future__ import annotations

import os
import pickle
import warnings

import checkpoint_patterns as cp
import pytest
import safe_cases
import torch

from lioncub import LionCub
from lioncub.comm.spawn import spawn
from lioncub.integrations import checkpoint


def _one(steps=2):
    net = safe_cases.model()
    opt = LionCub(net.parameters(), lr=safe_cases.LR, method="vote-1bit", bucket_mb=safe_cases.BUCKET_MB)
    cp.step(net, opt, 0, 1, steps)
    return net, opt


def _fresh():
    net = safe_cases.model()
    return net, LionCub(net.parameters(), lr=safe_cases.LR, method="vote-1bit", bucket_mb=safe_cases.BUCKET_MB)


def test_a_save_by_rank_0_alone_is_refused_in_one_line_that_shows_the_pattern(tmp_path):
    path = str(tmp_path / "ckpt")
    r0, r1 = spawn(cp.rank0_saves_alone, 2, path, timeout=90)
    err = r0["error"]
    assert err is not None and "\n" not in err and r1["error"] is None
    assert "called on rank 0 but not on rank 1" in err and "every rank" in err and "if rank == 0:" in err
    assert "torch.save(" in err and "opt.state_dict()" in err  # the rank-0 pattern that works
    assert r0["before"] == ["ckpt"] or r0["before"] == []  # nothing written by the refused call
    assert not any("lioncub-" in name for name in r0["before"])
    assert r0["after"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # and the next save works


def test_nanogpt_rank0_torch_save_of_the_state_dict_works_and_loads_safely(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    r0, r1 = spawn(cp.rank0_torch_save, 2, path, timeout=90)
    assert r0["iter_num"] == 2 and r0["step"] == r1["step"] == 4
    assert torch.equal(r0["params"], r1["params"])  # both resumed from rank 0's file: replicas stay equal


def test_the_scripts_metadata_round_trips_and_bad_metadata_is_refused_in_one_line(tmp_path):
    net, opt = _one()
    extra = {"step": 10, "config": {"lr": 3e-4, "layers": [6, 16, 3], "name": "tiny"}, "best_val_loss": 1.25}
    checkpoint.save(str(tmp_path / "a"), net, opt, extra=extra)
    info = checkpoint.load(str(tmp_path / "a"), *_fresh())
    assert info["extra"] == extra and info["step"] == 2
    checkpoint.save(str(tmp_path / "b"), net, opt)
    assert checkpoint.load(str(tmp_path / "b"), *_fresh())["extra"] is None
    for bad, word in ((("a", "tuple"), "dict"), ({"betas": (0.9, 0.99)}, "unchanged"), ({"f": object()}, "plain"),
                      ({1: "int key"}, "unchanged")):
        with pytest.raises(TypeError, match=word) as exc:
            checkpoint.save(str(tmp_path / "c"), net, opt, extra=bad)
        assert "\n" not in str(exc.value)
    assert not (tmp_path / "c").exists()


def test_saving_twice_to_one_folder_is_quiet_and_keeps_the_second(tmp_path):
    path = str(tmp_path / "ckpt")
    for r in spawn(cp.save_twice, 2, path, timeout=90):
        assert r["warnings"] == [] and r["messages"] == []  # no "Detected an existing checkpoint"
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"] and r["siblings"] == ["ckpt"]
        assert r["info"]["step"] == 4 and r["info"]["extra"]["step"] == 4 and r["same"]


def test_a_save_that_dies_midway_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    net, opt = _one(2)
    checkpoint.save(path, net, opt, extra={"step": 2})
    real = checkpoint._dcp_save

    def dies(state, where, opt_):  # writes the data files, then the job is killed before .metadata
        real(state, where, opt_)
        os.remove(os.path.join(where, ".metadata"))
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_dcp_save", dies)
    cp.step(net, opt, 0, 3, 4)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, net, opt, extra={"step": 4})
    monkeypatch.undo()
    assert checkpoint.load(path, *_fresh())["extra"] == {"step": 2}  # the old one, whole
    checkpoint.save(path, net, opt, extra={"step": 4})  # the next save clears what the dead one left
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert checkpoint.load(path, *_fresh())["extra"] == {"step": 4}


def test_a_job_killed_between_the_two_renames_resumes_from_the_new_checkpoint(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    net, opt = _one(2)
    checkpoint.save(path, net, opt, extra={"step": 2})
    cp.step(net, opt, 0, 3, 4)
    checkpoint.save(str(tmp_path / "new"), net, opt, extra={"step": 4})
    os.rename(path, path + ".lioncub-old-x")  # the old one moved aside, the new one not yet in place
    os.rename(str(tmp_path / "new"), path + ".lioncub-saving-x")
    with caplog.at_level("WARNING", logger="lioncub"):
        assert checkpoint.load(path, *_fresh())["extra"] == {"step": 4}
    assert "a save died while replacing it" in caplog.text


def test_node_local_disks_are_said_refused_on_every_rank_and_load_once_gathered(tmp_path):
    r0, r1 = spawn(cp.node_local_disks, 2, str(tmp_path), timeout=120)
    assert r0["files"] == [".metadata", "__0_0.distcp"] and r1["files"] == ["__1_0.distcp"]  # each its own
    assert any("rank 1 does not see the .metadata" in m for m in r1["messages"])
    assert any("1 of 2 ranks do not see" in m for m in r0["messages"])
    for r in (r0, r1):  # rank 1 has no .metadata: refused on both ranks, neither waits for the other
        assert r["refused"] is not None and "no complete checkpoint" in r["refused"] and "\n" not in r["refused"]
        assert r["info"]["momenta"] == "own" and r["info"]["extra"] == {"step": 3} and r["same"]


class _Payload:
    """What an attacker's pickle would do: here, create a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_checkpoint_that_carries_a_pickled_object_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    net, opt = _one()
    marker = str(tmp_path / "pwned")
    # 1. an entry of the checkpoint (DCP's own load would run it: torch.load(weights_only=False))
    path = str(tmp_path / "entry")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": net.state_dict(), "lioncub": {"meta": _Payload(marker)}}, checkpoint_id=path, no_dist=True)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="refused") as exc:
        checkpoint.load(path, *_fresh())
    assert "\n" not in str(exc.value) and not os.path.exists(marker)
    # 2. DCP's .metadata itself (torch reads it with pickle.load)
    path = str(tmp_path / "metadata")
    checkpoint.save(path, net, opt)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="posix.mkdir|os.mkdir") as exc:
        checkpoint.load(path, *_fresh())
    assert "\n" not in str(exc.value) and not os.path.exists(marker)


def test_lioncub_train_resume_loads_plain_data_only(tmp_path):
    from lioncub.apps.train.loop import TrainConfig, load_plain, resume, train

    cfg = TrainConfig(model="mlp", method="vote-1bit", steps=3, checkpoint_dir=str(tmp_path / "ckpt"))
    train(cfg, progress=False)
    (saved,) = os.listdir(tmp_path / "ckpt")
    state = load_plain(str(tmp_path / "ckpt" / saved))  # what --resume reads, with weights_only=True
    assert state["step"] == 3 and len(state["records"]) == 3
    marker = str(tmp_path / "pwned")
    state["records"].append(_Payload(marker))
    torch.save(state, str(tmp_path / "ckpt" / "step0000004-rank0.pt"))  # someone who can write the folder
    from lioncub.apps.train.loop import _setup

    model, _, opt, _, _ = _setup(TrainConfig(**dict(vars(cfg), resume=True)), 1)
    with pytest.raises(ValueError, match="refused to load a checkpoint that is not plain data") as exc:
        resume(TrainConfig(**dict(vars(cfg), resume=True)), model, opt, 0, 1)
    assert "\n" not in str(exc.value) and not os.path.exists(marker)
