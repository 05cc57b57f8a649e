"""The rank context that the interpreted ``dl`` primitives read.

The runtime makes a :class:`RankContext` current on a device's thread while that
device's rank runs a kernel in the interpreter; ``dl.rank()``, ``dl.symm_at()`` and friends
read it. (Compiled kernels read the same facts from device memory: ``device_abi``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import numpy as np

__all__ = ["RankContext", "current", "active"]


@dataclasses.dataclass(frozen=True)
class RankContext:
    """Where a kernel launch runs.

    Attributes:
      rank: position of this device along the kernel's mesh axis (its team rank).
      num_ranks: size of that axis (the team size).
      pe: this device's SHMEM PE.
      team_pes: PE of every team rank.
      heap_bases: symmetric heap base address of every team rank (uint64).
      heap_size: bytes per heap.
      epoch: how many times this call site has run on this rank, counting this run (from 1).
      barrier_area: address (this rank's heap) of ``num_ranks`` uint64 counters for
        ``dl.barrier_all``.
      timeout: seconds a wait may take.
      label: names the kernel, for error messages.
      abort_word: address (this rank's heap) of the team's int64 abort word: waits of
        epoch ``e`` give up once it reaches ``e`` (a rank of the call failed); 0: none.
      run_abort_word: address of the execution's int64 abort word: waits give up once it
        is nonzero (a call of the same execution failed: ``runtime/failed_runs.py``); 0:
        none.
      timeline: where the primitives append timeline events of a timed launch
        (``language/timeline.py``); None: the launch is not timed.
    """

    rank: int
    num_ranks: int
    pe: int
    team_pes: tuple[int, ...]
    heap_bases: np.ndarray
    heap_size: int
    epoch: int
    barrier_area: int
    timeout: float
    label: str
    abort_word: int = 0
    run_abort_word: int = 0
    timeline: list | None = None

    def who(self) -> str:
        """``"rank R of N (PE P), kernel K"`` for error messages."""
        return f"rank {self.rank} of {self.num_ranks} (PE {self.pe}), kernel {self.label}"


_state = threading.local()


def current() -> RankContext:
    """The calling thread's rank context.

    Raises:
      RuntimeError: no distributed kernel is running on this thread.
    """
    ctx = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "distributed primitives (dl.rank, dl.symm_at, ...) only run inside a kernel "
            "launched by jax_triton_dist.triton_call"
        )
    return ctx


@contextlib.contextmanager
def active(ctx: RankContext) -> Iterator[RankContext]:
    """Makes ``ctx`` current on the calling thread inside the block."""
    previous = getattr(_state, "ctx", None)
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = previous
