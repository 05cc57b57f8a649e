"""One-sided RMA, signals and ordering: puts, gets, signal updates, waits, barrier.

Destinations of puts and sources of gets are symmetric addresses of the calling PE
(translated to PE ``pe``'s heap); the other side may be any host or device memory.
"""

from __future__ import annotations

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.lifetime import check_pe
from jax_triton_dist.shmem.memory import offset_of
from jax_triton_dist.shmem.pes import my_pe
from jax_triton_dist.shmem.rendezvous import barrier
from jax_triton_dist.shmem.settings import wait_timeout
from jax_triton_dist.shmem.signals import Cmp, SignalOp

__all__ = [
    "Cmp", "SignalOp", "putmem", "getmem", "putmem_nbi", "getmem_nbi", "putmem_signal",
    "putmem_signal_nbi", "signal_op", "signal_fetch", "signal_wait_until", "quiet", "fence",
    "barrier_all",
]

def _remote(dest: int, pe: int, what: str) -> int:
    check_pe(pe)
    base = _lib.heap_base(pe)
    if base == 0:
        raise _lib.ShmemError(
            f"PE {my_pe()}: {what}: PE {pe}'s heap is not reachable by load/store from here "
            "(another node: NVSHMEM reports no nvshmem_ptr mapping); host-side puts and gets "
            "reach PEs on this node only")
    return base + offset_of(int(dest), what)


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
    return _lib.load(me, _lib.heap_base(me) + offset_of(sig_addr, "signal_fetch"), 8)


def signal_wait_until(sig_addr: int, cmp: Cmp, cmp_value: int, timeout: float | None = None) -> int:
    """Waits until the local signal ``sig_addr`` satisfies ``cmp`` against ``cmp_value``.

    Returns:
      The signal's value once the comparison held.

    Raises:
      ShmemTimeoutError: not satisfied within ``timeout`` (default: the wait timeout);
        the message names the PE, the address, the expected and the seen value.
    """
    cmp = Cmp(cmp)
    me = my_pe()
    addr = _lib.heap_base(me) + offset_of(int(sig_addr), "signal_wait_until: sig_addr")
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
    barrier("shmem.barrier_all")
