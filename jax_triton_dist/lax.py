"""The collectives under ``jax.lax``'s names and signatures.

Replace ``jax.lax.psum`` & co. by these inside ``jax.shard_map`` and the program keeps its
results, types and derivatives while the communication runs the project's kernels::

    from jax_triton_dist import lax as jtd_lax

    y = jtd_lax.psum(x, ("dp", "tp"))
    z = jtd_lax.all_gather(x, "tp", axis=1, tiled=True)

Each is the matching op of :mod:`jax_triton_dist.collectives` (``psum`` is
``all_reduce(op="sum")``, ``psum_scatter`` is ``reduce_scatter``, ...), which documents the
behaviour; ``pmean`` is ``psum`` divided by the team size, as in ``jax.lax``.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_triton_dist import collectives

__all__ = ["psum", "pmax", "pmin", "pmean", "all_gather", "psum_scatter", "all_to_all"]


def psum(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.psum`` on the project's kernels (:func:`collectives.all_reduce`)."""
    return collectives.all_reduce(x, axis_name, op="sum", axis_index_groups=axis_index_groups)


def pmax(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pmax`` on the project's kernels."""
    return collectives.all_reduce(x, axis_name, op="max", axis_index_groups=axis_index_groups)


def pmin(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pmin`` on the project's kernels."""
    return collectives.all_reduce(x, axis_name, op="min", axis_index_groups=axis_index_groups)


def pmean(x: Any, axis_name: Any, *, axis_index_groups: Any = None) -> Any:
    """``jax.lax.pmean``: :func:`psum` divided by the number of ranks of a team."""
    total = psum(x, axis_name, axis_index_groups=axis_index_groups)
    if axis_index_groups is not None:
        size = len(axis_index_groups[0])
    else:
        size = jax.lax.axis_size(axis_name)  # mesh and vmap axes alike
    return jax.tree.map(lambda v: v / size, total)


def all_gather(x: Any, axis_name: Any, *, axis_index_groups: Any = None, axis: int = 0,
               tiled: bool = False, to: str = "varying") -> Any:
    """``jax.lax.all_gather`` on the project's kernels (``to``: ``"varying"`` or
    ``"invarying"``; ``jax.lax``'s ``"reduced"`` type is not supported)."""
    return collectives.all_gather(x, axis_name, axis=axis, tiled=tiled,
                                  axis_index_groups=axis_index_groups, to=to)


def psum_scatter(x: Any, axis_name: Any, *, scatter_dimension: int = 0,
                 axis_index_groups: Any = None, tiled: bool = False) -> Any:
    """``jax.lax.psum_scatter`` on the project's kernels (:func:`collectives.reduce_scatter`)."""
    return collectives.reduce_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                      tiled=tiled, axis_index_groups=axis_index_groups)


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               axis_index_groups: Any = None, tiled: bool = False) -> Any:
    """``jax.lax.all_to_all`` on the project's kernels."""
    return collectives.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled,
                                  axis_index_groups=axis_index_groups)
