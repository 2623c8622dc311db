"""The training loop behind `lioncub train`: one function per rank, the same under torchrun, a local spawn
or the emulated-Ethernet lab."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lioncub import methods
from lioncub.apps.train import configs, sharding
from lioncub.apps.train.data import TEXT_DATASETS, Blobs, text_dataset
from lioncub.apps.train.models import DEFAULTS, MLP, PRESETS, CharTransformer, GPTConfig, count_params
from lioncub.apps.tuned_lr import DEFAULT_LR
from lioncub.comm import transport, wire
from lioncub.comm.distributed import broadcast_parameters
from lioncub.comm.transport import group_rank_size
from lioncub.optim import LionCub, LocalSteps, schedules
from lioncub.optim.lion import Lion

MODELS = tuple(PRESETS) + ("mlp",)
AMP = ("none", "bf16")  # TrainConfig.amp: the forward pass in fp32, or under bf16 autocast


@dataclass
class TrainConfig:
    model: str = "char-tiny"
    method: str = methods.DEFAULT  # a configuration (lioncub.apps.train.configs): a LionCub method, or ddp+lion
    levels: int | None = None
    momentum_sync: str = "none"  # schedules.parse syntax: none, K, every:K, first:K:M, geometric:K, adaptive
    dense_warmup: int = 0  # steps of the allreduce method before `method` (LionCub's dense_warmup)
    local_steps: int | None = None  # LionCub(local_steps=H): H local steps, then an outer exchange of `method`
    outer: str | None = None  # the outer optimizer with local_steps, "kind[:LR[:MU]]" (default avg)
    fragments: int | None = None  # LionCub(fragments=F): stream the outer steps in F fragments
    outer_delay: int | None = None  # LionCub(outer_delay=D): inner steps a streamed exchange overlaps
    lr: float | None = None  # None: the model's DEFAULT_LR, the best of a measured sweep
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    warmup: int = 10
    steps: int = 100
    batch_size: int = 16
    block_size: int | None = None  # None: the model's default (64 for char-*, 256 for byte-*)
    data: str | None = None  # a text dataset (TEXT_DATASETS); None: the model's (pydoc-topics, python-src)
    amp: str = "none"  # "bf16": forward and loss under torch.autocast(bfloat16); parameters and updates in fp32
    bucket_mb: float | None = None  # None: LionCub's default (lioncub.comm.wire.auto_bucket_mb)
    grad_wire_dtype: str = "float32"
    overlap: bool = True
    ddp_hook: bool = False  # wrap the model in torch DDP and attach LionCub to it (lioncub.attach_ddp)
    hierarchical: bool = False  # LionCub's hierarchical layout: average inside a node, vote across nodes
    node_size: int | None = None  # ranks per node for `hierarchical` (None: torchrun's LOCAL_WORLD_SIZE)
    seed: int = 0
    eval_batches: int = 8
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    threads: int = 0  # torch threads per rank (0: leave as is)
    device: str = "cpu"  # where the model, data and optimizer live ("cuda", "cuda:1", ...)
    timing: bool = False  # LionCub(timing=True): exact phase times on CUDA, and every collective timed by name

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        run = self.configuration  # raises for a name that is not a configuration
        if self.lr is None:
            self.lr = DEFAULT_LR[self.model]
        default_data, default_block = DEFAULTS[self.model]
        if self.block_size is None:
            self.block_size = default_block
        if self.data is None:
            self.data = default_data
        if self.model == "mlp" and self.data != "blobs":
            raise ValueError(f"the mlp trains on blobs, not {self.data!r}")
        if self.model != "mlp" and self.data not in TEXT_DATASETS:
            raise ValueError(f"unknown dataset {self.data!r}; choose one of {', '.join(TEXT_DATASETS)}")
        if self.amp not in AMP:
            raise ValueError(f"amp must be one of {', '.join(AMP)}, got {self.amp!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.steps < 1 or self.batch_size < 1 or self.block_size < 2 or self.warmup < 0:
            raise ValueError("steps and batch_size must be >= 1, block_size >= 2 and warmup >= 0")
        schedules.parse(self.momentum_sync)  # validate early
        if self.dense_warmup < 0 or (self.dense_warmup and run.plain_lion):
            raise ValueError("dense_warmup must be >= 0 and applies to LionCub's methods, not "
                             + ", ".join(c.name for c in configs.CONFIGURATIONS if c.plain_lion))
        if (self.local_steps is not None or self.outer is not None) and run.plain_lion:
            raise ValueError("local_steps and outer apply to LionCub's methods (allreduce is DiLoCo's dense outer "
                             "all-reduce), not " + ", ".join(c.name for c in configs.CONFIGURATIONS if c.plain_lion))
        if self.hierarchical and (not run.compressed or run.wrapper.fsdp):
            raise ValueError("hierarchical applies to the compressed methods without hsdp (which is hierarchical "
                             "by construction)")
        if (self.fragments is not None or self.outer_delay is not None) and self.local_steps is None:
            raise ValueError("fragments and outer_delay stream the outer steps of local_steps: give local_steps too")
        if run.wrapper.fsdp and (self.ddp_hook or self.local_steps is not None):
            raise ValueError(f"{self.method}: " + ("ddp_hook does not apply to hsdp" if self.ddp_hook else
                             "local steps on a sharded model are not supported yet"))
        if self.node_size is not None and self.node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {self.node_size}")

    @property
    def configuration(self) -> configs.Configuration:
        return configs.parse(self.method)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown training options: {', '.join(sorted(unknown))}")
        return cls(**d)


def build(cfg: TrainConfig):
    """(model, dataset) for the config, identically initialised on every rank."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "mlp":
        return MLP(), Blobs(seed=cfg.seed)
    data = text_dataset(cfg.data)
    gpt = GPTConfig(vocab_size=data.vocab_size, block_size=cfg.block_size, **PRESETS[cfg.model])
    return CharTransformer(gpt), data


def autocast(cfg: TrainConfig):
    """The forward pass's context: bf16 autocast on the config's device type with amp="bf16"."""
    if cfg.amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16)


def _lr(cfg: TrainConfig, step: int) -> float:
    if step <= cfg.warmup:
        return cfg.lr * step / max(1, cfg.warmup)
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _ckpt_path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"step{step:07d}-rank{rank}.pt")


def _latest_checkpoint(directory: str) -> tuple[int, list[str]] | None:
    steps = {}
    for path in glob.glob(os.path.join(directory, "step*-rank*.pt")):
        name = os.path.basename(path)
        step, rank = int(name[4:11]), int(name.split("rank")[1][:-3])
        steps.setdefault(step, {})[rank] = path
    for step in sorted(steps, reverse=True):  # the newest step that every rank of that run saved
        if sorted(steps[step]) == list(range(len(steps[step]))):
            return step, [steps[step][r] for r in sorted(steps[step])]
    return None


def resume(cfg, model, opt, rank: int, world: int) -> tuple[int, list]:
    """(the step to go on from, the records so far) from cfg.checkpoint_dir's newest complete checkpoint, loaded
    into model and opt; (0, []) if there is none."""
    if cfg.configuration.wrapper.fsdp:
        return sharding.resume(cfg.checkpoint_dir, model, opt)
    found = _latest_checkpoint(cfg.checkpoint_dir)
    if not found:
        return 0, []
    step, paths = found
    state = load_plain(paths[rank] if len(paths) == world else paths[0])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"], state["records"]


def load_plain(path: str) -> dict:
    """A checkpoint file read by torch's safe loader (weights_only=True: tensors and plain data only), so that
    whoever can write the checkpoint folder cannot run code in the job; anything else is refused in one line."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ValueError(f"{path}: refused to load a checkpoint that is not plain data ({first}); lioncub's "
                         f"checkpoints hold tensors, numbers, strings, lists and dicts only") from None


def save_checkpoint(cfg, model, opt, step, rank, records) -> str:
    if cfg.configuration.wrapper.fsdp:
        return sharding.save(cfg.checkpoint_dir, model, opt, step, rank, records)
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    path = _ckpt_path(cfg.checkpoint_dir, step, rank)
    tmp = path + ".tmp"
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), step=step,
                    config=dataclasses.asdict(cfg), records=records), tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written checkpoint
    return path


def _mean_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, data, cfg: TrainConfig) -> float:
    """Mean loss over fixed validation batches, averaged over ranks (every rank gets the same number)."""
    model.eval()
    rank, world = group_rank_size()
    losses = []
    for i in range(rank, cfg.eval_batches * world, world):  # the ranks split one fixed set of batches
        x, y = data.batch(cfg.batch_size, cfg.block_size, seed=cfg.seed + 1, rank=0, step=i, split="val")
        with autocast(cfg):
            losses.append(model(x.to(cfg.device), y.to(cfg.device))[1].item())
    model.train()
    return _mean_over_ranks(statistics.fmean(losses))


def train(cfg: TrainConfig, progress: bool = True, on_step=None) -> dict:
    """Train on this rank (torch.distributed initialised, or a single process). Returns a summary; rank 0's
    summary holds the per-step records."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = group_rank_size()
    model, data, opt, net, fsdp = _setup(cfg, world)
    start, records = resume(cfg, model, opt, rank, world) if cfg.resume and cfg.checkpoint_dir else (0, [])
    bar = None
    if progress and rank == 0:
        from lioncub.optional import progress_bar

        bar = progress_bar(total=cfg.steps, initial=start, desc=f"{cfg.method} x{world}", unit="step", leave=False)
    waited = _start_together()
    for step in range(start + 1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        t0 = time.perf_counter()
        x, y = data.batch(cfg.batch_size, cfg.block_size, seed=cfg.seed, rank=rank, step=step)
        x, y = x.to(cfg.device), y.to(cfg.device)
        opt.zero_grad()
        with autocast(cfg):
            _, loss = net(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        records.append(dict(step=step, loss=loss.item(), step_s=t2 - t0, optimizer_s=t2 - t1,
                            lr=opt.param_groups[0]["lr"], **_step_figures(opt, t1 - t0, world, fsdp)))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", ms=f"{1e3 * (t2 - t0):.0f}")
        if on_step is not None:
            on_step(records[-1])
        if cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, model, opt, step, rank, records)
    if bar is not None:
        bar.close()
    if cfg.checkpoint_dir:
        save_checkpoint(cfg, model, opt, cfg.steps, rank, records)
    summary = summarize(cfg, records, evaluate(model, data, cfg), count_params(model), world, opt)
    summary["start_wait_seconds"] = waited
    return summary


def _start_together() -> float:
    """Seconds this rank waited for the others before its first step. Without it the ranks start apart by as
    long as the parameter broadcast takes to reach the last of them (rank 0's returns once sent: seconds on a
    slow link), and the first collective of the timed steps absorbs that skew: an outer step (local steps) or
    any wait for the slowest rank looks seconds long."""
    if not dist.is_initialized():
        return 0.0
    t0 = time.perf_counter()
    transport.call("barrier (start)", dist.barrier)
    return time.perf_counter() - t0


def _setup(cfg: TrainConfig, world: int):
    """(model, data, optimizer, the module to call, FSDP's bytes per step or None) as the configuration wants
    them: the model as it is, in torch DDP, or sharded by FSDP2 (HSDP)."""
    model, data = build(cfg)
    model.to(cfg.device)
    broadcast_parameters(model)
    mesh = sharding.mesh_for(cfg, world) if cfg.configuration.wrapper.fsdp else None
    if mesh is not None:
        sharding.shard(model, cfg, mesh)
    opt, net = make_optimizer(cfg, model), model
    fsdp = None
    if mesh is not None:
        sharding.attach(model, opt, cfg, mesh)
        fsdp = sharding.fsdp_bytes(cfg, model, world)
    if (cfg.configuration.wrapper.torch_ddp or cfg.ddp_hook) and dist.is_initialized():
        net = torch.nn.parallel.DistributedDataParallel(model)
        if cfg.ddp_hook:
            from lioncub.integrations.ddp import attach_ddp

            attach_ddp(net, opt)
    return model, data, opt, net, fsdp


def make_optimizer(cfg: TrainConfig, model):
    if cfg.configuration.plain_lion:
        return Lion(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    nodes = (cfg.node_size if cfg.node_size is not None else "local") if cfg.hierarchical else None
    local = None if cfg.local_steps is None else LocalSteps(cfg.local_steps, outer="avg" if cfg.outer is None else
                                                            cfg.outer, fragments=cfg.fragments, delay=cfg.outer_delay)
    opt = LionCub(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                  method=cfg.configuration.method.name, levels=cfg.levels,
                  momentum_sync=schedules.parse(cfg.momentum_sync),
                  bucket_mb=cfg.bucket_mb, grad_wire_dtype=cfg.grad_wire_dtype, overlap=cfg.overlap,
                  dense_warmup=cfg.dense_warmup, node_size=nodes, local=local)
    opt.timing = cfg.timing
    return opt


def _step_figures(opt, backward_s: float, world: int, fsdp: tuple[int, int] | None = None) -> dict:
    """Per-step compute, codec, communication and bytes. DDP's and FSDP's own communication is not instrumented:
    the backward time includes their exposed tail, and their bytes are the ring formulas' (`fsdp`: FSDP's
    bytes across and inside the node, sharding.fsdp_bytes)."""
    s = getattr(opt, "stats", None)
    cross, node = fsdp or (0, 0)
    if s is None:
        nbytes = sum(p.numel() * 4 for g in opt.param_groups for p in g["params"])
        ring = int(wire.bus_factor("allreduce", world) * nbytes) if world > 1 else 0
        return dict(compute_s=backward_s, codec_s=0.0, comm_s=0.0, bytes_sent=cross + node if fsdp else ring,
                    node_bytes_sent=node)
    return dict(compute_s=backward_s - s.last_backward_wait_s, codec_s=s.last_quantize_s + s.last_apply_s,
                comm_s=s.last_comm_s + s.last_sync_s, exposed_s=s.last_exposed_comm_s,
                bytes_sent=s.last_bytes_sent + node, node_bytes_sent=s.last_node_bytes_sent + node,
                agreement=s.last_agreement)


def _outer_delay(opt):
    stream = getattr(getattr(opt, "local", None), "stream", None)
    return None if stream is None else stream.D


def summarize(cfg, records, eval_loss, params, world, opt) -> dict:
    timed = records[2:] if len(records) > 4 else records  # the first steps allocate and warm caches

    def med(key):
        return statistics.median(r[key] for r in timed) if timed else 0.0

    tail = [r["loss"] for r in records[-10:]]
    agreed = [r["agreement"] for r in records if r.get("agreement") is not None]
    return dict(
        model=cfg.model, method=cfg.method, ranks=world, params=params, steps=cfg.steps, lr=cfg.lr,
        momentum_sync=cfg.momentum_sync, levels=getattr(opt, "levels", 0) or None,
        local_steps=cfg.local_steps, outer=str(opt.local.outer) if getattr(opt, "local", None) else None,
        fragments=cfg.fragments, outer_delay=_outer_delay(opt),
        final_loss=eval_loss, train_loss=_mean_over_ranks(statistics.fmean(tail)) if tail else float("nan"),
        step_seconds=med("step_s"), compute_seconds=med("compute_s"), codec_seconds=med("codec_s"),
        comm_seconds=med("comm_s"),
        # the mean includes the periodic momentum syncs the median skips: use it for throughput
        mean_step_seconds=statistics.fmean(r["step_s"] for r in timed) if timed else 0.0,
        # the mean communication step() and backward waited for (local steps: the outer exchanges' spread over
        # the steps) beside the mean compute (forward and backward)
        mean_exposed_seconds=statistics.fmean(r.get("exposed_s", 0.0) for r in timed) if timed else 0.0,
        mean_compute_seconds=statistics.fmean(r["compute_s"] for r in timed) if timed else 0.0,
        # the mean of step() as a whole: the exposed communication, the codec and the inner steps' own work
        mean_optimizer_seconds=statistics.fmean(r.get("optimizer_s", 0.0) for r in timed) if timed else 0.0,
        bytes_per_step=statistics.fmean(r["bytes_sent"] for r in timed) if timed else 0,
        # every step's bytes (a dense start's included): what a byte budget counts
        total_bytes_sent=sum(r["bytes_sent"] for r in records),
        # of which to the rank's own node (the hierarchical layout's node collectives)
        node_bytes_per_step=statistics.fmean(r.get("node_bytes_sent", 0) for r in timed) if timed else 0,
        skipped_steps=opt.stats.skipped_steps if hasattr(opt, "stats") else 0,
        momentum_syncs=opt.stats.momentum_syncs if hasattr(opt, "stats") else 0,
        # the ranks' agreement (optim.schedules.agreement) over the run and over its last tenth; None if unmeasured
        agreement=statistics.fmean(agreed) if agreed else None,
        final_agreement=statistics.fmean(agreed[-max(1, len(agreed) // 10):]) if agreed else None,
        # with cfg.timing: this rank's time in each collective (by lioncub.comm.transport's names) per step, the
        # whole run (setup and first steps included) over its steps
        collective_ms_per_step={k: 1e3 * t / cfg.steps for k, (_, t) in transport.call_times().items()}
        if cfg.timing else None,
        records=records,
    )


def _spawned(rank, world_size, cfg_dict, progress):
    out = train(TrainConfig.from_dict(cfg_dict), progress=progress)
    if rank:
        out.pop("records")
    return out


def train_local(cfg: TrainConfig, ranks: int, progress: bool = True, timeout: float | None = None) -> dict:
    """Train on `ranks` local Gloo processes (or in this process for ranks == 1); rank 0's summary. No time limit
    by default (a long run is not a hang: a rank that dies, or a collective that waits past Gloo's timeout, still
    ends it with an error)."""
    from lioncub.comm.spawn import spawn

    if ranks == 1 and not dist.is_initialized():
        return train(cfg, progress=progress)
    return spawn(_spawned, ranks, dataclasses.asdict(cfg), progress, timeout=timeout)[0]


def dumps(summary: dict) -> str:
    return json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=2)


def _compute_probe(rank, world_size, cfg_dict, steps):
    cfg = TrainConfig.from_dict(cfg_dict)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, data = build(cfg)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        x, y = data.batch(cfg.batch_size, cfg.block_size, seed=cfg.seed, rank=rank, step=step)
        model.zero_grad()
        with autocast(cfg):
            loss = model(x, y)[1]
        loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_compute(cfg: TrainConfig, ranks: int, steps: int = 5) -> float:
    """Forward + backward seconds per step with `ranks` processes computing at once on this machine (no
    communication): the compute time the simulator needs to predict a step before training."""
    from lioncub.comm.spawn import spawn

    return statistics.fmean(spawn(_compute_probe, ranks, dataclasses.asdict(cfg), steps, timeout=600))
