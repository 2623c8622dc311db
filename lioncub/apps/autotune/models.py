"""Models and GPUs: the compute time per step of a preset, a built-in model or N parameters."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from lioncub.simulator.units import format_time, parse_count, parse_time

# name -> peak dense bf16/fp16 tensor FLOP/s and memory bandwidth. The default assumption: an A100-class
# GPU reaching UTILIZATION of its peak in training (a typical large-model MFU).
GPUS = {
    "a100": dict(label="A100-class", peak_flops=312e12, memory_bandwidth=2.0e12),
    "h100": dict(label="H100-class (SXM)", peak_flops=989e12, memory_bandwidth=3.35e12),
    "v100": dict(label="V100-class", peak_flops=125e12, memory_bandwidth=0.9e12),
}
DEFAULT_GPU = "a100"
UTILIZATION = 0.40

# name -> parameters, training FLOPs per sample (forward + backward = 3x forward), default samples per rank
# per step, what a sample is. Transformers: 6 * params * tokens (per sequence of `seq` tokens);
# ResNet-50: 4.1 GMAC forward at 224x224 -> 3 * 8.2 GFLOP; ViT-B/16: 17.6 GMAC -> 3 * 35.2 GFLOP.
PRESETS = {
    "gpt2-124m": dict(params=124_439_808, seq=1024, batch=8, what="sequences of 1024 tokens"),
    "gpt2-350m": dict(params=354_823_168, seq=1024, batch=8, what="sequences of 1024 tokens"),
    "resnet50": dict(params=25_557_032, flops_per_sample=3 * 8.2e9, batch=256, what="224x224 images"),
    "vit-b16": dict(params=86_567_656, flops_per_sample=3 * 35.2e9, batch=128, what="224x224 images"),
}
BUILTIN = ("char-tiny", "char-small", "char-medium", "byte-30m", "byte-gpt2-small", "mlp")  # lioncub.apps.train.models
DEFAULT_TOKENS = 8192  # --params N without --tokens: 8 sequences of 1024 tokens per rank


@dataclass(frozen=True)
class ModelSpec:
    name: str  # preset / built-in name, or "custom"
    params: int
    compute_seconds: float  # forward + backward per rank per step
    compute_basis: str  # how compute_seconds was obtained, in words
    builtin: bool = False
    batch_size: int | None = None  # built-in: TrainConfig.batch_size
    block_size: int | None = None  # built-in char models: TrainConfig.block_size

    def to_dict(self) -> dict:
        return asdict(self)


_CHAR_SHAPES = {"char-tiny": (2, 128), "char-small": (4, 256), "char-medium": (6, 384),  # (layers, width)
                "byte-30m": (6, 640), "byte-gpt2-small": (12, 768)}
_BYTE_MODELS = {"byte-30m", "byte-gpt2-small"}  # vocabulary 256 (python-src), default block 256


def _char_vocab() -> int:
    from pydoc_data.topics import topics  # what lioncub.apps.train.data.CharText reads

    return len(set("".join(topics.values())))


def default_block(name: str) -> int:
    """A built-in transformer's default block size (TrainConfig's)."""
    return 256 if name in _BYTE_MODELS else 64


def builtin_params(name: str, block_size: int | None = None) -> int:
    """Parameters of a built-in model, counted without torch (the tests check them against the torch
    models): the transformers are nanoGPT-shaped (lioncub.apps.train.models), char-* over the characters of
    pydoc_data.topics, byte-* over 256 bytes; the MLP is 32 -> 256 -> 256 -> 10."""
    if name == "mlp":
        dims = [32, 256, 256, 10]
        return sum(a * b + b for a, b in zip(dims, dims[1:]))
    block_size = block_size or default_block(name)
    layers, c = _CHAR_SHAPES[name]
    v = 256 if name in _BYTE_MODELS else _char_vocab()
    block = 2 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * c + (4 * c * c + 4 * c) + (4 * c * c + c)
    return v * c + block_size * c + layers * block + 2 * c + c * v  # embeddings, blocks, ln_f, head


def _count(value, what: str) -> float:
    try:
        v = parse_count(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{what} must be positive, got {value!r}")
    return v


def model_spec(model: str | None = None, params=None, *, batch: int | None = None, seq_len: int | None = None,
               tokens=None, block_size: int | None = None, compute_seconds=None, flops=None,
               gpu: str = DEFAULT_GPU) -> ModelSpec:
    """The model to tune for: a preset, a built-in model or `params` parameters, and its compute time per
    step (given, or training FLOPs per step / achieved FLOP/s, by default the GPU's peak x UTILIZATION).
    1. check the arguments; 2. the achieved FLOP/s; 3. the model's work per step; 4. the compute time."""
    if model is not None and params is not None:
        raise ValueError("give --model or --params, not both")
    if model is None and params is None:
        raise ValueError("give the model: --model NAME (" + ", ".join(list(PRESETS) + list(BUILTIN))
                         + ") or --params N (e.g. 1.3B)")
    if gpu not in GPUS:
        raise ValueError(f"unknown --gpu {gpu!r}; choose one of: {', '.join(GPUS)}")
    for name, v in (("batch", batch), ("seq-len", seq_len), ("block-size", block_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"--{name} must be a positive integer, got {v!r}")
    achieved, flops_text = _achieved_flops(flops, gpu)
    if params is not None:
        w = _custom_work(params, batch, seq_len, tokens)
    elif model in PRESETS:
        w = _preset_work(model, batch, seq_len, tokens)
    elif model in BUILTIN:
        w = _builtin_work(model, batch, seq_len, block_size)
    else:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(list(PRESETS) + list(BUILTIN))}, "
                         "or give --params N")
    if compute_seconds is not None:
        try:
            c = parse_time(compute_seconds)
        except ValueError as exc:
            raise ValueError(f"--compute-seconds: {exc}") from None
        if not c >= 0:
            raise ValueError(f"--compute-seconds must be >= 0, got {compute_seconds!r}")
        basis = f"{format_time(c)} per step (given)"
    else:
        c = w.flops / achieved
        basis = f"{format_time(c)} per step = {w.text} / {flops_text}"
    return ModelSpec(w.name, w.params, c, basis, w.builtin, w.batch_size, w.block_size)


def _achieved_flops(flops, gpu: str) -> tuple[float, str]:
    """(FLOP/s, how it was obtained): given, else the GPU's peak x UTILIZATION."""
    if flops is not None:
        achieved = _count(flops, "--flops")
        return achieved, f"{achieved / 1e12:.4g} TFLOP/s (given)"
    g = GPUS[gpu]
    achieved = g["peak_flops"] * UTILIZATION
    return achieved, (f"{achieved / 1e12:.4g} TFLOP/s (assumed GPU: {g['label']}, "
                      f"{g['peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak at {UTILIZATION:.0%})")


@dataclass(frozen=True)
class _Work:
    """A model's training FLOPs per rank per step, and the figures they come from."""

    name: str
    params: int
    flops: float
    text: str  # the FLOPs in words
    builtin: bool = False
    batch_size: int | None = None
    block_size: int | None = None


def _custom_work(params, batch, seq_len, tokens) -> _Work:
    P = int(_count(params, "--params"))
    if P < 1:
        raise ValueError(f"--params must be at least 1, got {params!r}")
    if tokens is None and batch is not None:
        tokens = batch * (seq_len or 1024)
    t = _count(tokens, "--tokens") if tokens is not None else DEFAULT_TOKENS
    return _Work("custom", P, 6.0 * P * t, f"6 x {P / 1e6:.4g}M params x {t:g} tokens per rank")


def _preset_work(model, batch, seq_len, tokens) -> _Work:
    spec = PRESETS[model]
    P = spec["params"]
    b = batch or spec["batch"]
    if "seq" in spec:
        t = _count(tokens, "--tokens") if tokens is not None else b * (seq_len or spec["seq"])
        return _Work(model, P, 6.0 * P * t, f"6 x {P / 1e6:.4g}M params x {t:g} tokens per rank")
    if tokens is not None or seq_len is not None:
        raise ValueError(f"{model} is not a sequence model: give --batch (images per rank), not tokens")
    return _Work(model, P, spec["flops_per_sample"] * b,
                 f"{b} {spec['what']} per rank x {spec['flops_per_sample'] / 1e9:.4g} GFLOP")


def _builtin_work(model, batch, seq_len, block_size) -> _Work:
    bs = batch or 16
    blk = (block_size or seq_len or default_block(model)) if model != "mlp" else 64
    P = builtin_params(model, blk)
    t = bs * (blk if model != "mlp" else 1)
    return _Work(model, P, 6.0 * P * t,
                 f"6 x {P / 1e6:.4g}M params x {t} {'tokens' if model != 'mlp' else 'samples'} per rank", True, bs,
                 blk)
