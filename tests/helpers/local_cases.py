"""Local steps (LionCub(local=LocalSteps(H))): multi-rank scenarios and an independent oracle of the whole algorithm.

The gradients are a function of (rank, step) alone, never of the parameters, so the oracle can replay every
rank's local Lion steps, the codec's agreed update, the agreed scale, the error-feedback residuals and the outer
optimizer in plain torch from the module's own formulas, without LionCub's code."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from lioncub import LionCub, LocalSteps
from lioncub.methods.l1_pbit import default_levels

SHAPES = [(7, 5), (13,), (3, 3, 3), (33,), (2, 17)]
BUCKET_MB = 256 / 2**20  # several buckets
STREAM_BUCKET_MB = 128 / 2**20  # one bucket per tensor: fragments of one to several tensors
LR, WD, B1, B2 = 0.01, 0.1, 0.9, 0.99


def initial():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def grads(rank: int, step: int, bad=None):
    """Rank `rank`'s gradients at `step` (no exact zeros); `bad` = (rank, step) gets an inf."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    gs = [torch.randn(s, generator=gen) for s in SHAPES]
    if bad is not None and (rank, step) == tuple(bad):
        gs[1][3] = float("inf")
    return gs


def make(method, H, outer, error_feedback=True, node_size=None, bucket_mb=None, **stream):
    """node_size: the node layout with nodes of that many ranks; stream: fragments and outer_delay (then smaller
    buckets by default: more of them to make fragments of)."""
    params = [torch.nn.Parameter(t.clone()) for t in initial()]
    bucket_mb = bucket_mb or (STREAM_BUCKET_MB if stream else BUCKET_MB)
    opt = LionCub(params, lr=LR, betas=(B1, B2), weight_decay=WD, method=method, bucket_mb=bucket_mb,
                  local=LocalSteps(H, outer="avg" if outer is None else outer, fragments=stream.pop("fragments", None),
                                   delay=stream.pop("outer_delay", None), error_feedback=error_feedback),
                  node_size=node_size, **stream)
    return params, opt


def run(params, opt, rank, first, last, bad=None, nan_at=None, chatter=False):
    """Steps first..last; returns each step's parameters (flat) and bytes sent. chatter: the script all-reduces
    a metric on the default group before each step (while streamed exchanges are in flight)."""
    out = []
    for step in range(first, last + 1):
        opt.zero_grad()
        for p, g in zip(params, grads(rank, step, bad)):
            p.grad.copy_(g)
        if nan_at is not None and (rank, step) == tuple(nan_at):
            params[0].data[0, 0] = float("nan")  # from outside the optimizer: the pseudo-gradient is not finite
        if chatter:
            metric = torch.full((1000,), float(rank))
            dist.all_reduce(metric)
            assert torch.equal(metric, torch.full((1000,), float(sum(range(dist.get_world_size())))))
        opt.step()
        out.append(dict(params=[p.detach().clone() for p in params], bytes=opt.stats.last_bytes_sent,
                        node_bytes=opt.stats.last_node_bytes_sent))
    return out


def residuals_by_param(opt, params):
    """The error-feedback residual of each parameter (from the buckets' flat residuals)."""
    res = opt.local.residual
    if res is None:
        return None
    where = {}
    for k, b in enumerate(opt.engine.buckets):
        for _, p, s, e in b.segments():
            where[id(p)] = res[k][s:e].clone().view(p.shape)
    return [where[id(p)] for p in params]


def scenario(rank, world_size, method, H, outer, steps, bad=None, nan_at=None, error_feedback=True):
    params, opt = make(method, H, outer, error_feedback)
    recs = run(params, opt, rank, 1, steps, bad, nan_at)
    return dict(records=recs, residual=residuals_by_param(opt, params), local_skips=opt.local.local_skips,
                outer_steps=opt.local.outer_steps, outer_skips=opt.local.outer_skips,
                levels=opt.levels, momentum=[opt.state[p]["exp_avg"].clone() for p in params])


def node_scenario(rank, world_size, method, H, outer, steps, node_size, bad=None):
    """scenario() in the node layout (its momenta are shards: not reported)."""
    params, opt = make(method, H, outer, node_size=node_size)
    recs = run(params, opt, rank, 1, steps, bad)
    return dict(records=recs, residual=residuals_by_param(opt, params), local_skips=opt.local.local_skips,
                outer_steps=opt.local.outer_steps, outer_skips=opt.local.outer_skips)


def resume_case(rank, world_size, method, H, outer, steps, cut, **stream):
    """Uninterrupted vs saved (state_dict) after `cut` steps and resumed in a fresh optimizer: bit for bit.
    `stream`: fragments= and outer_delay= (then `in_flight`: the exchanges in flight at the cut)."""
    params, opt = make(method, H, outer, **stream)
    full = run(params, opt, rank, 1, steps)
    params, opt = make(method, H, outer, **stream)
    run(params, opt, rank, 1, cut)
    in_flight = len(opt.local.stream.pending) if stream else 0
    saved = dict(opt=opt.state_dict(), params=[p.detach().clone() for p in params])
    params, opt = make(method, H, outer, **stream)
    with torch.no_grad():
        for p, v in zip(params, saved["params"]):
            p.copy_(v)
    opt.load_state_dict(saved["opt"])
    resumed = run(params, opt, rank, cut + 1, steps)
    same = all(torch.equal(a, b) for ra, rb in zip(full[cut:], resumed) for a, b in zip(ra["params"], rb["params"]))
    return dict(same=same, steps=len(resumed), in_flight=in_flight)


def no_sync_case(rank, world_size, H):
    """Two micro-batches under no_sync vs one step on their sum: the same parameters; no bytes on inner steps."""
    out = []
    for accumulate in (True, False):
        params, opt = make("vote-1bit", H, "avg")
        sent = []
        for step in range(1, H + 1):
            opt.zero_grad()
            a, b = grads(rank, step), grads(rank + 100, step)
            if accumulate:
                with opt.no_sync():
                    for p, g in zip(params, a):
                        p.grad.add_(g)
                for p, g in zip(params, b):
                    p.grad.add_(g)
            else:
                for p, g, h in zip(params, a, b):
                    p.grad.copy_(g + h)
            opt.step()
            sent.append(opt.stats.last_bytes_sent)
        out.append(([p.detach().clone() for p in params], sent))
    flat = torch.cat([p.reshape(-1) for p in out[0][0]])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return dict(same=all(torch.equal(x, y) for x, y in zip(out[0][0], out[1][0])), sent=out[0][1],
                replicas=all(torch.equal(gathered[0], g) for g in gathered))


# --- the oracle -----------------------------------------------------------------------------------------


def lion(p, m, g):
    """One Lion step in plain torch: p <- p(1 - lr wd) - lr sign(b1 m + (1 - b1) g); m <- b2 m + (1 - b2) g."""
    c = m * B1 + g * (1 - B1)
    p = p * (1 - LR * WD) - LR * torch.sign(c)
    return p, m * B2 + g * (1 - B2)


def agreed(kind, es, levels):
    """(G per tensor for every rank alike, each rank's residual) of the pseudo-gradients es[rank][tensor]."""
    N = len(es)
    G, res = [], [[] for _ in es]
    for t in range(len(es[0])):
        a = [e[t].double().abs().mean() for e in es]
        s = sum(a) / N
        if kind == "dense":
            G.append(sum(e[t] for e in es) / N)
            continue
        if kind == "l1":
            mult = [((levels / 2) / x).float() for x in a]
            qs = [torch.clamp(torch.round(e[t] * k), -levels, levels) for e, k in zip(es, mult)]
            U = torch.sign(sum(qs))
            local = [q / k for q, k in zip(qs, mult)]
        else:
            signs = [torch.sign(e[t]) for e in es]
            U = sum(signs) / N if kind == "mean" else torch.sign(sum(signs))
            local = [x.float() * sg for x, sg in zip(a, signs)]
        G.append(U * s.float())
        for i, e in enumerate(es):
            res[i].append(e[t] - local[i])
    return G, res


def node_gradients(node: int, G: int, step: int, bad=None):
    """The gradients a node's ranks step on: the rank's own (G = 1), or the mean of the node's G ranks'."""
    if G == 1:
        return grads(node, step, bad)
    gs = [grads(node * G + j, step, bad) for j in range(G)]
    return [sum(g[t] for g in gs) / G for t in range(len(SHAPES))]


def oracle(kind, N, H, outer, steps, levels=0, bad=None, error_feedback=True, G=1, fragments=None, delay=0):
    """Every rank's parameters after each step, and the final residuals. outer = (kind, lr, momentum). G > 1:
    nodes of G ranks step together on their mean gradient and vote as one (local rank 0 holds the residual).
    fragments (lists of tensor indices) and delay: streamed outer steps; fragment f's pseudo-gradient is taken at
    the steps t with t % H == ((f + 1) H // F) % H, agreed on then, and applied at t + delay, where the fragment's
    tensors restart from its new anchor on every rank. None: one fragment of every tensor, applied at once."""
    okind, olr, mu = outer
    fragments = [list(range(len(SHAPES)))] if fragments is None else fragments
    F = len(fragments)
    p = [[t.clone() for t in initial()] for _ in range(N)]
    m = [[torch.zeros_like(t) for t in initial()] for _ in range(N)]
    anchor = [t.clone() for t in initial()]
    v = [torch.zeros_like(t) for t in anchor]
    r = [[torch.zeros_like(t) for t in anchor] for _ in range(N)]
    history, pending, voters = [], [], range(0, N, G)
    for step in range(1, steps + 1):
        for node in range(N // G):
            gs, i = node_gradients(node, G, step, bad), node * G
            if all(torch.isfinite(g).all() for g in gs):
                p[i], m[i] = map(list, zip(*[lion(x, y, g) for x, y, g in zip(p[i], m[i], gs)]))
                for j in range(i + 1, i + G):
                    p[j], m[j] = list(p[i]), list(m[i])
        for f, ts in enumerate(fragments):
            if step % H != ((f + 1) * H // F) % H:
                continue
            es = [[anchor[t] - p[i][t] + (r[i][t] if error_feedback and kind != "dense" else 0) for t in ts]
                  for i in voters]
            G_, res = agreed(kind, es, levels)
            if error_feedback and kind != "dense":
                for i, rr in zip(voters, res):
                    for t, x in zip(ts, rr):
                        r[i][t] = x
            pending.append((step + delay, ts, G_))
        for _, ts, G_ in [x for x in pending if x[0] == step]:
            for t, g in zip(ts, G_):
                v[t] = v[t] * mu + g
                d = v[t] if okind == "avg" else g + mu * v[t]
                anchor[t] = anchor[t] - (olr * H * LR * torch.sign(d) if okind == "sign" else olr * d)
                for i in range(N):
                    p[i][t] = anchor[t].clone()
        history.append([[x.clone() for x in p[i]] for i in range(N)])
    return history, r


KINDS = {"allreduce": "dense", "vote-1bit": "sign", "vote-pbit": "sign", "vote-allgather": "sign",
         "avg-pbit": "mean", "l1-pbit": "l1"}


def levels_for(method, N):
    return default_levels(N) if method == "l1-pbit" else 0


def dcp_resume_case(rank, world_size, method, H, outer, steps, cut, path, bad=None, node_size=None, **stream):
    """Uninterrupted vs lioncub.checkpoint.save after `cut` steps and load into a fresh model and optimizer:
    the parameters after every later step, and at the end the momenta, residuals, anchor, outer momentum and
    counters, bit for bit."""
    from lioncub.integrations import checkpoint

    def state(params, opt):
        sd = opt.local.state_dict()
        flat = (lambda ts: None if ts is None else torch.cat([t.reshape(-1) for t in ts]))
        return dict(momenta=flat([b.m for b in opt.engine.buckets]), residual=flat(sd["residual"]),
                    anchor=flat(sd["anchor"]), velocity=flat(sd["velocity"]),
                    counts=[sd[k] for k in ("local_skips", "outer_steps", "outer_skips")], step=opt.engine.steps)

    params, opt = make(method, H, outer, node_size=node_size, **stream)
    full = run(params, opt, rank, 1, steps, bad)
    full_state = state(params, opt)
    params, opt = make(method, H, outer, node_size=node_size, **stream)
    run(params, opt, rank, 1, cut, bad)
    checkpoint.save(path, torch.nn.ParameterList(params), opt)
    at_cut = [p.detach().clone() for p in params]
    params, opt = make(method, H, outer, node_size=node_size, **stream)
    info = checkpoint.load(path, torch.nn.ParameterList(params), opt)
    loaded_own = all(torch.equal(a, b) for a, b in zip(params, at_cut))
    resumed = run(params, opt, rank, cut + 1, steps, bad)
    same = all(torch.equal(a, b) for ra, rb in zip(full[cut:], resumed) for a, b in zip(ra["params"], rb["params"]))
    end = state(params, opt)
    same_state = all(full_state[k] == end[k] if not isinstance(end[k], torch.Tensor) or full_state[k] is None
                     else torch.equal(full_state[k], end[k]) for k in end)
    return dict(same=same, same_state=same_state, steps=len(resumed), info=info, loaded_own=loaded_own,
                at_cut=torch.cat([p.reshape(-1) for p in at_cut]), residual=end["residual"], counts=end["counts"])


# --- streamed outer steps (fragments) ---------------------------------------------------------------------


def fragment_tensors(opt, params):
    """The indices (in `params`) of the tensors in each of opt's fragments."""
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for k in ks for p in opt.engine.buckets[k].params] for ks in opt.local.stream.fragments]


@contextlib.contextmanager
def recording():
    """Every step's collectives as LionCub records them: a list per step of (op, bytes, dtype, scope)."""
    from lioncub.optim.engine import Engine

    out, real = [], Engine.record

    def record(engine, collectives, **kw):
        out.append([(c.op, c.nbytes, c.dtype, c.scope) for c in collectives])
        real(engine, collectives, **kw)

    Engine.record = record
    try:
        yield out
    finally:
        Engine.record = real


def stream_scenario(rank, world_size, method, H, outer, steps, F, delay=None, bad=None, nan_at=None, chatter=False,
                    node_size=None):
    """node_size: the node layout with nodes of that many ranks (`own_group` then: copies of both its groups)."""
    params, opt = make(method, H, outer, node_size=node_size, fragments=F, outer_delay=delay)
    s, nodes = opt.local.stream, opt.local.nodes
    own_group = opt.local.exchange.group is not opt.engine.group  # made with the optimizer, before any step
    if nodes is not None:
        own_group = opt.local.exchange.group is not nodes.cross and s.intra not in (None, nodes.intra)
    with recording() as collectives:
        recs = run(params, opt, rank, 1, steps, bad, nan_at, chatter)
    opt.state_dict()  # (waits for the exchanges in flight: `launches` lists what the thread ran, in its order)
    return dict(records=recs, residual=residuals_by_param(opt, params), fragments=fragment_tensors(opt, params),
                launches=list(s.launches), delay=s.D, exchanges=s.exchanges, local_skips=opt.local.local_skips,
                outer_steps=opt.local.outer_steps, outer_skips=opt.local.outer_skips, own_group=own_group,
                collectives=collectives, buckets=[b.n for b in opt.engine.buckets], stream_fragments=s.fragments)


def one_fragment_case(rank, world_size, method, H, outer, steps, node_size=None):
    """fragments=1 (outer_delay 0) against no fragments: the same parameters and bytes at every step, the same
    collectives recorded, and at the end the same anchors and residuals."""
    plain_params, plain_opt = make(method, H, outer, node_size=node_size, bucket_mb=STREAM_BUCKET_MB)
    with recording() as plain_colls:
        plain = run(plain_params, plain_opt, rank, 1, steps)
    params, opt = make(method, H, outer, node_size=node_size, fragments=1)
    with recording() as one_colls:
        one = run(params, opt, rank, 1, steps)
    opt.state_dict()
    same = all(torch.equal(a, b) for ra, rb in zip(plain, one) for a, b in zip(ra["params"], rb["params"]))
    a, b = plain_opt.local.state_dict(), opt.local.state_dict()
    same_state = all(torch.equal(x, y) for key in ("anchor", "residual") for x, y in zip(a[key] or (), b[key] or ()))
    return dict(same=same, bytes=[r["bytes"] for r in plain] == [r["bytes"] for r in one],
                launches=list(opt.local.stream.launches), same_state=same_state,
                same_collectives=plain_colls == one_colls, residual=b["residual"])


def stream_resume_case(rank, world_size, method, H, outer, steps, cut, F, delay, node_size=None):
    """resume_case() with streamed outer steps (an exchange may be in flight at the cut)."""
    return resume_case(rank, world_size, method, H, outer, steps, cut, fragments=F, outer_delay=delay,
                       node_size=node_size)


def stream_dcp_case(rank, world_size, method, H, outer, steps, cut, path, bad, F, delay, node_size=None):
    """dcp_resume_case() with streamed outer steps."""
    return dcp_resume_case(rank, world_size, method, H, outer, steps, cut, path, bad, node_size, fragments=F,
                           outer_delay=delay)


def stream_schedule(H, F, D, steps):
    """(launch step, fragment, applied at) of every streamed exchange, in launch order, from the issue's own rule."""
    out = []
    for t in range(1, steps + 1):
        out += [(t, f, t + D) for f in range(F) if t % H == ((f + 1) * H // F) % H]
    return out


def check_stream_order(reports, H, F, D, steps) -> list:
    """Right after its outer step a fragment's tensors are the same bits on every rank; every rank's thread ran the
    exchanges in the schedule's order; each applied once. Returns the (step, fragment) applications."""
    fragments, schedule = reports[0]["fragments"], stream_schedule(H, F, D, steps)
    applied = [(due, f) for _, f, due in schedule if due <= steps]
    for due, f in applied:
        first = reports[0]["records"][due - 1]["params"]
        for rep in reports[1:]:
            assert all(torch.equal(first[t], rep["records"][due - 1]["params"][t]) for t in fragments[f]), (due, f)
    for rep in reports:
        assert rep["launches"] == [(t, f) for t, f, _ in schedule]
        assert rep["exchanges"] == rep["outer_steps"] == len(applied) and rep["outer_skips"] == 0
    return applied
