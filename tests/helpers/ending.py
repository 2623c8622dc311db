"""A 4-rank training script that ends in one of the ways scripts end (run by torchrun in
tests/comm/test_clean_exit.py): LionCub's baseline with overlap, rank 0 evaluating alone before it leaves,
a final metric all-reduced by the script itself, then ENDING: "bare" (dist.destroy_process_group(), as the
PyTorch tutorials end), "finish" (lioncub.finish()) or "none" (no teardown at all)."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lioncub
from lioncub.apps.train.models import CharTransformer, GPTConfig

ending = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = CharTransformer(GPTConfig(vocab_size=65, block_size=32))
lioncub.broadcast_parameters(model)
opt = lioncub.LionCub(model.parameters(), lr=3e-4, method="allreduce")
gen = torch.Generator().manual_seed(rank)
for _ in range(20):
    x = torch.randint(0, 65, (8, 33), generator=gen)
    logits = model(x[:, :-1])
    logits = logits[0] if isinstance(logits, tuple) else logits
    loss = F.cross_entropy(logits.reshape(-1, 65), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
if rank == 0:  # evaluates alone: the others reach the end first
    with torch.no_grad():
        for _ in range(20):
            model(torch.randint(0, 65, (8, 32), generator=gen))
metric = torch.tensor([float(loss)])
dist.all_reduce(metric)
if ending == "bare":
    dist.destroy_process_group()
elif ending == "finish":
    lioncub.finish()
print(f"rank {rank} ended ({ending})", flush=True)
