"""fp16 in the frameworks, on CPU Gloo ranks: each framework is given the torch.amp.GradScaler it makes for fp16 on
a GPU (on CPU it makes none), lioncub.integrations swaps it, and rank 1's loss overflows at step OVERFLOW_STEP.
Each rank then replays the batches it trained on through the oracle: LionCub with no scaler at all, the loss
multiplied by the scale and the gradients by its inverse by hand, step OVERFLOW_STEP left out on every rank and
the scale halved after it."""

from __future__ import annotations

import os
import tempfile

import safe_cases
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_cases import flat

from lioncub import LionCub

STEPS, OVERFLOW_STEP, INIT_SCALE = 4, 2, 2.0**10
METHOD = "vote-1bit"
# what spawn() gives the ranks, plus what Lightning reads to see that the processes were launched for it
LIGHTNING_ENV = {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


class Net(torch.nn.Module):
    """safe_cases.model() whose forward returns the loss, records its batch and, on rank 1 at the overflow step,
    multiplies the loss by 1e30 (the fp16 backward overflows)."""

    def __init__(self, overflow=True):
        super().__init__()
        self.body = safe_cases.model()
        self.batches, self.overflow = [], overflow
        self.body[0].weight.register_hook(self._note)
        self.local_inf = []

    def _note(self, grad):
        self.local_inf.append(not bool(torch.isfinite(grad).all()))

    def forward(self, x, labels):
        self.batches.append((x.detach().clone(), labels.detach().clone()))
        loss = F.mse_loss(self.body(x).float(), labels)
        if self.overflow and len(self.batches) == OVERFLOW_STEP and dist.get_rank() == 1:
            loss = loss * 1e30
        return {"loss": loss}


def make_optimizer(params):
    return LionCub(params, lr=safe_cases.LR, method=METHOD, bucket_mb=safe_cases.BUCKET_MB)


def torch_scaler():
    """What accelerate and Lightning build for fp16 on a GPU (here on CPU, with a small initial scale)."""
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)


class Trace:
    """After every optimizer step: did the parameters move, and the scale."""

    def __init__(self, net):
        self.net, self.last = net, flat(net.parameters())
        self.changed, self.scales = [], []

    def note(self, scaler):
        now = flat(self.net.parameters())
        self.changed.append(not torch.equal(now, self.last))
        self.last = now
        self.scales.append(scaler.get_scale())

    def report(self, net, opt, scaler):
        from lioncub.integrations.amp import GradScaler
        from lioncub.integrations.ddp import unwrap_optimizer

        inner = unwrap_optimizer(opt)
        params, momenta = oracle(net.batches)
        return dict(changed=self.changed, scales=self.scales, local_inf=net.local_inf,
                    swapped=isinstance(scaler, GradScaler), params=flat(net.parameters()),
                    momenta=flat([inner.state[p]["exp_avg"] for p in net.parameters()]),
                    oracle_params=params, oracle_momenta=momenta)


def oracle(batches):
    """The run the frameworks must give: no scaler object, the overflow step left out, the scale halved after it."""
    net = Net(overflow=False)
    opt = LionCub(net.parameters(), lr=safe_cases.LR, method=METHOD, bucket_mb=safe_cases.BUCKET_MB, overlap=False)
    scale = INIT_SCALE
    for step, (x, y) in enumerate(batches, start=1):
        if step == OVERFLOW_STEP:
            scale /= 2
            continue
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x, y)["loss"]
        (loss * scale).backward()
        for p in net.parameters():
            p.grad.mul_(1 / scale)
        opt.step()
    return flat(net.parameters()), flat([opt.state[p]["exp_avg"] for p in net.parameters()])


def accelerate_run(rank, world_size):
    from accelerate import Accelerator

    import lioncub
    from lioncub.integrations import replace_grad_scaler

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    # what Accelerator.__init__ sets for fp16 on a GPU (accelerate reads these two attributes)
    accelerator.native_amp, accelerator.scaler = True, torch_scaler()
    replace_grad_scaler(accelerator)
    net = Net()
    model, opt = accelerator.prepare(net, make_optimizer(net.parameters()))
    lioncub.attach_ddp(model, opt)
    trace, skipped = Trace(net), []
    for step in range(1, STEPS + 1):
        x, y = safe_cases.batch(rank, step)
        accelerator.backward(model(x, y)["loss"])
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
        trace.note(accelerator.scaler)
    return dict(trace.report(net, opt, accelerator.scaler), skipped=skipped)


class _Rows(torch.utils.data.Dataset):
    """Rows of safe_cases' batches, as dicts (the Hugging Face Trainer's format)."""

    def __init__(self, n=STEPS * 16):
        gen = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def hf_trainer_run(rank, world_size, max_grad_norm=0.0):
    """max_grad_norm > 0: the Trainer clips through accelerate's clip_grad_norm_, which unscales first."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lioncub.integrations import attach_to_trainer

    net = Net()
    opt = make_optimizer(net.parameters())
    trace = Trace(net)

    class Note(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trace.note(trainer.accelerator.scaler)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=8, fp16=True,
                                 use_cpu=True, report_to=[], save_strategy="no", lr_scheduler_type="constant",
                                 max_grad_norm=max_grad_norm, disable_tqdm=True, ddp_backend="gloo")
        trainer = Trainer(model=net, args=args, train_dataset=_Rows(), optimizers=(opt, None),
                          callbacks=[Note()])
        # what Accelerator.__init__ sets for fp16 on a GPU (the Trainer's accelerator reads these two attributes)
        trainer.accelerator.native_amp, trainer.accelerator.scaler = True, torch_scaler()
        attach_to_trainer(trainer)
        trainer.train()
    return trace.report(net, opt, trainer.accelerator.scaler)


def lightning_run(rank, world_size):
    import lightning as L
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from lioncub.integrations import lightning_callback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            return self.net(*batch)["loss"]

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    class Note(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trace.note(trainer.precision_plugin.scaler)

    module = Module()
    trace = Trace(module.net)
    rows = _Rows()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows.x, rows.y), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=STEPS,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch_scaler())],
                        callbacks=[lightning_callback(), Note()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    return trace.report(module.net, trainer.optimizers[0], trainer.precision_plugin.scaler)
