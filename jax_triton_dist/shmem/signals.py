"""Comparisons and signal updates: the project's own numbering, defined once here.

The host API (``shmem.signal_wait_until``, ``shmem.signal_op``), the ``dl`` primitives and
the C++ backends use these values (``tests/test_device_abi.py`` checks the C++ enums
agree); backends that wrap another SHMEM library translate them. Pure Python: the kernel
language imports it where the extension is not built (the Ascend lowering).
"""

from __future__ import annotations

import enum

__all__ = ["Cmp", "SignalOp"]


class Cmp(enum.IntEnum):
    """Comparison of ``signal_wait_until`` and ``dl.wait``."""

    EQ = 0
    NE = 1
    GT = 2
    GE = 3
    LT = 4
    LE = 5


class SignalOp(enum.IntEnum):
    """Signal update of ``signal_op`` / ``putmem_signal`` / ``dl.notify``."""

    SET = 0
    ADD = 1
