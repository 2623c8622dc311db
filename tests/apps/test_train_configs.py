"""Training configurations (lioncub.apps.train.configs): the strings users type, parsed into a wrapper and an
optimizer, and the capabilities the training loop, the prediction, the benches and the demo ask."""

from __future__ import annotations

import argparse

import pytest

from lioncub import methods
from lioncub.apps.train import configs


def test_every_method_and_ddp_lion_parse_and_spell_back():
    hsdp = tuple(f"hsdp+{n}" for n in methods.NAMES)
    assert configs.NAMES == methods.NAMES + ("ddp+lion", "hsdp+lion") + hsdp  # --method's choices, in order
    for name in configs.NAMES:
        assert configs.parse(name).name == name
    for name in methods.NAMES:
        run = configs.parse(name)
        assert run.wrapper is configs.LIONCUB and run.method is methods.get(name)
    ddp = configs.parse("ddp+lion")
    assert ddp is configs.DDP_LION and ddp.wrapper is configs.DDP and ddp.method is None
    for name in methods.NAMES:
        run = configs.parse(f"hsdp+{name}")
        assert run.wrapper is configs.HSDP and run.wrapper.fsdp and run.method is methods.get(name)
    sharded = configs.parse("hsdp+lion")
    assert sharded.plain_lion and sharded.wrapper.fsdp and not sharded.wrapper.torch_ddp


@pytest.mark.parametrize("text", ["nope", "", "ddp", "ddp+", "ddp+nope", "ddp+vote-1bit", "lion", "lioncub+lion",
                                  "DDP+LION", " vote-1bit", None, 3])
def test_a_bad_configuration_is_a_one_line_error_listing_the_choices(text):
    with pytest.raises(ValueError) as err:
        configs.parse(text)
    msg = str(err.value)
    assert "\n" not in msg and msg == (f"unknown method {text!r}; choose one of allreduce, vote-allgather, vote-1bit, "
                                       "vote-pbit, avg-pbit, l1-pbit, ddp+lion, hsdp+lion, hsdp+allreduce, "
                                       "hsdp+vote-allgather, hsdp+vote-1bit, hsdp+vote-pbit, hsdp+avg-pbit, "
                                       "hsdp+l1-pbit")


def test_capabilities():
    ddp, allreduce = configs.parse("ddp+lion"), configs.parse(methods.BASELINE)
    assert ddp.plain_lion and ddp.wrapper.torch_ddp
    assert not (ddp.dense or ddp.compressed or ddp.uses_levels)
    assert allreduce.dense and not (allreduce.plain_lion or allreduce.compressed or allreduce.wrapper.torch_ddp)
    for name in methods.COMPRESSED:
        run = configs.parse(name)
        assert run.compressed and not (run.plain_lion or run.dense or run.wrapper.torch_ddp)
        assert run.uses_levels == methods.get(name).uses_levels
    assert [n for n in configs.NAMES if configs.parse(n).uses_levels] == ["l1-pbit", "hsdp+l1-pbit"]
    assert [c.name for c in configs.CONFIGURATIONS if c.plain_lion] == ["ddp+lion", "hsdp+lion"]


def test_train_config_asks_the_record():
    from lioncub.apps.train.loop import TrainConfig, build, make_optimizer
    from lioncub.optim import LionCub
    from lioncub.optim.lion import Lion

    assert TrainConfig(method="ddp+lion").configuration is configs.DDP_LION
    assert TrainConfig(method="vote-1bit", dense_warmup=3).configuration.compressed
    with pytest.raises(ValueError,
                       match=r"^unknown method 'ddp\+vote-1bit'; choose one of .*, ddp\+lion, hsdp\+lion, .*l1-pbit$"):
        TrainConfig(method="ddp+vote-1bit")
    with pytest.raises(ValueError, match="applies to LionCub's methods, not ddp\\+lion"):
        TrainConfig(method="ddp+lion", dense_warmup=1)
    with pytest.raises(ValueError, match="hierarchical by construction"):
        TrainConfig(method="hsdp+vote-1bit", hierarchical=True)
    for name in ("hsdp+vote-1bit", "hsdp+lion"):  # (DCP: lioncub.checkpoint; torch's sharded state dicts for Lion)
        assert TrainConfig(method=name, checkpoint_dir="x").checkpoint_dir == "x"
    for name in ("ddp+lion", methods.BASELINE):
        with pytest.raises(ValueError, match="hierarchical applies to the compressed methods without hsdp"):
            TrainConfig(method=name, hierarchical=True)
    net = build(TrainConfig(model="mlp"))[0]
    assert type(make_optimizer(TrainConfig(model="mlp", method="ddp+lion"), net)) is Lion
    assert isinstance(make_optimizer(TrainConfig(model="mlp", method="vote-1bit"), net), LionCub)


def test_the_cli_takes_every_configuration():
    from lioncub.apps.train.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for name in configs.NAMES:
        assert config_from_args(parser.parse_args(["train", "--method", name])).method == name
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--method", "ddp+vote-1bit"])


def test_the_prediction_models_ddp_lion_as_ddp_buckets_of_the_baseline():
    from lioncub.apps.train.loop import TrainConfig
    from lioncub.apps.train.predict import predict_step

    kw = dict(ranks=4, bandwidth="100Mbit")
    ddp = predict_step(TrainConfig(model="mlp", method="ddp+lion"), 10**6, 0.05, **kw)
    dense = predict_step(TrainConfig(model="mlp", method=methods.BASELINE, bucket_mb=25.0), 10**6, 0.05, **kw)
    assert ddp.step_seconds == dense.step_seconds and ddp.bytes_sent_per_rank == dense.bytes_sent_per_rank
