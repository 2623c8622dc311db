"""`lioncub bench step`: the optimizer step per method on local Gloo ranks, beside a plain local Lion step.

Every number comes from one run, side by side: ratios are what matter on a shared machine. The ranks
measure each method in turn, several rounds, interleaved, and report medians. Also times the public
majority-vote scheme (per-tensor all-gather of packed signs, torch.mode decoding) and, at world size 1,
LionCub against lion-pytorch's Lion on identical parameters.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from lioncub.comm.wire import bus_factor
from lioncub.methods import NAMES as METHODS


def transformer_shapes(target_params: int, vocab: int = 96, block: int = 256) -> list[tuple]:
    """Parameter shapes of a GPT-like model with about target_params parameters."""
    d, layers = 384, 1
    while True:
        per_layer = 12 * d * d + 13 * d
        layers = max(1, round((target_params - (vocab + block) * d) / per_layer))
        if layers <= 12:
            break
        d *= 2
    shapes = [(vocab, d), (block, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def _params(shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype)) for s in shapes]


def _grads(shapes, rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=gen) for s in shapes]


def public_majority_vote_step(params, grads, moms, lr=1e-4, b1=0.9, b2=0.99):
    """The reference Distributed Lion scheme: per tensor, pack signs with a shift-and-sum, all-gather
    them, unpack every rank's copy and take torch.mode over ranks."""
    N = dist.get_world_size()
    shifts = torch.arange(8, dtype=torch.uint8)
    for p, g, m in zip(params, grads, moms):
        update = (m * b1 + g * (1 - b1)).sign()
        bits = (update > 0).reshape(-1)
        pad = (-bits.numel()) % 8
        bits = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
        packed = (bits << shifts).sum(-1).to(torch.uint8)
        gathered = [torch.empty_like(packed) for _ in range(N)]
        dist.all_gather(gathered, packed)
        votes = torch.stack([((x[:, None] >> shifts) & 1).reshape(-1)[: p.numel()].bool() for x in gathered])
        majority = torch.mode(votes.to(torch.uint8), dim=0).values.float() * 2 - 1
        p.data.add_(majority.view_as(p), alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)


def _rank_main(rank, world_size, shapes, methods, steps, rounds, public, backward=False):
    from lioncub import LionCub

    local_group, _ = dist.new_subgroups(group_size=1)
    grads = _grads(shapes, rank)
    timings: dict[str, list[float]] = {m: [] for m in ["local"] + methods + (["public-vote"] if public else [])}
    bytes_sent: dict[str, int] = {}

    def run(name):
        params = _params(shapes)
        if name == "public-vote":
            moms = [torch.zeros_like(p) for p in params]
            step = lambda: public_majority_vote_step(params, grads, moms)  # noqa: E731
        else:
            group = local_group if name == "local" else None
            method, _, mb = name.partition("@")
            opt = LionCub(params, lr=1e-4, method="allreduce" if name == "local" else method, process_group=group,
                          bucket_mb=float(mb.removesuffix("MiB")) if mb else None, overlap=not backward)
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            step = opt.step
        for i in range(steps + 1):
            if backward:  # (no public scheme: it takes `grads` as they are)
                opt.zero_grad()
                torch.autograd.backward(params, grads)
            dist.barrier()
            t = time.perf_counter()
            step()
            if i:  # the first step allocates buffers
                timings[name].append(time.perf_counter() - t)
        if name not in ("public-vote", "local"):
            bytes_sent[name] = opt.stats.last_bytes_sent

    for r in range(rounds):
        for name in timings:
            if name == "public-vote" and r:
                continue  # one round is plenty: it is an order of magnitude slower
            run(name)
    return {"ms": {k: statistics.median(v) * 1e3 for k, v in timings.items()}, "bytes": bytes_sent}


def _single_process(shapes, steps):
    """World size 1: LionCub vs lion-pytorch's Lion, same parameters after the same steps, step() timed alone.
    The gradients come through autograd (torch.autograd.backward on the parameters), as in training, so LionCub
    takes its non-finite check during backward (lioncub.optim.backward)."""
    from lioncub import LionCub

    try:
        from lion_pytorch import Lion
    except ImportError:
        return None
    grads = _grads(shapes, 0)
    out = {}
    finals = {}
    names = ("lioncub", "lion-pytorch", "lioncub-unchecked")
    for name in names + names:
        params = _params(shapes)
        if name == "lion-pytorch":
            opt = Lion(params, lr=1e-4, weight_decay=0.1)
        else:  # unchecked: without the non-finite check (one read of the gradients) lion-pytorch lacks
            opt = LionCub(params, lr=1e-4, weight_decay=0.1, skip_nonfinite=name == "lioncub")
        times, backward = [], []
        for _ in range(steps):
            t = time.perf_counter()
            opt.zero_grad()
            torch.autograd.backward(params, grads)
            backward.append(time.perf_counter() - t)
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        out.setdefault(name, []).append(statistics.median(times[1:]) * 1e3)
        out.setdefault(name + " backward", []).append(statistics.median(backward[1:]) * 1e3)
        finals[name] = params
    same = all(torch.equal(a, b) for a, b in zip(finals["lioncub"], finals["lion-pytorch"]))
    return {"lioncub_ms": min(out["lioncub"]), "lion_pytorch_ms": min(out["lion-pytorch"]),
            "lioncub_unchecked_ms": min(out["lioncub-unchecked"]), "identical": same,
            "backward_ms": {k: min(out[k + " backward"]) for k in names}}


def bench_step(ranks=4, params=5_000_000, steps=6, rounds=3, methods=None, public=True,
               bucket_mb: float | None = None, backward: bool = False) -> dict:
    """`bucket_mb`: each method also runs with buckets of that size (rows "method@<size>MiB"), side by side.
    `backward`: the gradients come through autograd before each (timed) step(), under overlap=False."""
    from lioncub.comm.spawn import spawn

    methods = list(methods or METHODS)
    if bucket_mb is not None:
        methods += [f"{m}@{bucket_mb:g}MiB" for m in methods]
    shapes = transformer_shapes(params)
    n = sum(torch.Size(s).numel() for s in shapes)
    per_rank = spawn(_rank_main, ranks, shapes, methods, steps, rounds, public and not backward, backward,
                     timeout=1800)
    ms = {k: max(r["ms"][k] for r in per_rank) for k in per_rank[0]["ms"]}  # the slowest rank sets the pace
    base_bytes = per_rank[0]["bytes"].get("allreduce") or bus_factor("allreduce", ranks) * 4 * n
    rows = []
    for name, t in ms.items():
        b = per_rank[0]["bytes"].get(name)
        rows.append(dict(method=name, ms=round(t, 2), x_local=round(t / ms["local"], 2),
                         bytes_sent=b, bytes_vs_fp32=None if b is None else round(b / base_bytes, 4)))
    return dict(ranks=ranks, params=n, tensors=len(shapes), threads_per_rank=max(1, torch.get_num_threads() // ranks),
                gradients="through autograd, overlap=False" if backward else "set by hand", rows=rows,
                single_process=_single_process(shapes, steps + 1))


def run(args) -> int:
    res = bench_step(args.ranks, int(args.params), args.steps, args.rounds, args.methods, not args.no_public,
                     args.bucket_mb, args.backward)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{res['ranks']} Gloo ranks over loopback, {res['params'] / 1e6:.2f}M parameters in "
          f"{res['tensors']} tensors, gradients {res['gradients']} (median ms per step(), slowest rank)")
    print(f"{'method':22s} {'ms/step':>9s} {'x local':>8s} {'bytes sent':>12s} {'vs fp32':>8s}")
    for r in res["rows"]:
        b = "" if r["bytes_sent"] is None else f"{r['bytes_sent']:,}"
        v = "" if r["bytes_vs_fp32"] is None else f"{100 * r['bytes_vs_fp32']:.1f}%"
        print(f"{r['method']:22s} {r['ms']:9.1f} {r['x_local']:8.2f} {b:>12s} {v:>8s}")
    sp = res["single_process"]
    if sp:
        print(f"world size 1: LionCub {sp['lioncub_ms']:.1f} ms, lion-pytorch {sp['lion_pytorch_ms']:.1f} ms "
              f"({sp['lion_pytorch_ms'] / sp['lioncub_ms']:.2f}x), identical parameters: {sp['identical']}; "
              f"without the non-finite check {sp['lioncub_unchecked_ms']:.1f} ms "
              f"({sp['lion_pytorch_ms'] / sp['lioncub_unchecked_ms']:.2f}x); step() alone: LionCub checks during "
              f"backward, which took {sp['backward_ms']['lioncub']:.1f} ms (unchecked "
              f"{sp['backward_ms']['lioncub-unchecked']:.1f}, lion-pytorch {sp['backward_ms']['lion-pytorch']:.1f})")
    return 0
