"""Rendezvous of the SHMEM host API: an all-gather of one int64 among the members of a
team, the primitive every collective host call (malloc, free, barrier, team split) is
built on.

PEs of one process meet in the backend (C++, the GIL released while waiting); PEs in
different processes (``nvshmem``) meet in JAX's distributed key-value store
(:class:`~jax_triton_dist.shmem.nvshmem_bootstrap.KeyValueRendezvous`), which
:func:`jax_triton_dist.shmem.init` starts with the instance.
"""

from __future__ import annotations

from jax_triton_dist import _shmem as _lib
from jax_triton_dist.shmem.lifetime import cross_process_store
from jax_triton_dist.shmem.pes import my_pe
from jax_triton_dist.shmem.settings import TIMEOUT_ENV, wait_timeout

__all__ = ["WORLD_KEY", "gather", "world_gather", "barrier", "process_gather"]

WORLD_KEY = 0
"""Rendezvous key of the team of every PE."""


def gather(team_key: int, members: int, index: int, value: int, what: str) -> list[int]:
    """Member ``index`` of the ``members`` of team ``team_key`` contributes ``value``;
    returns every member's value in member order. Calls pair up in order per team.

    Raises:
      ShmemTimeoutError: a member did not arrive within the wait timeout; the message
        says that ``what`` (done by the calling PE) is collective and who was missing.
    """
    store = cross_process_store()
    try:
        if store is not None:
            return store(team_key, members, index, int(value), wait_timeout())
        return _lib.rendezvous(team_key, members, index, int(value), wait_timeout())
    except _lib.ShmemTimeoutError as error:
        raise _lib.ShmemTimeoutError(
            f"PE {my_pe()}: {what} is collective and {error} (members are numbered in the "
            f"team; raise {TIMEOUT_ENV} if they are only slow)") from None


def world_gather(value: int, what: str) -> list[int]:
    """:func:`gather` over every PE, by the calling PE."""
    return gather(WORLD_KEY, _lib.n_pes(), my_pe(), value, what)


def barrier(what: str) -> None:
    """Completes the calling PE's outstanding RMA, then waits for every PE."""
    _lib.quiet(my_pe())
    world_gather(0, what)


def process_gather(name: str, members: int, index: int, value: int) -> list[int]:
    """All-gather of one int64 among PEs of different processes (``nvshmem``), for the
    runtime's cross-process call sites. ``name`` must be unique per rendezvous and the
    same in every member.

    Raises:
      ShmemError: SHMEM runs in one process and ``members > 1``.
      ShmemTimeoutError: a member did not arrive within the wait timeout.
    """
    store = cross_process_store()
    if store is None:
        if members == 1:
            return [int(value)]
        raise _lib.ShmemError("no cross-process rendezvous: SHMEM runs in one process")
    return store.gather(name, members, index, value, wait_timeout())
