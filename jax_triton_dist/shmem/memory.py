"""Symmetric memory: collective allocation in every PE's heap, and addresses.

Each PE's heap is a separate allocation of the same size, and a symmetric allocation is
the same offset in every heap. Addresses are plain integers in the calling PE's heap
(host addresses on ``host``, GPU virtual addresses on ``cuda``/``nvshmem``).
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.lifetime import check_pe
from jax_triton_dist.shmem.pes import my_pe
from jax_triton_dist.shmem.rendezvous import barrier, world_gather
from jax_triton_dist.shmem.settings import ALIGNMENT, HEAP_SIZE_ENV

__all__ = ["align", "malloc", "calloc", "free", "ptr", "as_array", "offset_of"]

ShmemError = _lib.ShmemError


def offset_of(addr: int, what: str) -> int:
    """Offset of ``addr`` in the calling PE's heap.

    Raises:
      ShmemError: ``addr`` is not in that heap (the message says whose heap it is in).
    """
    me = my_pe()
    base = _lib.heap_base(me)
    if not base <= addr < base + _lib.heap_size():
        owner = _lib.pe_of(addr)
        where = f"the heap of PE {owner}" if owner >= 0 else "no symmetric heap"
        raise ShmemError(
            f"PE {me}: {what} 0x{addr:x} is not in this PE's symmetric heap (it is in {where}); "
            "pass an address returned by shmem.malloc on this PE")
    return addr - base


def _allocates(pe: int) -> bool:
    """Whether PE ``pe`` runs its process's allocator for collective allocations: PE 0 for
    an in-process backend; under ``nvshmem`` every process allocates in its own heap (equal
    histories give equal offsets: checked)."""
    return pe == 0 or _lib.process_pe() >= 0


def align(alignment: int, size: int) -> int:
    """Collective symmetric allocation of ``size`` bytes aligned to ``alignment``.

    Returns the address in the calling PE's heap; 0 for ``size == 0``.

    Raises:
      ValueError: negative size, or an alignment that is not a power of two.
      ShmemError: the PEs asked for different sizes, or the heap is exhausted.
    """
    if size < 0:
        raise ValueError(f"shmem.malloc: size must be >= 0, got {size}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"shmem.align: alignment must be a power of two, got {alignment}")
    me = my_pe()
    sizes = world_gather(size, "shmem.malloc")
    if len(set(sizes)) != 1:
        raise ShmemError(
            "shmem.malloc is collective with equal sizes, but the PEs asked for "
            + ", ".join(f"PE {pe}: {s} bytes" for pe, s in enumerate(sizes)))
    if size == 0:
        return 0
    offset = -1
    if _allocates(me):
        with contextlib.suppress(ShmemError):
            offset = _lib.alloc(size, max(alignment, ALIGNMENT))
    offsets = world_gather(offset, "shmem.malloc")
    if _lib.process_pe() < 0:
        offset = offsets[0]
    elif len(set(offsets)) != 1:
        if offset >= 0:
            _lib.release(offset)  # nobody keeps a block that not every PE got
        if min(offsets) >= 0:
            raise ShmemError(
                "shmem.malloc: the PEs' heaps diverged (offsets "
                + ", ".join(f"PE {pe}: 0x{o:x}" for pe, o in enumerate(offsets))
                + "): every PE must make the same sequence of malloc/free calls")
        offset = -1
    if offset < 0:
        raise ShmemError(
            f"PE {me}: symmetric heap exhausted: cannot allocate {size} bytes "
            f"(heap {_lib.heap_size()} bytes, {_lib.allocated_bytes()} in use, largest free block "
            f"{_lib.largest_free_block()}); raise the heap with shmem.init(heap_size=...) or "
            f"{HEAP_SIZE_ENV}")
    return _lib.heap_base(me) + offset


def malloc(size: int) -> int:
    """Collective symmetric allocation of ``size`` bytes (see :func:`align`)."""
    return align(ALIGNMENT, size)


def calloc(nmemb: int, size: int) -> int:
    """Collective, zero-filled symmetric allocation of ``nmemb * size`` bytes."""
    if nmemb < 0 or size < 0:
        raise ValueError(f"shmem.calloc: counts must be >= 0, got nmemb={nmemb}, size={size}")
    addr = malloc(nmemb * size)
    if addr:
        _lib.memset(my_pe(), addr, 0, nmemb * size)
        barrier("shmem.calloc")
    return addr


def free(addr: int | None) -> None:
    """Collective release of a symmetric allocation. ``free(None)``/``free(0)`` do nothing.

    Raises:
      ShmemError: ``addr`` is not in the heap, is not an allocation (double free), or the PEs
        freed different allocations.
    """
    if not addr:
        return
    me = my_pe()
    offset = offset_of(int(addr), "shmem.free: address")
    offsets = world_gather(offset, "shmem.free")
    if len(set(offsets)) != 1:
        raise ShmemError(
            "shmem.free is collective on one allocation, but the PEs freed offsets "
            + ", ".join(f"PE {pe}: 0x{o:x}" for pe, o in enumerate(offsets)))
    released = _lib.release(offset) if _allocates(me) else 0
    reports = world_gather(released, "shmem.free")
    released = min(reports) if _lib.process_pe() >= 0 else reports[0]
    if released == 0:
        raise ShmemError(
            f"PE {me}: shmem.free(0x{int(addr):x}): not a live allocation (double free, or an "
            "address inside an allocation rather than its start)")


def ptr(addr: int, pe: int) -> int:
    """Address of symmetric ``addr`` in PE ``pe``'s heap, or 0 where that heap is not
    reachable by load/store (``nvshmem``: a PE on another node)."""
    check_pe(pe)
    offset = offset_of(int(addr), "shmem.ptr: address")
    base = _lib.heap_base(pe)
    return base + offset if base else 0


def as_array(addr: int, shape: int | tuple[int, ...], dtype) -> np.ndarray:
    """A NumPy view of host memory at ``addr`` (no copy).

    Raises:
      ShmemError: ``addr`` is in a GPU heap (copy it with ``getmem`` instead).
    """
    if _lib.initialized():
        owner = _lib.pe_of(int(addr))
        if owner >= 0 and _lib.device_of(owner) >= 0:
            raise ShmemError(
                f"shmem.as_array: 0x{int(addr):x} is GPU memory (the heap of PE {owner}); "
                "copy it into a host array with shmem.getmem")
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (ctypes.c_char * nbytes).from_address(addr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
