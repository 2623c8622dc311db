"""Multi-rank scenarios of the hierarchical layout (module-level, so spawned ranks can import them).

The oracle re-derives each step from every rank's gradient and every node's momentum with plain torch:
a node's gradient is the mean of its ranks' (the test's gradients are multiples of 1/8 and small, so every
sum is exact in any order and in every dtype), its direction c = b1 m + (1 - b1) g, and the nodes vote as
the flat oracle's ranks do. A bucket is sharded as FSDP2 shards tensors (rebuilt here with padding and views:
each tensor's rows padded to a multiple of G and cut in G equal parts, shard j the j-th part of every tensor);
the 1-bit tie-break counts positions inside a shard, and l1-pbit's scale is per tensor's part (its padding a
part of its own).
"""

from __future__ import annotations

import dist_cases
import oracle
import torch
import torch.distributed as dist

from lioncub import LionCub
from lioncub.methods import NAMES as METHODS
from lioncub.methods.l1_pbit import default_levels

COMPRESSED = [m for m in METHODS if m != "allreduce"]


def exact_grads(params, rank, step):
    """dist_cases' gradients rounded to multiples of 1/8 in [-4, 4] (exact sums in bf16/fp16 too)."""
    grads = dist_cases.make_grads(params, rank, step)
    return [None if g is None else (g.float() * 8).round().clamp(-32, 32).div(8).to(g.dtype) for g in grads]


def _parts(shapes, offsets, G):
    """Per tensor: (rows, columns, rows per shard)."""
    out = []
    for shape, s, e in zip(shapes, offsets[:-1], offsets[1:]):
        rows = shape[0] if len(shape) else 1
        out.append((rows, (e - s) // rows, -(-rows // G)))
    return out


def shard_of(flat, shapes, offsets, G, j):
    """Shard j of a bucket-ordered flat tensor."""
    parts = []
    for (rows, cols, per), s, e in zip(_parts(shapes, offsets, G), offsets[:-1], offsets[1:]):
        t = torch.nn.functional.pad(flat[s:e].reshape(rows, cols), (0, 0, 0, per * G - rows))
        parts.append(t.reshape(G, per * cols)[j])
    return torch.cat(parts)


def shard_pieces(shapes, offsets, G, j):
    """(shard start, shard end, bucket start or None for padding) of each tensor's real rows and its padding
    in shard j."""
    out, at = [], 0
    for (rows, cols, per), s in zip(_parts(shapes, offsets, G), offsets[:-1]):
        real = max(0, min(per, rows - j * per))
        if real:
            out.append((at, at + real * cols, s + j * per * cols))
        if per > real:
            out.append((at + real * cols, at + per * cols, None))
        at += per * cols
    return out


def _node_update(method, gs, ms, b1, step, levels, start, end, first_index):
    """U on bucket elements [start, end) from the nodes' mean gradients gs and momenta ms (lists over nodes)."""
    cs = [oracle.direction(g[start:end], m[start:end], b1) for g, m in zip(gs, ms)]
    if method in ("vote-1bit", "vote-allgather"):
        return torch.sign(sum(oracle.one_bit_vote(c, first_index, k, step) for k, c in enumerate(cs)))
    if method == "vote-pbit":
        return torch.sign(sum(torch.sign(c) for c in cs))
    if method == "avg-pbit":
        return sum(torch.sign(c) for c in cs) / len(cs)
    if method == "l1-pbit":
        return torch.sign(sum(oracle.l1_quantize(c, levels) for c in cs))
    raise ValueError(method)


def _node_momenta(b, G):
    """Every node's momentum shards of bucket b (fp32): node k's j-th is rank k * G + j's."""
    shards = dist_cases.gather(b.m.float())
    return [[shards[k * G + j] for j in range(G)] for k in range(len(shards) // G)]


def check_hierarchical(rank, world_size, G, steps=4, momentum_sync=3, overlap=True, methods=None):
    report = {}
    nodes = world_size // G
    for method in methods or COMPRESSED:
        params, groups = dist_cases.make_params()
        opt = LionCub(groups, lr=dist_cases.LR, betas=(dist_cases.B1, dist_cases.B2),
                      weight_decay=dist_cases.WD, method=method, bucket_mb=dist_cases.BUCKET_MB,
                      momentum_sync=momentum_sync, node_size=G, overlap=overlap)
        levels = default_levels(nodes) if method == "l1-pbit" else 0
        hyper = {id(p): (g["lr"], g["weight_decay"], *g["betas"]) for g in opt.param_groups for p in g["params"]}
        r = dict(mismatch=0, elements=0, momentum_err=0.0, replicas_equal=True, levels=opt.levels,
                 momentum_elements=sum(b.m.numel() for b in opt.engine.buckets),
                 param_elements=sum(b.n for b in opt.engine.buckets))
        for step in range(1, steps + 1):
            grads = exact_grads(params, rank, step)
            effective = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            if overlap:  # a real backward, so the hooks run: loss = sum(p * g)
                opt.zero_grad()
                sum((p.float() * g.float()).sum() for p, g in zip(params, effective)).backward()
            else:
                dist_cases.assign(params, grads, step)
            before = {b: b.p.detach().clone() for b in opt.engine.buckets}
            node_m = {b: _node_momenta(b, G) for b in opt.engine.buckets}
            node_g = {}
            for b in opt.engine.buckets:
                local = torch.zeros(b.n, dtype=torch.float32)
                for p, s, e in zip(b.params, b.offsets[:-1], b.offsets[1:]):
                    local[s:e] = effective[[id(q) for q in params].index(id(p))].float().reshape(-1)
                every = dist_cases.gather(local)
                # the mean as the reduce-scatter forms it: an exact sum, divided by G in the gradient's dtype
                node_g[b] = [sum(every[k * G + j] for j in range(G)).to(b.g.dtype).div_(G).float()
                             for k in range(nodes)]
            opt.step()
            node, mine = divmod(rank, G)
            for b in opt.engine.buckets:
                lr, wd, b1, b2 = hyper[id(b.params[0])]
                shapes, got = [p.shape for p in b.params], b.p.detach()
                for j in range(G):
                    gs = [shard_of(g, shapes, b.offsets, G, j) for g in node_g[b]]
                    ms = [m[j] for m in node_m[b]]
                    for s, e, at in shard_pieces(shapes, b.offsets, G, j):
                        if at is None:
                            continue  # padding: votes as c = 0, updates nothing
                        U = _node_update(method, gs, ms, b1, step, levels, s, e, s)
                        want = oracle.expected_params(before[b][at : at + e - s], U, lr, wd)
                        have = got[at : at + e - s]
                        if method == "avg-pbit":
                            bad = ~torch.isclose(have.float(), want.float(), rtol=1e-6, atol=1e-9)
                        else:
                            bad = have != want
                        r["mismatch"] += int(bad.sum())
                        r["elements"] += e - s
                # momentum of this rank's shard: the EMA of its node's mean gradient, averaged on sync steps
                want_m = [(torch.mul(m[mine].to(b.m.dtype).float(), b2)
                           .add_(shard_of(g, shapes, b.offsets, G, mine), alpha=1 - b2)).to(b.m.dtype).float()
                          for m, g in zip(node_m[b], node_g[b])]
                expect = (sum(want_m) / nodes).to(b.m.dtype).float() if step % momentum_sync == 0 else want_m[node]
                r["momentum_err"] = max(r["momentum_err"], (b.m.float() - expect).abs().max().item())
            everyone = dist_cases.gather(dist_cases.flat(params))
            r["replicas_equal"] &= all(torch.equal(x, everyone[0]) for x in everyone)
        r["stats"] = opt.stats.as_dict()
        r["agreement"] = opt.stats.last_agreement
        report[method] = r
    return report


def hierarchical_vs_flat_bytes(rank, world_size, G):
    """One vote-1bit step's bytes per rank, flat and hierarchical, on 64k parameters."""
    out = {}
    for hier in (False, True):
        p = torch.nn.Parameter(torch.zeros(1 << 16))
        opt = LionCub([p], lr=0.01, method="vote-1bit", node_size=G if hier else None)
        p.grad.copy_(torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank)))
        opt.step()
        out[hier] = opt.stats.last_bytes_sent
        out["node", hier] = opt.stats.last_node_bytes_sent
    return out


def guard_credit(rank, world_size, G, start, steps):
    """The adaptive guard's credit after a dense start and compressed steps that never sync (threshold 0),
    with each step's bytes and node-scoped bytes as the stats recorded them."""
    from lioncub.optim.schedules import Adaptive

    p = torch.nn.Parameter(torch.zeros(1 << 14))
    opt = LionCub([p], lr=0.01, method="vote-1bit", node_size=G, overlap=False,
                  momentum_sync=Adaptive(threshold=0.0, budget=1.0, start=start))
    rows = []
    for step in range(1, steps + 1):
        p.grad.copy_(torch.randn(1 << 14, generator=torch.Generator().manual_seed(100 * step + rank)))
        opt.step()
        rows.append((opt.stats.last_bytes_sent, opt.stats.last_node_bytes_sent))
    return dict(rows=rows, credit=opt.schedule.credit, syncs=opt.stats.momentum_syncs)


def nonfinite_on_one_rank(rank, world_size, G, bad_rank):
    params, groups = dist_cases.make_params()
    opt = LionCub(groups, lr=dist_cases.LR, method="vote-1bit", bucket_mb=dist_cases.BUCKET_MB,
                  node_size=G, overlap=False)
    out = []
    for step in range(1, 4):
        grads = exact_grads(params, rank, step)
        if step == 2 and rank == bad_rank:
            grads[0].view(-1)[3] = float("nan")
        dist_cases.assign(params, grads, step)
        before = dist_cases.flat(params)
        m_before = torch.cat([b.m.float() for b in opt.engine.buckets])
        opt.step()
        out.append(dict(changed=not torch.equal(before, dist_cases.flat(params)),
                        momenta_changed=not torch.equal(m_before,
                                                        torch.cat([b.m.float() for b in opt.engine.buckets]))))
    return dict(steps=out, skipped=opt.stats.skipped_steps)


def resume(rank, world_size, G, steps_before, steps_after, state=None):
    """Train; optionally from `state` (this rank's own state_dict and params)."""
    params, groups = dist_cases.make_params()
    opt = LionCub(groups, lr=dist_cases.LR, method="l1-pbit", bucket_mb=dist_cases.BUCKET_MB,
                  node_size=G, momentum_sync=5)
    start = 0
    if state is not None:
        with torch.no_grad():
            for p, saved in zip(params, state[rank]["params"]):
                p.copy_(saved)
        opt.load_state_dict(state[rank]["opt"])
        start = steps_before
    for step in range(start + 1, start + (steps_after if state is not None else steps_before) + 1):
        dist_cases.assign(params, exact_grads(params, rank, step), step)
        opt.step()
    sd = opt.state_dict()
    sd["lioncub"]["momentum_shards"] = [t.clone() for t in sd["lioncub"]["momentum_shards"]]
    return dict(params=[p.detach().clone() for p in params], opt=sd)


def bad_node_size(rank, world_size):
    try:
        LionCub([torch.nn.Parameter(torch.zeros(8))], method="vote-1bit", node_size=2 if rank else 1)
    except ValueError as exc:
        return str(exc)
    finally:
        dist.barrier()
    return None


def dcp_train(rank, world_size, G, path, steps, resume=False, total=None):
    """lioncub.integrations.checkpoint with momentum shards: train and save, or load and train on to `total`."""
    from lioncub.integrations import checkpoint

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt = LionCub(net.parameters(), lr=0.01, method="vote-1bit", bucket_mb=1e-3, node_size=G)
    first = 1
    if resume:
        checkpoint.load(path, net, opt)
        first = opt.engine.steps + 1
    for step in range(first, (total if resume else steps) + 1):
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        net(torch.randn(4, 16, generator=gen)).square().mean().backward()
        opt.step()
    if path and not resume:
        checkpoint.save(path, net, opt)
    return dict(params=dist_cases.flat(net.parameters()), shards=torch.cat([b.m for b in opt.engine.buckets]),
                step=opt.engine.steps)


def dcp_flat_load(rank, world_size, path):
    from lioncub.integrations import checkpoint

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    checkpoint.load(path, net, LionCub(net.parameters(), lr=0.01, method="vote-1bit", bucket_mb=1e-3))


def dense_warmup_matches_flat(rank, world_size, G, K=3, steps=5):
    """dense_warmup=K, hierarchical and flat: the parameters after every step, and after step K this rank's
    momentum shards and the same shards cut from the flat run's (every rank's) momentum."""
    runs, layout = {}, None
    for hier in (True, False):
        params, groups = dist_cases.make_params()
        index = {id(p): i for i, p in enumerate(params)}
        opt = LionCub(groups, lr=dist_cases.LR, method="vote-1bit", bucket_mb=dist_cases.BUCKET_MB, dense_warmup=K,
                      node_size=G if hier else None)
        if hier:  # each bucket's tensors (by index) and boundaries
            layout = [([index[id(p)] for p in b.params], b.offsets) for b in opt.engine.buckets]
        trace, moms = [], None
        for step in range(1, steps + 1):
            opt.zero_grad()
            grads = exact_grads(params, rank, step)
            effective = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            sum((p.float() * g.float()).sum() for p, g in zip(params, effective)).backward()
            opt.step()
            trace.append(dist_cases.flat(params))
            if step == K and hier:
                moms = torch.cat([b.m.float() for b in opt.engine.buckets])
            elif step == K:
                moms = torch.cat([shard_of(torch.cat([opt.state[params[i]]["exp_avg"].float().reshape(-1)
                                                      for i in members]),
                                           [params[i].shape for i in members], offsets, G, rank % G)
                                  for members, offsets in layout])
        runs[hier] = dict(trace=trace, momenta=moms, stats=opt.stats.as_dict())
    return runs


def timed_collectives(rank, world_size, G, steps=3):
    """opt.timing = True: every collective of a step, counted and timed by name."""
    from lioncub.comm import transport

    params, groups = dist_cases.make_params()
    opt = LionCub(groups, lr=dist_cases.LR, method="vote-1bit", bucket_mb=dist_cases.BUCKET_MB,
                  node_size=G, overlap=False)
    opt.timing = True
    for step in range(1, steps + 1):
        dist_cases.assign(params, exact_grads(params, rank, step), step)
        opt.step()
    return dict(times=transport.call_times(), buckets=len(opt.engine.buckets), collectives=opt.stats.total_collectives)
