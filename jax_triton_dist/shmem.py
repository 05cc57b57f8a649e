"""Host SHMEM API: symmetric heaps, one-sided RMA, signals, barriers and teams.

Names follow ACLSHMEM (Ascend's SHMEM) and OpenSHMEM. Each PE's heap is a separate
allocation of ``heap_size`` bytes, and a symmetric allocation is the same offset in
every heap. Backends:

* ``host``: ``n_pes`` processing elements (PEs) in one process, one per JAX CPU
  device; heaps are host memory (pages committed on use).
* ``cuda``: one process driving its local GPUs; PE ``i``'s heap is GPU memory on
  ``devices[i]`` (by default PE ``i`` is GPU ``i``), mapped on demand as allocations
  grow and reachable from every GPU of the job, so kernels load and store peers' heaps
  directly. Several PEs may share one GPU (for testing on one GPU).

:func:`init` picks ``host`` on CPU and ``cuda`` on GPU; ``backend=`` or
``$JTD_SHMEM_BACKEND`` overrides.

A PE is a thread bound to a PE number. The runtime binds each JAX device's
thread while it runs a kernel; user code binds threads with :func:`as_pe`::

    shmem.init(n_pes=4)

    def program(pe):
        with shmem.as_pe(pe):
            buf = shmem.malloc(64)          # collective: every PE calls it
            ...
            shmem.free(buf)

Addresses are plain integers (addresses in the calling PE's heap: host addresses on
``host``, GPU virtual addresses on ``cuda``). Sources and destinations of ``putmem`` /
``getmem`` that are not in a heap may be host or device memory.
Collective calls (``malloc``, ``calloc``, ``align``, ``free``, ``barrier_all``,
``team_split_strided``, ``team_sync``) must be made by every PE of the team in
the same order; a PE that waits longer than the timeout raises
:class:`ShmemTimeoutError` naming the PEs that did not arrive.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import os
import threading
from collections.abc import Iterator

import numpy as np

from jax_triton_dist import _shmem as _lib

__all__ = [
    "ShmemError", "ShmemTimeoutError", "Cmp", "SignalOp", "InitStatus", "Team", "TEAM_WORLD",
    "DEFAULT_HEAP_SIZE", "DEFAULT_GPU_HEAP_SIZE", "DEFAULT_NVSHMEM_HEAP_SIZE", "HEAP_SIZE_ENV",
    "TIMEOUT_ENV", "BACKEND_ENV", "BACKENDS", "available_backends", "device_of",
    "init", "finalize", "init_status", "backend", "heap_size", "as_pe", "bind_pe", "unbind_pe",
    "my_pe", "n_pes", "malloc", "calloc", "align", "free", "ptr", "as_array", "barrier_all",
    "putmem", "getmem", "putmem_nbi", "getmem_nbi", "putmem_signal", "putmem_signal_nbi",
    "signal_op", "signal_fetch", "signal_wait_until", "quiet", "fence",
    "team_split_strided", "team_my_pe", "team_n_pes", "team_translate_pe", "team_sync",
    "team_destroy", "wait_timeout", "generation",
]

ShmemError = _lib.ShmemError
ShmemTimeoutError = _lib.ShmemTimeoutError

DEFAULT_HEAP_SIZE = 1 << 30
"""Default per-PE heap size of ``host`` (1 GiB of address space; pages are committed on
use)."""
DEFAULT_GPU_HEAP_SIZE = 64 << 30
"""Default per-PE heap size of ``cuda`` (64 GiB of GPU address space; physical memory is
mapped as allocations grow, in steps of at least 32 MiB)."""
BACKEND_ENV = "JTD_SHMEM_BACKEND"
"""Environment variable naming the backend :func:`init` uses when none is given."""
DEFAULT_NVSHMEM_HEAP_SIZE = 1 << 30
"""Default heap size of ``nvshmem`` (1 GiB: NVSHMEM commits the heap's memory up front)."""
BACKENDS = ("host", "cuda", "nvshmem")
HEAP_SIZE_ENV = "JTD_SHMEM_HEAP_SIZE"
"""Environment variable for the heap size: bytes, or with a K/M/G suffix."""
TIMEOUT_ENV = "JTD_WAIT_TIMEOUT"
"""Environment variable: seconds a wait or a collective may take before it fails."""
DEFAULT_TIMEOUT_S = 60.0

_MIN_ALIGNMENT = 256
_WORLD_KEY = 0


class Cmp(enum.IntEnum):
    """Comparison of ``signal_wait_until`` (and ``dl.wait``)."""

    EQ = 0
    NE = 1
    GT = 2
    GE = 3
    LT = 4
    LE = 5


class SignalOp(enum.IntEnum):
    """Signal update of ``signal_op`` / ``putmem_signal``."""

    SET = 0
    ADD = 1


class InitStatus(enum.IntEnum):
    """Result of :func:`init_status`."""

    NOT_INITIALIZED = 0
    INITIALIZED = 1


def wait_timeout() -> float:
    """Seconds a wait or collective may take: ``$JTD_WAIT_TIMEOUT`` or 60."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def _parse_size(raw: str) -> int:
    text = raw.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    try:
        return int(float(digits) * scale)
    except ValueError:
        raise ValueError(
            f"{HEAP_SIZE_ENV}={raw!r} is not a size (examples: 268435456, 256M, 2G)"
        ) from None


# ---------------------------------------------------------------------------
# Lifetime
# ---------------------------------------------------------------------------

_teams_lock = threading.Lock()
_next_team_key = [1]
_generation = [0]


def generation() -> int:
    """How many times :func:`init` has succeeded in this process (state older than the
    current generation refers to released heaps)."""
    return _generation[0]


def available_backends() -> tuple[str, ...]:
    """Backends this build has (``cuda`` needs the CUDA headers at build time, ``nvshmem``
    NVSHMEM's headers too)."""
    return (("host",) + (("cuda",) if _lib.has_cuda() else ())
            + (("nvshmem",) if _lib.has_nvshmem() else ()))


def _default_backend() -> str:
    """``$JTD_SHMEM_BACKEND``; else ``host`` on CPU; on GPUs ``nvshmem`` for one process per
    GPU in a multi-process job, else ``cuda`` (one process driving its local GPUs)."""
    env = os.environ.get(BACKEND_ENV)
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
        :data:`DEFAULT_HEAP_SIZE` (``host``) or :data:`DEFAULT_GPU_HEAP_SIZE` (``cuda``).
      backend: ``"host"``, ``"cuda"`` or ``"nvshmem"``. Default: ``$JTD_SHMEM_BACKEND``,
        else ``host`` when JAX's default platform is the CPU, ``nvshmem`` in a multi-process
        job with one GPU per process, ``cuda`` otherwise.
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
    backend = backend or _default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"shmem.init: unknown backend {backend!r} (expected one of {BACKENDS})")
    if backend != "cuda" and devices is not None:
        raise ValueError(f"shmem.init: devices= is for the cuda backend ({backend!r} chooses "
                         "its devices)")
    if backend not in available_backends():
        needs = "NVSHMEM's headers" if backend == "nvshmem" else "the CUDA headers"
        raise ShmemError(f"shmem.init: this build has no {backend!r} backend (built without "
                         f"{needs})")
    if backend == "nvshmem":
        _init_nvshmem(n_pes, heap_size)
        return
    if n_pes is None:
        if devices is not None:
            n_pes = len(devices)
        else:
            import jax

            n_pes = jax.local_device_count("cpu" if backend == "host" else "gpu")
    heap_size = _heap_size_or_default(
        heap_size, DEFAULT_HEAP_SIZE if backend == "host" else DEFAULT_GPU_HEAP_SIZE)
    if int(n_pes) <= 0:
        raise ValueError(f"shmem.init: n_pes must be positive, got {n_pes}")
    if backend == "cuda":
        devices = list(range(int(n_pes))) if devices is None else [int(d) for d in devices]
        if len(devices) != int(n_pes):
            raise ValueError(f"shmem.init: {len(devices)} devices given for {n_pes} PEs "
                             "(one device per PE)")
    try:
        _lib.init(backend, int(n_pes), heap_size, devices or [])
    except RuntimeError as error:
        if isinstance(error, ShmemError):
            raise
        raise ShmemError(f"shmem.init({backend!r}): {error}") from None
    _generation[0] += 1
    _kv_exchange[0] = None


_kv_exchange: list = [None]  # the nvshmem backend's cross-process rendezvous


def _heap_size_or_default(heap_size: int | None, default: int) -> int:
    if heap_size is None:
        env = os.environ.get(HEAP_SIZE_ENV)
        heap_size = _parse_size(env) if env else default
    if int(heap_size) <= 0:
        raise ValueError(
            f"shmem.init: heap_size must be positive, got {heap_size} (set it with the "
            f"heap_size argument or {HEAP_SIZE_ENV})"
        )
    return (int(heap_size) + _MIN_ALIGNMENT - 1) // _MIN_ALIGNMENT * _MIN_ALIGNMENT


def _process_gather(name: str, members: int, index: int, value: int) -> list[int]:
    """All-gather of one int64 among PEs of different processes (``nvshmem``); ``name``
    must be unique per rendezvous and the same in every member. For the runtime."""
    if _kv_exchange[0] is None:
        if members == 1:
            return [int(value)]
        raise ShmemError("no cross-process rendezvous: SHMEM runs in one process")
    return _kv_exchange[0].gather(name, members, index, value, wait_timeout())


def _init_nvshmem(n_pes: int | None, heap_size: int | None) -> None:
    from jax_triton_dist import nvshmem_bootstrap

    count, me, gpu = nvshmem_bootstrap.geometry()
    if n_pes is not None and int(n_pes) != count:
        raise ValueError(f"shmem.init('nvshmem'): n_pes={n_pes}, but the job has {count} "
                         "processes (one PE per process)")
    heap_size = _heap_size_or_default(heap_size, DEFAULT_NVSHMEM_HEAP_SIZE)
    nvshmem_bootstrap.prepare_heap(heap_size)
    library = nvshmem_bootstrap.library_path()
    generation = _generation[0] + 1
    uid = nvshmem_bootstrap.unique_id(library, count, me, generation, wait_timeout())
    try:
        _lib.init("nvshmem", count, heap_size, [gpu], me, uid, library)
    except RuntimeError as error:
        if isinstance(error, ShmemError):
            raise
        raise ShmemError(f"shmem.init('nvshmem'): {error}") from None
    _generation[0] = generation
    _kv_exchange[0] = nvshmem_bootstrap.Exchange(generation) if count > 1 else None


_finalize_hooks: list = []


def _on_finalize(hook) -> None:
    """Runs ``hook()`` before every :func:`finalize` (the runtime drops launch plans that
    point into the heaps)."""
    _finalize_hooks.append(hook)


def finalize() -> None:
    """Releases every heap. Symmetric addresses become invalid."""
    _require_init()
    for hook in _finalize_hooks:
        hook()
    _lib.finalize()
    _kv_exchange[0] = None


def _finalize_at_exit() -> None:
    # Heaps are released while the GPU driver is still up (before JAX tears its
    # backends down and before C++ static destructors run).
    if _lib.initialized():
        with contextlib.suppress(Exception):  # nothing useful to report at exit
            finalize()


atexit.register(_finalize_at_exit)


def init_status() -> InitStatus:
    """Whether :func:`init` has run (and :func:`finalize` has not)."""
    return InitStatus.INITIALIZED if _lib.initialized() else InitStatus.NOT_INITIALIZED


def backend() -> str:
    """Name of the active backend."""
    _require_init()
    return _lib.backend_name()


def heap_size() -> int:
    """Bytes per PE heap."""
    _require_init()
    return _lib.heap_size()


def device_of(pe: int) -> int:
    """GPU of PE ``pe`` (``cuda``), or -1 (``host``: host memory)."""
    _require_init()
    _check_pe(pe)
    return _lib.device_of(int(pe))


def _require_init() -> None:
    if not _lib.initialized():
        raise ShmemError("SHMEM is not initialised: call jax_triton_dist.shmem.init() first")


# ---------------------------------------------------------------------------
# PE binding
# ---------------------------------------------------------------------------

_bound = threading.local()


def bind_pe(pe: int) -> None:
    """Makes the calling thread act as PE ``pe`` (see :func:`as_pe`)."""
    _require_init()
    _check_pe(pe)
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
    """The calling thread's PE (under ``nvshmem``, unbound threads are this process's PE)."""
    _require_init()
    pe = getattr(_bound, "pe", None)
    if pe is None:
        pe = _lib.process_pe()
    if pe < 0:
        raise ShmemError(
            "this thread is not bound to a PE: wrap the code in `with shmem.as_pe(pe):` "
            "(the runtime binds each JAX device's thread while its kernel runs)"
        )
    return pe


def n_pes() -> int:
    """Number of PEs."""
    _require_init()
    return _lib.n_pes()


def _check_pe(pe: int, what: str = "pe") -> None:
    n = _lib.n_pes()
    if not isinstance(pe, (int, np.integer)) or not 0 <= int(pe) < n:
        raise ValueError(f"{what} {pe!r} is out of range: this job has PEs 0..{n - 1}")


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def _offset_of(addr: int, what: str) -> int:
    me = my_pe()
    base = _lib.heap_base(me)
    if not base <= addr < base + _lib.heap_size():
        owner = _lib.pe_of(addr)
        where = f"the heap of PE {owner}" if owner >= 0 else "no symmetric heap"
        raise ShmemError(
            f"PE {me}: {what} 0x{addr:x} is not in this PE's symmetric heap (it is in {where}); "
            "pass an address returned by shmem.malloc on this PE"
        )
    return addr - base


def _exchange(team_key: int, size: int, index: int, value: int, what: str) -> list[int]:
    try:
        if _kv_exchange[0] is not None:  # PEs in several processes
            return _kv_exchange[0](team_key, size, index, int(value), wait_timeout())
        return _lib.exchange(team_key, size, index, int(value), wait_timeout())
    except ShmemTimeoutError as error:
        raise ShmemTimeoutError(
            f"PE {my_pe()}: {what} is collective and {error} (members are numbered in the "
            f"team; raise {TIMEOUT_ENV} if they are only slow)"
        ) from None


def _world_exchange(value: int, what: str) -> list[int]:
    return _exchange(_WORLD_KEY, _lib.n_pes(), my_pe(), value, what)


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
    sizes = _world_exchange(size, "shmem.malloc")
    if len(set(sizes)) != 1:
        raise ShmemError(
            "shmem.malloc is collective with equal sizes, but the PEs asked for "
            + ", ".join(f"PE {pe}: {s} bytes" for pe, s in enumerate(sizes))
        )
    if size == 0:
        return 0
    # One allocator per process: PE 0 allocates for an in-process backend; under nvshmem
    # every process allocates in its own (equal histories give equal offsets: checked).
    offset = -1
    if _allocates(me):
        with contextlib.suppress(ShmemError):
            offset = _lib.alloc(size, max(alignment, _MIN_ALIGNMENT))
    offsets = _world_exchange(offset, "shmem.malloc")
    if _lib.process_pe() < 0:
        offset = offsets[0]
    elif len(set(offsets)) != 1:
        if offset >= 0:
            _lib.release(offset)  # nobody keeps a block that not every PE got
        if min(offsets) >= 0:
            raise ShmemError(
                "shmem.malloc: the PEs' heaps diverged (offsets "
                + ", ".join(f"PE {pe}: 0x{o:x}" for pe, o in enumerate(offsets))
                + "): every PE must make the same sequence of malloc/free calls"
            )
        offset = -1
    if offset < 0:
        raise ShmemError(
            f"PE {me}: symmetric heap exhausted: cannot allocate {size} bytes "
            f"(heap {_lib.heap_size()} bytes, {_lib.allocated_bytes()} in use, largest free block "
            f"{_lib.largest_free_block()}); raise the heap with shmem.init(heap_size=...) or "
            f"{HEAP_SIZE_ENV}"
        )
    return _lib.heap_base(me) + offset


def _allocates(pe: int) -> bool:
    """Whether PE ``pe`` runs its process's allocator for collective allocations."""
    return pe == 0 or _lib.process_pe() >= 0


def malloc(size: int) -> int:
    """Collective symmetric allocation of ``size`` bytes (see :func:`align`)."""
    return align(_MIN_ALIGNMENT, size)


def calloc(nmemb: int, size: int) -> int:
    """Collective, zero-filled symmetric allocation of ``nmemb * size`` bytes."""
    if nmemb < 0 or size < 0:
        raise ValueError(f"shmem.calloc: counts must be >= 0, got nmemb={nmemb}, size={size}")
    addr = malloc(nmemb * size)
    if addr:
        _lib.memset(my_pe(), addr, 0, nmemb * size)
        barrier_all()
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
    offset = _offset_of(int(addr), "shmem.free: address")
    offsets = _world_exchange(offset, "shmem.free")
    if len(set(offsets)) != 1:
        raise ShmemError(
            "shmem.free is collective on one allocation, but the PEs freed offsets "
            + ", ".join(f"PE {pe}: 0x{o:x}" for pe, o in enumerate(offsets))
        )
    released = _lib.release(offset) if _allocates(me) else 0
    reports = _world_exchange(released, "shmem.free")
    released = min(reports) if _lib.process_pe() >= 0 else reports[0]
    if released == 0:
        raise ShmemError(
            f"PE {me}: shmem.free(0x{int(addr):x}): not a live allocation (double free, or an "
            "address inside an allocation rather than its start)"
        )


def ptr(addr: int, pe: int) -> int:
    """Address of symmetric ``addr`` in PE ``pe``'s heap, or 0 where that heap is not
    reachable by load/store (``nvshmem``: a PE on another node)."""
    _check_pe(pe)
    offset = _offset_of(int(addr), "shmem.ptr: address")
    base = _lib.heap_base(pe)
    return base + offset if base else 0


def as_array(addr: int, shape: int | tuple[int, ...], dtype) -> np.ndarray:
    """A NumPy view of host memory at ``addr`` (no copy).

    Raises:
      ShmemError: ``addr`` is in a GPU heap (copy it with :func:`getmem` instead).
    """
    if _lib.initialized():
        owner = _lib.pe_of(int(addr))
        if owner >= 0 and _lib.device_of(owner) >= 0:
            raise ShmemError(
                f"shmem.as_array: 0x{int(addr):x} is GPU memory (the heap of PE {owner}); "
                "copy it into a host array with shmem.getmem"
            )
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (ctypes.c_char * nbytes).from_address(addr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


# ---------------------------------------------------------------------------
# RMA
# ---------------------------------------------------------------------------


def _remote(dest: int, pe: int, what: str) -> int:
    _check_pe(pe)
    base = _lib.heap_base(pe)
    if base == 0:
        raise ShmemError(
            f"PE {my_pe()}: {what}: PE {pe}'s heap is not reachable by load/store from here "
            "(another node: NVSHMEM reports no nvshmem_ptr mapping); host-side puts and gets "
            "reach PEs on this node only")
    return base + _offset_of(int(dest), what)


def _check_nbytes(nbytes: int, fn: str) -> None:
    if nbytes < 0:
        raise ValueError(f"shmem.{fn}: nbytes must be >= 0, got {nbytes}")


def putmem(dest: int, source: int, nbytes: int, pe: int) -> None:
    """Copies ``nbytes`` from local ``source`` to symmetric ``dest`` on PE ``pe``."""
    _check_nbytes(nbytes, "putmem")
    _lib.copy(my_pe(), _remote(dest, pe, "putmem: dest"), int(source), nbytes, True)


def getmem(dest: int, source: int, nbytes: int, pe: int) -> None:
    """Copies ``nbytes`` from symmetric ``source`` on PE ``pe`` to local ``dest``."""
    _check_nbytes(nbytes, "getmem")
    _lib.copy(my_pe(), int(dest), _remote(source, pe, "getmem: source"), nbytes, True)


def putmem_nbi(dest: int, source: int, nbytes: int, pe: int) -> None:
    """Non-blocking :func:`putmem`: complete after :func:`quiet` (immediate on `host`);
    ``source`` must not change before then."""
    _check_nbytes(nbytes, "putmem_nbi")
    _lib.copy(my_pe(), _remote(dest, pe, "putmem_nbi: dest"), int(source), nbytes, False)


def getmem_nbi(dest: int, source: int, nbytes: int, pe: int) -> None:
    """Non-blocking :func:`getmem`: ``dest`` holds the data after :func:`quiet`
    (immediate on `host`)."""
    _check_nbytes(nbytes, "getmem_nbi")
    _lib.copy(my_pe(), int(dest), _remote(source, pe, "getmem_nbi: source"), nbytes, False)


def signal_op(sig_addr: int, signal: int, sig_op: SignalOp, pe: int) -> None:
    """Atomically sets or adds ``signal`` to the 64-bit signal ``sig_addr`` on PE ``pe``."""
    op = SignalOp(sig_op)
    _lib.signal(my_pe(), _remote(sig_addr, pe, "signal_op: sig_addr"), int(signal), int(op), 8)


def putmem_signal(
    dest: int, source: int, nbytes: int, sig_addr: int, signal: int, sig_op: SignalOp, pe: int
) -> None:
    """:func:`putmem`, then (ordered after the data) :func:`signal_op` on the same PE."""
    putmem_nbi(dest, source, nbytes, pe)
    signal_op(sig_addr, signal, sig_op, pe)  # the backend orders it after the copy


def putmem_signal_nbi(
    dest: int, source: int, nbytes: int, sig_addr: int, signal: int, sig_op: SignalOp, pe: int
) -> None:
    """:func:`putmem_signal` (the signal is visible on return, so it completes at once)."""
    putmem_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe)


def signal_fetch(sig_addr: int) -> int:
    """Reads the local 64-bit signal at ``sig_addr`` (acquire)."""
    me = my_pe()
    return _lib.load(me, _lib.heap_base(me) + _offset_of(sig_addr, "signal_fetch"), 8)


def signal_wait_until(sig_addr: int, cmp: Cmp, cmp_value: int, timeout: float | None = None) -> int:
    """Waits until the local signal ``sig_addr`` satisfies ``cmp`` against ``cmp_value``.

    Returns:
      The signal's value once the comparison held.

    Raises:
      ShmemTimeoutError: not satisfied within ``timeout`` (default :func:`wait_timeout`);
        the message names the PE, the address, the expected and the seen value.
    """
    cmp = Cmp(cmp)
    me = my_pe()
    addr = _lib.heap_base(me) + _offset_of(int(sig_addr), "signal_wait_until: sig_addr")
    who = f"PE {me} signal_wait_until"
    timeout = wait_timeout() if timeout is None else timeout
    _lib.wait(me, [addr], 8, False, int(cmp), int(cmp_value), float(timeout), who)
    return _lib.load(me, addr, 8)


def quiet() -> None:
    """Completes this PE's outstanding puts and gets."""
    _lib.quiet(my_pe())


def fence() -> None:
    """Orders this PE's puts to each PE (completes them: a stronger guarantee)."""
    _lib.quiet(my_pe())


def barrier_all() -> None:
    """Collective: waits for every PE and completes outstanding RMA."""
    _lib.quiet(my_pe())
    _world_exchange(0, "shmem.barrier_all")


# ---------------------------------------------------------------------------
# Teams
# ---------------------------------------------------------------------------


class Team:
    """A strided subset of PEs: ``start, start + stride, ...`` (``size`` of them).

    Team objects come from :func:`team_split_strided`; :data:`TEAM_WORLD` holds every PE.
    """

    def __init__(self, key: int, start: int, stride: int, size: int):
        self.key, self.start, self.stride, self.size = key, start, stride, size
        self.destroyed = False

    def pes(self) -> list[int]:
        """Global PE numbers of the members, in team order."""
        return [self.start + i * self.stride for i in range(self.size)]

    def index_of(self, pe: int) -> int:
        """Team PE number of global ``pe``, or -1 if not a member."""
        offset = pe - self.start
        if offset < 0 or offset % self.stride:
            return -1
        index = offset // self.stride
        return index if index < self.size else -1

    def _check(self) -> None:
        if self.destroyed:
            raise ShmemError(f"team {self.key} was destroyed")

    def __repr__(self) -> str:
        return f"Team(start={self.start}, stride={self.stride}, size={self.size})"


class _WorldTeam(Team):
    def __init__(self):
        super().__init__(_WORLD_KEY, 0, 1, 0)

    @property
    def size(self) -> int:  # type: ignore[override]
        return n_pes()

    @size.setter
    def size(self, value: int) -> None:
        pass


TEAM_WORLD: Team = _WorldTeam()
"""Every PE."""

def _team_of(team: Team) -> Team:
    if not isinstance(team, Team):
        raise TypeError(f"expected a shmem.Team, got {type(team).__name__}")
    team._check()
    return team


def team_my_pe(team: Team) -> int:
    """The calling PE's number in ``team``, or -1 if it is not a member."""
    return _team_of(team).index_of(my_pe())


def team_n_pes(team: Team) -> int:
    """Number of PEs in ``team``."""
    return _team_of(team).size


def team_translate_pe(src_team: Team, src_pe: int, dest_team: Team) -> int:
    """Number in ``dest_team`` of PE ``src_pe`` of ``src_team``; -1 if not a member."""
    src, dest = _team_of(src_team), _team_of(dest_team)
    if not 0 <= src_pe < src.size:
        raise ValueError(f"team_translate_pe: src_pe {src_pe} is out of range 0..{src.size - 1}")
    return dest.index_of(src.pes()[src_pe])


def team_split_strided(parent: Team, start: int, stride: int, size: int) -> Team | None:
    """Collective over ``parent``: a new team of parent PEs ``start + i * stride``.

    Returns:
      The new team on its members, ``None`` on the other PEs of ``parent``.

    Raises:
      ValueError: the team does not fit in ``parent``.
      ShmemError: the PEs of ``parent`` passed different arguments.
    """
    parent = _team_of(parent)
    if size <= 0 or stride < 1 or start < 0 or start + (size - 1) * stride >= parent.size:
        raise ValueError(
            f"team_split_strided: start={start}, stride={stride}, size={size} does not fit in a "
            f"parent team of {parent.size} PEs"
        )
    me = parent.index_of(my_pe())
    if me < 0:
        raise ShmemError(f"PE {my_pe()} is not a member of {parent!r}")
    signature = hash((start, stride, size)) & 0x7FFFFFFFFFFFFFFF
    seen = _exchange(parent.key, parent.size, me, signature, "shmem.team_split_strided")
    if len(set(seen)) != 1:
        raise ShmemError("team_split_strided is collective: the PEs of the parent team passed "
                         "different start/stride/size")
    # PE 0 of the parent draws the new team's rendezvous key; a second exchange shares it.
    key = 0
    if me == 0:
        with _teams_lock:
            key = _next_team_key[0]
            _next_team_key[0] += 1
    key = _exchange(parent.key, parent.size, me, key, "shmem.team_split_strided")[0]
    pes = parent.pes()
    team = Team(key, pes[start], stride * parent.stride, size)
    return team if team.index_of(my_pe()) >= 0 else None


def team_sync(team: Team) -> None:
    """Collective barrier over the members of ``team``."""
    team = _team_of(team)
    me = team.index_of(my_pe())
    if me < 0:
        raise ShmemError(f"PE {my_pe()} is not a member of {team!r}")
    _lib.quiet(my_pe())
    _exchange(team.key, team.size, me, 0, "shmem.team_sync")


def team_destroy(team: Team) -> None:
    """Destroys ``team``; using it afterwards raises :class:`ShmemError`."""
    team = _team_of(team)
    if team is TEAM_WORLD:
        raise ShmemError("TEAM_WORLD cannot be destroyed")
    team.destroyed = True
