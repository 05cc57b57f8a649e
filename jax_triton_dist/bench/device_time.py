"""Kernel-alone device time of jitted functions, from JAX's profiler (CUPTI on GPUs).

Both sides of a comparison are timed the same way: each call of a jitted function runs
alone (blocked on), under one profiler trace, and its time is the sum of the durations of
the GPU kernels it ran — our Triton kernel launched by the custom call, XLA's cuBLAS and
fusion kernels — without host dispatch, launch gaps or copies. Memory copies and sets
(e.g. the epoch write before our launch) are left out on both sides.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["kernel_seconds", "KernelTimes"]

_NOT_KERNELS = ("memcpy", "memset", "MemcpyD", "MemsetD", "Memcpy", "Memset")


class KernelTimes:
    """The kernels one call ran (names) and the median seconds per call."""

    def __init__(self, seconds: float, kernels: list[str], calls: int, source: str):
        self.seconds = seconds
        self.kernels = kernels
        self.calls = calls
        self.source = source  # "profiler" (device time) or "wall" (no device events found)

    def __repr__(self) -> str:
        return (f"KernelTimes({self.seconds * 1e6:.1f} us/call over {self.calls} calls, "
                f"{self.source}, kernels={self.kernels})")


_SUMMARY_LINES = ("XLA", "Launch", "Step", "Framework", "Source")


def _device_events(path: str) -> list[tuple[int, int, str]]:
    """``(start_ns, duration_ns, name)`` of every kernel on a GPU plane of a trace: the
    events of its stream lines (its summary lines — XLA ops and modules, launch stats —
    repeat them)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")]
        if not streams:
            streams = [line for line in lines
                       if not any(word in line.name for word in _SUMMARY_LINES)]
        for line in streams:
            for event in line.events:
                if any(word in event.name for word in _NOT_KERNELS):
                    continue
                events.append((int(event.start_ns), int(event.duration_ns), event.name))
    return sorted(events)


def _split_calls(events: list[tuple[int, int, str]], calls: int) -> list[list]:
    """Groups the kernel events of ``calls`` consecutive blocked calls, at the ``calls - 1``
    widest gaps between one kernel's end and the next one's start."""
    if calls == 1 or len(events) < calls:
        return [events]
    gaps = sorted(range(1, len(events)),
                  key=lambda i: events[i][0] - (events[i - 1][0] + events[i - 1][1]),
                  reverse=True)[:calls - 1]
    bounds = [0, *sorted(gaps), len(events)]
    return [events[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def kernel_seconds(fn: Callable[..., Any], *args: Any, calls: int = 20,
                   warmup: int = 3) -> KernelTimes:
    """Median over ``calls`` blocked calls of ``fn(*args)`` of its kernels' summed device
    time. Falls back to the median wall time per call (``source="wall"``) where the
    profiler records no device kernels (the CPU backend)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    walls = []
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                walls.append(time.perf_counter() - start)
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        events = _device_events(paths[0]) if paths else []
    if not events:
        return KernelTimes(statistics.median(walls), [], calls, "wall")
    groups = _split_calls(events, calls)
    per_call = [sum(duration for _, duration, _ in group) / 1e9 for group in groups]
    names = sorted({name for _, _, name in groups[len(groups) // 2]})
    return KernelTimes(statistics.median(per_call), names, len(groups), "profiler")
