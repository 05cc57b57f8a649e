"""Negative controls of the Ascend check: kernels whose synchronisation the compiler is
known to delete. The check must fail each of them; if it passes one, it cannot see the
deletion it exists to catch.

* ``lost_exchange`` announces with ``tl.atomic_xchg`` and ignores the old value: the TTIR
  has the flag write, the HIVM IR does not.
* ``side_effect_free_wait`` is a ring kernel lowered with the ``aclshmem`` mapping whose
  wait calls are marked ``no_side_effect`` (as Triton-distributed's Ascend port marks
  ``aclshmem_wait``); its wait's result is unused, so the compiler deletes the wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from jax_triton_dist.ascend.catalog import Case, Expected

__all__ = ["CONTROLS", "lost_exchange_kernel"]


@triton.jit
def lost_exchange_kernel(flag_ptr, value):
    """Raises a flag with an exchange whose old value nobody reads."""
    tl.atomic_xchg(flag_ptr, value)


CONTROLS = {
    # name: (case, mapping, lowering options)
    "lost_exchange": (Case("lost_exchange", f"{__name__}:lost_exchange_kernel",
                           {"flag_ptr": "i32"}, {"value": 1}, {},
                           Expected(notifies=1, waits=0, barriers=0)), "args", {}),
    "side_effect_free_wait": (Case("side_effect_free_wait",
                                   "jax_triton_dist.kernels.ring_exchange:ring_shift_kernel",
                                   {"x_ptr": "fp32", "out_ptr": "fp32", "buf_ptr": "fp32",
                                    "flag_ptr": "i32"}, {"n": 4096}, {"BLOCK": 1024},
                                   Expected(notifies=1, waits=1)),
                              "aclshmem", {"side_effect_free_waits": True}),
}
"""Each control with the mapping and lowering options it is lowered with (2 ranks)."""
