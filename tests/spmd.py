"""Runs a function on every PE of the host SHMEM backend, one thread per PE."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from jax_triton_dist import shmem


def run_pes(fn: Callable[[int], Any], n_pes: int | None = None, timeout: float = 120.0) -> list:
    """Calls ``fn(pe)`` on a thread bound to each PE; returns the results in PE order.

    Re-raises the first exception (lowest PE) after all threads finished.
    """
    n = shmem.n_pes() if n_pes is None else n_pes
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def body(pe: int) -> None:
        try:
            with shmem.as_pe(pe):
                results[pe] = fn(pe)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors[pe] = error

    threads = [threading.Thread(target=body, args=(pe,), daemon=True) for pe in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a PE thread did not finish within {timeout} s")
    for error in errors:
        if error is not None:
            raise error
    return results


def errors_of(fn: Callable[[int], Any], n_pes: int | None = None) -> list[BaseException | None]:
    """Like :func:`run_pes`, but returns each PE's exception (or None)."""
    n = shmem.n_pes() if n_pes is None else n_pes

    def wrapped(pe: int):
        try:
            fn(pe)
        except Exception as error:  # noqa: BLE001
            return error
        return None

    return run_pes(wrapped, n)
