"""Shared pieces of the tests marked `cuda` (what `make gpu-check` runs with `pytest -m cuda`): the device, the
sizes, the rank and training functions the tests start in other processes, and the report of figures.

The device is CUDA where torch sees a GPU. Without one the `cuda` tests are skipped (tests/conftest.py), except
in the rehearsal, `LIONCUB_TEST_DEVICE=cpu TRITON_INTERPRET=1`: then they run on CPU tensors with the Triton
interpreter at tiny sizes (what `make gpu-check` does on a machine without a GPU). `LIONCUB_GPU_CHECK_SIZE=tiny`
gives the tiny sizes on a GPU too (a smoke run).

With `LIONCUB_TEST_REPORT=path` the tests append one JSON line per figure the GPU check reports but does not
assert (the exactness targets: "bit-identical" on a GPU, where a rounding-level flip is allowed).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available() and os.environ.get("LIONCUB_TEST_DEVICE", "cuda") != "cpu"
DEVICE = torch.device("cuda" if CUDA else "cpu")
SIZE = os.environ.get("LIONCUB_GPU_CHECK_SIZE") or ("full" if CUDA else "tiny")
TRITON_OPS = "lioncub.kernels.triton_ops"
TWINS = "lioncub.kernels.reference"

GPT2_124M = dict(n_layer=12, d=768, vocab=50257, ctx=1024)
GPT2_124M_PARAMS = 124_439_808

CFG = {
    "full": dict(
        smoke_n=(1 << 20) + 3, gpt2=GPT2_124M, busy_dim=1024, exchange_n=1 << 20,
        ranks=dict(world_sizes=[2, 4], steps=20, sync_every=7, shapes=[(1000, 257), (4097,), (3, 333), (65537,)],
                   bf16=[(511, 129)], fp16=[(70001,)], bucket_mb=0.5),
        train=dict(model="char-medium", steps=200, batch_size=32, block_size=128, eval_batches=4),
    ),
    "tiny": dict(
        smoke_n=4099, gpt2=dict(n_layer=1, d=32, vocab=256, ctx=64), busy_dim=32, exchange_n=4099,
        ranks=dict(world_sizes=[2], steps=3, sync_every=2, shapes=[(37, 5), (300,)], bf16=[(7, 3)], fp16=[(11,)],
                   bucket_mb=1024 / 2**20),
        train=dict(model="char-tiny", steps=3, batch_size=4, block_size=16, eval_batches=1),
    ),
}[SIZE]


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def report(what: str, **fields) -> None:
    """One figure for the GPU check's summary (LIONCUB_TEST_REPORT); `target=True/False` marks an exactness
    target: reported, met or not."""
    path = os.environ.get("LIONCUB_TEST_REPORT")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps(dict(test=test, what=what, device=DEVICE.type, **fields), default=str) + "\n")


def gpt2_shapes(n_layer: int, d: int, vocab: int, ctx: int) -> list[tuple]:
    """Parameter shapes of GPT-2 (124M with n_layer=12, d=768, vocab=50257, ctx=1024: 124,439,808)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


# --- several ranks sharing the device (tests/comm/test_ranks_cuda.py) ---------------------------------------


def ranks_body(rank, world_size, cfg):
    """One rank: every method on both kernel backends, `steps` steps, then all replicas compared (on the
    host, so the comparison itself does not depend on the backend's CUDA support)."""
    import torch.distributed as dist

    from lioncub import LionCub, kernels, methods
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU (NCCL would need one GPU per rank: Gloo here)
    out = {}
    for backend in cfg["backends"]:
        os.environ["LIONCUB_KERNELS"] = backend
        for method in cfg["methods"]:
            gen = torch.Generator().manual_seed(0)
            kinds = [(cfg["shapes"], torch.float32), (cfg["bf16"], torch.bfloat16), (cfg["fp16"], torch.float16)]
            groups = [[torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(device)) for s in shapes]
                      for shapes, dtype in kinds]
            params = [p for g in groups for p in g]
            opt = LionCub([dict(params=groups[0]), dict(params=groups[1], lr=0.02, weight_decay=0.0),
                           dict(params=groups[2], lr=0.005, betas=(0.8, 0.95))], lr=0.01, weight_decay=0.1,
                          method=method, bucket_mb=cfg["bucket_mb"],
                          momentum_sync=None if methods.get(method).dense else cfg["sync_every"])
            start = torch.cat([p.detach().double().cpu().reshape(-1) for p in params])
            t0 = time.perf_counter()
            for step in range(1, cfg["steps"] + 1):
                g = torch.Generator().manual_seed(1000 * step + rank)
                for p in params:
                    grad = torch.randn(p.shape, generator=g)
                    grad.view(-1)[::5] = 0
                    p.grad.copy_(grad.to(p.dtype))
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if rank == 0:  # progress in the log: a run cut short shows where its time went
                print(f"ranks: world size {world_size}, {backend} {method}: {cfg['steps']} steps in {seconds:.2f} s",
                      file=sys.stderr, flush=True)
            flat = torch.cat([p.detach().double().cpu().reshape(-1) for p in params])
            moms = torch.cat([opt.state[p]["exp_avg"].detach().double().cpu().reshape(-1) for p in params])
            gathered = [torch.empty_like(flat) for _ in range(world_size)]
            dist.all_gather(gathered, flat)
            out[f"{backend} {method}"] = dict(
                replicas_equal=all(torch.equal(gathered[0], x) for x in gathered),
                moved=int((flat != start).sum()), elements=flat.numel(), finite=bool(torch.isfinite(flat).all()),
                skipped=opt.stats.skipped_steps, step_ms=1e3 * seconds / cfg["steps"],
                digest=hashlib.sha256(flat.numpy().tobytes() + moms.numpy().tobytes()).hexdigest()[:16],
                ran=kernels.implementation(params[0].detach()).__name__)
    return out


# --- training on the device (tests/apps/test_train_cuda.py) --------------------------------------------------

TRAIN_TOLERANCE = 0.02  # relative, on the mean loss of the last steps and on the eval loss


def train_run(out_path: str, device: str, cfg: dict) -> None:
    """One training run in this process (LIONCUB_KERNELS from the environment), deterministic algorithms."""
    from lioncub import kernels
    from lioncub.apps.train.loop import TrainConfig, train
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # the math attention: flash / memory-efficient backward kernels accumulate with atomics
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    tc = TrainConfig(model=cfg["model"], method="l1-pbit", steps=cfg["steps"], batch_size=cfg["batch_size"],
                     block_size=cfg["block_size"], eval_batches=cfg["eval_batches"], device=device, seed=0,
                     threads=0 if device == "cuda" else 1)
    t0 = time.perf_counter()
    s = train(tc, progress=False)
    probe = torch.zeros(1, device=device)
    res = dict(kernels_env=os.environ.get("LIONCUB_KERNELS", "auto"), ran=kernels.implementation(probe).__name__,
               params=s["params"], final_loss=s["final_loss"], losses=[x["loss"] for x in s["records"]],
               step_ms=1e3 * s["step_seconds"], seconds=time.perf_counter() - t0)
    Path(out_path).write_text(json.dumps(res))


def curve_diff(a: list[float], b: list[float]) -> dict:
    """Where two loss curves part, and how far apart their last steps' mean is."""
    first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    tail_n = max(1, min(20, len(a) // 5))
    ta, tb = sum(a[-tail_n:]) / tail_n, sum(b[-tail_n:]) / tail_n
    return dict(identical=a == b, first_different_step=first,
                max_abs_diff=max((abs(x - y) for x, y in zip(a, b)), default=0.0),
                tail_mean_rel_diff=abs(ta - tb) / max(abs(ta), 1e-12), tail_steps=tail_n)
