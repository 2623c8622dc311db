"""lioncub.kernels: the codecs of the compressed Lion step, as Triton kernels and plain-torch twins.

Dispatch is chosen by `LIONCUB_KERNELS`:
  auto   (default) Triton on CUDA tensors, the torch twins on CPU tensors;
  torch  the torch twins everywhere;
  triton Triton everywhere; CPU tensors then need TRITON_INTERPRET=1 (there is no silent fallback).
"""

from __future__ import annotations

import importlib
import os

from . import reference

MODES = ("auto", "torch", "triton")
OPS = ("lion_step", "prepass", "quantize_pack", "quantize_pack_checked", "vote", "unpack_apply")


def mode() -> str:
    value = os.environ.get("LIONCUB_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"LIONCUB_KERNELS={value!r}: choose one of {', '.join(MODES)}")
    return value


def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def backend_for(tensor) -> str:
    """'triton' or 'torch' for an op on this tensor under the current LIONCUB_KERNELS."""
    m = mode()
    if m == "torch":
        return "torch"
    if m == "triton":
        if not _triton_available():
            raise RuntimeError("LIONCUB_KERNELS=triton but triton is not installed")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "LIONCUB_KERNELS=triton on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "(slow; meant for tests), or use LIONCUB_KERNELS=auto|torch"
            )
        return "triton"
    return "triton" if tensor.is_cuda and _triton_available() else "torch"


def implementation(tensor):
    """The module that implements the ops for this tensor."""
    if backend_for(tensor) == "torch":
        return reference
    return importlib.import_module("lioncub.kernels.triton_ops")


def all_finite(tensors) -> bool:
    """Whether every element of every tensor in the sequence is finite: one read pass each and one host
    sync in all (a sync per bucket stalls the GPU's queue; the same code on CPU and GPU)."""
    return reference.all_finite(tensors)


def finite_flag(t):
    """Whether every element of t is finite: a 0-dim bool tensor on its device, one read, no host sync."""
    return implementation(t).finite_flag(t)


def nonfinite_flag(flags):
    """1 (a 0-dim int32 tensor on their device) where one of the 0-dim `flags` (finite_flag's) is false, read
    by lion_step(skip=...) on the device: the step decides without a host sync."""
    return reference.nonfinite_flag(flags)


def lion_step(p, g, m, **kw):
    return implementation(p).lion_step(p, g, m, **kw)


def prepass(codec, g, m, **kw):
    return implementation(g).prepass(codec, g, m, **kw)


def quantize_pack(codec, g, m, out, **kw):
    return implementation(g).quantize_pack(codec, g, m, out, **kw)


def quantize_pack_checked(codec, g, m, out, **kw):
    """quantize_pack, returning whether every element of g is finite (finite_flag's answer, no read of its own)."""
    return implementation(g).quantize_pack_checked(codec, g, m, out, **kw)


def vote(rows, out_sign, out_nonzero=None):
    return implementation(rows).vote(rows, out_sign, out_nonzero)


def unpack_apply(codec, p, code, **kw):
    return implementation(p).unpack_apply(codec, p, code, **kw)
