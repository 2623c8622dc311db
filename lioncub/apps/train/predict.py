"""Predicted step time of a training run, from the calibrated simulator (what `lioncub train --json` reports
as `predicted_step_seconds`)."""

from __future__ import annotations

from lioncub import methods
from lioncub.optim import schedules
from lioncub.simulator.step.model import DDP_BUCKET_MB


def momentum_interval(spec: str, steps: int) -> int | None:
    """The every-K interval with the same sync rate as the schedule `spec` over `steps` steps."""
    schedule = schedules.resolve(schedules.parse(spec))
    rate = schedule.rate(steps)
    return None if rate <= 0 else max(1, round(1 / rate))


def predict_step(cfg, params: int, compute_seconds: float, *, ranks: int, bandwidth, ranks_per_host: int = 1,
                 latency=0.0, profile=None, units=None):
    """simulate_step for a run of `cfg` (a TrainConfig) on `ranks` ranks, `ranks_per_host` per host (a node),
    over links of `bandwidth`, with the lab's calibrated Gloo profile by default. The ddp+lion baseline is the
    allreduce method, overlapped. A hierarchical `cfg` is simulated with the cluster's nodes as its nodes, an
    hsdp one in the sharded layout on them (`units`: its FSDP units' parameter counts, default cfg's model's);
    raises NotImplementedError where the simulator cannot model the run (then there is no prediction)."""
    from lioncub.simulator import Cluster, simulate_step

    run, layout = cfg.configuration, {}
    if cfg.hierarchical or run.wrapper.fsdp:
        if cfg.node_size not in (None, ranks_per_host):
            raise NotImplementedError(f"the simulator's nodes are the hosts ({ranks_per_host} ranks), not nodes of "
                                      f"{cfg.node_size}")
        layout["sharded" if run.wrapper.fsdp else "hierarchical"] = True

    if getattr(cfg, "local_steps", None):
        if run.wrapper.fsdp:
            raise NotImplementedError("local steps do not run on sharded models")
        layout.update(local_steps=cfg.local_steps, fragments=cfg.fragments, outer_delay=cfg.outer_delay)
    if profile is None:
        from lioncub.apps.calibrate import default_lab_profile

        profile = default_lab_profile()
    cluster = Cluster.for_ranks(ranks, ranks_per_host, bandwidth=bandwidth, latency=latency)
    from lioncub.comm.wire import STEP_RUN_MB, auto_bucket_mb

    if run.wrapper.fsdp:  # FSDP2's units; its collectives in the parameters' dtype (fp32: no MixedPrecisionPolicy)
        layout["units"] = units if units is not None else unit_params(cfg)
        layout["grad_dtype"] = "float32"
    if run.plain_lion and run.wrapper.fsdp:  # FSDP2's own HSDP: its all-reduce across nodes, plain Lion
        method, bucket_mb, interval, overlap = methods.BASELINE, DDP_BUCKET_MB, None, True
    elif run.plain_lion:  # the wrapper communicates
        if not run.wrapper.torch_ddp:
            raise NotImplementedError(f"the simulator does not model {run.wrapper.name}'s communication")
        # torch DDP all-reduces the fp32 gradients in its buckets during backward
        method, bucket_mb, interval, overlap = methods.BASELINE, DDP_BUCKET_MB, None, True
    else:
        method, bucket_mb = run.method.name, cfg.bucket_mb or auto_bucket_mb(4 * params)
        interval, overlap = momentum_interval(cfg.momentum_sync, cfg.steps), cfg.overlap
        if not overlap and cfg.bucket_mb is None and not layout:  # step() exchanges runs of buckets (optim.buckets.Run)
            bucket_mb = max(bucket_mb, STEP_RUN_MB)
    layout.setdefault("grad_dtype", cfg.grad_wire_dtype)
    if not run.plain_lion and not run.wrapper.fsdp and sum(sizes := tensor_sizes(cfg)) == params:
        layout["tensors"] = sizes  # LionCub's buckets, cut at the model's tensors as the optimizer cuts them
    return simulate_step(cluster, method, params, interval, bucket_mb, compute_seconds, backend=profile,
                         levels=cfg.levels, overlap=overlap, **layout)


_SIZES: dict = {}


def tensor_sizes(cfg) -> list[int]:
    """The element counts of cfg's model's trainable tensors in model.parameters() order (built once per model,
    block size and data set; the global random state is left as it was)."""
    key = (cfg.model, cfg.block_size, cfg.data)
    if key not in _SIZES:
        import torch

        from lioncub.apps.train.loop import build

        with torch.random.fork_rng(devices=[]):
            _SIZES[key] = [p.numel() for p in build(cfg)[0].parameters() if p.requires_grad]
    return _SIZES[key]


def unit_params(cfg) -> list[int]:
    """The parameter counts of the FSDP units `lioncub train` makes of cfg's model (sharding.shard: the root's
    own parameters, then each block), in forward order."""
    from lioncub.apps.train.loop import build
    from lioncub.apps.train.sharding import unit_params as of_model

    return of_model(build(cfg)[0])
