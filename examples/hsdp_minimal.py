"""LionCub on a model sharded by FSDP2 (HSDP: shard inside a node, vote across nodes). Run it with torchrun:

    torchrun --nnodes 2 --nproc_per_node 4 ... examples/hsdp_minimal.py --method vote-1bit --steps 50

Each node's ranks hold 1/G of the parameters, gradients and momenta (G = torchrun's --nproc_per_node, from
LOCAL_WORLD_SIZE, or --shard-size). FSDP2 reduce-scatters each block's gradients inside the node; LionCub's
method runs across the nodes on each rank's shard and updates FSDP's shards in place. With one node (G = the
world) there is no replica to vote with: use --method allreduce (plain Lion on the sharded gradient).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lioncub


def block(width):
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="vote-1bit")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--momentum-sync", default="every:20")
    ap.add_argument("--shard-size", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    help="ranks that shard the model (one node's; default LOCAL_WORLD_SIZE)")
    args = ap.parse_args()

    rank, world = lioncub.init_distributed(timeout=120)  # NCCL on GPUs, Gloo on CPUs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shard_size < 1 or world % args.shard_size:
        raise SystemExit(f"--shard-size {args.shard_size} must divide the world size {world}")
    nodes = world // args.shard_size
    mesh = init_device_mesh(device, (nodes, args.shard_size), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same initial weights everywhere (fully_shard keeps each rank's slice of them)
    width = 64
    model = torch.nn.Sequential(torch.nn.Linear(32, width), block(width), block(width), torch.nn.Linear(width, 10))
    dense = sum(p.numel() for p in model.parameters())
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])  # shard inside the node only: LionCub's vote crosses the nodes
    fully_shard(model, mesh=mesh["shard"])
    opt = lioncub.LionCub(model.parameters(), lr=3e-4, weight_decay=0.1, method=args.method,
                          momentum_sync=args.momentum_sync)
    lioncub.attach_fsdp(model, opt, mesh)  # once, before the first backward

    gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    w_true = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 32, generator=gen)
        y = (x @ w_true).argmax(1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step} loss {loss.item():.4f} sent {opt.stats.last_bytes_sent} B", flush=True)

    # the full model is the same on every rank (each node's shards are replicas of the other nodes')
    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    ref = full.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(ref, full), "replicas diverged"
    local = sum(p.to_local().numel() for p in model.parameters())
    if rank == 0:
        print(f"done: {world} rank(s), {nodes} node(s) of {args.shard_size}, method {args.method}, final loss "
              f"{loss.item():.4f}, parameters per rank {local} of {dense}")
    lioncub.finish()


if __name__ == "__main__":
    main()
