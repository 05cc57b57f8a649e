"""Collectives as distributed Triton kernels, drop-in replacements for ``jax.lax``'s.

Call them inside ``jax.shard_map`` (jitted or eager) exactly like the ``jax.lax``
collective each one replaces: same arguments (pytrees, a tuple of axis names,
``axis_index_groups``), same results, same types (a sum is invariant over its axes under
``check_vma=True``), same derivatives in both modes, and ``jax.vmap`` inside and outside.
Every op runs the project's kernels (``kernels/exchange.py``, ``kernels/allreduce.py``)
through :func:`jax_triton_dist.triton_call`; only ``all_reduce(..., method="xla")`` runs
``jax.lax``, as a reference. :mod:`jax_triton_dist.lax` gives them ``jax.lax``'s names.

Element types: every boolean and numeric type of a byte or more (see
``collectives/element_types.py`` for how each moves and accumulates): data movement is
bit-exact, integer reductions are exact (wrapping like XLA), float16/bfloat16/float8
reductions accumulate in float32, float64 in float64, in rank order, so every rank gets
bit-identical results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_triton_dist import axis_names
from jax_triton_dist.collectives import element_types, primitives, uneven_groups
from jax_triton_dist.collectives.launch import ONE_SHOT_MAX_BYTES
from jax_triton_dist.compiler_axes import every_axis_manual
from jax_triton_dist.runtime import jax_compat

__all__ = [
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ONE_SHOT_MAX_BYTES",
    "REDUCE_OPS", "ALL_REDUCE_METHODS", "GATHER_RESULTS",
]

REDUCE_OPS = ("sum", "max", "min")
ALL_REDUCE_METHODS = ("auto", "one_shot", "two_shot", "xla")

Groups = Sequence[Sequence[int]] | None


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def _check_reduce(op: str, fn: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{fn}: op must be one of {list(REDUCE_OPS)}, got {op!r}")


def _axis(axis: int, ndim: int, what: str, fn: str) -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{fn}: {what}={axis} is out of range for {ndim} dimensions")
    return int(axis) % ndim


def _team(axis_name: Any, groups: Groups, fn: str):
    """``(axes, groups, size)`` of a call: the names as a tuple, the checked groups, the
    ranks per team (over the mesh axes, times the sizes of any ``jax.vmap`` axes named)."""
    axes = axis_names.as_tuple(axis_name, fn)
    if not axes:  # jax.lax returns the operand
        return (), None, 1
    if any(isinstance(a, (int, np.integer)) for a in axes):
        raise TypeError(f"{fn}: positional (integer) axes {axis_name!r} are not supported; "
                        "name shard_map mesh axes")
    vmapped = {a: axis_names.vmap_axis_size(a) for a in axes}
    vmapped = {a: n for a, n in vmapped.items() if n is not None}
    if vmapped and groups is not None:
        raise NotImplementedError(f"{fn}: axis_index_groups are not supported over vmap axes "
                                  f"({sorted(vmapped)}), as in jax.lax")
    mesh_axes = tuple(a for a in axes if a not in vmapped)
    size = int(np.prod(list(vmapped.values()), dtype=np.int64))
    if not mesh_axes:
        return axes, None, size
    team = axis_names.team(mesh_axes, fn, groups)
    return axes, team.groups, team.num_ranks * size


def _uneven_groups(axis_name: Any, groups: Groups) -> tuple[tuple[int, ...], ...] | None:
    """``axis_index_groups`` when they have different sizes (checked), else None."""
    names = axis_names.as_tuple(axis_name, "all_reduce")
    if groups is None or not names or any(axis_names.vmap_axis_size(a) for a in names):
        return None  # the team's checks report what is wrong
    try:
        sizes = {len(g) for g in groups}
    except TypeError:
        return None  # reported by the team's check
    if len(sizes) < 2:
        return None
    return axis_names.check_groups(groups, axis_names.axis_size(axis_name), "all_reduce",
                                   equal=False)


def _leaf(x: Any, fn: str) -> jax.Array:
    x = jnp.asarray(x)
    element_types.check(x.dtype, fn)
    return x


def _check_parts(n: int, world: int, what: str, fn: str, tiled: bool, axis_name: Any) -> None:
    """A dimension of size ``n`` splits into one part per rank."""
    if tiled and n % world:
        raise ValueError(f"{fn}: {what} has size {n}, which does not divide by the "
                         f"{world} ranks of axis {axis_name!r}")
    if not tiled and n != world:
        raise ValueError(f"{fn}(tiled=False): {what} has size {n} but must equal the "
                         f"{world} ranks of axis {axis_name!r}")


# ---------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------


GATHER_RESULTS = ("varying", "invarying")


@every_axis_manual
def all_gather(x: Any, axis_name: Any, *, axis: int = 0, tiled: bool = False,
               axis_index_groups: Groups = None, to: str = "varying") -> Any:
    """Gathers ``x`` from every rank of ``axis_name``; same result as ``jax.lax.all_gather``.

    Args:
      x: per-rank array, or a pytree of them.
      axis_name: a manual mesh axis, or a tuple of them (ranks ordered row-major, the
        first axis slowest).
      axis: where the ranks' blocks go: a new dimension of size ``num_ranks`` at
        ``axis`` (``tiled=False``), or concatenated along dimension ``axis`` (``tiled=True``).
      tiled: see ``axis``.
      axis_index_groups: groups of indices along ``axis_name`` (equal sizes, covering
        each index once) that gather among themselves, in group order.
      to: the result's type under ``check_vma=True``, as in ``jax.lax.all_gather``:
        ``"varying"`` over ``axis_name`` (its transpose is a reduce-scatter sum), or
        ``"invarying"`` (one value for the whole axis, like ``all_gather_invariant``; its
        transpose takes each rank's own block; not with ``axis_index_groups``).

    Returns:
      Per-rank result, identical on every rank of a team.

    Example::

        y = jax.shard_map(lambda v: jtd.all_gather(v, "tp", tiled=True), mesh=mesh,
                          in_specs=P("tp"), out_specs=P())(x)   # y == x
    """
    if to not in GATHER_RESULTS:
        raise ValueError(f"all_gather: to must be one of {list(GATHER_RESULTS)}, got {to!r}")
    if to == "invarying" and axis_index_groups is not None:
        raise ValueError("all_gather(to='invarying') does not take axis_index_groups: each "
                         "group's result differs")
    axes, groups, size = _team(axis_name, axis_index_groups, "all_gather")
    if not axes:
        return x

    def one(leaf):
        leaf = _leaf(leaf, "all_gather")
        dim = _axis(axis, leaf.ndim if tiled else leaf.ndim + 1, "axis", "all_gather")
        return primitives.bind_all_gather(leaf, axes=axes, groups=groups, size=size, axis=dim,
                                          tiled=bool(tiled), invariant=to == "invarying")
    return jax.tree.map(one, x)


@every_axis_manual
def reduce_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0, tiled: bool = False,
                   op: str = "sum", axis_index_groups: Groups = None) -> Any:
    """Reduces ``x`` over the ranks and scatters the result; like ``jax.lax.psum_scatter``.

    Args:
      x: per-rank array (or pytree). With ``tiled=False``, ``x.shape[scatter_dimension]``
        must equal the number of ranks and that dimension is removed; with ``tiled=True``
        it must divide by the number of ranks and shrinks by that factor.
      axis_name: a manual mesh axis, or a tuple of them.
      scatter_dimension: the dimension split among the ranks (rank r gets part r).
      tiled: see ``x``.
      op: ``"sum"`` (``psum_scatter``), ``"max"`` or ``"min"``.
      axis_index_groups: groups of indices along ``axis_name`` that reduce among
        themselves (rank r of a group gets part r).

    Raises:
      ValueError: a size that does not divide by the number of ranks, a bad op or dimension.
      TypeError: ``bool`` with ``op="sum"``, complex with max or min.
    """
    _check_reduce(op, "reduce_scatter")
    axes, groups, size = _team(axis_name, axis_index_groups, "reduce_scatter")
    if not axes:
        return x

    def one(leaf):
        leaf = _leaf(leaf, "reduce_scatter")
        element_types.reduction_type(leaf.dtype, op, "reduce_scatter")
        dim = _axis(scatter_dimension, leaf.ndim, "scatter_dimension", "reduce_scatter")
        _check_parts(leaf.shape[dim], size, f"dimension {dim}", "reduce_scatter", tiled,
                     axis_name)
        return primitives.bind_reduce_scatter(leaf, axes=axes, groups=groups, size=size,
                                              dim=dim, tiled=bool(tiled), op=op)
    return jax.tree.map(one, x)


def _xla_all_reduce(x, axis_name, op, groups):
    fn = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op]
    return fn(x, axis_name, axis_index_groups=groups)


@every_axis_manual
def all_reduce(x: Any, axis_name: Any, *, op: str = "sum", method: str = "auto",
               axis_index_groups: Groups = None) -> Any:
    """Reduces ``x`` over the ranks of ``axis_name``; like ``jax.lax.psum`` / ``pmax`` / ``pmin``.

    Args:
      x: per-rank array (or pytree). A value that is not traced (a Python number, a
        NumPy array) is the same on every rank: its sum is ``num_ranks * x`` and its max
        and min are ``x``, as in ``jax.lax``.
      axis_name: a manual mesh axis, or a tuple of them.
      op: ``"sum"``, ``"max"`` or ``"min"``.
      method: ``"one_shot"`` (every rank pushes its whole array to every rank: lowest
        latency, for small messages), ``"two_shot"`` (reduce-scatter then all-gather: less
        traffic, for large messages), ``"auto"`` (one-shot up to
        :data:`ONE_SHOT_MAX_BYTES` per rank), or ``"xla"`` (``jax.lax``, as a reference).
      axis_index_groups: groups of indices along ``axis_name`` that reduce among
        themselves. Groups of different sizes are allowed (as in ``jax.lax``); they run
        as an all-gather of the whole axis and a local reduction (``uneven_groups.py``).

    Returns:
      The reduction; a ``bool`` sum is ``int32``. Without ``axis_index_groups`` it does
      not vary over ``axis_name`` (``out_specs=P()`` holds under ``check_vma=True``).
    """
    _check_reduce(op, "all_reduce")
    if method not in ALL_REDUCE_METHODS:
        raise ValueError(f"all_reduce: method must be one of {list(ALL_REDUCE_METHODS)}, "
                         f"got {method!r}")
    uneven = _uneven_groups(axis_name, axis_index_groups)
    axes, groups, size = _team(axis_name, None if uneven else axis_index_groups, "all_reduce")
    if not axes:
        return x

    def one(leaf):
        if not jax_compat.is_traced(leaf):  # the same on every rank
            leaf = _leaf(leaf, "all_reduce")
            if op != "sum":
                return leaf
            if not uneven:
                return leaf.astype(element_types.sum_result_type(leaf.dtype)) * size
            # groups of different sizes: each rank's sum counts its own group
        leaf = _leaf(leaf, "all_reduce")
        if op == "sum":
            leaf = leaf.astype(element_types.sum_result_type(leaf.dtype))
        element_types.reduction_type(leaf.dtype, op, "all_reduce")
        if method == "xla":
            return _xla_all_reduce(leaf, axes, op, uneven or groups)
        if uneven:
            return uneven_groups.all_reduce(leaf, axes=axes, groups=uneven, size=size, op=op)
        return primitives.bind_all_reduce(leaf, axes=axes, groups=groups, size=size, op=op,
                                          method=method)
    return jax.tree.map(one, x)


@every_axis_manual
def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               tiled: bool = False, axis_index_groups: Groups = None) -> Any:
    """Sends part ``p`` of ``x`` to rank ``p``; like ``jax.lax.all_to_all``.

    Args:
      x: per-rank array (or pytree), split along ``split_axis`` into one part per rank.
      axis_name: a manual mesh axis, or a tuple of them.
      split_axis: with ``tiled=False`` its size must equal the number of ranks and it is
        removed; with ``tiled=True`` it must divide by the number of ranks.
      concat_axis: where the received parts go: a new dimension (``tiled=False``) or
        concatenated along this dimension (``tiled=True``), in source-rank order.
      tiled: see above.
      axis_index_groups: groups of indices along ``axis_name`` that exchange among
        themselves.
    """
    axes, groups, size = _team(axis_name, axis_index_groups, "all_to_all")
    if not axes:
        return x

    def one(leaf):
        leaf = _leaf(leaf, "all_to_all")
        split = _axis(split_axis, leaf.ndim, "split_axis", "all_to_all")
        concat = _axis(concat_axis, leaf.ndim, "concat_axis", "all_to_all")
        _check_parts(leaf.shape[split], size, f"split_axis {split}", "all_to_all", tiled,
                     axis_name)
        if tiled:
            return primitives.bind_all_to_all(leaf, axes=axes, groups=groups, size=size,
                                              split_axis=split, concat_axis=concat)
        # Untiled: a unit dimension for the parts to concatenate along, removed after.
        if split < concat:
            concat += 1
            leaf = jnp.expand_dims(leaf, concat)
        elif concat < split:
            leaf = jnp.expand_dims(leaf, concat)
            split += 1
        out = primitives.bind_all_to_all(leaf, axes=axes, groups=groups, size=size,
                                         split_axis=split, concat_axis=concat)
        return out if split == concat else jnp.squeeze(out, split)
    return jax.tree.map(one, x)
