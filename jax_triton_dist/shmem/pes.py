"""PE binding: which processing element the calling thread acts as.

In-process backends (``host``, ``cuda``) run a PE per thread: a thread acts as PE ``p``
inside ``with shmem.as_pe(p):`` (the runtime binds each JAX device's thread while it runs
a kernel). Under ``nvshmem`` every thread of the process is the process's PE.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.lifetime import check_pe, require_init

__all__ = ["bind_pe", "unbind_pe", "as_pe", "my_pe", "n_pes"]

_bound = threading.local()


def bind_pe(pe: int) -> None:
    """Makes the calling thread act as PE ``pe`` (see :func:`as_pe`)."""
    require_init()
    check_pe(pe)
    _bound.pe = int(pe)


def unbind_pe() -> None:
    """Releases the calling thread's PE binding."""
    _bound.pe = None


@contextlib.contextmanager
def as_pe(pe: int) -> Iterator[int]:
    """Context manager: the calling thread acts as PE ``pe`` inside the block."""
    previous = getattr(_bound, "pe", None)
    bind_pe(pe)
    try:
        yield int(pe)
    finally:
        _bound.pe = previous


def my_pe() -> int:
    """The calling thread's PE (under ``nvshmem``, unbound threads are this process's PE).

    Raises:
      ShmemError: SHMEM is not initialised, or the thread is bound to no PE.
    """
    require_init()
    pe = getattr(_bound, "pe", None)
    if pe is None:
        pe = _lib.process_pe()
    if pe < 0:
        raise _lib.ShmemError(
            "this thread is not bound to a PE: wrap the code in `with shmem.as_pe(pe):` "
            "(the runtime binds each JAX device's thread while its kernel runs)")
    return pe


def n_pes() -> int:
    """Number of PEs."""
    require_init()
    return _lib.n_pes()
