"""A straggling rank: one CPU device starts every kernel late."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["delayed_device"]


@contextlib.contextmanager
def delayed_device(pe: int, seconds: float) -> Iterator[None]:
    """Inside the block, CPU device ``pe`` sleeps ``seconds`` before each kernel it runs
    (the other ranks wait for it in their ``dl.wait``\\ s), as a slow or preempted rank
    would. CPU backend only: compiled GPU launches do not pass through Python.

    Raises:
      ValueError: a negative delay.
    """
    if seconds < 0:
        raise ValueError(f"delayed_device: seconds must be >= 0, got {seconds}")
    from jax_triton_dist.runtime import cpu_dispatch

    original = cpu_dispatch._run

    def delayed(call_id, device_ordinal, *args):
        if device_ordinal == pe:
            time.sleep(seconds)
        return original(call_id, device_ordinal, *args)

    cpu_dispatch._run = delayed
    try:
        yield
    finally:
        cpu_dispatch._run = original
