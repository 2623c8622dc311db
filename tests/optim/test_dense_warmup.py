"""LionCub(dense_warmup=K): the first K steps are plain allreduce Lion bit for bit (momenta identical on
every rank), then the chosen method from that state; overlap or not; a resume on either side of the
boundary equals the uninterrupted run."""

import argparse
import json

import pytest
import safe_cases

from lioncub import LionCub
from lioncub.apps.train.loop import TrainConfig
from lioncub.comm import wire
from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit"])
def test_dense_warmup_then_method_and_resume(method):
    reports = spawn(safe_cases.warmup_cases, 2, method, 3, 6, timeout=120)
    for rank, r in enumerate(reports):
        assert r["momenta_identical_after_warmup"], rank
        for overlap in (True, False):
            o = r[overlap]
            assert o["warmup_equal"], (rank, overlap)  # steps 1..K: allreduce Lion, bit for bit
            assert o["after_equal"], (rank, overlap)  # then the method, from the warm-up's state
            assert o["changed_after_warmup"] and o["momenta_differ_after"] and o["replicas_equal"], (rank, overlap)
        assert r["resume_at_2"] and r["resume_at_4"], rank
        assert r["state_dict_warmup"] == 3


def test_dense_warmup_is_validated_and_recorded():
    net = safe_cases.model()
    with pytest.raises(ValueError, match="dense_warmup"):
        LionCub(net.parameters(), dense_warmup=-1)
    opt = LionCub(net.parameters(), method="vote-1bit", dense_warmup=5)
    assert opt.engine.method_at(5).dense and not opt.engine.method_at(6).dense
    assert opt.state_dict()["lioncub"]["dense_warmup"] == 5


def test_lioncub_train_dense_warmup_flag(tmp_path):
    from lioncub.apps.train.cli import config_from_args, register
    from lioncub.cli import main

    log = tmp_path / "steps.jsonl"
    assert main(["train", "--model", "mlp", "--ranks", "2", "--steps", "4", "--method", "vote-1bit",
                 "--dense-warmup", "2", "--log", str(log), "--json"]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    sent = [r["bytes_sent"] for r in records]
    check = wire.traffic([wire.SAME_GRADIENTS], 2, 1)[0]  # once, on the first vote (Engine.check_replicas)
    assert sent[0] == sent[1] > 10 * sent[2] and sent[2] - check == sent[3]  # fp32 gradients, then 1-bit votes
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", "--dense-warmup", "300"])
    assert config_from_args(args).dense_warmup == 300
    with pytest.raises(ValueError, match="dense_warmup"):
        TrainConfig(method="ddp+lion", dense_warmup=3)


def test_autotune_recommends_a_dense_warmup_by_risk_level():
    import torch
    from lioncub.simulator import Cluster, get_profile

    from lioncub.apps import autotune
    from lioncub.apps.autotune.risk_rule import dense_warmup_for

    assert [dense_warmup_for(level, 10_000) for level in ("low", "medium", "high")] == [0, 200, 500]
    assert dense_warmup_for("high", 1000) == 100  # at most a tenth of the run
    cluster = Cluster.for_ranks(16, bandwidth="1Gbit", latency="50us")
    model = autotune.model_spec("char-tiny", compute_seconds=0.05)
    res = autotune.search(cluster, model.params, model.compute_seconds, steps=3000, backend="gloo")
    levels = set()
    for c in res.best_per_method():
        cfg = json.loads(json.dumps(autotune.build_config(c, res, model, cluster, "t", get_profile("gloo"), "v",
                                                          steps=3000)))
        want = 0 if c.method == "allreduce" else dense_warmup_for(cfg["risk"]["level"], 3000)
        guard = c.momentum_sync.startswith("adaptive")  # dense until the later of the warm-up and its start
        assert c.dense_steps == (max(want, 12) if guard else want), c.method
        assert cfg["optimizer"].get("dense_warmup", 0) == cfg["train"].get("dense_warmup", 0) == want, c.method
        levels.add(cfg["risk"]["level"])
        opt = LionCub(torch.nn.Linear(3, 3).parameters(), **cfg["optimizer"])  # both accept it
        assert opt.dense_warmup == want and TrainConfig.from_dict(cfg["train"]).dense_warmup == want
    assert {"low", "medium"} <= levels or {"medium", "high"} <= levels  # the rule was exercised
