"""Lifetime of the SHMEM instance: choosing a backend, starting it, releasing it.

One instance runs per process at a time (:func:`init` ... :func:`finalize`); each start
counts a new *generation*, so state the runtime keeps per instance (call-site regions,
launch plans) can tell that it refers to released heaps.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem import nvshmem_bootstrap, settings

__all__ = [
    "InitStatus", "available_backends", "default_backend", "init", "finalize", "init_status",
    "backend", "heap_size", "device_of", "generation", "on_finalize", "require_init",
    "check_pe", "cross_process_store",
]

ShmemError = _lib.ShmemError


class InitStatus(enum.IntEnum):
    """Result of :func:`init_status`."""

    NOT_INITIALIZED = 0
    INITIALIZED = 1


@dataclasses.dataclass
class _Lifetime:
    """What this module remembers across instances."""

    generation: int = 0  # successful init() calls so far
    # The running instance's rendezvous across processes (a KeyValueRendezvous; None when
    # every PE is in this process).
    cross_process: Any = None
    finalize_hooks: list[Callable[[], None]] = dataclasses.field(default_factory=list)


_state = _Lifetime()


def cross_process_store() -> Any:
    """The running instance's cross-process rendezvous, or None (see ``rendezvous``)."""
    return _state.cross_process


def generation() -> int:
    """How many times :func:`init` has succeeded in this process (state older than the
    current generation refers to released heaps)."""
    return _state.generation


def available_backends() -> tuple[str, ...]:
    """Backends this build has (``cuda`` needs the CUDA headers at build time, ``nvshmem``
    NVSHMEM's headers too)."""
    return (("host",) + (("cuda",) if _lib.has_cuda() else ())
            + (("nvshmem",) if _lib.has_nvshmem() else ()))


def default_backend() -> str:
    """The backend :func:`init` starts when none is given: ``$JTD_SHMEM_BACKEND``; else
    ``host`` on CPU; on GPUs ``nvshmem`` for one process per GPU in a multi-process job,
    else ``cuda`` (one process driving its local GPUs).

    Raises:
      ValueError: ``$JTD_SHMEM_BACKEND`` names no backend.
    """
    env = settings.backend_from_env()
    if env:
        return env
    import jax

    if jax.default_backend() == "cpu":
        return "host"
    if jax.process_count() > 1 and jax.local_device_count() == 1:
        return "nvshmem"
    return "cuda"


def init(n_pes: int | None = None, heap_size: int | None = None, backend: str | None = None,
         devices: list[int] | None = None) -> None:
    """Initialises SHMEM for this process.

    Args:
      n_pes: number of PEs. Default: the number of JAX CPU devices (``host``), or of
        ``devices`` / local GPUs (``cuda``).
      heap_size: bytes per PE heap. Default: ``$JTD_SHMEM_HEAP_SIZE``, else
        ``DEFAULT_HEAP_SIZE`` (``host``) or ``DEFAULT_GPU_HEAP_SIZE`` (``cuda``).
      backend: ``"host"``, ``"cuda"`` or ``"nvshmem"``. Default: :func:`default_backend`.
      devices: ``cuda`` only: the GPU of each PE (default ``0 .. n_pes - 1``); a GPU may
        appear more than once.

    ``nvshmem`` runs one PE per process: PE ``jax.process_index()`` of
    ``jax.process_count()``, on the process's only GPU (``n_pes`` must match, or be None).
    NVSHMEM's library comes from the ``nvidia-nvshmem-cu13`` wheel (or
    ``$JTD_NVSHMEM_LIB``); its unique id travels through JAX's distributed key-value store.

    Raises:
      ShmemError: already initialised, or the backend cannot start (the message says why).
      ValueError: ``n_pes`` or ``heap_size`` is not positive, an unknown backend, or
        ``devices`` that do not match ``n_pes``.
    """
    if _lib.initialized():
        raise ShmemError("SHMEM is already initialised (call shmem.finalize() first)")
    backend = backend or default_backend()
    if backend not in settings.BACKENDS:
        raise ValueError(f"shmem.init: unknown backend {backend!r} (expected one of "
                         f"{settings.BACKENDS})")
    if backend != "cuda" and devices is not None:
        raise ValueError(f"shmem.init: devices= is for the cuda backend ({backend!r} chooses "
                         "its devices)")
    if backend not in available_backends():
        needs = "NVSHMEM's headers" if backend == "nvshmem" else "the CUDA headers"
        raise ShmemError(f"shmem.init: this build has no {backend!r} backend (built without "
                         f"{needs})")
    if backend == "nvshmem":
        _init_nvshmem(n_pes, heap_size)
    else:
        _init_in_process(backend, n_pes, heap_size, devices)


def _init_in_process(backend: str, n_pes: int | None, heap_size: int | None,
                     devices: list[int] | None) -> None:
    if n_pes is None:
        if devices is not None:
            n_pes = len(devices)
        else:
            import jax

            n_pes = jax.local_device_count("cpu" if backend == "host" else "gpu")
    heap_size = settings.heap_size_or_default(
        heap_size, settings.DEFAULT_HEAP_SIZE if backend == "host"
        else settings.DEFAULT_GPU_HEAP_SIZE)
    if int(n_pes) <= 0:
        raise ValueError(f"shmem.init: n_pes must be positive, got {n_pes}")
    if backend == "cuda":
        devices = list(range(int(n_pes))) if devices is None else [int(d) for d in devices]
        if len(devices) != int(n_pes):
            raise ValueError(f"shmem.init: {len(devices)} devices given for {n_pes} PEs "
                             "(one device per PE)")
    _start(backend, int(n_pes), heap_size, devices or [])
    _state.cross_process = None


def _start(backend: str, *args) -> None:
    try:
        _lib.init(backend, *args)
    except RuntimeError as error:
        if isinstance(error, ShmemError):
            raise
        raise ShmemError(f"shmem.init({backend!r}): {error}") from None
    _state.generation += 1


def _init_nvshmem(n_pes: int | None, heap_size: int | None) -> None:
    count, me, gpu = nvshmem_bootstrap.geometry()
    if n_pes is not None and int(n_pes) != count:
        raise ValueError(f"shmem.init('nvshmem'): n_pes={n_pes}, but the job has {count} "
                         "processes (one PE per process)")
    heap_size = settings.heap_size_or_default(heap_size, settings.DEFAULT_NVSHMEM_HEAP_SIZE)
    nvshmem_bootstrap.prepare_heap(heap_size)
    library = nvshmem_bootstrap.library_path()
    upcoming = _state.generation + 1
    uid = nvshmem_bootstrap.unique_id(library, count, me, upcoming, settings.wait_timeout())
    _start("nvshmem", count, heap_size, [gpu], me, uid, library)
    _state.cross_process = nvshmem_bootstrap.KeyValueRendezvous(upcoming) if count > 1 else None


def on_finalize(hook: Callable[[], None]) -> None:
    """Runs ``hook()`` before every :func:`finalize` (the runtime drops launch plans that
    point into the heaps). Registering the same hook twice runs it once."""
    if hook not in _state.finalize_hooks:
        _state.finalize_hooks.append(hook)


def finalize() -> None:
    """Releases every heap. Symmetric addresses become invalid.

    Raises:
      ShmemError: SHMEM is not initialised.
    """
    require_init()
    for hook in _state.finalize_hooks:
        hook()
    _lib.finalize()
    _state.cross_process = None


@atexit.register  # at import: after JAX's exit hooks, before every later one
def _finalize_at_exit() -> None:
    """Releases the heaps at interpreter exit. Exit hooks run in the reverse order of
    their registration: this one, registered when the package is imported (after JAX),
    runs after the runtime's (which stop the kernels that use the heaps, registered
    later) and before JAX tears its backends down (while the GPU driver is still up, and
    before C++ static destructors run)."""
    if _lib.initialized():
        with contextlib.suppress(Exception):  # nothing useful to report at exit
            finalize()


def init_status() -> InitStatus:
    """Whether :func:`init` has run (and :func:`finalize` has not)."""
    return InitStatus.INITIALIZED if _lib.initialized() else InitStatus.NOT_INITIALIZED


def require_init() -> None:
    """Raises ShmemError unless SHMEM is initialised."""
    if not _lib.initialized():
        raise ShmemError("SHMEM is not initialised: call jax_triton_dist.shmem.init() first")


def backend() -> str:
    """Name of the active backend."""
    require_init()
    return _lib.backend_name()


def heap_size() -> int:
    """Bytes per PE heap."""
    require_init()
    return _lib.heap_size()


def check_pe(pe: int, what: str = "pe") -> None:
    """Raises ValueError unless ``pe`` is a PE number of the running instance."""
    n = _lib.n_pes()
    if not isinstance(pe, (int, np.integer)) or not 0 <= int(pe) < n:
        raise ValueError(f"{what} {pe!r} is out of range: this job has PEs 0..{n - 1}")


def device_of(pe: int) -> int:
    """GPU of PE ``pe`` (``cuda``), or -1 (``host``: host memory)."""
    require_init()
    check_pe(pe)
    return _lib.device_of(int(pe))
