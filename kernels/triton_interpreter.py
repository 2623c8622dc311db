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
    """Patch two bugs of older Triton interpreters (triton 3.6; fixed by 3.9), so that the kernels run under
    TRITON_INTERPRET=1 with any supported Triton. Compiled kernels are untouched (the patches replace
    functions of triton.runtime.interpreter only); each is applied only when a probe shows the bug:

    * `tl.fma` evaluated as x*y + z with two roundings. The kernels' fmas must round once, as on a GPU and
      in torch's kernels, or a value at a rounding boundary differs from the twin.
    * a runtime scalar used as a Python int (`range(N)` over a kernel argument or a loaded value) calls
      int() on a 1-element array, which NumPy >= 2.4 refuses.
    Returns the names of the patches applied."""
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # noqa: BLE001 - no interpreter in this Triton: nothing to patch
        return []
    applied = []
    builder_cls = getattr(interp, "InterpreterBuilder", None)
    handle = getattr(interp, "TensorHandle", None)
    if builder_cls is not None and handle is not None and hasattr(builder_cls, "create_fma"):
        one = np.array([1 + 2.0**-12], dtype=np.float32)
        try:
            got = builder_cls.create_fma(None, handle(one, tl.float32), handle(one, tl.float32),
                                         handle(-np.ones(1, np.float32), tl.float32)).data
            unfused = float(got[0]) != 2.0**-11 + 2.0**-24
        except Exception:  # noqa: BLE001 - a builder that needs its instance: leave it alone
            unfused = False
        if unfused:
            original = builder_cls.create_fma

            def create_fma(self, x, y, z):
                if z.data.dtype != np.float32:
                    return original(self, x, y, z)
                return handle(fma_fp32_exact(x.data, y.data, z.data), z.dtype.scalar)

            builder_cls.create_fma = create_fma
            applied.append("fma")
    patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if patch_tensor is not None and scope_cls is not None and handle is not None:
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
        if broken:
            def patched(tensor, scope):
                patch_tensor(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

            interp._patch_lang_tensor = patched
            applied.append("index")
    return applied


INTERPRETER_PATCHES = _interpreter_compat()
