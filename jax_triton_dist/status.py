"""What the runtime holds and what went wrong without an exception: heap use, and the
failures GPUs recorded asynchronously.
"""

from __future__ import annotations

import dataclasses

from jax_triton_dist import shmem
from jax_triton_dist.runtime import call_site, cuda_dispatch, site_uses

__all__ = ["Usage", "heap_usage", "check_errors"]


@dataclasses.dataclass(frozen=True)
class Usage:
    """The symmetric heaps' use, and the runtime's share of it."""

    heap: shmem.HeapUsage | None  # None: SHMEM is not running
    call_sites: int  # traced triton_call sites still held (executables use them)
    regions: int  # their teams' symmetric regions in the heaps

    def __str__(self) -> str:
        heap = str(self.heap) if self.heap else "SHMEM not running"
        return f"{heap}; {self.call_sites} call sites, {self.regions} regions"


def heap_usage() -> Usage:
    """The heaps' use now, after releasing the call sites of executables that are gone
    (``jax.clear_caches()`` or the last reference to a jitted function drops them).

    Example::

        jtd.heap_usage()   # Usage(heap=HeapUsage(heap_bytes=..., in_use_bytes=...), ...)
    """
    site_uses.drain()
    heap = shmem.heap_usage() if shmem.init_status() == shmem.InitStatus.INITIALIZED else None
    sites, regions = call_site.live_sites()
    return Usage(heap, sites, regions)


def check_errors() -> None:
    """Raises a failure a GPU recorded without trapping — a ``dl.wait`` that timed out ends
    its launch and records why, and the failing call site's next call raises it too; call
    this after ``block_until_ready()`` to learn of it at once, as with NCCL's asynchronous
    errors. The records are emptied; CPU failures always raise in the call itself.

    Raises:
      RuntimeError: a GPU recorded a failure.
    """
    cuda_dispatch.check_errors()
