"""NVSHMEM device calls, for kernels on the ``nvshmem`` backend (``dl.nvshmem``).

Where a peer's heap is mapped into this process (the same node), ``dl.symm_at`` and the
``dl`` SHMEM calls built on it reach it with plain loads and stores. These calls go
through NVSHMEM's device library instead (linked from ``libnvshmem_device.bc``), which
also reaches PEs NVSHMEM connects by other transports. They compile only for the
``nvshmem`` backend; elsewhere (CPU, the ``cuda`` backend) they raise an error naming
the ``dl`` call to use instead.

Sizes are in elements of ``dest``'s type; ``pe`` is a rank of the kernel's mesh axis
(translated to its NVSHMEM PE). The ``*_block`` calls are collective over the program's
threads: every thread of the program must reach them (Triton's scalar code runs in every
thread; a condition on program ids or loaded values is uniform across a program).
``dest`` and ``sig_addr`` are symmetric addresses of this rank (workspaces, symmetric
arguments); ``source`` is any local device address.
"""

from __future__ import annotations

from jax_triton_dist.language import compiled as _compiled
from jax_triton_dist.language.primitives import SIG_OPS, _primitive

__all__ = ["putmem_nbi_block", "putmem_signal_nbi_block", "getmem_block", "signal_op",
           "quiet", "fence", "my_pe", "n_pes"]


def _cpu(*args, **kwargs):
    raise NotImplementedError(
        "dl.nvshmem calls are NVSHMEM device functions: they run only in kernels compiled "
        "for the nvshmem SHMEM backend (GPUs, one process per GPU); in the interpreter use "
        "dl.putmem / dl.getmem / dl.putmem_signal / dl.signal_op")


@_primitive(_cpu)
def putmem_nbi_block(dest, source, nelems, pe, _semantic=None, _generator=None):
    """Starts copying ``nelems`` elements from ``source`` to symmetric ``dest`` on ``pe``
    (complete after :func:`quiet`)."""
    return _compiled.nvshmem_put(dest, source, nelems, pe, None, 0, "set", _semantic)


@_primitive(_cpu, choices={"sig_op": SIG_OPS}, name="nvshmem.putmem_signal_nbi_block")
def putmem_signal_nbi_block(dest, source, nelems, sig_addr, signal, sig_op, pe,
                            _semantic=None, _generator=None):
    """:func:`putmem_nbi_block`, then sets (``sig_op="set"``) or adds to (``"add"``) the
    uint64 signal ``sig_addr`` on ``pe`` once the data has landed."""
    return _compiled.nvshmem_put(dest, source, nelems, pe, sig_addr, signal, sig_op,
                                 _semantic)


@_primitive(_cpu)
def getmem_block(dest, source, nelems, pe, _semantic=None, _generator=None):
    """Copies ``nelems`` elements from symmetric ``source`` on ``pe`` to local ``dest``."""
    return _compiled.nvshmem_get(dest, source, nelems, pe, _semantic)


@_primitive(_cpu, choices={"sig_op": SIG_OPS}, name="nvshmem.signal_op")
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None, _generator=None):
    """Sets or adds to the uint64 signal ``sig_addr`` on ``pe`` (one thread does it)."""
    return _compiled.nvshmem_signal_op(sig_addr, signal, sig_op, pe, _semantic)


@_primitive(_cpu)
def quiet(_semantic=None, _generator=None):
    """Completes this thread's outstanding NVSHMEM operations."""
    return _compiled.nvshmem_simple("quiet", _semantic)


@_primitive(_cpu)
def fence(_semantic=None, _generator=None):
    """Orders this thread's NVSHMEM operations to each PE."""
    return _compiled.nvshmem_simple("fence", _semantic)


@_primitive(_cpu)
def my_pe(_semantic=None, _generator=None):
    """This process's NVSHMEM PE (not the kernel's rank: see ``dl.rank``)."""
    return _compiled.nvshmem_simple("my_pe", _semantic)


@_primitive(_cpu)
def n_pes(_semantic=None, _generator=None):
    """Number of NVSHMEM PEs of the job."""
    return _compiled.nvshmem_simple("n_pes", _semantic)
