"""Atomic operations on host memory: what the interpreted ``dl`` primitives do to flags.

They work on any host address (no SHMEM instance needed); the C++ side implements them
with ``std::atomic`` and releases the GIL while a wait spins.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_triton_dist import _shmem as _lib

__all__ = ["wait_flags", "signal_op", "fence", "cancel_waits"]


def wait_flags(addrs: Sequence[int], itemsize: int, is_signed: bool, cmp: int, value: int,
               timeout_s: float, who: str, abort_word: int = 0, epoch: int = 0,
               run_abort_word: int = 0) -> None:
    """Spins until every flag at ``addrs`` (``itemsize`` bytes, 4 or 8) compares true with
    ``value`` under ``cmp`` (a :class:`shmem.Cmp`).

    Raises:
      ShmemTimeoutError: not within ``timeout_s``; names ``who``, the flag index and
        address, the expected and the seen value.
      ShmemAbortedError: the int64 at ``abort_word`` reached ``epoch`` (a peer of the call
        failed), the int64 at ``run_abort_word`` is nonzero (a call of the same execution
        failed: ``runtime/failed_runs.py``), or waits were cancelled (:func:`cancel_waits`).
    """
    _lib.wait_flags([int(a) for a in addrs], itemsize, is_signed, int(cmp), int(value),
                    float(timeout_s), who, int(abort_word), int(epoch), int(run_abort_word))


def cancel_waits(reason: str) -> None:
    """Makes every wait and rendezvous of the process, running or to come, raise
    ShmemAbortedError with ``reason`` (at interpreter exit: no thread may stay spinning)."""
    _lib.cancel_waits(reason)


def signal_op(addr: int, value: int, op: int, itemsize: int) -> None:
    """Release store (``SignalOp.SET``) or acquire-release add (``ADD``) of ``value``."""
    _lib.signal_op(int(addr), int(value), int(op), itemsize)


def fence() -> None:
    """A sequentially consistent fence."""
    _lib.fence()
