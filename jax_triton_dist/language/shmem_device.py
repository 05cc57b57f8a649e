"""Device SHMEM calls (ACLSHMEM / NVSHMEM names) as ``@triton.jit`` functions.

All are written in Triton on top of the primitives (``symm_at``, ``notify``,
``wait``, ``fence``), so they run on every backend the primitives support.
Sizes are in elements of the pointers' type; ``pe`` is a rank of the kernel's
mesh axis.
"""

import triton
import triton.language as tl

from jax_triton_dist.language.primitives import (
    barrier_area,
    consume_token,
    fence,
    notify,
    num_ranks,
    rank,
    symm_at,
    wait,
)

__all__ = [
    "my_pe", "n_pes", "ptr", "putmem", "getmem", "putmem_signal", "signal_op",
    "signal_wait_until", "barrier_all", "quiet", "fence",
]


@triton.jit
def my_pe():
    """This rank (the kernel's position along its mesh axis)."""
    return rank()


@triton.jit
def n_pes():
    """Number of ranks along the kernel's mesh axis."""
    return num_ranks()


@triton.jit
def ptr(addr, pe):
    """Address of symmetric ``addr`` on rank ``pe``."""
    return symm_at(addr, pe)


@triton.jit
def _copy(dest, source, nelems, BLOCK: tl.constexpr):
    """Copies ``nelems`` elements, ``BLOCK`` at a time."""
    for start in range(0, nelems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < nelems
        tl.store(dest + offs, tl.load(source + offs, mask=mask), mask=mask)


@triton.jit
def putmem(dest, source, nelems, pe, BLOCK: tl.constexpr = 1024):
    """Copies ``nelems`` elements from local ``source`` to symmetric ``dest`` on ``pe``."""
    _copy(symm_at(dest, pe), source, nelems, BLOCK)


@triton.jit
def getmem(dest, source, nelems, pe, BLOCK: tl.constexpr = 1024):
    """Copies ``nelems`` elements from symmetric ``source`` on ``pe`` to local ``dest``."""
    _copy(dest, symm_at(source, pe), nelems, BLOCK)


@triton.jit
def signal_op(sig_addr, signal, sig_op: tl.constexpr, pe):
    """Sets (``"set"``) or adds (``"add"``) ``signal`` to the signal ``sig_addr`` on ``pe``."""
    notify(sig_addr, pe, signal, sig_op, "sys")


@triton.jit
def putmem_signal(dest, source, nelems, sig_addr, signal, sig_op: tl.constexpr, pe,
                  BLOCK: tl.constexpr = 1024):
    """:func:`putmem`, then a release update of ``sig_addr`` on ``pe`` after the data."""
    putmem(dest, source, nelems, pe, BLOCK)
    fence("sys")
    notify(sig_addr, pe, signal, sig_op, "sys")


@triton.jit
def signal_wait_until(sig_addr, cmp: tl.constexpr, cmp_value):
    """Waits until the local signal satisfies ``cmp`` (``"eq"``, ``"ge"``, ...); returns it."""
    token = wait(sig_addr, 1, "sys", "acquire", cmp_value, cmp)
    return tl.atomic_add(consume_token(sig_addr, token), 0, sem="acquire", scope="sys")


@triton.jit
def quiet():
    """Completes this program's outstanding puts (stores are complete at a fence)."""
    fence("sys")


@triton.jit
def barrier_all():
    """Waits until every rank of the axis has reached a ``barrier_all``.

    Reset-free: rank ``r`` adds one to counter ``r`` on every rank, then waits until
    every counter of its own heap has reached its own count. Call it from one program
    of the launch (other programs of the same launch are not synchronised by it).
    """
    area = barrier_area()
    me = rank()
    for peer in range(0, num_ranks()):
        notify(area + me, peer, 1, "add", "sys")
    arrived = tl.atomic_add(area + me, 0, sem="acquire", scope="sys")
    wait(area, num_ranks(), "sys", "acquire", arrived, "ge")
