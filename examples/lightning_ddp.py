"""LionCub with PyTorch Lightning: `configure_optimizers` returns a LionCub, the DDP strategy wraps the model,
and `lioncub.integrations.lightning_callback()` attaches LionCub to it.

    torchrun --nproc_per_node 2 examples/lightning_ddp.py --method vote-1bit --steps 40
"""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

import lioncub
from lioncub.integrations import lightning_callback


class Classifier(L.LightningModule):
    def __init__(self, method):
        super().__init__()
        self.method = method
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return lioncub.LionCub(self.parameters(), lr=3e-3, weight_decay=0.1, method=self.method)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="vote-1bit")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    L.seed_everything(0, verbose=False)
    model = Classifier(args.method)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    xs = torch.randn(args.steps * 16 * 4, 32, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, (xs @ teacher).argmax(1)), batch_size=16)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=args.steps,
                        callbacks=[lightning_callback()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if trainer.world_size > 1:
        ref = flat.clone()
        torch.distributed.broadcast(ref, 0)
        assert torch.equal(ref, flat), "replicas diverged"
    if trainer.global_rank == 0:
        k = max(1, len(model.losses) // 4)
        opt = trainer.optimizers[0]
        print(f"loss first {sum(model.losses[:k]) / k:.4f} last {sum(model.losses[-k:]) / k:.4f}")
        s = opt.stats
        print(f"done: lightning, method {args.method}, {s.steps} steps, {s.overlapped_steps} overlapped")
    lioncub.finish()


if __name__ == "__main__":
    main()
