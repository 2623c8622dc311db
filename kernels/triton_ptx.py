"""Compile the Triton kernels ahead of time for an NVIDIA target, on any machine (no GPU needed: Triton
ships ptxas), and report each kernel's global memory instructions.

This is the check available where no GPU is: the GPU code path (which the interpreter does not run)
compiles for sm_90, and full tiles use 128-bit vector accesses (ld/st.global.v4 of 32-bit lanes).
Run it in a process without TRITON_INTERPRET=1 (the kernels must be JIT functions, not interpreted ones):

    python -m lioncub.kernels.triton_ptx [--arch 90] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import time

POINTER_ARGS = ("_ptr",)
INT_ARGS = {"n", "nbytes", "W", "N", "half", "B", "nb", "parity", "world", "offset"}


def _kernels():
    from . import triton_apply, triton_lion, triton_prepass, triton_quantize, triton_vote

    f32 = {"p": "*fp32", "g": "*fp32", "m": "*fp32"}
    bf16 = {"p": "*bf16", "g": "*bf16", "m": "*bf16"}
    gm32 = {"g": "*fp32", "m": "*fp32"}
    emu = {"EMU": False}
    return [
        # name, kernel, pointer types (by prefix before _ptr), constexprs, warps
        ("lion fp32", triton_lion.lion_kernel, {**f32, "skip": "*i32"}, {"BLOCK": 2048, **emu}, 8),
        ("lion bf16", triton_lion.lion_kernel, {**bf16, "skip": "*i32"}, {"BLOCK": 2048, **emu}, 8),
        ("prepass finite fp32", triton_prepass.finite_kernel, {"g": "*fp32", "bad": "*i32"}, {"BLOCK": 4096}, 8),
        ("prepass l1 sums fp32", triton_prepass.l1_sum_kernel,
         {**f32, "tile": "*i32", "lo": "*i32", "hi": "*i32", "part": "*fp64"}, {"BLOCK": 4096}, 8),
        ("prepass l1 combine", triton_prepass.combine_kernel, {"part": "*fp64", "first": "*i32", "sums": "*fp64"},
         {"CHUNK": 256}, 4),
        ("quantize 1-bit fp32", triton_quantize.onebit_kernel, {**f32, "out": "*u8", "bad": "*u8"},
         {"BYTES": 256, "UPDATE_M": True, "CHECK": False, **emu}, 8),
        ("quantize 1-bit bf16 (momentum deferred, checked)", triton_quantize.onebit_kernel,
         {**bf16, "out": "*u8", "bad": "*i32"}, {"BYTES": 256, "UPDATE_M": False, "CHECK": True, **emu}, 8),
        ("quantize l1-pbit fp32 (u8, 1 field)", triton_quantize.fields_kernel,
         {**f32, "out": "*u8", "mult": "*fp32", "off": "*i32", "seg": "*i32", "bad": "*u8"},
         {"CODEC": 3, "WIDTH": 8, "FIELDS": 1, "WIDE": False, "BW": 2048, "NSTEPS": 6, "UPDATE_M": True,
          "CHECK": False, **emu}, 8),
        ("quantize vote-pbit fp32 (i64, 21 fields, checked)", triton_quantize.fields_kernel,
         {**f32, "out": "*i64", "mult": "*u8", "off": "*u8", "seg": "*u8", "bad": "*i32"},
         {"CODEC": 1, "WIDTH": 3, "FIELDS": 21, "WIDE": True, "BW": 64, "NSTEPS": 1, "UPDATE_M": False,
          "CHECK": True, **emu}, 8),
        ("apply 1-bit fp32 (+tie plane)", triton_apply.onebit_kernel, {"p": "*fp32", "s": "*u8", "z": "*u8", **gm32},
         {"HAS_Z": True, "HAS_M": False, "BYTES": 256, **emu}, 8),
        ("apply 1-bit fp32 (+tie plane, +momentum)", triton_apply.onebit_kernel,
         {"p": "*fp32", "s": "*u8", "z": "*u8", **gm32}, {"HAS_Z": True, "HAS_M": True, "BYTES": 256, **emu}, 8),
        ("apply 1-bit bf16 (+momentum)", triton_apply.onebit_kernel, {"p": "*bf16", "s": "*u8", "z": "*u8",
                                                                          "g": "*bf16", "m": "*bf16"},
         {"HAS_Z": False, "HAS_M": True, "BYTES": 256, **emu}, 8),
        ("apply l1-pbit fp32 (u8, 1 field, +momentum)", triton_apply.fields_kernel,
         {"p": "*fp32", "code": "*u8", **gm32},
         {"CODEC": 3, "WIDTH": 8, "FIELDS": 1, "WIDE": False, "HAS_M": True, "BW": 2048, **emu}, 8),
        ("apply avg-pbit fp32 (u8, 2 fields)", triton_apply.fields_kernel, {"p": "*fp32", "code": "*u8", **gm32},
         {"CODEC": 2, "WIDTH": 4, "FIELDS": 2, "WIDE": False, "HAS_M": False, "BW": 1024, **emu}, 8),
        ("vote 8 rows (int32 words)", triton_vote.vote_kernel, {"rows": "*i32", "sign": "*i32", "nz": "*i32"},
         {"HAS_NZ": True, "NPL": 4, "BW": 1024}, 4),
        # integer arguments equal to 1 are specialised to constants by the JIT: those variants compile too
        ("edge: vote 1 row (N = 1)", triton_vote.vote_kernel, {"rows": "*u8", "sign": "*u8", "nz": "*u8"},
         {"N": 1, "HAS_NZ": True, "NPL": 1, "BW": 1024}, 4),
        ("edge: vote 2 rows (half = 1)", triton_vote.vote_kernel, {"rows": "*i32", "sign": "*i32", "nz": "*i32"},
         {"half": 1, "B": 1, "HAS_NZ": False, "NPL": 2, "BW": 1024}, 4),
        ("edge: quantize 1-bit (n = 1, parity = 1)", triton_quantize.onebit_kernel,
         {**bf16, "out": "*u8", "bad": "*u8"},
         {"n": 1, "nbytes": 1, "parity": 1, "BYTES": 256, "UPDATE_M": True, "CHECK": False, **emu}, 8),
        ("edge: apply avg-pbit (N = 1, W = 1)", triton_apply.fields_kernel,
         {"p": "*fp16", "code": "*i64", "g": "*fp16", "m": "*fp16"},
         {"world": 1, "offset": 1, "W": 1, "CODEC": 2, "WIDTH": 2, "FIELDS": 31, "WIDE": True, "HAS_M": False, "BW": 64,
          **emu}, 8),
    ]


def _signature(fn, pointers, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith(POINTER_ARGS):
            sig[name] = pointers[name[: -len("_ptr")]]
        else:
            sig[name] = "i32" if name in INT_ARGS else "fp32"
    return sig


def compile_all(arch: int = 90, only: list[str] | None = None) -> list[dict]:
    """Compile each kernel variant for sm_<arch>; 16-byte aligned pointers, as a bucket's first tensor."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    results = []
    for name, fn, pointers, constexprs, warps in _kernels():
        if only and not any(o in name for o in only):
            continue
        sig = _signature(fn, pointers, constexprs)
        attrs = {(i,): backend.parse_attr("D") for i, a in enumerate(fn.arg_names) if sig[a].startswith("*")}
        t0 = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=target,
                                options={"num_warps": warps, "enable_fp_fusion": False})
        ptx = kernel.asm["ptx"]
        ops = sorted(set(re.findall(r"\b((?:ld|st)\.global[.\w]*)", ptx)))
        results.append(dict(name=name, seconds=round(time.perf_counter() - t0, 2), global_ops=ops,
                            **_resources(kernel.asm.get("cubin")),
                            vector_loads=any(o.startswith("ld.global") and ".v4." in o for o in ops),
                            vector_stores=any(o.startswith("st.global") and (".v4." in o or ".v2." in o)
                                              for o in ops),
                            fma=ptx.count("fma.rn.f32"), ptx_lines=ptx.count("\n")))
    return results


def _resources(cubin) -> dict:
    """Registers per thread and stack (spill) bytes of the cubin, from the cuobjdump Triton ships."""
    import os
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return dict(registers=None, stack_bytes=None)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return dict(registers=int(regs.group(1)) if regs else None, stack_bytes=int(stack.group(1)) if stack else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="SM version (90 = H100)")
    ap.add_argument("--only", nargs="*", help="substrings of the variant names to compile")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = compile_all(args.arch, args.only)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for r in res:
            print(f"{r['name']:<44} {r['seconds']:5.1f}s  regs {r['registers']}, stack {r['stack_bytes']}  "
                  f"v4 loads {'yes' if r['vector_loads'] else 'no ':<3}  {' '.join(r['global_ops'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
