"""The CPU backend's address checks: every load, store and atomic of an interpreted kernel
must touch one of the buffers of its launch — its operands, its results, the symmetric
region of its call site on any rank of its team. Anything else raises, naming the rank,
the kernel, the address and the nearest buffer, instead of corrupting memory or
crashing the process (an out-of-bounds store on CPU is a segfault otherwise).

On by default; ``JTD_CPU_BOUNDS_CHECK=0`` turns it off (see the README for its cost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["ENV", "Buffer", "Bounds", "enabled", "checking", "check"]

ENV = "JTD_CPU_BOUNDS_CHECK"


def enabled() -> bool:
    """Whether launches check addresses (``$JTD_CPU_BOUNDS_CHECK``, default on).

    Raises:
      ValueError: the variable is neither 0 nor 1.
    """
    raw = os.environ.get(ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV}={raw!r}: expected 0 (off) or 1 (on)")
    return raw == "1"


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One valid address range ``[start, start + nbytes)``."""

    start: int
    nbytes: int
    name: str


class Bounds:
    """The buffers one rank's launch may touch."""

    def __init__(self, buffers: Sequence[Buffer], who: str):
        self.buffers = sorted((b for b in buffers if b.nbytes > 0), key=lambda b: b.start)
        self.starts = np.array([b.start for b in self.buffers], dtype=np.uint64)
        self.ends = np.array([b.start + b.nbytes for b in self.buffers], dtype=np.uint64)
        self.who = who

    def _nearest(self, address: int) -> str:
        best = None
        for b in self.buffers:
            if address < b.start:
                gap, where = b.start - address, f"{b.start - address} bytes before"
            else:
                gap, where = address - (b.start + b.nbytes) + 1, (
                    f"{address - (b.start + b.nbytes)} bytes past the end of")
            if best is None or gap < best[0]:
                best = (gap, f"{where} {b.name} (0x{b.start:x}, {b.nbytes} bytes)")
        return best[1] if best else "no buffer at all"

    def check(self, addresses: np.ndarray, itemsize: int, op: str, dtype: str) -> None:
        """Raises IndexError unless every ``[address, address + itemsize)`` lies in one
        buffer."""
        if addresses.size == 0:
            return
        flat = addresses.reshape(-1).astype(np.uint64)
        index = np.searchsorted(self.starts, flat, side="right").astype(np.int64) - 1
        inside = index >= 0
        safe = np.where(inside, index, 0)
        inside &= flat + np.uint64(itemsize) <= self.ends[safe] if self.ends.size else False
        if np.all(inside):
            return
        bad = int(flat[np.argmin(inside)])
        count = int(np.count_nonzero(~inside))
        raise IndexError(
            f"{self.who}: out-of-bounds {op} of {dtype} at 0x{bad:x} ({count} of "
            f"{flat.size} addresses outside every buffer of the launch): "
            f"{self._nearest(bad)}")


_active = threading.local()


@contextlib.contextmanager
def checking(bounds: Bounds | None) -> Iterator[None]:
    """Checks the calling thread's memory operations against ``bounds`` inside the block
    (None: no checks)."""
    previous = getattr(_active, "bounds", None)
    _active.bounds = bounds
    try:
        yield
    finally:
        _active.bounds = previous


def check(ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int, op: str,
          dtype: str) -> None:
    """Checks the addresses ``ptrs`` (where ``mask``) against the thread's bounds, if any."""
    bounds = getattr(_active, "bounds", None)
    if bounds is None:
        return
    addresses = np.asarray(ptrs)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
    bounds.check(addresses, itemsize, op, dtype)
