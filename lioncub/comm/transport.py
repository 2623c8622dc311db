"""torch.distributed plumbing shared by every method: failures as CommError, rank/size, averaging, the
step's control message. The collectives of each method live in lioncub.methods; nothing here knows them.

Every collective goes through `call`, which turns a backend failure (a dead or stalled peer, a network
error, a process-group timeout) into a CommError that says so, and notes its tensors so that the process
ends cleanly (lioncub.comm.clean_exit).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from lioncub.comm import clean_exit

# torch >= 2.10 renames all_gather_into_tensor to all_gather_single
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
all_to_all = dist.all_to_all_single
# and reduce_scatter_tensor to reduce_scatter_single
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommError(RuntimeError):
    """A collective failed: a peer rank died or stalled, or the network broke."""


def group_rank_size(group=None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


_OWN: dict = {}  # ranks -> (the world it was made in, the group)


def own_group(group=None):
    """A process group of the same ranks as `group` (default: the world) that only LionCub sends on, or `group`
    itself with one rank or none. Made once per set of ranks in a process group's life (each Gloo group holds its
    own sockets and threads), so every rank of `group` must first ask for it together, in the same order as its
    other process groups are made."""
    if group_rank_size(group)[1] <= 1:
        return group
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    world, made = _OWN.get(ranks, (None, None))
    if world is not dist.group.WORLD:  # (none yet, or one of a world that was destroyed since)
        made = dist.new_group(ranks=list(ranks))
        _OWN[ranks] = dist.group.WORLD, made
    return made


_TIMES: dict[str, list] | None = None  # name -> [calls, seconds], while record_call_times is on
_TIMES_LOCK = threading.Lock()


def record_call_times(on: bool = True) -> None:
    """Time every collective of this process by name (`call_times()`); LionCub(timing=True) turns it on."""
    global _TIMES
    with _TIMES_LOCK:
        _TIMES = ({} if _TIMES is None else _TIMES) if on else None


def call_times() -> dict[str, tuple[int, float]]:
    """{collective name: (calls, seconds)} since recording began (a wall-clock time per call, waiting for
    the slowest peer included; on CUDA the time to enqueue unless the caller synchronises)."""
    with _TIMES_LOCK:
        return {k: (int(n), float(t)) for k, (n, t) in (_TIMES or {}).items()}


def call(name: str, fn, *args, **kwargs):
    t0 = time.perf_counter() if _TIMES is not None else None
    counted = clean_exit.before(list(args) + list(kwargs.values()))
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as exc:
        rank = group_rank_size()[0]
        raise CommError(
            f"lioncub: {name} failed on rank {rank}: a peer rank died or stalled past the process-group "
            f"timeout, or the network failed. Original error: {exc}"
        ) from exc
    finally:
        clean_exit.track(counted)  # (the exit waits until Gloo let go of them: lioncub.comm.clean_exit)
        if t0 is not None:
            dt = time.perf_counter() - t0
            with _TIMES_LOCK:
                if _TIMES is not None:
                    entry = _TIMES.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += dt


def allreduce_mean_(tensor: torch.Tensor, group=None, wire_dtype: torch.dtype = torch.float32) -> None:
    """Average a float tensor over the group in place, summing in `wire_dtype`."""
    _, N = group_rank_size(group)
    buf = tensor if tensor.dtype == wire_dtype else tensor.to(wire_dtype)
    call(f"all_reduce ({wire_dtype})", dist.all_reduce, buf, group=group)
    buf.div_(N)
    if buf is not tensor:
        tensor.copy_(buf)


def agree_control(nonfinite, sumsq=None, group=None, device="cpu", unused: int = 0) -> tuple[int, float, int]:
    """The step's control message (lioncub.comm.wire.CONTROL): one float64 SUM all-reduce of [this rank's
    non-finite count, its sum of squared gradients, how many of its parameters got no gradient] (each a
    number or a 0-dim tensor, so that the step waits for the device only here; sumsq 0 if None). Returns
    the sums."""
    msg = torch.zeros(3, dtype=torch.float64, device=device)
    msg[0] = nonfinite
    if sumsq is not None:
        msg[1] = sumsq
    msg[2] = unused
    call("all_reduce (control)", dist.all_reduce, msg, group=group)
    count, total, unused_total = msg.tolist()
    return int(count), total, int(unused_total)


def used_anywhere(used: list[bool], group=None, device="cpu") -> list[bool]:
    """Per parameter, whether any rank of the group used it (an int32 SUM all-reduce of the flags)."""
    t = torch.tensor(used, dtype=torch.int32, device=device)
    call("all_reduce (unused parameters)", dist.all_reduce, t, group=group)
    return [bool(x) for x in t.tolist()]


def equal_everywhere(values: torch.Tensor, group=None, device="cpu") -> bool:
    """Whether the float64 `values` are equal on every rank of the group and their last one is not zero (one MAX
    all-reduce of the values and their negatives, timed as "all_reduce (same gradients)": the maximum equals the
    negated minimum exactly when every rank sent the same). The result is identical on every rank."""
    n = values.numel()
    t = torch.cat([values, -values]).to(device)
    call("all_reduce (same gradients)", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
    t = t.cpu()
    return bool(torch.equal(t[:n], -t[n:]) and t[n - 1] != 0)


def any_rank(flag: bool, group=None, device="cpu", what: str = "any rank") -> bool:
    """Whether `flag` is true on any rank of the group (one 4-byte MAX all-reduce, timed as "all_reduce
    (<what>)"; `flag` alone without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device)
    call(f"all_reduce ({what})", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
