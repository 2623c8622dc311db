"""LionCub in your own training script. Run it with torchrun (any number of processes, CPU or GPU):

    torchrun --nproc_per_node 4 examples/torchrun_minimal.py --method l1-pbit --steps 50

On several nodes, --hierarchical averages inside each node and votes across nodes (nodes of torchrun's
--nproc_per_node ranks, from LOCAL_WORLD_SIZE).

No DDP wrapper: LionCub does all communication itself, during backward. Each rank must see different data.
"""

import argparse

import torch
import torch.nn.functional as F

import lioncub


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="l1-pbit")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--momentum-sync", default="every:20")
    ap.add_argument("--hierarchical", action="store_true", help="average inside a node, vote across nodes")
    args = ap.parse_args()

    rank, world = lioncub.init_distributed(timeout=120)  # NCCL on GPUs, Gloo on CPUs
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device)
    lioncub.broadcast_parameters(model)  # every rank starts from rank 0's weights
    opt = lioncub.LionCub(model.parameters(), lr=3e-4, weight_decay=0.1, method=args.method,
                          momentum_sync=args.momentum_sync, node_size="local" if args.hierarchical else None)

    gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    teacher = torch.Generator().manual_seed(7)
    w_true = torch.randn(64, 10, generator=teacher)
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 64, generator=gen)
        y = (x @ w_true).argmax(1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            s = opt.stats
            print(f"step {step} loss {loss.item():.4f} sent {s.last_bytes_sent} B "
                  f"comm {1e3 * s.last_comm_s:.2f} ms", flush=True)

    # replicas stay bit-identical: check it
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if world > 1:
        ref = flat.clone()
        torch.distributed.broadcast(ref, 0)
        assert torch.equal(ref, flat), "replicas diverged"
    if rank == 0:
        layout = f", nodes of {opt.node_size}" if args.hierarchical else ""
        print(f"done: {world} rank(s){layout}, method {args.method}, final loss {loss.item():.4f}")
    lioncub.finish()  # barrier + destroy_process_group, safe against Gloo's exit-time race


if __name__ == "__main__":
    main()
