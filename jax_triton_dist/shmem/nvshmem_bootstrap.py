"""Starting the ``nvshmem`` SHMEM backend in a JAX multi-process job.

One process per GPU (``jax.distributed.initialize``): PE ``p`` is process ``p``. PE 0 makes
NVSHMEM's unique id and publishes it in JAX's distributed key-value store; every other
PE reads it from there (no MPI, no torch). The same store carries the host API's
collective rendezvous (``shmem.malloc`` consistency checks, ``barrier_all``, team splits)
between processes (:class:`KeyValueRendezvous`).

Used by :mod:`jax_triton_dist.shmem.lifetime`; imports nothing else of the package but its
settings.
"""

from __future__ import annotations

import os
import struct

import jax

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.settings import parse_size

LIBRARY_ENV = "JTD_NVSHMEM_LIB"
"""Environment variable: path of ``libnvshmem_host.so.3`` (default: the
``nvidia-nvshmem-cu13`` wheel's)."""
SYMMETRIC_SIZE_ENV = "NVSHMEM_SYMMETRIC_SIZE"
_HEAP_SLACK = 512 << 20  # NVSHMEM's own symmetric objects share the heap with ours
_KEY_PREFIX = "jax_triton_dist/nvshmem"


def library_path() -> str:
    """Path of NVSHMEM's host library: ``$JTD_NVSHMEM_LIB``, else the wheel's."""
    path = os.environ.get(LIBRARY_ENV)
    if path:
        return path
    try:
        import nvidia.nvshmem
    except ImportError:
        raise _lib.ShmemError(
            "shmem.init('nvshmem'): NVSHMEM not found: pip install nvidia-nvshmem-cu13, or "
            f"set {LIBRARY_ENV} to libnvshmem_host.so.3") from None
    return os.path.join(list(nvidia.nvshmem.__path__)[0], "lib", "libnvshmem_host.so.3")


def library_version() -> str:
    """Version of NVSHMEM's host library, ``"major.minor.patch"`` (loads it).

    Raises:
      ShmemError: the library is missing, or this build has no ``nvshmem`` backend.
    """
    if not _lib.has_nvshmem():
        raise _lib.ShmemError("this build of jax_triton_dist has no nvshmem backend (built "
                              "without NVSHMEM's headers)")
    return _lib.nvshmem_version(library_path())


def device_library_path(capability: int = 90) -> str | None:
    """NVSHMEM's device bitcode next to the host library: ``libnvshmem_device_sm_<cc>.bc``
    (NVSHMEM >= 3.5 ships one per architecture), else ``libnvshmem_device.bc``; None if
    neither is there."""
    lib = os.path.dirname(library_path())
    for name in (f"libnvshmem_device_sm_{capability}.bc", "libnvshmem_device.bc"):
        path = os.path.join(lib, name)
        if os.path.exists(path):
            return path
    return None


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise _lib.ShmemError(
            "shmem.init('nvshmem') with more than one PE needs JAX's distributed runtime: "
            "call jax.distributed.initialize() first")
    return client


def _blocking_get(key: str, timeout_s: float, what: str) -> bytes:
    """The value of ``key`` in JAX's key-value store, once some process has set it;
    ShmemTimeoutError saying ``what`` did not arrive after ``timeout_s``."""
    try:
        return _client().blocking_key_value_get_bytes(key, int(timeout_s * 1000))
    except Exception as error:  # noqa: BLE001 - the store raises its own error types
        raise _lib.ShmemTimeoutError(
            f"{what} did not arrive within {timeout_s:g} s ({error})") from None


def geometry() -> tuple[int, int, int]:
    """``(n_pes, my_pe, gpu)`` of this process: its JAX process index on its only GPU."""
    devices = jax.local_devices()
    if len(devices) != 1 or devices[0].platform != "gpu":
        raise _lib.ShmemError(
            "shmem.init('nvshmem') runs one PE per process on one GPU, but this process sees "
            f"{[str(d) for d in devices]}: start one process per GPU (e.g. "
            "CUDA_VISIBLE_DEVICES per process), or use the 'cuda' backend")
    return jax.process_count(), jax.process_index(), devices[0].local_hardware_id


def prepare_heap(heap_size: int) -> None:
    """Makes NVSHMEM's symmetric heap room for ours (``$NVSHMEM_SYMMETRIC_SIZE``)."""
    needed = heap_size + _HEAP_SLACK
    raw = os.environ.get(SYMMETRIC_SIZE_ENV)
    if raw is None:
        os.environ[SYMMETRIC_SIZE_ENV] = str(needed)
        return
    if parse_size(raw, SYMMETRIC_SIZE_ENV) < needed:
        raise _lib.ShmemError(
            f"shmem.init('nvshmem'): {SYMMETRIC_SIZE_ENV}={raw} leaves no room for a "
            f"{heap_size}-byte heap (needs >= {needed} bytes: the heap plus "
            f"{_HEAP_SLACK >> 20} MiB for NVSHMEM); raise it or lower the heap size")


def unique_id(library: str, n_pes: int, my_pe: int, generation: int,
              timeout_s: float) -> bytes:
    """NVSHMEM's unique id: made here on PE 0, read from JAX's key-value store elsewhere."""
    key = f"{_KEY_PREFIX}/{generation}/unique_id"
    if my_pe == 0:
        uid = _lib.nvshmem_unique_id(library)
        if n_pes > 1:
            _client().key_value_set_bytes(key, uid)
        return uid
    return _blocking_get(
        key, timeout_s, f"shmem.init('nvshmem'): on PE {my_pe}, NVSHMEM's unique id from PE 0 "
        "(is PE 0 initialising SHMEM too?)")


class KeyValueRendezvous:
    """All-gathers of one int64 among PEs in different processes, through JAX's key-value
    store (the cross-process form of :mod:`jax_triton_dist.shmem.rendezvous`). Keys are
    never deleted (a few bytes per collective call)."""

    def __init__(self, generation: int):
        self.generation = generation
        self.rounds: dict[int, int] = {}

    def __call__(self, team_key: int, members: int, index: int, value: int,
                 timeout_s: float) -> list[int]:
        """Round ``r`` of team ``team_key``'s rendezvous (rounds counted per process)."""
        round_ = self.rounds.get(team_key, 0)
        self.rounds[team_key] = round_ + 1
        return self.gather(f"x/{team_key}/{round_}", members, index, value, timeout_s)

    def gather(self, name: str, members: int, index: int, value: int,
               timeout_s: float) -> list[int]:
        """Member ``index`` of ``members`` contributes ``value`` under ``name`` (unique per
        rendezvous); returns every member's value, in member order."""
        base = f"{_KEY_PREFIX}/{self.generation}/{name}"
        _client().key_value_set_bytes(f"{base}/{index}", struct.pack("<q", int(value)))
        return [struct.unpack("<q", _blocking_get(
                    f"{base}/{member}", timeout_s,
                    f"member {member} of {members} at {name!r}"))[0]
                for member in range(members)]
