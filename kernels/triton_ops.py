"""lioncub's Triton kernels, with the signatures and semantics of their torch twins
(`lioncub.kernels.reference`); `lioncub.kernels` dispatches here for CUDA tensors (LIONCUB_KERNELS=auto)
or always (LIONCUB_KERNELS=triton; CPU tensors then run under TRITON_INTERPRET=1).

One launch per flat bucket, one pass over memory per kernel:
  lion_step      p, g, m -> p, m                          plain fused Lion (world size 1)
  finite_flag    g -> whether all of it is finite           (read only)
  prepass        g (and m for l1-pbit) -> finite flag, L1 multipliers per tensor (read only)
  quantize_pack  g, m -> packed code, m                   c, code and momentum update in one pass
                 (quantize_pack_checked: and whether g is all finite, counted in that pass)
  vote           N packed 1-bit rows -> majority bits     bit-sliced popcount, nothing unpacked
  unpack_apply   code, p -> p                             decode U and apply decay + step in one pass
See docs/kernels.md for layouts and bytes moved per parameter.
"""

from __future__ import annotations

from .triton_apply import unpack_apply
from .triton_lion import lion_step
from .triton_prepass import finite_flag, prepass
from .triton_quantize import quantize_pack, quantize_pack_checked
from .triton_vote import vote

__all__ = ["lion_step", "finite_flag", "prepass", "quantize_pack", "quantize_pack_checked", "vote", "unpack_apply"]
