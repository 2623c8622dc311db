"""A DDP + AdamW training script in the shape of nanoGPT's train.py: a small GPT, torch DDP, gradient
accumulation under no_sync(), clipping at 1.0, a loss scaler, a rank-0 checkpoint inside the eval block and
torch.compile. to_lioncub.diff beside it converts it to LionCub (docs/integrations.md).

    torchrun --nproc_per_node 2 examples/ddp_adamw/train.py --max_iters 20
"""

import argparse
import hashlib
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", default="out")
parser.add_argument("--max_iters", type=int, default=200)
parser.add_argument("--eval_interval", type=int, default=50)
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--block_size", type=int, default=32)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.1)
parser.add_argument("--grad_clip", type=float, default=1.0)
parser.add_argument("--dtype", default="float16" if torch.cuda.is_available() else "float32")
parser.add_argument("--compile", default="inductor", help="a torch.compile backend, or none")
parser.add_argument("--activation_checkpointing", action="store_true")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def attn(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def block(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward(self, x):
        if args.activation_checkpointing and self.training:
            return checkpoint(self.block, x, use_reentrant=False)  # recompute the block's activations in backward
        return self.block(x)


class GPT(nn.Module):
    def __init__(self, vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1  # a torchrun run?
if ddp:
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    ddp_rank, ddp_local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    ddp_rank, device, master_process, seed_offset = 0, "cuda" if torch.cuda.is_available() else "cpu", True, 0
if device.startswith("cuda"):
    torch.cuda.set_device(device)
if master_process:
    os.makedirs(args.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# the data: a fixed random "language" (each token has a likely successor), the same on every rank
lang = torch.Generator().manual_seed(0)
successor = torch.randperm(64, generator=lang)
text = torch.zeros(20_000, dtype=torch.long)
for i in range(1, len(text)):
    text[i] = successor[text[i - 1]] if torch.rand(1, generator=lang) < 0.8 else torch.randint(64, (1,), generator=lang)
splits = {"train": text[:18_000], "val": text[18_000:]}


def get_batch(split, seed):
    data = splits[split]
    gen = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=gen)
    x = torch.stack([data[i : i + args.block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix])
    return x.to(device), y.to(device)


model = GPT(block_size=args.block_size).to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == "float16"))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optim_groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(optim_groups, lr=args.learning_rate, betas=(0.9, 0.95))
if args.compile != "none":
    model = torch.compile(model, backend=args.compile)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    model.eval()
    out = {}
    for split in ("train", "val"):
        out[split] = sum(model(*get_batch(split, 10_000 + k))[1].item() for k in range(4)) / 4
    model.train()
    return out


def get_lr(it):  # linear warm-up, then cosine decay to a tenth
    warmup = max(1, args.max_iters // 10)
    if it < warmup:
        return args.learning_rate * (it + 1) / warmup
    ratio = (it - warmup) / max(1, args.max_iters - warmup)
    return args.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * ratio)))


best_val_loss = 1e9
for iter_num in range(args.max_iters + 1):
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss and iter_num > 0:
            best_val_loss = losses["val"]
            ckpt = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                    "best_val_loss": best_val_loss, "config": vars(args)}
            torch.save(ckpt, os.path.join(args.out_dir, "ckpt.pt"))
    if iter_num == args.max_iters:
        break
    for micro_step in range(args.gradient_accumulation_steps):
        X, Y = get_batch("train", 1000 * iter_num + 100 * ddp_rank + micro_step)  # this rank's own data
        last = micro_step == args.gradient_accumulation_steps - 1
        with model.no_sync() if ddp and not last else nullcontext():  # forward and backward: sync on the last
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
            scaler.scale(loss).backward()
    if args.grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in raw_model.parameters())).hexdigest()
print(f"rank {ddp_rank}: final loss {loss.item() * args.gradient_accumulation_steps:.4f}, parameters {digest[:16]}")
if ddp:
    destroy_process_group()
