"""The intra-kernel timeline: what the ``dl`` primitives record when a call site is timed.

A timed launch records, per program, its start and end, each ``dl.wait``'s start and end and
each ``dl.notify`` (with the peer), each with a timestamp: the GPU's ``%globaltimer`` in
compiled kernels, the host's ``perf_counter_ns`` in the interpreter. Untimed call sites
compile without any of it.

Compiled kernels write events into a timeline area of the call site's symmetric region
(after the workspaces and staging; :func:`area_bytes`): per program an int64 event counter,
then ``capacity`` events of four int64 words (:data:`EVENT_FIELDS`). The interpreter appends
the same events to the rank context's ``timeline`` list.
"""

from __future__ import annotations

import enum
import time

import numpy as np

from jax_triton_dist.language import context

__all__ = ["Kind", "EVENT_FIELDS", "EVENT_BYTES", "program_stride", "area_bytes", "decode",
           "record_interpreted"]


class Kind(enum.IntEnum):
    """What an event marks."""

    PROGRAM_START = 0
    PROGRAM_END = 1
    WAIT_START = 2
    WAIT_END = 3
    NOTIFY = 4  # arg: the peer rank


EVENT_FIELDS = ("time_ns", "kind", "epoch", "arg")
"""The int64 words of one recorded event."""
EVENT_BYTES = 8 * len(EVENT_FIELDS)


def program_stride(capacity: int) -> int:
    """Bytes per program in the timeline area: the counter, then ``capacity`` events."""
    return 8 + capacity * EVENT_BYTES


def area_bytes(programs: int, capacity: int) -> int:
    """Bytes of the timeline area of a launch of ``programs`` programs."""
    return programs * program_stride(capacity)


def decode(raw: bytes | np.ndarray, programs: int, capacity: int
           ) -> tuple[list[tuple[int, int, int, int, int]], int]:
    """The events of one rank's timeline area: ``([(program, time_ns, kind, epoch, arg)],
    dropped)``, ``dropped`` counting events beyond ``capacity``."""
    words = np.frombuffer(bytes(raw), np.int64)
    stride = program_stride(capacity) // 8
    events, dropped = [], 0
    for program in range(programs):
        block = words[program * stride:(program + 1) * stride]
        count = int(block[0])
        kept = min(count, capacity)
        dropped += count - kept
        for row in block[1:1 + kept * len(EVENT_FIELDS)].reshape(kept, len(EVENT_FIELDS)):
            events.append((program, int(row[0]), int(row[1]), int(row[2]), int(row[3])))
    return events, dropped


def _program_index() -> int:
    from triton.runtime import interpreter as _interp

    builder = _interp.interpreter_builder
    x, y, z = builder.grid_idx
    nx, ny, _ = builder.grid_dim
    return x + nx * (y + ny * z)


def record_interpreted(kind: Kind, arg: int = 0) -> None:
    """Appends an event of the running interpreted program, when its launch is timed."""
    ctx = getattr(context._state, "ctx", None)
    if ctx is None or ctx.timeline is None:
        return
    ctx.timeline.append((_program_index(), time.perf_counter_ns(), int(kind), ctx.epoch,
                         int(arg)))
