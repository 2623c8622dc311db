"""World size 1 on CPU, GPT-2-124M parameter shapes (124,439,808 fp32): step() alone after zero_grad() and
torch.autograd.backward(params, grads), for LionCub with its non-finite check in step() (as before
lioncub.optim.finite), in backward, and without one; rounds rotate the order. Medians of 9 iterations after 2.

    python docs/results/issue30/backward-check/cpu_gpt2_step.py [N_LAYER]      (from the repository root)
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "scripts")
from gpu_bench import gpt2_shapes  # noqa: E402

from lioncub import LionCub  # noqa: E402


def main(n_layer: int) -> None:
    shapes = gpt2_shapes(n_layer=n_layer, d=768, vocab=50257, ctx=1024)
    n = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]

    def optimizer(**kw):
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.02)) for s in shapes]
        return ps, LionCub(ps, lr=1e-4, weight_decay=0.1, **kw)

    before = optimizer()
    before[1].engine.backward_check.close()
    before[1].engine.backward_check = None  # the check in step(), as before lioncub.optim.finite
    runs = {"check in step (as before)": before, "check in backward": optimizer(),
            "no check": optimizer(skip_nonfinite=False)}
    times = {k: dict(backward=[], step=[]) for k in runs}
    names = list(runs)
    for i in range(11):
        for name in names[i % 3:] + names[:i % 3]:
            ps, opt = runs[name]
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.autograd.backward(ps, grads)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i >= 2:
                times[name]["backward"].append(t1 - t0)
                times[name]["step"].append(t2 - t1)
    print(f"{n / 1e6:.1f}M params, torch threads {torch.get_num_threads()}")
    for k, v in times.items():
        print(f"{k:32s} zero_grad + backward {1e3 * statistics.median(v['backward']):6.1f} ms  "
              f"step {1e3 * statistics.median(v['step']):6.1f} ms  (min {1e3 * min(v['step']):.1f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
