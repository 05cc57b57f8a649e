"""Intra-kernel timelines: when each program of each rank ran, waited and signalled.

Inside ``with jtd.timeline.record("trace.json"):`` every ``triton_call`` (and every op built
on it) traced in the block is timed: its programs record their start and end, each
``dl.wait`` its start and end, each ``dl.notify`` the moment and the peer — from the GPU's
``%globaltimer`` in compiled kernels, from the host clock on the CPU backend. When the block
ends the events are written as a Chrome/Perfetto trace (open it at https://ui.perfetto.dev
or chrome://tracing): one process per PE, one thread per program, so a glance shows whether
a rank's communication overlaps its compute or waits for a late peer.

Timing is chosen at trace time, so ``record`` clears JAX's caches when it starts and ends
(functions traced before are traced again, timed, and after the block untimed again);
kernels of untimed sites hold no timeline code. ``$JTD_TIMELINE=PATH`` times every site
of the process and writes ``PATH`` at exit. ``$JTD_TIMELINE_EVENTS`` (default 256) is the
number of events a program keeps per recording; later ones are counted in the trace's
``otherData.dropped_events``.

Example::

    with jtd.timeline.record("ag_matmul.json") as rec:
        f(x, w).block_until_ready()      # results must be ready before the block ends
    print(len(rec.events), "events")
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from jax_triton_dist.runtime import timeline_capture

__all__ = ["Recording", "record", "chrome_trace"]

chrome_trace = timeline_capture.chrome_trace


@dataclasses.dataclass
class Recording:
    """What a :func:`record` block recorded (filled when the block ends).

    Attributes:
      path: where the trace was written (None: not written).
      events: one dict per event: kernel, site, device, pe, rank, num_ranks, program,
        time_ns, kind (``PROGRAM_START``, ``PROGRAM_END``, ``WAIT_START``, ``WAIT_END``,
        ``NOTIFY``), epoch, arg (a notify's peer), clock.
      dropped: events not kept for lack of room (raise ``$JTD_TIMELINE_EVENTS``).
    """

    path: str | None
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    dropped: int = 0

    def trace(self) -> dict[str, Any]:
        """The Chrome trace object of the events."""
        return chrome_trace(self.events, self.dropped)


@contextlib.contextmanager
def record(path: str | None = None) -> Iterator[Recording]:
    """Times the distributed kernels traced inside the block; writes the trace to ``path``
    (if given) when the block ends. Block on the results inside the block."""
    jax.clear_caches()
    timeline_capture.start()
    recording = Recording(path)
    try:
        yield recording
    finally:
        timeline_capture.stop()
        recording.events, recording.dropped = timeline_capture.collect()
        if path is not None:
            timeline_capture.write(path, recording.events, recording.dropped)
        jax.clear_caches()
