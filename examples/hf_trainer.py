"""LionCub with the Hugging Face Trainer: a tiny GPT-2 built from a config (no download), on synthetic text.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --method vote-1bit --steps 30

The Trainer wraps the model in DDP itself; `attach_to_trainer` replaces DDP's all-reduce with LionCub's vote.
"""

import argparse
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import lioncub
from lioncub.integrations import attach_to_trainer


class Patterns(torch.utils.data.Dataset):
    """Sequences of a few repeating patterns: a model that learns them gets a low loss."""

    def __init__(self, n=512, length=32, vocab=64, seed=0):
        gen = torch.Generator().manual_seed(seed)
        motifs = torch.randint(0, vocab, (8, 8), generator=gen)
        picks = torch.randint(0, 8, (n,), generator=gen)
        self.data = motifs[picks].repeat(1, length // 8)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="vote-1bit")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    opt = lioncub.LionCub(model.parameters(), lr=3e-3, weight_decay=0.0, method=args.method)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
                                  logging_steps=5, report_to=[], save_strategy="no", use_cpu=True,
                                  lr_scheduler_type="constant", disable_tqdm=True,
                                  ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None)
        trainer = Trainer(model=model, args=targs, train_dataset=Patterns(), optimizers=(opt, None))
        attach_to_trainer(trainer)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if torch.distributed.is_initialized():
        ref = flat.clone()
        torch.distributed.broadcast(ref, 0)
        assert torch.equal(ref, flat), "replicas diverged"
    if trainer.is_world_process_zero():
        print(f"losses {' '.join(f'{x:.4f}' for x in losses)}")
        print(f"done: hf trainer, method {args.method}, {opt.stats.overlapped_steps} overlapped steps")
    lioncub.finish()


if __name__ == "__main__":
    main()
