"""Executions in which a rank's kernel failed: the other ranks' calls of the same execution
stop at once instead of waiting out ``JTD_WAIT_TIMEOUT`` for a rank that will not come.

XLA gives every custom call the id of its execution (``RunId``: one per SPMD execution,
shared by its devices). When a PE's call fails, its program ends there; a peer that goes
on to a later call of the same execution would wait for it in vain (at the call's first
join, or at a ``dl.wait`` for its flags). The CPU backend therefore enters every dispatch
into its run here: a run that has failed refuses new calls, and its running calls' waits
watch the run's abort word (an int64 that turns 1 when the run fails) besides their team's.
The execution fails either way; this makes it fail now, with the first failure's message.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import numpy as np

from jax_triton_dist import shmem
from jax_triton_dist.shmem import host_atomics

__all__ = ["entered", "fail", "reason"]

_KEEP = 256  # failed runs remembered (a run's failure matters only while it executes)

_lock = threading.Lock()
_words: dict[int, tuple[np.ndarray, int]] = {}  # run -> (abort word, calls inside)
_failed: collections.OrderedDict[int, str] = collections.OrderedDict()  # run -> why


def reason(run_id: int) -> str | None:
    """Why the run failed (its first failure: PE, kernel and message), or None."""
    with _lock:
        return _failed.get(run_id)


@contextlib.contextmanager
def entered(run_id: int, who: str) -> Iterator[int]:
    """Enters a call of ``who`` (e.g. ``PE 1, kernel k``) into execution ``run_id``;
    yields the address of the run's abort word (waits give up when it is nonzero). Run 0
    stands for no known execution: nothing is tracked, the address is 0.

    Raises:
      ShmemAbortedError: the run has already failed (on another PE).
    """
    if not run_id:
        yield 0
        return
    with _lock:
        why = _failed.get(run_id)
        if why is None:
            word, inside = _words.get(run_id, (None, 0))
            if word is None:
                word = np.zeros(1, np.int64)
            _words[run_id] = (word, inside + 1)
    if why is not None:
        raise shmem.ShmemAbortedError(f"{who}: not run: {why}")
    try:
        yield word.ctypes.data
    finally:
        with _lock:
            word, inside = _words[run_id]
            if inside == 1:
                del _words[run_id]
            else:
                _words[run_id] = (word, inside - 1)


def fail(run_id: int, pe: int, what: str, message: str) -> None:
    """Records that ``what`` (a kernel) failed on ``pe`` in execution ``run_id`` (the first
    failure of a run is the one kept) and raises the run's abort word."""
    if not run_id:
        return
    with _lock:
        if run_id not in _failed:
            _failed[run_id] = (f"PE {pe}'s {what} failed in this execution "
                               f"({message})")
            while len(_failed) > _KEEP:
                _failed.popitem(last=False)
        if run_id in _words:
            host_atomics.signal_op(_words[run_id][0].ctypes.data, 1, shmem.SignalOp.SET, 8)
