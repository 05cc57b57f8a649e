"""The distributed kernel language, imported as ``dl``::

    import triton
    import triton.language as tl
    import jax_triton_dist.language as dl

    @triton.jit
    def ring_kernel(x_ptr, out_ptr, buf_ptr, flag_ptr, n, BLOCK: tl.constexpr):
        me, world = dl.rank(), dl.num_ranks()
        ...

Primitives (``rank``, ``num_ranks``, ``epoch``, ``symm_at``, ``wait``, ``notify``,
``consume_token``, ``fence``, ``extern_call``) hide the backend; the device SHMEM
calls (``putmem``, ``getmem``, ``putmem_signal``, ``signal_op``, ``signal_wait_until``,
``barrier_all``, ``quiet``, ``my_pe``, ``n_pes``, ``ptr``) are ``@triton.jit`` functions
built on them. ``dl.nvshmem`` holds NVSHMEM's own device calls (the ``nvshmem`` backend
only). Kernels using them are launched with ``jax_triton_dist.triton_call``.
"""

from jax_triton_dist.language import nvshmem
from jax_triton_dist.language.primitives import (
    barrier_area,
    consume_token,
    epoch,
    extern_call,
    fence,
    notify,
    num_ranks,
    rank,
    register_interpreter_extern,
    symm_at,
    wait,
)
from jax_triton_dist.language.shmem_device import (
    barrier_all,
    getmem,
    my_pe,
    n_pes,
    ptr,
    putmem,
    putmem_signal,
    quiet,
    signal_op,
    signal_wait_until,
)

__all__ = [
    "rank", "num_ranks", "epoch", "symm_at", "wait", "notify", "consume_token", "fence",
    "barrier_area", "extern_call", "register_interpreter_extern",
    "my_pe", "n_pes", "ptr", "putmem", "getmem", "putmem_signal", "signal_op",
    "signal_wait_until", "barrier_all", "quiet", "nvshmem",
]
