"""The machine at hand: its devices and backend, and the user's compute per step, measured.

`read_devices()` says what this machine would train on: CUDA GPUs (their count is the ranks per node, NCCL the
backend) or the CPU (one rank, Gloo; torchrun's LOCAL_WORLD_SIZE where it is set). `measure_here(model, batch,
loss_fn)` times forward + backward of the user's model on one batch on the model's device (after warm-up
steps; the median of the timed ones) and returns what the search needs (`Here`): parameters, compute seconds,
the devices and backend. `lioncub autotune --here [--model-fn module:function]` is the same from the command
line. Only this module imports torch, and only when called.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from lioncub.simulator.units import format_size, format_time


@dataclass(frozen=True)
class Devices:
    """What this machine trains on: `device` "cuda" or "cpu", how many (the ranks per node), the backend."""

    device: str
    name: str
    count: int  # CUDA devices, or 1 CPU
    gpus_per_node: int  # ranks per node: the CUDA devices, or torchrun's LOCAL_WORLD_SIZE (else 1) on CPU
    backend: str  # "nccl" on CUDA, "gloo" on CPU
    memory_bytes: int | None = None  # each CUDA device's memory

    def describe(self) -> str:
        mem = f", {format_size(self.memory_bytes)} each" if self.memory_bytes else ""
        what = f"{self.count} x {self.name}{mem}" if self.device == "cuda" else f"CPU ({self.name})"
        return f"{what}: {self.gpus_per_node} rank(s) per node, backend {self.backend}"


def read_devices() -> Devices:
    """This machine's devices and the backend LionCub would use on them (lioncub.init_distributed's choice)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        return Devices("cuda", props.name, n, n, "nccl", int(props.total_memory))
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    import platform

    return Devices("cpu", platform.processor() or platform.machine() or "cpu", 1, ranks, "gloo")


@dataclass(frozen=True)
class Here:
    """The user's model on this machine: what `lioncub.apps.autotune.search` takes, measured.

    `search(here.cluster(nodes=4, bandwidth="10Gbit"), here.params, here.compute_seconds, backend=here.backend)`.
    """

    params: int  # trainable parameters (those the optimizer updates and the ranks exchange)
    compute_seconds: float  # forward + backward of one batch: the median of the timed steps
    samples: list = field(default_factory=list)  # each timed step's seconds
    warmup: int = 0
    device: str = "cpu"  # where it ran: "cuda:0", "cpu"
    devices: Devices | None = None

    @property
    def backend(self) -> str:
        return self.devices.backend if self.devices else "gloo"

    @property
    def gpus_per_node(self) -> int:
        return self.devices.gpus_per_node if self.devices else 1

    @property
    def compute_basis(self) -> str:
        spread = (f", {format_time(min(self.samples))}-{format_time(max(self.samples))}" if len(self.samples) > 1
                  else "")
        return (f"{format_time(self.compute_seconds)} per step (measured here: forward + backward of one batch on "
                f"{self.device}, median of {len(self.samples)} after {self.warmup} warm-up{spread})")

    def cluster(self, nodes: int = 1, **links):
        """A `lioncub.simulator.Cluster` of `nodes` machines like this one (`links`: bandwidth, latency, ...)."""
        from lioncub.simulator import Cluster

        return Cluster(nodes=nodes, gpus_per_node=self.gpus_per_node, **links)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(backend=self.backend, gpus_per_node=self.gpus_per_node, compute_basis=self.compute_basis)
        return d


def _to(batch, device):
    """The batch on `device`: tensors moved, containers rebuilt, anything else as it is."""
    if hasattr(batch, "to") and callable(batch.to) and hasattr(batch, "device"):
        return batch.to(device)
    if isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "items"):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _default_loss(model, batch):
    """The loss of one batch without a loss_fn: `model(**batch)` for a mapping (a Hugging Face batch with
    labels), `model(*batch)` for a tuple or list, else `model(batch)`; then the output's `.loss` (Hugging
    Face), the second item of a (logits, loss) pair, a scalar output itself, or else the output's sum (the
    same backward as a real loss)."""
    import torch

    if isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "items"):
        out = model(**batch)
    elif isinstance(batch, (list, tuple)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (list, tuple)):
        loss = next((o for o in out[1:] if isinstance(o, torch.Tensor) and o.dim() == 0), None)
        out = out[0] if loss is None else out
    if loss is None and isinstance(out, torch.Tensor):
        loss = out if out.dim() == 0 else out.float().sum()
    if not isinstance(loss, torch.Tensor):
        raise ValueError("cannot find a loss in the model's output: pass loss_fn(model, batch) -> loss")
    return loss


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_here(model, batch, loss_fn=None, *, steps: int = 5, warmup: int = 2, device=None) -> Here:
    """Time forward + backward of `model` on one `batch` on this machine, and read its devices and backend.

    Args:
        model: a torch module (a Hugging Face model too); measured where its parameters are, or moved to `device`.
        batch: one rank's batch: a tensor, a tuple or list of them, or a mapping (a Hugging Face batch).
        loss_fn: `loss_fn(model, batch) -> loss`, e.g. `lambda m, b: F.cross_entropy(m(b[0]), b[1])`; without
            one, the model's output gives the loss (`.loss`, a (logits, loss) pair, or the output's sum).
        steps: timed steps (the median is the compute time); warmup: untimed steps before them (allocator,
            autotuning, lazy initialisation).
        device: move the model and the batch there first (default: leave the model where it is).

    Returns:
        A `Here`: trainable parameters, compute seconds per step, each timed step's seconds, the device, and
        `devices` (`read_devices()`): the ranks per node and the backend. Gradients are left zeroed.
    """
    import torch

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters")
    if device is not None:
        model.to(device)
    dev = trainable[0].device
    batch = _to(batch, dev)
    loss_fn = loss_fn or _default_loss
    was_training = model.training
    model.train()
    samples = []
    try:
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            _sync(dev)
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor")
            loss.backward()
            _sync(dev)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    params = sum(p.numel() for p in trainable)
    where = f"{dev.type}:{dev.index if dev.index is not None else 0}" if dev.type == "cuda" else dev.type
    return Here(params, statistics.median(samples), samples, warmup, where, read_devices())


def load_model_fn(spec: str):
    """`module:function` or `path/to/file.py:function` -> (model, batch, loss_fn or None): the function takes no
    arguments and returns (model, batch), (model, batch, loss_fn) or a dict with those keys."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"--model-fn takes module:function or file.py:function, got {spec!r}")
    if mod_name.endswith(".py") or os.sep in mod_name:
        if not os.path.isfile(mod_name):
            raise ValueError(f"--model-fn: no file {mod_name!r}")
        loader = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            raise ValueError(f"--model-fn: cannot import {mod_name!r} ({exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--model-fn: {mod_name} has no function {fn_name!r}")
    out = fn()
    if isinstance(out, dict):
        if "model" not in out or "batch" not in out:
            raise ValueError(f"--model-fn: {spec}() returned a dict without 'model' and 'batch'")
        return out["model"], out["batch"], out.get("loss_fn")
    if isinstance(out, (list, tuple)) and len(out) in (2, 3):
        return out[0], out[1], out[2] if len(out) == 3 else None
    raise ValueError(f"--model-fn: {spec}() must return (model, batch) or (model, batch, loss_fn)")
