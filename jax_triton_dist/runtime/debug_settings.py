"""Debugging settings: environment variables that make the runtime show what it does.

Every setting is read when it is needed and a bad value raises a ``ValueError`` naming the
variable and what is expected (``triton_call`` reads them at trace time, with the SHMEM
settings). The README's "Debugging" table documents them.
"""

from __future__ import annotations

import os

from jax_triton_dist.shmem import settings

__all__ = ["DUMP_IR_ENV", "LOG_ENV", "LOG_CATEGORIES", "TIMELINE_ENV", "TIMELINE_EVENTS_ENV",
           "DEFAULT_TIMELINE_EVENTS", "dump_ir_dir", "log_categories", "logs",
           "timeline_path", "timeline_events", "check_environment"]

DUMP_IR_ENV = "JTD_DUMP_IR"
"""A directory: every compiled kernel's stages are written under it, one folder per call
site and device."""
LOG_ENV = "JTD_LOG"
"""Comma-separated log categories (:data:`LOG_CATEGORIES`), written through absl logging."""
LOG_CATEGORIES = ("plan", "launch", "compile", "autotune")
"""``plan``: a line per call site's first run on a device (its team, rank, grid);
``launch``: a line per launch (kernel, grid, rank, team, epoch; implies ``plan``);
``compile``: a line per compiled kernel with its compile time; ``autotune``: a line per
config timed and per choice (``jax_triton_dist.autotune``)."""
TIMELINE_ENV = "JTD_TIMELINE"
"""A path: call sites traced while it is set record an intra-kernel timeline, written there
as a Chrome/Perfetto trace when the process exits (``jtd.timeline.record`` does the same for
a block of code)."""
TIMELINE_EVENTS_ENV = "JTD_TIMELINE_EVENTS"
"""Events each program of a timed launch may record (later ones are counted, not kept)."""
DEFAULT_TIMELINE_EVENTS = 256


def dump_ir_dir() -> str | None:
    """``$JTD_DUMP_IR``, or None when unset or empty."""
    return os.environ.get(DUMP_IR_ENV) or None


def log_categories() -> frozenset[str]:
    """The categories ``$JTD_LOG`` names (``launch`` implies ``plan``).

    Raises:
      ValueError: an unknown category.
    """
    raw = os.environ.get(LOG_ENV, "")
    names = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = sorted(names - set(LOG_CATEGORIES) - {"all"})
    if unknown:
        raise ValueError(f"{LOG_ENV}={raw!r}: unknown categories {unknown} (expected a "
                         f"comma-separated list of {', '.join(LOG_CATEGORIES)}, or all)")
    if "all" in names:
        return frozenset(LOG_CATEGORIES)
    if "launch" in names:
        names.add("plan")
    return frozenset(names)


def logs(category: str) -> bool:
    """Whether ``$JTD_LOG`` asks for ``category``."""
    return category in log_categories()


def timeline_path() -> str | None:
    """``$JTD_TIMELINE``, or None when unset or empty."""
    return os.environ.get(TIMELINE_ENV) or None


def timeline_events() -> int:
    """``$JTD_TIMELINE_EVENTS`` or 256.

    Raises:
      ValueError: not a positive integer.
    """
    return settings.positive_from_env(TIMELINE_EVENTS_ENV, DEFAULT_TIMELINE_EVENTS, int,
                                      "an integer")


def check_environment() -> None:
    """Reads every debugging setting, so that a bad one raises where the caller sees it.

    Raises:
      ValueError: a bad value.
    """
    log_categories()
    timeline_events()
    path = dump_ir_dir()
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{DUMP_IR_ENV}={path!r} is a file; expected a directory (it is "
                         "created if missing)")
