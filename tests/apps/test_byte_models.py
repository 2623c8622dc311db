"""The byte-level models (byte-30m, byte-gpt2-small) on the python-src corpus: their sizes, defaults and a
two-step smoke run each."""

from __future__ import annotations

import math

import pytest

from lioncub.apps.train.loop import TrainConfig, build, train, train_local
from lioncub.apps.train.models import count_params
from lioncub.apps.tuned_lr import DEFAULT_LR, TO_BE_MEASURED


def _gpt_params(layers: int, width: int, vocab: int, block: int) -> int:
    """nanoGPT's count, written out: per block two LayerNorms, qkv and proj, the 4x MLP; embeddings, ln_f and an
    untied head without bias."""
    per_block = 2 * (2 * width) + (3 * width * width + 3 * width) + (width * width + width) \
        + (4 * width * width + 4 * width) + (4 * width * width + width)
    return vocab * width + block * width + layers * per_block + 2 * width + width * vocab


@pytest.mark.parametrize("name,layers,width,count256", [("byte-30m", 6, 640, 30_033_920),
                                                        ("byte-gpt2-small", 12, 768, 85_645_824)])
def test_sizes_and_defaults(name, layers, width, count256):
    cfg = TrainConfig(model=name)
    assert (cfg.data, cfg.block_size, cfg.lr) == ("python-src", 256, DEFAULT_LR[name])
    model, data = build(cfg)  # the token files are opened at the first batch, not here
    assert data.vocab_size == 256 and model.cfg.n_head * 64 == width
    assert count_params(model) == _gpt_params(layers, width, 256, 256) == count256
    if name == "byte-gpt2-small":  # GPT-2-small's body; GPT-2's 124M has a 50,257-token embedding
        assert _gpt_params(12, 768, 256, 1024) == 86_235_648
        assert _gpt_params(12, 768, 50257, 1024) - 50257 * 768 == 124_439_808  # GPT-2 ties its head to it


def test_the_char_models_keep_their_data_and_block_and_bad_names_are_one_line_errors():
    cfg = TrainConfig()
    assert (cfg.model, cfg.data, cfg.block_size) == ("char-tiny", "pydoc-topics", 64)
    assert TrainConfig(model="char-tiny", data="python-src").data == "python-src"
    with pytest.raises(ValueError, match="unknown dataset 'wiki'"):
        TrainConfig(data="wiki")
    with pytest.raises(ValueError, match="the mlp trains on blobs"):
        TrainConfig(model="mlp", data="python-src")
    with pytest.raises(ValueError, match="amp must be one of"):
        TrainConfig(amp="fp8")


def test_the_placeholder_lrs_are_marked_and_every_other_default_is_swept():
    assert TO_BE_MEASURED == {"byte-30m", "byte-gpt2-small"} and TO_BE_MEASURED <= set(DEFAULT_LR)


def _smoke(summary, params):
    assert summary["params"] == params and summary["steps"] == 2 and len(summary["records"]) == 2
    assert all(math.isfinite(r["loss"]) and 4.0 < r["loss"] < 7.0 for r in summary["records"])  # ln 256 = 5.55
    assert math.isfinite(summary["final_loss"])


@pytest.mark.slow
def test_byte_30m_trains_two_steps_on_two_gloo_ranks_with_bf16_autocast():
    cfg = TrainConfig(model="byte-30m", method="vote-1bit", steps=2, warmup=1, batch_size=2, block_size=16,
                      eval_batches=1, amp="bf16")
    _smoke(train_local(cfg, 2, progress=False), _gpt_params(6, 640, 256, 16))


@pytest.mark.slow
def test_byte_gpt2_small_trains_two_steps():
    cfg = TrainConfig(model="byte-gpt2-small", method="allreduce", steps=2, warmup=1, batch_size=1, block_size=16,
                      eval_batches=1)
    _smoke(train(cfg, progress=False), _gpt_params(12, 768, 256, 16))


def test_train_cli_takes_data_and_amp(monkeypatch):
    from lioncub.apps.train import cli
    from lioncub.cli import build_parser

    args = build_parser("train").parse_args(["train", "--model", "char-tiny", "--data", "python-src", "--amp",
                                             "bf16"])
    cfg = cli.config_from_args(args)
    assert (cfg.data, cfg.amp, cfg.block_size) == ("python-src", "bf16", 64)
