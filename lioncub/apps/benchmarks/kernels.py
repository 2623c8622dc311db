"""`lioncub bench kernels`: the codec kernels' throughput against the device's copy bandwidth.

On a GPU (Triton kernels), for bucket sizes from 1M to 256M elements: GB/s moved by each kernel (the
bytes it must read and write, by design, over its time), its fraction of the copy bandwidth measured in
the same run (`dst.copy_(src)`), and whole-step times: a compressed step without communication
(prepass, quantize-and-pack, vote, unpack-and-apply; "checked": without the pre-pass, which backward takes:
the finite check, and for l1-pbit its L1 scales too) against the plain fused Lion step, against the torch
twins on the same GPU and against lion-pytorch's Triton Lion. Targets on an H100: quantize-and-pack and
unpack-and-apply at >= 85% of copy bandwidth; the compressed step within 1.3x of the plain fused step.

On CPU (torch twins): pack_bits/unpack_bits against numpy.packbits/unpackbits in the same run (target
>= 1.0x); the codec's own encode (fp32 c -> packed votes) and decode (packed -> +-1 fp32) against the
same pipelines written with numpy; and the twins' kernels against the CPU's copy bandwidth, beside
lion-pytorch's Lion.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from lioncub import methods
from lioncub.comm import wire
from lioncub.kernels import reference
from lioncub.methods.vote_1bit import chunk_bytes

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_sizes(text: str) -> list[int]:
    out = []
    for tok in text.split(","):
        tok = tok.strip().upper()
        out.append(int(float(tok[:-1]) * UNITS[tok[-1]]) if tok[-1] in UNITS else int(tok))
        if out[-1] < 8 or out[-1] % 8:
            raise ValueError(f"sizes are element counts, multiples of 8 (the packing's bytes): got {tok}")
    return out


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return str(n)


class Timer:
    """Median milliseconds of fn: CUDA events with an L2 flush per run (triton.testing.do_bench) on a GPU,
    perf_counter over `repeat` runs after one warm-up on CPU."""

    def __init__(self, cuda: bool, repeat: int):
        self.cuda, self.repeat = cuda, repeat

    def __call__(self, fn) -> float:
        if self.cuda:
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=10, rep=max(20, 10 * self.repeat),
                                                 return_mode="median"))
        fn()
        times = []
        for _ in range(self.repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)


# --- bytes per parameter --------------------------------------------------------------------------------


def lion_traffic(elem_bytes: int) -> dict:
    """Bytes the plain fused Lion step reads and writes per parameter: p, g, m in, p, m out."""
    return {"lion_step": 5 * elem_bytes}


def step_traffic(method: str, world_size: int, elem_bytes: int, levels: int | None = None) -> dict:
    """Bytes each kernel of one step of a compressed method reads and writes per parameter, by design (large
    buckets), for parameters, gradients and momenta of `elem_bytes` bytes."""
    E, N = elem_bytes, world_size
    planes = wire.result_planes(N)
    meth = methods.get(method)
    if meth.codec.kind == "signs":
        code = 1 / 8
        return {"prepass": E, "quantize_pack": 3 * E + code, "vote": _vote_traffic(meth, N, planes),
                "unpack_apply": 2 * E + planes / 8}
    code = meth.layout(N, levels or 0).bits_per_element / 8
    prepass = 2 * E if meth.codec.l1 else E
    return {"prepass": prepass, "quantize_pack": 3 * E + code, "unpack_apply": 2 * E + code}


def _vote_traffic(meth, N: int, planes: int) -> float:
    """The vote's bytes per parameter: it reads the N rows of packed signs a rank counts (what the method's
    first collective delivers: its chunk of every rank's signs, or all of them) and writes `planes` bits per
    element counted."""
    n = 8 * N * 2**20  # whole chunks: the figures per parameter come out exact
    colls = meth.collectives(n, N)
    rows = colls[0].nbytes if colls else n // 8  # one rank counts its own row
    return rows / n + planes * rows / (N * n)


def traffic_table(world_size: int = 8) -> list[dict]:
    """Bytes per parameter of one step, fp32 and bf16, and against the plain fused Lion step's: that step
    first, then each compressed method."""
    steps = {"lion": lion_traffic} | {m: lambda E, m=m: step_traffic(m, world_size, E) for m in methods.COMPRESSED}
    rows = []
    for method, traffic in steps.items():
        row = {"method": method}
        for name, E in (("fp32", 4), ("bf16", 2)):
            total = sum(traffic(E).values())
            row[name] = total
            row[f"{name}_x_lion"] = total / (5 * E)
        rows.append(row)
    return rows


# --- the kernels of one bucket ------------------------------------------------------------------------


def _bucket(ops, n: int, dtype, device, N: int) -> SimpleNamespace:
    """One bucket's tensors (p, g, m in `dtype`, two parameter tensors), codes and codecs for N voters."""
    gen = torch.Generator().manual_seed(0)
    b = SimpleNamespace(E=torch.finfo(dtype).bits // 8, offsets=[0, n // 2, n], chunk=chunk_bytes(n, N),
                        planes=wire.result_planes(N), signs=methods.get("vote-1bit").codec)
    b.p = (torch.randn(n, generator=gen) * 0.02).to(dtype).to(device)
    b.g = torch.randn(n, generator=gen).to(dtype).to(device)
    b.m = (torch.randn(n, generator=gen) * 0.1).to(dtype).to(device)
    l1 = methods.get("l1-pbit")
    b.s = l1.resolve_levels(N)
    b.lay, b.l1 = l1.layout(N, b.s), l1.codec
    b.onebit = torch.zeros(N * b.chunk, dtype=torch.uint8, device=device)
    b.mine = torch.empty(b.planes * b.chunk, dtype=torch.uint8, device=device)
    b.fields = torch.zeros(b.lay.words(n), dtype=getattr(torch, b.lay.dtype), device=device)
    b.sign_plane = torch.randint(0, 256, (N * b.chunk,), dtype=torch.uint8, device=device)
    b.tie_plane = torch.randint(0, 256, (N * b.chunk,), dtype=torch.uint8, device=device) if b.planes == 2 else None
    b.mult = ops.prepass(b.l1, b.g, b.m, beta1=0.9, offsets=b.offsets, levels=b.s)[1]
    return b


def bucket_ops(ops, n: int, dtype, device, N: int):
    """(name, bytes moved by design, fn) for each kernel of one bucket of n elements, plus step closures."""
    b = _bucket(ops, n, dtype, device, N)
    p, g, m, offsets, signs, l1, s, lay, E = b.p, b.g, b.m, b.offsets, b.signs, b.l1, b.s, b.lay, b.E
    hp, code = dict(beta1=0.9, beta2=0.99), (b.sign_plane, b.tie_plane)

    def vote():
        ops.vote(b.onebit.view(N, b.chunk), b.mine[:b.chunk], b.mine[b.chunk:] if b.planes == 2 else None)

    def apply_deferred():  # step() after an overlapped exchange: the apply with the momentum update it deferred
        ops.unpack_apply(signs, p, code, lr=1e-4, wd=0.1, world_size=N, momentum=(g, m, 0.99))

    kernels = [
        ("lion_step", 5 * E * n, lambda: ops.lion_step(p, g, m, lr=1e-4, wd=0.1, **hp)),
        ("prepass (finite)", E * n, lambda: ops.prepass(signs, g, m, beta1=0.9, offsets=offsets)),
        ("prepass (l1 scale)", 2 * E * n, lambda: ops.prepass(l1, g, m, beta1=0.9, offsets=offsets, levels=s)),
        ("quantize_pack 1-bit", 3 * E * n + N * b.chunk, lambda: ops.quantize_pack(signs, g, m, b.onebit, **hp)),
        ("quantize_pack_checked 1-bit, deferred m", 2 * E * n + N * b.chunk,  # (the overlapped exchange's encode)
         lambda: ops.quantize_pack_checked(signs, g, m, b.onebit, update_momentum=False, **hp)),
        (f"quantize_pack l1-pbit ({lay.bits_per_element:.0f} b)", 3 * E * n + lay.nbytes(n),
         lambda: ops.quantize_pack(l1, g, m, b.fields, layout=lay, mult=b.mult, offsets=offsets, levels=s, **hp)),
        (f"vote ({N} rows)", N * b.chunk + b.planes * b.chunk, vote),
        ("unpack_apply 1-bit", 2 * E * n + b.planes * N * b.chunk,
         lambda: ops.unpack_apply(signs, p, code, lr=1e-4, wd=0.1, world_size=N)),
        ("unpack_apply 1-bit + momentum", 5 * E * n + b.planes * N * b.chunk, apply_deferred),
        (f"unpack_apply l1-pbit ({lay.bits_per_element:.0f} b)", 2 * E * n + lay.nbytes(n),
         lambda: ops.unpack_apply(l1, p, b.fields, lr=1e-4, wd=0.1, world_size=N, levels=s, layout=lay)),
    ]

    def step_1bit_checked():  # the pre-pass is the finite check, which backward took (lioncub.optim.backward)
        ops.quantize_pack(signs, g, m, b.onebit, **hp)
        vote()
        ops.unpack_apply(signs, p, code, lr=1e-4, wd=0.1, world_size=N)

    def step_1bit():
        ops.prepass(signs, g, m, beta1=0.9, offsets=offsets)
        step_1bit_checked()

    def step_l1_checked():  # the pre-pass (the check and the L1 scales) ran during backward
        ops.quantize_pack(l1, g, m, b.fields, layout=lay, mult=b.mult, offsets=offsets, levels=s, **hp)
        ops.unpack_apply(l1, p, b.fields, lr=1e-4, wd=0.1, world_size=N, levels=s, layout=lay)

    def step_l1():
        _, k = ops.prepass(l1, g, m, beta1=0.9, offsets=offsets, levels=s)
        ops.quantize_pack(l1, g, m, b.fields, layout=lay, mult=k, offsets=offsets, levels=s, **hp)
        ops.unpack_apply(l1, p, b.fields, lr=1e-4, wd=0.1, world_size=N, levels=s, layout=lay)

    def apply_deferred_l1():
        ops.unpack_apply(l1, p, b.fields, lr=1e-4, wd=0.1, world_size=N, levels=s, layout=lay, momentum=(g, m, 0.99))

    steps = {"lion": kernels[0][2], "vote-1bit": step_1bit, "vote-1bit-checked": step_1bit_checked, "l1-pbit": step_l1,
             "l1-pbit-checked": step_l1_checked, "vote-1bit-overlapped": apply_deferred,
             "l1-pbit-overlapped": apply_deferred_l1}
    return kernels, steps, (p, g, m)


def copy_gbps(timer, n_bytes: int, device) -> float:
    src = torch.ones(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def lion_pytorch_step(cuda: bool, tensors):
    """lion-pytorch's update: its Triton kernel on a GPU, its torch code on CPU (None if not installed)."""
    try:
        if cuda:
            from lion_pytorch.triton import update_fn
        else:
            from lion_pytorch.lion_pytorch import update_fn
    except ImportError:
        return None
    p, g, m = tensors
    return lambda: update_fn(p, g, m, 1e-4, 0.1, 0.9, 0.99)


# --- the runs --------------------------------------------------------------------------------------------


def bench_device(sizes, dtype, device, N, repeat) -> dict:
    cuda = device.type == "cuda"
    timer = Timer(cuda, repeat)
    ops = importlib_ops(cuda)
    # a buffer well beyond the last-level cache (50 MB L2 on an H100)
    copy = copy_gbps(timer, max(4 * max(sizes), (2**30 if cuda else 2**26)), device)
    rows, steps = [], []
    for n in sizes:
        kernels, step_fns, tensors = bucket_ops(ops, n, dtype, device, N)
        for name, nbytes, fn in kernels:
            ms = timer(fn)
            gbps = nbytes / ms / 1e6
            rows.append(dict(size=n, kernel=name, ms=ms, bytes=nbytes, gbps=gbps, of_copy=gbps / copy))
        row = dict(size=n, **{f"{k}_ms": timer(f) for k, f in step_fns.items()})
        _, twin_steps, _ = bucket_ops(reference, n, dtype, device, N)
        row.update({f"twin_{k}_ms": timer(f) for k, f in twin_steps.items()})
        other = lion_pytorch_step(cuda, tensors)
        row["lion_pytorch_ms"] = timer(other) if other else None
        steps.append(row)
        del kernels, step_fns, tensors, twin_steps
        if cuda:
            torch.cuda.empty_cache()
    return dict(copy_gbps=copy, kernels=rows, steps=steps)


def importlib_ops(cuda: bool):
    if cuda:
        from lioncub.kernels import triton_ops
        return triton_ops
    return reference


def bench_packbits(sizes, repeat) -> list[dict]:
    """The twins' pack_bits/unpack_bits against numpy's, on the same bits, in the same run (interleaved
    runs, medians: the two see the same machine load)."""
    rows = []
    for n in sizes:
        bits = torch.from_numpy(np.random.default_rng(0).integers(0, 2, n).astype(np.uint8))
        bits_np = bits.numpy()
        packed = reference.pack_bits(bits)
        packed_np = packed.numpy()
        assert np.array_equal(packed_np, np.packbits(bits_np, bitorder="little"))
        assert np.array_equal(reference.unpack_bits(packed).numpy(), bits_np)
        t = _interleaved(_packbits_fns(bits, packed), 10 * repeat)
        moved = n + n // 8
        row = dict(bits=n, pack_gbps=moved / t["pack"] / 1e6, pack_numpy_gbps=moved / t["pack_np"] / 1e6,
                   pack_x_numpy=t["pack_np"] / t["pack"], unpack_gbps=moved / t["unpack"] / 1e6,
                   unpack_numpy_gbps=moved / t["unpack_np"] / 1e6, unpack_x_numpy=t["unpack_np"] / t["unpack"])
        c = torch.randn(n, generator=torch.Generator().manual_seed(n))
        assert np.array_equal(_codec_fns(c, packed)["encode"]().numpy(), np.packbits(c.numpy() > 0, bitorder="little"))
        t = _interleaved(_codec_fns(c, packed), 10 * repeat)
        row.update(encode_x_numpy=t["encode_np"] / t["encode"], decode_x_numpy=t["decode_np"] / t["decode"],
                   encode_ms=t["encode"], decode_ms=t["decode"])
        rows.append(row)
    return rows


def _codec_fns(c: torch.Tensor, packed: torch.Tensor) -> dict:
    """What the 1-bit codec does on CPU, and the same pipeline in numpy."""
    c_np, packed_np, n = c.numpy(), packed.numpy(), c.numel()
    out = torch.empty(n // 8, dtype=torch.uint8)
    return {"encode": lambda: reference.pack_signs(c, out),
            "encode_np": lambda: np.packbits(c_np > 0, bitorder="little"),
            "decode": lambda: reference.unpack_signs(packed, n),
            "decode_np": lambda: np.unpackbits(packed_np, bitorder="little").astype(np.float32) * 2 - 1}


def _packbits_fns(bits: torch.Tensor, packed: torch.Tensor) -> dict:
    bits_np, packed_np = bits.numpy(), packed.numpy()
    return {"pack": lambda: reference.pack_bits(bits),
            "pack_np": lambda: np.packbits(bits_np, bitorder="little"),
            "unpack": lambda: reference.unpack_bits(packed),
            "unpack_np": lambda: np.unpackbits(packed_np, bitorder="little")}


def _interleaved(fns: dict, repeat: int) -> dict:
    """Median ms of each fn, run in turn in a fresh random order each round (no fn always runs right after
    another that warmed the cache for it)."""
    times = {k: [] for k in fns}
    order = list(fns)
    rng = np.random.default_rng(0)
    for f in fns.values():
        f()
    for _ in range(repeat):
        rng.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def bench(device: str = "auto", sizes=None, dtype: str = "float32", world_size: int = 8, repeat=None,
          threads=None, ptx: bool = False) -> dict:
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    if threads or not cuda:  # CPU: one thread by default, like numpy, and steady on a shared machine
        torch.set_num_threads(threads or 1)
    if sizes is None:
        sizes = [2**20 * k for k in ((1, 4, 16, 64, 256) if cuda else (1, 4, 16))]
    repeat = repeat or (10 if cuda else 5)
    res = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name() if cuda else cpu_model(),
               backend="triton" if cuda else "torch twins", dtype=dtype, world_size=world_size,
               torch=torch.__version__, numpy=np.__version__, threads=torch.get_num_threads(), sizes=sizes)
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    res.update(bench_device(sizes, getattr(torch, dtype), dev, world_size, repeat))
    if not cuda:
        res["packbits"] = bench_packbits(sizes, repeat)
    if ptx:
        res["ptx"] = _ptx_subprocess()
    res["targets"] = _targets(res, cuda)
    return res


def _ptx_subprocess():
    """Compile the Triton kernels for sm_90 in a clean process (the kernels must not be interpreted)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "lioncub.kernels.triton_ptx", "--json"],
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-2000:]}


def _targets(res, cuda) -> dict:
    t = {}
    if cuda:
        big = max(res["sizes"])
        for r in res["kernels"]:
            if r["size"] == big and r["kernel"].startswith(("quantize_pack", "unpack_apply")):
                t[f"{r['kernel']} >= 85% of copy"] = r["of_copy"] >= 0.85
        for s in res["steps"]:
            if s["size"] == big:
                for k in ("vote-1bit", "l1-pbit"):
                    t[f"{k} step <= 1.3x fused Lion"] = s[f"{k}_ms"] <= 1.3 * s["lion_ms"]
    else:
        for r in res["packbits"]:
            t[f"pack_bits {human(r['bits'])} >= 1.0x numpy"] = r["pack_x_numpy"] >= 1.0
            t[f"unpack_bits {human(r['bits'])} >= 1.0x numpy"] = r["unpack_x_numpy"] >= 1.0
            t[f"encode {human(r['bits'])} >= 1.0x numpy"] = r["encode_x_numpy"] >= 1.0
            t[f"decode {human(r['bits'])} >= 1.0x numpy"] = r["decode_x_numpy"] >= 1.0
    return t


# --- report ----------------------------------------------------------------------------------------------


def run(args) -> int:
    res = bench(args.device, args.sizes, args.dtype, args.world_size, args.repeat, args.threads, args.ptx)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(format_report(res))
    return 0


def _ms(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_report(res: dict) -> str:
    lines = [f"lioncub bench kernels, {res['date']}: {res['device']} ({res['backend']}, {res['dtype']}, "
             f"N = {res['world_size']}, torch {res['torch']}, triton {res['triton']}, {res['threads']} threads)",
             f"copy bandwidth (dst.copy_(src), same run): {res['copy_gbps']:.1f} GB/s", "",
             f"{'size':>5s}  {'kernel':40s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s}"]
    for r in res["kernels"]:
        lines.append(f"{human(r['size']):>5s}  {r['kernel']:40s} {r['ms']:9.3f} {r['gbps']:8.1f} "
                     f"{100 * r['of_copy']:7.0f}%")
    lines += ["", f"{'size':>5s}  {'step (ms)':30s} {'lion':>8s} {'vote-1bit':>10s} {'(checked)':>10s} "
              f"{'l1-pbit':>9s} {'(checked)':>10s} {'lion-pytorch':>13s}"]
    for s in res["steps"]:
        lp = "" if s["lion_pytorch_ms"] is None else f"{s['lion_pytorch_ms']:.3f}"
        # (the checked rows are absent from runs before the pre-pass moved into backward)
        checked, l1_checked = s.get("vote-1bit-checked_ms"), s.get("l1-pbit-checked_ms")
        lines.append(f"{human(s['size']):>5s}  {res['backend']:30s} {s['lion_ms']:8.3f} {s['vote-1bit_ms']:10.3f} "
                     f"{_ms(checked):>10s} {s['l1-pbit_ms']:9.3f} {_ms(l1_checked):>10s} {lp:>13s}")
        if res["backend"] != "torch twins":
            lines.append(f"{'':>5s}  {'torch twins (same device)':30s} {s['twin_lion_ms']:8.3f} "
                         f"{s['twin_vote-1bit_ms']:10.3f} {_ms(s.get('twin_vote-1bit-checked_ms')):>10s} "
                         f"{s['twin_l1-pbit_ms']:9.3f} {_ms(s.get('twin_l1-pbit-checked_ms')):>10s}")
        lines.append(f"{'':>5s}  {'x plain Lion':30s} {1:8.2f} {s['vote-1bit_ms'] / s['lion_ms']:10.2f} "
                     f"{_ms(checked and checked / s['lion_ms'], 2):>10s} {s['l1-pbit_ms'] / s['lion_ms']:9.2f} "
                     f"{_ms(l1_checked and l1_checked / s['lion_ms'], 2):>10s}")
    lines += ["", "(checked): the step when backward took the pre-pass (lioncub.optim.backward): vote-1bit's finite "
                  "check, l1-pbit's check and L1 scales; quantize, vote, apply"]
    for name in ("vote-1bit", "l1-pbit"):
        over = [s for s in res["steps"] if s.get(f"{name}-overlapped_ms")]
        if over:
            lines.append(f"{name}'s step() after an overlapped exchange (the apply with the deferred momentum update; "
                         "the rest ran during backward): " + ", ".join(
                             f"{human(s['size'])} {s[f'{name}-overlapped_ms']:.3f} ms "
                             f"({s[f'{name}-overlapped_ms'] / s['lion_ms']:.2f}x plain Lion)" for s in over))
    if "packbits" in res:
        lines += ["", f"{'bits':>5s}  {'pack GB/s':>10s} {'numpy':>8s} {'x numpy':>8s}   {'unpack GB/s':>11s} "
                      f"{'numpy':>8s} {'x numpy':>8s}"]
        for r in res["packbits"]:
            lines.append(f"{human(r['bits']):>5s}  {r['pack_gbps']:10.2f} {r['pack_numpy_gbps']:8.2f} "
                         f"{r['pack_x_numpy']:8.2f}   {r['unpack_gbps']:11.2f} {r['unpack_numpy_gbps']:8.2f} "
                         f"{r['unpack_x_numpy']:8.2f}")
        lines += ["", f"{'bits':>5s}  codec pipelines vs numpy: encode fp32 c -> packed votes "
                      "(numpy: packbits(c > 0)); decode packed -> +-1 fp32 (numpy: unpackbits, astype, *2-1)"]
        for r in res["packbits"]:
            lines.append(f"{human(r['bits']):>5s}  encode {r['encode_ms']:.3f} ms ({r['encode_x_numpy']:.2f}x numpy)"
                         f"   decode {r['decode_ms']:.3f} ms ({r['decode_x_numpy']:.2f}x numpy)")
    if "ptx" in res and isinstance(res["ptx"], list):
        lines += ["", "sm_90 compile check (ptxas, no GPU): 128-bit loads in full tiles"]
        lines += [f"  {r['name']:44s} {'yes' if r['vector_loads'] else 'no'}" for r in res["ptx"]]
    lines += ["", "targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in res["targets"].items())]
    return "\n".join(lines)
