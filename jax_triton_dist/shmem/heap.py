"""The SHMEM services the runtime uses: non-collective regions in every PE's heap, heap
addresses, and copies issued on behalf of a PE.

The runtime (call sites, the CPU and CUDA dispatchers, ``one_gpu``, the benchmarks)
goes through this module, never through the ``_shmem`` extension. Unlike
:func:`shmem.malloc`, a :func:`reserve` is made by one thread for a whole team (every rank
of a call site joins first), so it needs no rendezvous.
"""

from __future__ import annotations

import dataclasses

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.lifetime import require_init
from jax_triton_dist.shmem.settings import ALIGNMENT, HEAP_SIZE_ENV

__all__ = ["HeapUsage", "running_backend", "process_pe", "heap_base", "heap_size", "usage",
           "reserve", "release", "copy", "memset", "init_nvshmem_module"]



def running_backend() -> str | None:
    """Name of the running backend, or None before :func:`shmem.init`."""
    return _lib.backend_name() if _lib.initialized() else None


def process_pe() -> int:
    """This process's PE when each process holds one (``nvshmem``), else -1."""
    require_init()
    return _lib.process_pe()


def heap_base(pe: int) -> int:
    """Base address of PE ``pe``'s heap as this process reaches it (0: not reachable)."""
    return _lib.heap_base(int(pe))


def heap_size() -> int:
    """Bytes per heap."""
    return _lib.heap_size()


@dataclasses.dataclass(frozen=True)
class HeapUsage:
    """How much of each PE's heap is allocated (the same in every heap)."""

    heap_bytes: int
    in_use_bytes: int
    largest_free_block: int
    allocations: int  # live allocations: shmem.malloc blocks and call-site regions

    def __str__(self) -> str:
        return (f"heap {self.heap_bytes} bytes, {self.in_use_bytes} in use in "
                f"{self.allocations} allocations, largest free block {self.largest_free_block}")


def usage() -> HeapUsage:
    """Current use of the heaps (the same in every heap: allocations are symmetric).

    Raises:
      ShmemError: SHMEM is not initialised.
    """
    require_init()
    return HeapUsage(_lib.heap_size(), _lib.allocated_bytes(), _lib.largest_free_block(),
                     _lib.allocation_count())


def reserve(nbytes: int, what: str) -> int:
    """Reserves ``nbytes`` at one offset of every heap (aligned to ``ALIGNMENT``).

    Returns:
      The offset.

    Raises:
      ShmemError: the heap has no room; the message says ``what`` needed it.
    """
    require_init()
    try:
        return _lib.alloc(int(nbytes), ALIGNMENT)
    except _lib.ShmemError:
        raise _lib.ShmemError(
            f"{what}: symmetric heap exhausted: it needs {nbytes} bytes per rank ({usage()}); "
            f"raise {HEAP_SIZE_ENV}") from None


def release(offset: int) -> int:
    """Releases an offset from :func:`reserve`; returns its size (0 if unknown)."""
    return _lib.release(int(offset))


def copy(pe: int, dst: int, src: int, nbytes: int, blocking: bool = True) -> None:
    """Copies ``nbytes`` from ``src`` to ``dst`` (any heap or local memory) as PE ``pe``."""
    _lib.copy(int(pe), int(dst), int(src), int(nbytes), blocking)


def memset(pe: int, addr: int, byte: int, nbytes: int) -> None:
    """Fills ``nbytes`` at ``addr`` with ``byte``, as PE ``pe``."""
    _lib.memset(int(pe), int(addr), int(byte), int(nbytes))


def init_nvshmem_module(module: int) -> None:
    """Binds a loaded kernel module that holds NVSHMEM device code to the running
    ``nvshmem`` instance (``nvshmemx_cumodule_init``).

    Raises:
      ShmemError: SHMEM does not run the ``nvshmem`` backend.
    """
    _lib.nvshmem_cumodule_init(int(module))
