"""Collectives as distributed Triton kernels, drop-in replacements for ``jax.lax``'s.

Call them inside ``jax.shard_map`` on per-rank arrays, exactly like the ``jax.lax``
collective each one replaces; they give the same results and gradients. Every op runs
the project's kernels (``kernels/exchange.py``, ``kernels/allreduce.py``) through
:func:`jax_triton_dist.triton_call`; only ``all_reduce(..., method="xla")`` runs
``jax.lax``, as a reference.

Supported dtypes: float32, bfloat16, float16, int32. Floating reductions accumulate in
float32, in rank order, so every rank gets bit-identical results.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jax_triton_dist import dtypes, tiles
from jax_triton_dist.kernels.allreduce import two_shot_all_reduce_kernel
from jax_triton_dist.kernels.exchange import push_exchange_kernel
from jax_triton_dist.triton_call import Workspace, axis_size, triton_call

__all__ = [
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "COLLECTIVE_DTYPES",
    "ONE_SHOT_MAX_BYTES", "REDUCE_OPS", "ALL_REDUCE_METHODS",
]

COLLECTIVE_DTYPES = dtypes.COLLECTIVE_DTYPES
REDUCE_OPS = ("sum", "max", "min")
ALL_REDUCE_METHODS = ("auto", "one_shot", "two_shot", "xla")
ONE_SHOT_MAX_BYTES = 256 * 1024
"""``all_reduce(method="auto")`` uses one-shot up to this many bytes per rank, else two-shot."""


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def _check(x: Any, op: str) -> jax.Array:
    x = jnp.asarray(x)
    dtypes.check_dtype(x.dtype, COLLECTIVE_DTYPES, op)
    return x


def _check_reduce(op: str, fn: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{fn}: op must be one of {list(REDUCE_OPS)}, got {op!r}")


def _axis(axis: int, ndim: int, what: str, fn: str) -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{fn}: {what}={axis} is out of range for {ndim} dimensions")
    return int(axis) % ndim


def _divisible(size: int, world: int, what: str, fn: str) -> None:
    if size % world:
        raise ValueError(f"{fn}: {what} has size {size}, which does not divide by the "
                         f"{world} ranks of the axis")


# ---------------------------------------------------------------------------
# Kernel launches on canonical layouts
# ---------------------------------------------------------------------------


def _push_exchange(x: jax.Array, axis_name: str, world: int, *, send_chunks: bool,
                   reduce: str) -> jax.Array:
    """``x``: [world, n] (row p for rank p) if ``send_chunks`` else [n].

    Returns [world, n] (by source) if ``reduce == "none"``, else [n].
    """
    n = x.shape[-1]
    block, programs = tiles.exchange_block(n)
    out_shape = (world, n) if reduce == "none" else (n,)
    return triton_call(
        push_exchange_kernel, x, n=n,
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype),
        workspace=[Workspace((2, world, n), x.dtype), Workspace((2, world, programs), jnp.int32)],
        grid=(programs,), axis_name=axis_name,
        SEND_CHUNKS=send_chunks, REDUCE=reduce, BLOCK=block,
    )


def _two_shot(x: jax.Array, axis_name: str, world: int, reduce: str) -> jax.Array:
    n = x.shape[0]
    chunk = triton.cdiv(n, world)
    block, programs = tiles.exchange_block(chunk)
    return triton_call(
        two_shot_all_reduce_kernel, x, n=n, chunk=chunk,
        out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
        workspace=[Workspace((2, world, chunk), x.dtype), Workspace((2, world, chunk), x.dtype),
                   Workspace((2, 2, world, programs), jnp.int32)],
        grid=(programs,), axis_name=axis_name, REDUCE=reduce, BLOCK=block,
    )


# ---------------------------------------------------------------------------
# all_gather <-> reduce_scatter
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(x, axis_name, axis, tiled):
    world = axis_size(axis_name)
    if x.size == 0:
        rows = jnp.zeros((world,) + x.shape, x.dtype)
    else:
        rows = _push_exchange(x.reshape(-1), axis_name, world, send_chunks=False, reduce="none")
    stacked = jnp.moveaxis(rows.reshape((world,) + x.shape), 0, axis)
    if not tiled:
        return stacked
    return stacked.reshape(x.shape[:axis] + (world * x.shape[axis],) + x.shape[axis + 1:])


def _all_gather_fwd(x, axis_name, axis, tiled):
    return _all_gather(x, axis_name, axis, tiled), None


def _all_gather_bwd(axis_name, axis, tiled, _, g):
    return (_reduce_scatter(g, axis_name, axis, tiled, "sum"),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def all_gather(x: Any, axis_name: str, *, axis: int = 0, tiled: bool = False) -> jax.Array:
    """Gathers ``x`` from every rank of ``axis_name``; same result as ``jax.lax.all_gather``.

    Args:
      x: per-rank array.
      axis_name: the manual mesh axis.
      axis: where the ranks' blocks go: a new dimension of size ``num_ranks`` at
        ``axis`` (``tiled=False``), or concatenated along dimension ``axis`` (``tiled=True``).
      tiled: see ``axis``.

    Returns:
      Per-rank result, identical on every rank of the axis.

    Example::

        y = jax.shard_map(lambda v: jtd.all_gather(v, "tp", tiled=True), mesh=mesh,
                          in_specs=P("tp"), out_specs=P())(x)   # y == x
    """
    x = _check(x, "all_gather")
    axis = _axis(axis, x.ndim if tiled else x.ndim + 1, "axis", "all_gather")
    return _all_gather(x, axis_name, axis, bool(tiled))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _reduce_scatter(x, axis_name, dim, tiled, op):
    world = axis_size(axis_name)
    if tiled:
        parts = x.reshape(x.shape[:dim] + (world, x.shape[dim] // world) + x.shape[dim + 1:])
        chunks = jnp.moveaxis(parts, dim, 0)
        out_shape = x.shape[:dim] + (x.shape[dim] // world,) + x.shape[dim + 1:]
    else:
        chunks = jnp.moveaxis(x, dim, 0)
        out_shape = x.shape[:dim] + x.shape[dim + 1:]
    if x.size == 0:
        return jnp.zeros(out_shape, x.dtype)
    out = _push_exchange(chunks.reshape(world, -1), axis_name, world, send_chunks=True, reduce=op)
    return out.reshape(out_shape)


def _reduce_scatter_fwd(x, axis_name, dim, tiled, op):
    return _reduce_scatter(x, axis_name, dim, tiled, op), None


def _reduce_scatter_bwd(axis_name, dim, tiled, op, _, g):
    if op != "sum":
        raise NotImplementedError(f"reduce_scatter(op={op!r}) is not differentiable; only "
                                  "op='sum' is")
    return (_all_gather(g, axis_name, dim, tiled),)


_reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


def reduce_scatter(x: Any, axis_name: str, *, scatter_dimension: int = 0, tiled: bool = False,
                   op: str = "sum") -> jax.Array:
    """Reduces ``x`` over the ranks and scatters the result; like ``jax.lax.psum_scatter``.

    Args:
      x: per-rank array. With ``tiled=False``, ``x.shape[scatter_dimension]`` must equal
        the number of ranks and that dimension is removed; with ``tiled=True`` it must
        divide by the number of ranks and shrinks by that factor.
      axis_name: the manual mesh axis.
      scatter_dimension: the dimension split among the ranks (rank r gets part r).
      tiled: see ``x``.
      op: ``"sum"`` (``psum_scatter``), ``"max"`` or ``"min"``.

    Raises:
      ValueError: a size that does not divide by the number of ranks, a bad op or dimension.
    """
    x = _check(x, "reduce_scatter")
    _check_reduce(op, "reduce_scatter")
    dim = _axis(scatter_dimension, x.ndim, "scatter_dimension", "reduce_scatter")
    world = axis_size(axis_name)
    if tiled:
        _divisible(x.shape[dim], world, f"dimension {dim}", "reduce_scatter")
    elif x.shape[dim] != world:
        raise ValueError(f"reduce_scatter(tiled=False): dimension {dim} has size {x.shape[dim]}"
                         f" but must equal the {world} ranks of axis {axis_name!r}")
    return _reduce_scatter(x, axis_name, dim, bool(tiled), op)


# ---------------------------------------------------------------------------
# all_reduce
# ---------------------------------------------------------------------------


def _xla_all_reduce(x, axis_name, op):
    return {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[op](x, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_reduce(x, axis_name, op, method):
    if method == "xla":
        return _xla_all_reduce(x, axis_name, op)
    world = axis_size(axis_name)
    if x.size == 0:
        return x
    if method == "auto":
        method = "one_shot" if x.size * x.dtype.itemsize <= ONE_SHOT_MAX_BYTES else "two_shot"
    flat = x.reshape(-1)
    if method == "one_shot":
        out = _push_exchange(flat, axis_name, world, send_chunks=False, reduce=op)
    else:
        out = _two_shot(flat, axis_name, world, op)
    return out.reshape(x.shape)


def _all_reduce_fwd(x, axis_name, op, method):
    return _all_reduce(x, axis_name, op, method), None


def _all_reduce_bwd(axis_name, op, method, _, g):
    if op != "sum":
        raise NotImplementedError(f"all_reduce(op={op!r}) is not differentiable; only op='sum' is")
    return (_all_reduce(g, axis_name, op, method),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


def all_reduce(x: Any, axis_name: str, *, op: str = "sum", method: str = "auto") -> jax.Array:
    """Reduces ``x`` over the ranks of ``axis_name``; like ``jax.lax.psum`` / ``pmax`` / ``pmin``.

    Args:
      x: per-rank array.
      axis_name: the manual mesh axis.
      op: ``"sum"``, ``"max"`` or ``"min"``.
      method: ``"one_shot"`` (every rank pushes its whole array to every rank: lowest
        latency, for small messages), ``"two_shot"`` (reduce-scatter then all-gather: less
        traffic, for large messages), ``"auto"`` (one-shot up to
        :data:`ONE_SHOT_MAX_BYTES` per rank), or ``"xla"`` (``jax.lax``, as a reference).
    """
    x = _check(x, "all_reduce")
    _check_reduce(op, "all_reduce")
    if method not in ALL_REDUCE_METHODS:
        raise ValueError(f"all_reduce: method must be one of {list(ALL_REDUCE_METHODS)}, "
                         f"got {method!r}")
    axis_size(axis_name)
    return _all_reduce(x, axis_name, op, method)


# ---------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _all_to_all(x, axis_name, split_axis, concat_axis, tiled):
    world = axis_size(axis_name)
    if tiled:
        parts = x.reshape(x.shape[:split_axis] + (world, x.shape[split_axis] // world)
                          + x.shape[split_axis + 1:])
        chunks = jnp.moveaxis(parts, split_axis, 0)
    else:
        chunks = jnp.moveaxis(x, split_axis, 0)
    chunk_shape = chunks.shape[1:]
    if x.size == 0:
        received = chunks
    else:
        rows = _push_exchange(chunks.reshape(world, -1), axis_name, world, send_chunks=True,
                         reduce="none")
        received = rows.reshape((world,) + chunk_shape)
    stacked = jnp.moveaxis(received, 0, concat_axis)
    if not tiled:
        return stacked
    return stacked.reshape(chunk_shape[:concat_axis] + (world * chunk_shape[concat_axis],)
                           + chunk_shape[concat_axis + 1:])


def _all_to_all_fwd(x, axis_name, split_axis, concat_axis, tiled):
    return _all_to_all(x, axis_name, split_axis, concat_axis, tiled), None


def _all_to_all_bwd(axis_name, split_axis, concat_axis, tiled, _, g):
    return (_all_to_all(g, axis_name, concat_axis, split_axis, tiled),)


_all_to_all.defvjp(_all_to_all_fwd, _all_to_all_bwd)


def all_to_all(x: Any, axis_name: str, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> jax.Array:
    """Sends part ``p`` of ``x`` to rank ``p``; like ``jax.lax.all_to_all``.

    Args:
      x: per-rank array, split along ``split_axis`` into one part per rank.
      axis_name: the manual mesh axis.
      split_axis: with ``tiled=False`` its size must equal the number of ranks and it is
        removed; with ``tiled=True`` it must divide by the number of ranks.
      concat_axis: where the received parts go: a new dimension (``tiled=False``) or
        concatenated along this dimension (``tiled=True``), in source-rank order.
      tiled: see above.
    """
    x = _check(x, "all_to_all")
    world = axis_size(axis_name)
    split_axis = _axis(split_axis, x.ndim, "split_axis", "all_to_all")
    concat_axis = _axis(concat_axis, x.ndim, "concat_axis", "all_to_all")
    if tiled:
        _divisible(x.shape[split_axis], world, f"split_axis {split_axis}", "all_to_all")
    elif x.shape[split_axis] != world:
        raise ValueError(f"all_to_all(tiled=False): split_axis {split_axis} has size "
                         f"{x.shape[split_axis]} but must equal the {world} ranks of axis "
                         f"{axis_name!r}")
    return _all_to_all(x, axis_name, split_axis, concat_axis, bool(tiled))
