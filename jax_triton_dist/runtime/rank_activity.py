"""What each PE's kernels are doing now, for the messages of waits that time out.

A rank that waits in vain for a peer is told which ranks never came; this registry says
where they are instead: the CPU backend records every dispatch of a PE from its start
(before it joins its team) to its end, and a timeout's message lists them ("PE 1 runs
kernel ring_kernel (call 12) for 59.9 s", "PE 2 runs no kernel (the last it ran: ...,
failed 0.1 s ago (SystemError))"), so a peer stuck in an earlier call, or not reached by
its program at all, shows at once.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

__all__ = ["running", "describe"]

_lock = threading.Lock()
_ids = itertools.count()
_running: dict[int, tuple[int, str, float]] = {}  # id -> (PE, what, start)
_last: dict[int, tuple[str, float, str | None]] = {}  # PE -> (what it ran last, end, error)


@contextlib.contextmanager
def running(pe: int, what: str) -> Iterator[None]:
    """Records that ``pe`` runs ``what`` (e.g. ``kernel ring_kernel (call 12)``) inside the
    block."""
    with _lock:
        key = next(_ids)
        _running[key] = (pe, what, time.monotonic())
    error = None
    try:
        yield
    except BaseException as failure:
        error = type(failure).__name__
        raise
    finally:
        with _lock:
            del _running[key]
            _last[pe] = (what, time.monotonic(), error)


def describe(pes: list[int]) -> str:
    """One clause per PE of ``pes``: what it runs now and for how long, else what it ran
    last and how that ended (its program has not reached a later call), else that it has
    run nothing."""
    now = time.monotonic()
    with _lock:
        entries = sorted(_running.values(), key=lambda entry: entry[2])
        last = dict(_last)
    clauses = []
    for pe in pes:
        mine = [f"{what} for {now - start:.1f} s" for p, what, start in entries if p == pe]
        if mine:
            clauses.append(f"PE {pe} runs {', '.join(mine)}")
        elif pe in last:
            what, end, error = last[pe]
            ended = f"failed {now - end:.1f} s ago ({error})" if error else (
                f"ended {now - end:.1f} s ago")
            clauses.append(f"PE {pe} runs no kernel (the last it ran: {what}, {ended})")
        else:
            clauses.append(f"PE {pe} has run no kernel")
    return "; ".join(clauses)
