"""The lock around the Python AST work the runtime does off the main thread.

CPython 3.11's ``ast`` module keeps the depth of the tree it is converting in
interpreter-wide state, so two threads that parse at once can fail with
``SystemError: AST constructor recursion depth mismatch``. The runtime parses kernel
source on XLA's device threads: the interpreter rewrites a kernel and its helpers at their
first run (``runtime/interpreter.py``), an autotuned site hashes its kernel's source
(``JITFunction.cache_key``, ``call_site.CallSite.tuning_key``), the CUDA backend compiles
(``runtime/cuda_dispatch.py``). All of it holds :data:`LOCK`.
"""

from __future__ import annotations

import threading

__all__ = ["LOCK"]

LOCK = threading.RLock()
"""Held while the runtime parses or compiles Python source (re-entrant: a compile may
hash the kernel's source)."""
