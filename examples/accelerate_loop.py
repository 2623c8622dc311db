"""LionCub with Hugging Face accelerate: `accelerator.prepare` wraps the model in DDP, then `attach_ddp`.

    torchrun --nproc_per_node 2 examples/accelerate_loop.py --method vote-1bit --steps 40
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import lioncub


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="vote-1bit")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    args = ap.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    opt = lioncub.LionCub(model.parameters(), lr=3e-3, weight_decay=0.1, method=args.method)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    xs = torch.randn(args.steps * args.accumulate * 16 * accelerator.num_processes, 32,
                     generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(xs, (xs @ teacher).argmax(1))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)  # prepare() shards it per rank
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        lioncub.attach_ddp(model, opt)
    losses = []
    for x, y in loader:
        with accelerator.accumulate(model):  # DDP's no_sync on all but the last micro-batch
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the update ignores it (lioncub.integrations.ddp)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    if accelerator.num_processes > 1:
        ref = flat.clone()
        torch.distributed.broadcast(ref, 0)
        assert torch.equal(ref, flat), "replicas diverged"
    if accelerator.is_main_process:
        k = max(1, len(losses) // 4)
        print(f"loss first {sum(losses[:k]) / k:.4f} last {sum(losses[-k:]) / k:.4f}")
        inner = lioncub.integrations.ddp.unwrap_optimizer(opt)
        print(f"done: accelerate, method {args.method}, {inner.stats.steps} steps, "
              f"{inner.stats.overlapped_steps} overlapped")
    lioncub.finish()


if __name__ == "__main__":
    main()
