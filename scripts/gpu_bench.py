"""The benchmarks of `make gpu-check` (scripts/gpu_check.py runs them): figures and speed targets, reported met or
not; what must hold is in the tests marked `cuda`. Each writes OUT.json (figures, targets, summary).

    python scripts/gpu_bench.py kernels OUT.json [--device cuda|cpu] [--size full|tiny] [--outdir DIR]
    python scripts/gpu_bench.py optimizer OUT.json [--device cuda|cpu] [--size full|tiny] [--kernels-json BENCH.json]

kernels: `lioncub bench kernels --json`: fp32 at 1M, 4M, 16M, 64M, 124,439,808 (GPT-2) and 256M elements, bf16 at
64M and 256M (64K fp32 at --size tiny); the codec kernels' fraction of the copy bandwidth, the compressed steps
against the fused Lion step. Each run's JSON as DIR/05-bench-DTYPE.json.

optimizer:
1. copy bandwidth: dst.copy_(src) on 1 GiB (16 MiB at --size tiny), device to device;
2. GPT-2-124M parameter shapes (124,439,808 fp32), world size 1: LionCub (with and without the non-finite
   check), lion-pytorch's Lion(use_triton=True) and torch.optim.AdamW(fused=True), interleaved rounds;
3. LionCub's step() timed alone after a backward that took the finite check, against no check at all, with a
   backward that only accumulates and one that computes (a matmul before each gradient lands);
4. the compressed codec against the fused Lion step on a bucket of the same size, from
   `lioncub bench kernels --json` (--kernels-json).
On CPU tensors (the rehearsal) the figures mean nothing and the targets are not evaluated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

GPT2 = dict(full=dict(n_layer=12, d=768, vocab=50257, ctx=1024), tiny=dict(n_layer=1, d=32, vocab=256, ctx=64))
ROUNDS = dict(full=(5, 10, 1024, 1 << 30), tiny=(2, 2, 32, 16 << 20))  # rounds, steps per round, busy dim, copy


def gpt2_shapes(n_layer: int, d: int, vocab: int, ctx: int) -> list[tuple]:
    """Parameter shapes of GPT-2 (124M with n_layer=12, d=768, vocab=50257, ctx=1024: 124,439,808)."""
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def timed(device, fn, repeat: int = 1) -> float:
    """ms per call of fn (CUDA: between events, the queue drained first)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(repeat):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / repeat
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1e3 * (time.perf_counter() - t) / repeat


def copy_bandwidth(device, nbytes: int) -> dict:
    """dst.copy_(src) of nbytes: GB/s counting the bytes read and written (2 * nbytes per copy), median of 5."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timed(device, lambda: dst.copy_(src), 2)
    repeat = max(1, min(20, int(50 / max(timed(device, lambda: dst.copy_(src)), 1e-3))))  # about 50 ms a round
    ms = statistics.median(timed(device, lambda: dst.copy_(src), repeat) for _ in range(5))
    return dict(bytes=nbytes, ms=ms, gbps=2 * nbytes / ms / 1e6, meaningful=device.type == "cuda")


def contenders(device, shapes, cuda: bool) -> dict:
    """{name: (parameters, optimizer)} on copies of the same parameters and gradients."""
    from lioncub import LionCub
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(s, generator=gen, device=device).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device) for s in shapes]

    def fresh():
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        return ps
    hp, out = dict(lr=1e-4, weight_decay=0.1), {}
    out["lioncub"] = (ps := fresh(), LionCub(ps, **hp))
    out["lioncub, no finite check"] = (ps := fresh(), LionCub(ps, skip_nonfinite=False, **hp))
    try:
        from lion_pytorch import Lion
        out["lion-pytorch" + (" (triton)" if cuda else " (torch)")] = (ps := fresh(), Lion(ps, use_triton=cuda, **hp))
    except ImportError:
        pass
    out["torch AdamW(fused=True)"] = (ps := fresh(), torch.optim.AdamW(ps, fused=True, **hp))
    return out


def busy_backward(device, grads: list, dim: int):
    """backward(params): each gradient (grads') lands after a (dim x dim) matmul, as after a layer's backward."""
    w = torch.randn(dim, dim, device=device)

    class Land(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, g):
            ctx.g = g
            return p.view_as(p)

        @staticmethod
        def backward(ctx, _):
            torch.mm(w, w)
            return ctx.g, None

    return lambda params: torch.autograd.backward([Land.apply(p, g).sum() for p, g in zip(params, grads)])


def iterations(device, runs: dict, backward, n_iter: int, deadline: float) -> dict:
    """{run: median ms of backward (zero_grad + backward), step() alone, both}, after 3 warm-up iterations."""
    times = {k: dict(backward=[], step=[], iteration=[]) for k in runs}
    for i in range(n_iter + 3):
        for name, (ps, opt) in runs.items():
            t_back = timed(device, lambda o=opt, q=ps: (o.zero_grad(), backward(q)))
            t_step = timed(device, opt.step)
            if i >= 3:
                for part, t in (("backward", t_back), ("step", t_step), ("iteration", t_back + t_step)):
                    times[name][part].append(t)
        if i >= 3 and time.monotonic() > deadline:
            break
    return {k: {part: round(statistics.median(v), 4) for part, v in t.items()} for k, t in times.items()}


def codec_of_bench(path: Path | None, n: int) -> dict | str:
    """The codec on a bucket of n elements from `lioncub bench kernels --json` (N = 8 rows), over fused Lion."""
    res = json.loads(path.read_text()) if path and path.exists() else {}
    row = next((s for s in res.get("steps", []) if s["size"] == n), None)
    if row is None:
        return "not measured (the kernel bench has no bucket of this size)"
    x = {k: row.get(f"{k}_ms") and round(row[f"{k}_ms"] / row["lion_ms"], 3)
         for k in ("vote-1bit", "vote-1bit-checked", "vote-1bit-overlapped", "l1-pbit", "l1-pbit-checked",
                   "l1-pbit-overlapped")}
    return dict(size=n, world_size=res.get("world_size"), lion_ms=row["lion_ms"], x_lion=x,
                note="prepass + quantize_pack + vote (N rows) + unpack_apply; checked: without the prepass (backward "
                     "took it); overlapped: unpack_apply with the deferred momentum update alone")


LIONCUB_CLI = "import sys; from lioncub.cli import main; sys.exit(main(sys.argv[1:]))"  # the `lioncub` command
# --repeat 5: 50 ms of timed runs per figure (do_bench medians); the bench makes its buffers with CPU randn
KERNEL_RUNS = dict(full=[dict(dtype="float32", sizes="1M,4M,16M,64M,124439808,256M", share=0.62, repeat=5),
                         dict(dtype="bfloat16", sizes="64M,256M", share=0.38, repeat=5)],
                   tiny=[dict(dtype="float32", sizes="64K", share=1.0, repeat=1)])


def bench_summary(res: dict, big: int) -> dict:
    """From `lioncub bench kernels --json`: the codec kernels' fraction of copy (>= big) and the step ratios."""
    codec = [x for x in res.get("kernels", []) if x["kernel"].startswith(("quantize_pack", "unpack_apply"))
             and x["size"] >= big]
    ratios = {}
    for s in res.get("steps", []):
        if lion := s.get("lion_ms"):
            ratios[s["size"]] = {k: round(s[f"{k}_ms"] / lion, 3) for k in (
                "vote-1bit", "vote-1bit-checked", "vote-1bit-overlapped", "l1-pbit", "l1-pbit-checked",
                "l1-pbit-overlapped") if s.get(f"{k}_ms")}
            for key, name in (("lion_pytorch_ms", "lion-pytorch / lion"), ("twin_lion_ms", "twin lion / lion")):
                if s.get(key):
                    ratios[s["size"]][name] = round(s[key] / lion, 3)
    return dict(copy_gbps=res.get("copy_gbps"), device=res.get("device"), backend=res.get("backend"),
                min_codec_of_copy=min((x["of_copy"] for x in codec), default=None),
                codec_of_copy={f"{x['kernel']} @ {x['size']}": round(x["of_copy"], 3) for x in codec},
                step_ratios=ratios)


def kernels_bench(a) -> dict:
    """Each run of `lioncub bench kernels` with its share of the time (the last one: what the others left)."""
    r: dict = dict(device=a.device, size=a.size, runs={}, checks={}, targets={})
    t0, parts, specs = time.monotonic(), [], KERNEL_RUNS[a.size]
    for i, spec in enumerate(specs):
        left = a.seconds - (time.monotonic() - t0)
        cmd = [sys.executable, "-c", LIONCUB_CLI, "bench", "kernels", "--device", a.device, "--json", "--sizes",
               spec["sizes"], "--dtype", spec["dtype"], "--repeat", str(spec["repeat"])]
        t, res = time.monotonic(), None
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                               timeout=max(1.0, left if i == len(specs) - 1 else min(left, a.seconds * spec["share"])))
            out, rc = p.stdout, p.returncode
            res = json.loads(out[out.find("{"):]) if rc == 0 and "{" in out else None
            sys.stderr.write(p.stderr[-3000:])
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            out, rc = str(exc), None
        e = r["runs"][spec["dtype"]] = dict(command=" ".join(cmd), rc=rc, seconds=round(time.monotonic() - t, 2))
        r["checks"][f"bench {spec['dtype']} ran"] = res is not None
        if res is None:
            e["error"] = out[-2000:]
            parts.append(f"{spec['dtype']}: FAILED (rc {rc})")
            continue
        if a.outdir:
            (a.outdir / f"05-bench-{spec['dtype']}.json").write_text(json.dumps(res, indent=2))
        e.update(bench_summary(res, 64 * 2**20 if a.device == "cuda" else 0), bench_targets=res.get("targets", {}))
        m = e["min_codec_of_copy"]
        parts.append(f"{spec['dtype']}: copy {e['copy_gbps']:.0f} GB/s, codec kernels >= "
                     f"{'-' if m is None else f'{100 * m:.0f}%'} of copy")
    mins = [e.get("min_codec_of_copy") for e in r["runs"].values()]
    ratios = r["runs"].get("float32", {}).get("step_ratios", {})
    if ratios:
        size = max(ratios, key=int)
        r["largest"] = dict(size=int(size), **ratios[size])
        parts.append(f"vote-1bit step {r['largest'].get('vote-1bit', float('nan')):.2f}x fused Lion at {size} elements")
    if a.device == "cuda":
        r["targets"]["quantize-and-pack, unpack-and-apply >= 85% of copy (>= 64M, fp32 and bf16)"] = (
            all(m is not None and m >= 0.85 for m in mins) if len(mins) == 2 else None)
        r["targets"]["vote-1bit codec <= 1.3x fused Lion (largest bucket)"] = (
            r["largest"].get("vote-1bit", 9) <= 1.3 if "largest" in r else None)
    r["summary"] = "; ".join(parts)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=("kernels", "optimizer"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=tuple(GPT2), default=None)
    ap.add_argument("--kernels-json", type=Path, help="optimizer: the fp32 kernel bench's JSON (the codec's times)")
    ap.add_argument("--outdir", type=Path, help="kernels: where each run's JSON goes")
    ap.add_argument("--seconds", type=float, default=60.0, help="stop after about this long")
    a = ap.parse_args(argv)
    a.size = a.size or ("full" if a.device == "cuda" else "tiny")
    r = kernels_bench(a) if a.which == "kernels" else optimizer_bench(a)
    a.out.write_text(json.dumps(r, indent=2, default=str))
    print(r["summary"])
    return 0


def optimizer_bench(a) -> dict:
    """The optimizer's figures and targets (the docstring's 1-4)."""
    device, deadline = torch.device(a.device), time.monotonic() + a.seconds
    cuda, size = device.type == "cuda", a.size
    rounds, steps, busy, copy_bytes = ROUNDS[size]
    from lioncub import LionCub, kernels
    r: dict = dict(device=a.device, size=size, targets={})
    r["copy"] = copy_bandwidth(device, copy_bytes)
    shapes = gpt2_shapes(**GPT2[size])
    n = r["params"] = sum(math.prod(s) for s in shapes)
    runs = contenders(device, shapes, cuda)
    r["backend"] = kernels.implementation(runs["lioncub"][0][0].detach()).__name__
    for _, opt in runs.values():  # warm-up: Triton compiles, lion-pytorch autotunes
        timed(device, opt.step, 3)
    times: dict = {k: [] for k in runs}
    for _ in range(rounds):  # interleaved: the contenders see the same machine state
        for name, (_, opt) in runs.items():
            times[name].append(timed(device, opt.step, steps))
        if time.monotonic() > deadline:
            break
    ms = r["step_ms"] = {k: round(statistics.median(v), 4) for k, v in times.items()}
    lion, copy = ms["lioncub"], r["copy"]["gbps"]
    r["speedup"] = {k: round(v / lion, 3) for k, v in ms.items() if k != "lioncub"}
    r["lioncub_of_copy"] = round(24 * n / (lion / 1e3) / 1e9 / copy, 3)  # 20 B/param by design, + 4 for the check
    del runs
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, generator=gen, device=device) for s in shapes]
    pair = {}
    for name, skip in (("check in backward", True), ("no check", False)):
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device).mul_(0.02)) for s in shapes]
        pair[name] = (ps, LionCub(ps, lr=1e-4, weight_decay=0.1, skip_nonfinite=skip))
    plain = iterations(device, pair, lambda ps: torch.autograd.backward(ps, grads), rounds * steps, deadline)
    computing = iterations(device, pair, busy_backward(device, grads, busy), rounds * steps, deadline + 10)
    bound = 20 * n / copy / 1e6  # ms: p, g, m read, p, m written, fp32
    r["check_in_backward"] = dict(ms=plain, bound_20_bytes_ms=round(bound, 4),
                                  step_x_bound=round(plain["check in backward"]["step"] / bound, 3),
                                  computing_backward=dict(ms=computing, busy_dim=busy, check_cost_in_iteration_ms=round(
                                      computing["check in backward"]["iteration"] - computing["no check"]["iteration"],
                                      4)))
    c = r["codec"] = codec_of_bench(a.kernels_json, n)
    lp = next((k for k in ms if k.startswith("lion-pytorch")), None)
    t = r["targets"]
    if cuda:
        t["LionCub world size 1 >= 1.0x lion-pytorch's Triton Lion"] = None if lp is None else ms[lp] >= lion
        t["LionCub world size 1 faster than torch fused AdamW"] = ms["torch AdamW(fused=True)"] > lion
        t["LionCub, check taken in backward: step <= 1.10x 20 bytes/parameter at copy bandwidth"] = \
            r["check_in_backward"]["step_x_bound"] <= 1.10
        x = c["x_lion"] if isinstance(c, dict) else {}
        for key, name, limit in (("vote-1bit-checked", "vote-1bit codec, check taken in backward,", 1.15),
                                 ("l1-pbit", "l1-pbit codec, pre-pass in step(),", 1.5),
                                 ("l1-pbit-checked", "l1-pbit codec, pre-pass taken in backward,", 1.5)):
            t[f"{name} <= {limit}x fused Lion (GPT-2 124M elements)"] = None if not x.get(key) else x[key] <= limit
    parts = [f"{n / 1e6:.2f}M params: LionCub {lion:.3f} ms/step"]
    parts += [f"{k} {v:.3f} ms (= {v / lion:.2f}x LionCub's)" for k, v in ms.items() if k != "lioncub"]
    parts.append(f"check in backward: step {plain['check in backward']['step']:.3f} ms = "
                 f"{r['check_in_backward']['step_x_bound']:.2f}x 20 B/param at copy ({copy:.0f} GB/s)")
    if isinstance(c, dict):
        parts.append(f"codec vote-1bit {c['x_lion']['vote-1bit']}x, l1-pbit {c['x_lion']['l1-pbit']}x fused Lion")
    r["summary"] = "; ".join(parts)
    return r


if __name__ == "__main__":
    sys.exit(main())
