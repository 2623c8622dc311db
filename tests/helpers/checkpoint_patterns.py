"""Multi-rank checkpoints as scripts write them (issue 51 item 3): a rank-0-only save, metadata of the script's
own, saving twice to one folder, node-local disks. Module-level functions, so spawned ranks can import them."""

from __future__ import annotations

import os
import shutil
import warnings

import torch
import torch.distributed as dist
from dist_cases import flat
from safe_cases import BUCKET_MB, LR, batch, listen, model, momenta

from lioncub import LionCub
from lioncub.integrations import checkpoint


def trained(rank, steps, method="vote-1bit"):
    net = model()
    opt = LionCub(net.parameters(), lr=LR, method=method, bucket_mb=BUCKET_MB)
    step(net, opt, rank, 1, steps)
    return net, opt


def step(net, opt, rank, first, last):
    for s in range(first, last + 1):
        opt.zero_grad()
        x, y = batch(rank, s)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def rank0_saves_alone(rank, world_size, path):
    """Rank 0 calls lioncub.checkpoint.save inside `if rank == 0:` while rank 1 goes on to a barrier (elsewhere,
    in a collective). Then both save together, which works: the refused call left nothing behind."""
    net, opt = trained(rank, 2)
    error = None
    if rank == 0:
        try:
            checkpoint.save(path, net, opt, timeout=3)
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    dist.barrier()
    saved = sorted(os.listdir(os.path.dirname(path)))
    checkpoint.save(path, net, opt, extra={"step": 2})
    return dict(error=error, before=saved, after=sorted(os.listdir(path)))


def rank0_torch_save(rank, world_size, path):
    """nanoGPT's pattern, unchanged: rank 0 torch.save's model.state_dict() and opt.state_dict() in its eval block
    while the other ranks train on; a resume loads that file with torch.load's default (weights_only=True)."""
    net, opt = trained(rank, 2)
    if rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "iter_num": 2,
                    "config": {"lr": LR}}, path)
    step(net, opt, rank, 3, 4)  # the others never waited for rank 0's save
    dist.barrier()
    net2 = model()
    opt2 = LionCub(net2.parameters(), lr=LR, method="vote-1bit", bucket_mb=BUCKET_MB)
    ckpt = torch.load(path)  # torch >= 2.6: weights_only=True
    net2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    step(net2, opt2, rank, 3, 4)
    return dict(params=flat(net2.parameters()), momenta=momenta(opt2, net2), iter_num=ckpt["iter_num"],
                step=opt2.engine.steps)


def save_twice(rank, world_size, path):
    """Two saves to one folder: no warning, and the folder holds the second one only."""
    net, opt = trained(rank, 2)
    log = listen()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(path, net, opt, extra={"step": 2})
        step(net, opt, rank, 3, 4)
        checkpoint.save(path, net, opt, extra={"step": 4, "config": {"lr": LR, "layers": [6, 16, 3]}})
    files = sorted(os.listdir(path))
    siblings = sorted(os.listdir(os.path.dirname(path)))
    net2 = model()
    opt2 = LionCub(net2.parameters(), lr=LR, method="vote-1bit", bucket_mb=BUCKET_MB)
    info = checkpoint.load(path, net2, opt2)
    return dict(warnings=[str(w.message) for w in caught], messages=log.messages, files=files, siblings=siblings,
                info=info, same=torch.equal(flat(net2.parameters()), flat(net.parameters()))
                and torch.equal(momenta(opt2, net2), momenta(opt, net)))


def node_local_disks(rank, world_size, root):
    """Each rank saves to its own folder (a node-local disk each): rank 1 is told its files alone cannot be
    loaded; loading there is refused on every rank (no hang); once the files are gathered into one folder (as
    the docs say), every rank resumes bit for bit."""
    net, opt = trained(rank, 3)
    log = listen()
    mine = os.path.join(root, f"node{rank}", "ckpt")
    checkpoint.save(mine, net, opt, extra={"step": 3})
    files = sorted(os.listdir(mine))
    dist.barrier()
    fresh = model()
    opt2 = LionCub(fresh.parameters(), lr=LR, method="vote-1bit", bucket_mb=BUCKET_MB)
    try:
        checkpoint.load(mine, fresh, opt2, timeout=30)
        refused = None
    except checkpoint.CheckpointError as exc:
        refused = str(exc)
    gathered = os.path.join(root, "gathered")
    if rank == 0:  # what a job script would do: copy every node's files into one folder every rank reads
        os.makedirs(gathered)
        for r in range(world_size):
            src = os.path.join(root, f"node{r}", "ckpt")
            for name in os.listdir(src):
                shutil.copy(os.path.join(src, name), gathered)
    dist.barrier()
    info = checkpoint.load(gathered, fresh, opt2)
    return dict(files=files, messages=log.messages, refused=refused, info=info,
                same=torch.equal(flat(fresh.parameters()), flat(net.parameters()))
                and torch.equal(momenta(opt2, fresh), momenta(opt, net)))


def script_model(script: str, **kwargs):
    """The GPT class of a training script (examples/ddp_adamw/train.py), built without running its training: its
    source up to the launch."""
    with open(script) as f:
        source = f.read().split("ddp = int(os.environ", 1)[0]
    namespace: dict = {}
    exec(compile(source.replace("args = parser.parse_args()", "args = parser.parse_args([])"), script, "exec"),
         namespace)
    return namespace["GPT"](**kwargs)


def resume_script_checkpoint(rank, world_size, script, path):
    """What a resume of that script does on every rank: torch.load (weights_only, torch's default) of the file
    rank 0 saved, into the model and a LionCub built as the script builds it; then one more step."""
    net = script_model(script, block_size=32)
    ckpt = torch.load(path)
    net.load_state_dict(ckpt["model"])
    groups = [{"params": [p for p in net.parameters() if p.dim() >= 2]},
              {"params": [p for p in net.parameters() if p.dim() < 2]}]
    opt = LionCub(groups, lr=ckpt["optimizer"]["param_groups"][0]["lr"])
    opt.load_state_dict(ckpt["optimizer"])
    x = torch.randint(64, (4, 32), generator=torch.Generator().manual_seed(rank))
    net(x, x)[1].backward()
    opt.step()
    return dict(iter_num=ckpt["iter_num"], step=opt.engine.steps, params=flat(net.parameters()),
                wd=[g["weight_decay"] for g in opt.param_groups])
