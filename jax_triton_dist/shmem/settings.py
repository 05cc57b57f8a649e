"""SHMEM settings: environment variables, defaults, and the heap's allocation alignment.

Every setting is read when it is needed (nothing at import), and a bad value raises a
``ValueError`` that names the variable and shows what is expected.
"""

from __future__ import annotations

import os

__all__ = [
    "BACKENDS", "BACKEND_ENV", "HEAP_SIZE_ENV", "TIMEOUT_ENV", "DEFAULT_HEAP_SIZE",
    "DEFAULT_GPU_HEAP_SIZE", "DEFAULT_NVSHMEM_HEAP_SIZE", "DEFAULT_TIMEOUT_S", "ALIGNMENT",
    "aligned", "parse_size", "heap_size_or_default", "wait_timeout", "positive_from_env",
    "backend_from_env",
    "check_environment",
]

BACKENDS = ("host", "cuda", "nvshmem")
"""The SHMEM backends (a build has those :func:`shmem.available_backends` lists)."""
BACKEND_ENV = "JTD_SHMEM_BACKEND"
"""Environment variable naming the backend :func:`shmem.init` uses when none is given."""
HEAP_SIZE_ENV = "JTD_SHMEM_HEAP_SIZE"
"""Environment variable for the heap size: bytes, or with a K/M/G suffix."""
TIMEOUT_ENV = "JTD_WAIT_TIMEOUT"
"""Environment variable: seconds a wait or a collective may take before it fails."""

DEFAULT_HEAP_SIZE = 1 << 30
"""Default per-PE heap size of ``host`` (1 GiB of address space; pages are committed on
use)."""
DEFAULT_GPU_HEAP_SIZE = 64 << 30
"""Default per-PE heap size of ``cuda`` (64 GiB of GPU address space; physical memory is
mapped as allocations grow, in steps of at least 32 MiB)."""
DEFAULT_NVSHMEM_HEAP_SIZE = 1 << 30
"""Default heap size of ``nvshmem`` (1 GiB: NVSHMEM commits the heap's memory up front)."""
DEFAULT_TIMEOUT_S = 60.0

ALIGNMENT = 256
"""Bytes every symmetric allocation (and every call site's region) is aligned to."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGNMENT`."""
    return (int(nbytes) + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def parse_size(raw: str, what: str = HEAP_SIZE_ENV) -> int:
    """Bytes of a size written as ``268435456``, ``256M``, ``2G`` (``K``/``M``/``G``,
    optional ``B``).

    Raises:
      ValueError: not a size; the message names ``what``.
    """
    text = raw.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    try:
        return int(float(digits) * scale)
    except ValueError:
        raise ValueError(
            f"{what}={raw!r} is not a size (examples: 268435456, 256M, 2G)") from None


def heap_size_or_default(heap_size: int | None, default: int) -> int:
    """``heap_size``, else ``$JTD_SHMEM_HEAP_SIZE``, else ``default``; rounded up to the
    alignment.

    Raises:
      ValueError: the size is not positive, or the variable is not a size.
    """
    source = "the heap_size argument"
    if heap_size is None:
        env = os.environ.get(HEAP_SIZE_ENV)
        heap_size, source = (parse_size(env), f"{HEAP_SIZE_ENV}={env!r}") if env else (
            default, "the default")
    if int(heap_size) <= 0:
        raise ValueError(
            f"shmem.init: heap_size must be positive, got {heap_size} (from {source}; set it "
            f"with the heap_size argument or {HEAP_SIZE_ENV}, e.g. 256M)")
    return aligned(heap_size)


def wait_timeout() -> float:
    """Seconds a wait or collective may take: ``$JTD_WAIT_TIMEOUT`` or 60.

    Raises:
      ValueError: the variable is not a positive number.
    """
    return positive_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float, "a number of seconds")


def positive_from_env(name: str, default, convert, what: str):
    """``convert($name)``, or ``default`` when the variable is unset.

    Raises:
      ValueError: the value is not ``what`` (``convert`` fails), or not positive.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = convert(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def backend_from_env() -> str | None:
    """``$JTD_SHMEM_BACKEND``, or None when unset.

    Raises:
      ValueError: the variable names no backend.
    """
    raw = os.environ.get(BACKEND_ENV)
    if not raw:
        return None
    if raw not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={raw!r} is not a SHMEM backend (expected one of "
                         f"{', '.join(BACKENDS)})")
    return raw


def check_environment() -> None:
    """Reads every SHMEM setting of the environment, so that a bad one raises where the
    caller sees it (``triton_call`` checks at trace time, before any kernel runs).

    Raises:
      ValueError: a variable that is not a size, a positive number or a backend.
    """
    backend_from_env()
    wait_timeout()
    heap_size_or_default(None, DEFAULT_HEAP_SIZE)
