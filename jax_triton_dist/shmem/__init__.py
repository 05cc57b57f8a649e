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
* ``nvshmem``: one process per GPU in a ``jax.distributed`` job; PE = process index,
  the heap is NVSHMEM's symmetric memory.

:func:`init` picks ``host`` on CPU, ``nvshmem`` on GPUs with one GPU per process of a
multi-process job, ``cuda`` otherwise; ``backend=`` or ``$JTD_SHMEM_BACKEND`` overrides.

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

Package layout: :mod:`~.settings` (environment variables, defaults), :mod:`~.lifetime`
(backend choice, init/finalize), :mod:`~.pes` (PE binding), :mod:`~.rendezvous` (the
collective primitive), :mod:`~.memory`, :mod:`~.rma`, :mod:`~.teams`,
:mod:`~.nvshmem_bootstrap` (starting ``nvshmem`` in a JAX job). The runtime uses
:mod:`~.heap` (regions, copies) and :mod:`~.host_atomics` (the interpreter's flags).
"""

from jax_triton_dist._shmem import ShmemAbortedError, ShmemError, ShmemTimeoutError
from jax_triton_dist.shmem.heap import HeapUsage
from jax_triton_dist.shmem.heap import usage as heap_usage
from jax_triton_dist.shmem.lifetime import (
    InitStatus,
    available_backends,
    backend,
    device_of,
    finalize,
    heap_size,
    init,
    init_status,
)
from jax_triton_dist.shmem.memory import align, as_array, calloc, free, malloc, ptr
from jax_triton_dist.shmem.pes import as_pe, bind_pe, my_pe, n_pes, unbind_pe
from jax_triton_dist.shmem.rma import (
    Cmp,
    SignalOp,
    barrier_all,
    fence,
    getmem,
    getmem_nbi,
    putmem,
    putmem_nbi,
    putmem_signal,
    putmem_signal_nbi,
    quiet,
    signal_fetch,
    signal_op,
    signal_wait_until,
)
from jax_triton_dist.shmem.settings import (
    BACKEND_ENV,
    BACKENDS,
    DEFAULT_GPU_HEAP_SIZE,
    DEFAULT_HEAP_SIZE,
    DEFAULT_NVSHMEM_HEAP_SIZE,
    HEAP_SIZE_ENV,
    TIMEOUT_ENV,
    wait_timeout,
)
from jax_triton_dist.shmem.teams import (
    TEAM_WORLD,
    Team,
    team_destroy,
    team_my_pe,
    team_n_pes,
    team_split_strided,
    team_sync,
    team_translate_pe,
)

__all__ = [
    "ShmemError", "ShmemTimeoutError", "ShmemAbortedError", "Cmp", "SignalOp", "InitStatus",
    "Team", "TEAM_WORLD",
    "DEFAULT_HEAP_SIZE", "DEFAULT_GPU_HEAP_SIZE", "DEFAULT_NVSHMEM_HEAP_SIZE", "HEAP_SIZE_ENV",
    "TIMEOUT_ENV", "BACKEND_ENV", "BACKENDS", "available_backends", "device_of",
    "init", "finalize", "init_status", "backend", "heap_size", "as_pe", "bind_pe", "unbind_pe",
    "my_pe", "n_pes", "malloc", "calloc", "align", "free", "ptr", "as_array", "barrier_all",
    "putmem", "getmem", "putmem_nbi", "getmem_nbi", "putmem_signal", "putmem_signal_nbi",
    "signal_op", "signal_fetch", "signal_wait_until", "quiet", "fence",
    "team_split_strided", "team_my_pe", "team_n_pes", "team_translate_pe", "team_sync",
    "team_destroy", "wait_timeout", "heap_usage", "HeapUsage",
]
