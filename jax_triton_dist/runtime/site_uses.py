"""Which call sites XLA's executables still use: a site no executable uses is released
(its symmetric regions freed, its launch plans dropped), so a job that traces again and
again — new shapes, notebook cells — does not run the heap dry.

The FFI target's instantiate stage makes XLA create one use per (executable, device) and
destroy it with the executable (``xla_ffi/site_uses.h``); the extensions log both events,
and :func:`drain` applies the log. It runs where the runtime is about to need heap space
and where a user asks for the heap's use (``jax_triton_dist.heap_usage``), never from
XLA's threads while they destroy an executable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from jax_triton_dist.runtime import call_site

__all__ = ["add_log", "drain", "uses"]

_lock = threading.Lock()
_uses: dict[int, int] = {}  # call id -> live (executable, device) uses
_logs: list[Callable[[], list]] = []  # each returns (call_id, +1 | -1, instance) events


def add_log(take_events: Callable[[], list]) -> None:
    """Adds an extension's event log (``take_site_events``); registration does it."""
    if take_events not in _logs:
        _logs.append(take_events)


def drain() -> list[int]:
    """Applies the events logged since the last call; releases the sites whose last use
    ended. Returns their call ids."""
    with _lock:
        gone = []  # (call id, instance) of uses that ended
        for call_id, delta, instance in (event for log in _logs for event in log()):
            _uses[call_id] = _uses.get(call_id, 0) + delta
            if delta < 0:
                gone.append((call_id, instance))
        ended = [call_id for call_id, count in _uses.items() if count <= 0]
        for call_id in ended:
            del _uses[call_id]
    for call_id, instance in gone:
        if call_id not in ended:  # the site lives on in other custom calls
            call_site.release_instance(call_id, instance)
    for call_id in ended:
        call_site.release(call_id)
    return ended


def uses(call_id: int) -> int:
    """Live uses of ``call_id`` as of the last :func:`drain`."""
    with _lock:
        return _uses.get(call_id, 0)
