"""Timing helpers shared by the benchmark suites."""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_seconds(fn: Callable[[], Any], iters: int, reps: int = 1, warmup: int = 2) -> float:
    """Median time per call of ``fn()``.

    Each of ``iters`` samples dispatches ``reps`` calls back to back and blocks once, so
    with ``reps > 1`` the host's dispatch overlaps the device's work (steady-state time
    per call) instead of adding to it.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


def machine() -> dict[str, Any]:
    """What ran the benchmark."""
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "jax": jax.__version__,
    }


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Prints ``rows`` with ``columns`` = (key, header, format); a value that is missing or
    None (a baseline that could not run) prints as ``-``."""
    cells = [["-" if row.get(key) is None else format(row[key], fmt) for key, _, fmt in columns]
             for row in rows]
    widths = [max(len(header), *(len(c[i]) for c in cells)) if cells else len(header)
              for i, (_, header, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def print_parts(rows: list[dict[str, Any]], columns: dict[str, list[tuple[str, str, str]]]
                ) -> None:
    """Prints one table per part (``row["bench"]``) that has rows, with its columns."""
    for part, part_columns in columns.items():
        selected = [r for r in rows if r.get("bench") == part]
        if selected:
            print(f"\n{part}")
            print_table(selected, part_columns)


def write_json(path: str, suite: str, rows: list[dict[str, Any]]) -> None:
    """Writes the results with the machine description."""
    with open(path, "w") as f:
        json.dump({"suite": suite, "machine": machine(), "results": rows}, f, indent=2)
    print(f"wrote {path}")
