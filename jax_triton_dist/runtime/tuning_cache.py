"""The autotuner's disk cache: one JSON file of chosen configs, shared by processes.

Each entry is keyed by a hash of what the choice depends on (kernel source, operand
shapes and dtypes, key arguments, rank count, device kind, software versions, the config
space) and holds the chosen config, the measured times and that description. Writers
merge into the file under a lock and replace it atomically, so concurrent processes
(the ranks of a job on one node) keep each other's entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
from typing import Any

from absl import logging

__all__ = ["CACHE_ENV", "path", "key_of", "lookup", "store", "entries"]

CACHE_ENV = "JTD_AUTOTUNE_CACHE"
"""Path of the cache file; empty: no disk cache. Default:
``$XDG_CACHE_HOME/jax_triton_dist/autotune.json`` (``~/.cache`` without XDG_CACHE_HOME)."""
_FORMAT = 1
_lock = threading.Lock()  # the file lock is per process; threads take this one first


def path() -> str | None:
    """The cache file, or None when the disk cache is off.

    Raises:
      ValueError: ``$JTD_AUTOTUNE_CACHE`` names a directory.
    """
    raw = os.environ.get(CACHE_ENV)
    if raw is not None:
        if not raw.strip():
            return None
        if os.path.isdir(raw):
            raise ValueError(f"{CACHE_ENV}={raw!r} is a directory; expected the path of a "
                             "JSON file (it is created if missing), or empty for no cache")
        return raw
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax_triton_dist", "autotune.json")


def key_of(description: dict[str, Any]) -> str:
    """The entry key of a call described by JSON-compatible data."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read(file: str) -> dict[str, Any]:
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # a damaged file is replaced by the next store
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def lookup(key: str) -> dict[str, Any] | None:
    """The config stored under ``key`` (``Config.as_dict()`` form), or None."""
    file = path()
    if file is None:
        return None
    entry = _read(file).get(key)
    return entry.get("config") if isinstance(entry, dict) else None


def entries() -> dict[str, dict[str, Any]]:
    """Every entry of the cache file (empty when there is none)."""
    file = path()
    return {} if file is None else _read(file)


@contextlib.contextmanager
def _locked(file: str):
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with _lock, open(file + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(key: str, config: dict[str, Any], details: dict[str, Any]) -> None:
    """Stores ``config`` under ``key`` with ``details`` (times, the call's description).
    Does nothing when the disk cache is off; a cache that cannot be written is skipped
    (tuning is repeated next time), never an error of the call."""
    file = path()
    if file is None:
        return
    try:
        with _locked(file):
            merged = _read(file)
            merged[key] = {"config": config, **details}
            folder = os.path.dirname(os.path.abspath(file))
            with tempfile.NamedTemporaryFile("w", dir=folder, delete=False,
                                             suffix=".tmp") as out:
                json.dump({"format": _FORMAT, "entries": merged}, out, indent=1,
                          default=str)
            os.replace(out.name, file)
    except OSError as error:
        logging.warning("jtd autotune: cannot write the cache %s (%s); the choice is kept "
                        "for this process only", file, error)
