"""Patches for older Triton interpreters (TRITON_INTERPRET=1, the CPU tests), applied when this module is
imported (lioncub.kernels.triton_common imports it). It defines no kernels or device functions, so it can be
imported in any order relative to TRITON_INTERPRET."""

from __future__ import annotations

import numpy as np
import triton.language as tl


def fma_fp32_exact(x, y, z):
    """fp32 fma(x, y, z) in numpy, rounded once: the product of two fp32 values is exact in fp64; the fp64
    sum is made round-to-odd (TwoSum error, then the odd neighbour), and round-to-odd in 53 bits followed
    by round-to-nearest-even into 24 bits is the correctly rounded result."""
    x, y, z = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in (x, y, z)))
    with np.errstate(all="ignore"):  # inf - inf in the error term of a non-finite sum (not used then)
        p = x * y
        s = p + z
        bb = s - p
        err = (p - (s - bb)) + (z - bb)
        fix = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def _interpreter_compat() -> list[str]:
    """Patch the Triton interpreter (TRITON_INTERPRET=1) so that the kernels run under it, bit-identical to
    their twins and at the speed of the tests, with any supported Triton. Compiled kernels are untouched
    (the patches replace functions of triton.runtime.interpreter only); each is applied only when a probe
    shows it is needed:

    * `tl.fma` evaluated as x*y + z with two roundings (triton 3.6; fixed by 3.9). The kernels' fmas must
      round once, as on a GPU and in torch's kernels, or a value at a rounding boundary differs from the twin.
    * a runtime scalar used as a Python int (`range(N)` over a kernel argument or a loaded value) calls
      int() on a 1-element array, which NumPy >= 2.4 refuses (triton 3.6; fixed by 3.9).
    * `tl.reduce` with a combine function of our own (`runs_as_sum`) loops over the elements in Python; the
      interpreter runs only Triton's own (private) sum combine as np.sum. Marked sums run as np.sum too.
    Returns the names of the patches applied."""
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # noqa: BLE001 - no interpreter in this Triton: nothing to patch
        return []
    patches = (("fma", _patch_fma), ("index", _patch_index), ("sum", _patch_sum))
    return [name for name, patch in patches if patch(interp)]


def _patch_fma(interp) -> bool:
    """An fp32 `tl.fma` rounded once (fma_fp32_exact) where the interpreter rounds twice."""
    builder_cls = getattr(interp, "InterpreterBuilder", None)
    handle = getattr(interp, "TensorHandle", None)
    if builder_cls is None or handle is None or not hasattr(builder_cls, "create_fma"):
        return False
    one = np.array([1 + 2.0**-12], dtype=np.float32)
    try:
        got = builder_cls.create_fma(None, handle(one, tl.float32), handle(one, tl.float32),
                                     handle(-np.ones(1, np.float32), tl.float32)).data
        unfused = float(got[0]) != 2.0**-11 + 2.0**-24
    except Exception:  # noqa: BLE001 - a builder that needs its instance: leave it alone
        unfused = False
    if not unfused:
        return False
    original = builder_cls.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return original(self, x, y, z)
        return handle(fma_fp32_exact(x.data, y.data, z.data), z.dtype.scalar)

    builder_cls.create_fma = create_fma
    return True


def _patch_index(interp) -> bool:
    """`__index__` of an interpreted tensor that reads its one element, where int() of the array fails.

    The one use of a Triton private in lioncub.kernels: the interpreter patches `tl.tensor` per call with
    `_patch_lang_tensor`, and there is no public hook to change what it installs. Only the interpreter is
    touched, only when the probe shows the bug, and any other layout of the interpreter is left alone."""
    patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    handle = getattr(interp, "TensorHandle", None)
    if patch_tensor is None or scope_cls is None or handle is None:
        return False

    class Probe:
        pass

    scope = scope_cls()
    try:
        patch_tensor(Probe, scope)
        probe = Probe()
        probe.handle = handle(np.array([3], dtype=np.int32), tl.int32)
        broken = False
        try:
            broken = Probe.__index__(probe) != 3
        except TypeError:
            broken = True
    except Exception:  # noqa: BLE001 - another interpreter layout: leave it alone
        broken = False
    finally:
        scope.restore()
    if not broken:
        return False

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    return True


SUM_MARK = "lioncub_runs_as_sum"


def runs_as_sum(combine):
    """Mark a @triton.jit combine function (a, b) -> a + b so that the interpreter runs `tl.reduce` with it
    as np.sum, as it runs tl.sum (see _patch_sum). Returns it."""
    setattr(combine.fn, SUM_MARK, True)
    return combine


def _patch_sum(interp) -> bool:
    """tl.reduce with a combine function marked by `runs_as_sum`: one np.sum over the axis (the interpreter's
    reduce of tl.sum) instead of a Python loop over the elements, which made the interpreted tests 9x slower.
    Integer sums are exact either way; fp64 sums keep the interpreter's np.sum order."""
    ops = getattr(interp, "ReduceOps", None)
    if ops is None or not hasattr(ops, "apply_impl") or not hasattr(ops, "sum"):
        return False
    if getattr(ops.apply_impl, SUM_MARK, False):  # patched already (this module imported afresh)
        return False
    original = ops.apply_impl

    def apply_impl(self, input):
        if getattr(getattr(self.combine_fn, "fn", None), SUM_MARK, False):
            return self.sum(input[0])
        return original(self, input)

    setattr(apply_impl, SUM_MARK, True)
    ops.apply_impl = apply_impl
    return True


INTERPRETER_PATCHES = _interpreter_compat()
