"""`lioncub train --local-steps H --outer ...`, and the benches' +local:H configurations."""

import argparse
import json

import pytest


def test_lioncub_train_local_steps_flag(tmp_path):
    from lioncub.apps.benchmarks.train import _configs
    from lioncub.apps.train.cli import config_from_args, register
    from lioncub.apps.train.configs import split_local, split_run
    from lioncub.apps.train.loop import TrainConfig
    from lioncub.cli import main

    log = tmp_path / "steps.jsonl"
    assert main(["train", "--model", "mlp", "--ranks", "2", "--steps", "4", "--method", "vote-1bit",
                 "--local-steps", "2", "--outer", "avg", "--log", str(log), "--json"]) == 0
    sent = [json.loads(line)["bytes_sent"] for line in log.read_text().splitlines()]
    assert sent[0] == sent[2] == 0 and sent[1] == sent[3] > 0
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["train", "--local-steps", "25", "--outer", "sign:0.5"]))
    assert (cfg.local_steps, cfg.outer) == (25, "sign:0.5")
    with pytest.raises(ValueError, match="local_steps and outer apply to LionCub"):
        TrainConfig(method="ddp+lion", local_steps=3)
    assert split_local("vote-1bit+local:25:avg:1") == ("vote-1bit", 25, "avg:1")
    assert split_run("vote-1bit@every:10+local:5") == ("vote-1bit", "every:10", 0)
    with pytest.raises(ValueError, match=r"\+local:H"):
        split_local("vote-1bit+local:0")
    assert _configs("ddp+lion,vote-1bit,allreduce+local:5:avg", local_steps=10) == [
        ("ddp+lion", "none", False), ("vote-1bit+local:10", "none", False), ("allreduce+local:5:avg", "none", False)]


def test_lioncub_train_local_steps_resumes_exactly_from_its_checkpoint(tmp_path):
    """--local-steps 2 with --checkpoint-dir: 5 steps straight against 3 (mid-interval: the replicas differ
    there) and a resume to 5: the same losses step by step and the same final loss."""
    import os

    from lioncub.apps.train.loop import TrainConfig, train_local

    common = dict(model="mlp", method="vote-1bit", local_steps=2, outer="nesterov")
    full = train_local(TrainConfig(**common, steps=5), 2, progress=False)
    part = dict(common, checkpoint_dir=str(tmp_path / "ckpt"))
    train_local(TrainConfig(**part, steps=3), 2, progress=False)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step0000003-rank0.pt", "step0000003-rank1.pt"]
    resumed = train_local(TrainConfig(**part, steps=5, resume=True), 2, progress=False)
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in full["records"]]
    assert resumed["final_loss"] == full["final_loss"]


def test_lioncub_train_fragments_stream_the_outer_steps(tmp_path):
    """--fragments 2 (H=4, the default outer_delay 1): fragment 0's exchanges launch at steps 2 and 6, fragment 1's
    at 4 and 8, each applied a step later: bytes at 3, 5 and 7 only. A checkpoint after step 2 (an exchange in
    flight) resumes to 6 with the same losses."""
    from lioncub.apps.benchmarks.train import _cfg, _configs
    from lioncub.apps.train.configs import split_local, split_stream
    from lioncub.apps.train.loop import TrainConfig, train_local
    from lioncub.cli import main

    log = tmp_path / "steps.jsonl"
    assert main(["train", "--model", "mlp", "--ranks", "2", "--steps", "8", "--method", "vote-1bit", "--bucket-mb",
                 "0.0001", "--local-steps", "4", "--fragments", "2", "--log", str(log), "--json"]) == 0
    sent = [json.loads(line)["bytes_sent"] for line in log.read_text().splitlines()]
    assert [s > 0 for s in sent] == [step in (3, 5, 7) for step in range(1, 9)]
    common = dict(model="mlp", method="vote-1bit", local_steps=4, fragments=2, bucket_mb=0.0001)
    full = train_local(TrainConfig(**common, steps=6), 2, progress=False)
    assert (full["fragments"], full["outer_delay"]) == (2, 1)
    part = dict(common, checkpoint_dir=str(tmp_path / "ckpt"))
    train_local(TrainConfig(**part, steps=2), 2, progress=False)
    resumed = train_local(TrainConfig(**part, steps=6, resume=True), 2, progress=False)
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in full["records"]]
    with pytest.raises(ValueError, match="give local_steps too"):
        TrainConfig(method="vote-1bit", fragments=2)
    assert split_stream("vote-1bit+local:25:avg+stream:5") == ("vote-1bit+local:25:avg", 5, None)
    assert split_stream("vote-1bit+local:25+stream:5:4") == ("vote-1bit+local:25", 5, 4)
    assert split_local("vote-1bit+local:25:avg+stream:5") == ("vote-1bit", 25, "avg")
    for bad in ("vote-1bit+stream:2", "vote-1bit+local:4+stream:2:x", "vote-1bit+local:4+stream:0"):
        with pytest.raises(ValueError, match=r"\+stream:F\[:D\] with F >= 1"):
            split_stream(bad)
    assert _configs("vote-1bit+local:25+stream:5") == [("vote-1bit+local:25+stream:5", "none", False)]
    assert _cfg("vote-1bit+local:25+stream:5", "none", 10, "char-tiny").fragments == 5
    cfg = _cfg(_configs("allreduce+local:25+stream:5:4")[0][0], "none", 10, "char-tiny")
    assert (cfg.local_steps, cfg.fragments, cfg.outer_delay) == (25, 5, 4)


def test_a_rank_rejecting_its_options_is_a_one_line_error(capsys):
    """The options only the ranks can check (fragments against the model's buckets) come back as bad input."""
    from lioncub.cli import main

    assert main(["train", "--model", "mlp", "--ranks", "2", "--steps", "2", "--local-steps", "4",
                 "--fragments", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lioncub: error: rank ") and "more than the optimizer's 1 buckets" in err
    assert "Traceback" not in err and err.count("\n") == 1
