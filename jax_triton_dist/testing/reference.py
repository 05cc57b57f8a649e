"""Checking a distributed function against a reference, rank by rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["RankError", "default_tolerance", "compare", "assert_matches_reference"]


@dataclasses.dataclass(frozen=True)
class RankError:
    """The largest errors of one output on one rank."""

    output: str  # the output's path in the result pytree
    rank: dict[str, int]  # the device's mesh coordinates
    device: str
    max_abs: float
    max_rel: float
    ok: bool

    def __str__(self) -> str:
        where = ",".join(f"{k}={v}" for k, v in self.rank.items())
        return (f"{self.output:<12} {where:<14} {self.device:<12} {self.max_abs:<12.3e} "
                f"{self.max_rel:<12.3e} {'ok' if self.ok else 'FAIL'}")


def default_tolerance(dtype: Any) -> tuple[float, float]:
    """``(atol, rtol)`` for results of ``dtype`` computed by a distributed kernel against a
    reference: exact for integers and booleans; float32 1e-5; float16 2e-3; bfloat16 2e-2;
    8-bit floats 1.25e-1; float64 1e-12."""
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.inexact) and dtype.kind not in "fcV":
        return 0.0, 0.0
    name = dtype.name
    if name.startswith("float8"):
        return 1.25e-1, 1.25e-1
    table = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5, "complex64": 1e-5,
             "float64": 1e-12, "complex128": 1e-12}
    tol = table.get(name, 1e-5)
    return tol, tol


def _tolerance(tol: float | tuple[float, float] | None, dtype: Any) -> tuple[float, float]:
    if tol is None:
        return default_tolerance(dtype)
    if isinstance(tol, (int, float)):
        return float(tol), float(tol)
    atol, rtol = tol
    return float(atol), float(rtol)


def _wide(array: np.ndarray) -> np.ndarray:
    if np.iscomplexobj(array):
        return array.astype(np.complex128)
    return array.astype(np.float64)


def compare(name: str, got: jax.Array, want: jax.Array, mesh: jax.sharding.Mesh,
            atol: float, rtol: float) -> list[RankError]:
    """Each device's shard of ``got`` against the same shard of ``want``: one
    :class:`RankError` per device (``ok``: every element within ``atol + rtol * |want|``;
    NaN matches NaN)."""
    if got.shape != want.shape:
        raise AssertionError(f"output {name}: shape {got.shape}, reference {want.shape}")
    want_shards = {shard.device: shard for shard in want.addressable_shards}
    coords = {device: dict(zip(mesh.axis_names, index, strict=True))
              for index, device in np.ndenumerate(mesh.devices)}
    rows = []
    for shard in got.addressable_shards:
        other = want_shards.get(shard.device)
        a = _wide(np.asarray(shard.data))
        b = _wide(np.asarray(other.data)) if other is not None else _wide(
            np.asarray(want)[shard.index])
        diff = np.abs(a - b)
        diff = np.where(np.isnan(a) & np.isnan(b), 0.0, diff)
        max_abs = float(np.max(diff, initial=0.0))
        max_rel = float(np.max(diff / np.maximum(np.abs(b), np.finfo(np.float64).tiny),
                               initial=0.0))
        ok = bool(np.all(diff <= atol + rtol * np.abs(b)))
        rows.append(RankError(name, coords.get(shard.device, {}), str(shard.device), max_abs,
                              max_rel, ok))
    return rows


def assert_matches_reference(fn: Callable, reference: Callable, *inputs: Any,
                             mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any,
                             tol: float | tuple[float, float] | None = None,
                             jit: bool = True) -> list[RankError]:
    """Runs ``fn`` and ``reference`` on ``inputs`` under the same ``jax.shard_map`` and
    compares their outputs on every device.

    ``reference`` is typically the same computation written with ``jax.lax`` collectives
    (or in float32). Each output is compared shard by shard, so a wrong rank is named.

    Args:
      fn, reference: shard_map bodies with the same signature and output structure.
      *inputs: global arrays.
      mesh, in_specs, out_specs: as for ``jax.shard_map``.
      tol: ``atol = rtol = tol``, an ``(atol, rtol)`` pair, or None for
        :func:`default_tolerance` of each output's dtype.
      jit: run both under ``jax.jit`` (default) or eagerly.

    Returns:
      One :class:`RankError` per (output, device).

    Raises:
      AssertionError: an output differs beyond the tolerance on some rank (the message has
        a table of every rank's largest absolute and relative errors), or the outputs'
        structures, shapes or dtypes differ.
    """
    def run(body):
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        return (jax.jit(mapped) if jit else mapped)(*inputs)

    got, want = run(fn), run(reference)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    if got_tree != want_tree:
        raise AssertionError(f"outputs have structure {got_tree}, the reference {want_tree}")
    rows = []
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        name = jax.tree_util.keystr(path) or "out"
        if a.dtype != b.dtype:
            raise AssertionError(f"output {name}: dtype {a.dtype}, reference {b.dtype}")
        rows += compare(name, a, b, mesh, *_tolerance(tol, b.dtype))
    if not all(row.ok for row in rows):
        header = f"{'output':<12} {'rank':<14} {'device':<12} {'max abs':<12} {'max rel':<12}"
        bad = sorted({str(row.rank) for row in rows if not row.ok})
        raise AssertionError(f"{fn.__name__ if hasattr(fn, '__name__') else fn} differs from "
                             f"the reference on rank(s) {', '.join(bad)}:\n{header}\n"
                             + "\n".join(map(str, rows)))
    return rows
