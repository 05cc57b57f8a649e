"""Reductions over ``axis_index_groups`` of different sizes (``jax.lax.psum`` / ``pmax`` /
``pmin`` accept them; the gathers and scatters need equal sizes, in ``jax.lax`` too).

Every team of one kernel call has one rank count, so such a reduction gathers the whole
axis with the all-gather kernel and each rank reduces, locally, the blocks of its own
group: ``num_ranks`` times the traffic of a grouped reduction, for a pattern that is rare.
Sums accumulate as the kernels do (float16/bfloat16/float8 in float32), in index order.
The result is built from the all-gather primitive and ``jnp`` ops, so its derivatives are
theirs (the transpose of the gather is the reduce-scatter kernel).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_triton_dist.collectives import primitives

__all__ = ["all_reduce"]


def _same_group(groups: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """``[size, size]`` bool: indices ``i`` and ``j`` are in one group."""
    same = np.zeros((size, size), np.bool_)
    for group in groups:
        same[np.ix_(group, group)] = True
    return same


def _identity(dtype: np.dtype, op: str):
    if dtype == np.bool_:
        return op == "min"
    if jnp.issubdtype(dtype, jnp.inexact):
        return -np.inf if op == "max" else np.inf
    info = jnp.iinfo(dtype)
    return info.min if op == "max" else info.max


def _accumulation_type(dtype: np.dtype) -> np.dtype:
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def all_reduce(x: jax.Array, *, axes: tuple[Hashable, ...], groups: Sequence[Sequence[int]],
               size: int, op: str) -> jax.Array:
    """``x`` reduced with ``op`` over its group (one of ``groups``, along ``axes``, of
    ``size`` indices in all)."""
    dtype = np.dtype(x.dtype)
    gathered = primitives.bind_all_gather(x, axes=axes, groups=None, size=size, axis=0,
                                          tiled=False)
    index = jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
    mine = jnp.asarray(_same_group(groups, size))[index].reshape((size,) + (1,) * x.ndim)
    if op == "sum":
        work = gathered.astype(_accumulation_type(dtype))
        return jnp.sum(jnp.where(mine, work, jnp.zeros((), work.dtype)), axis=0).astype(dtype)
    reduce = jnp.max if op == "max" else jnp.min
    fill = jnp.asarray(_identity(dtype, op), dtype)
    return reduce(jnp.where(mine, gathered, fill), axis=0)
