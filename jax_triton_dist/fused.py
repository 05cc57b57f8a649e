"""Fused GEMM + communication ops: the matrix work and the collective in one kernel.

Per-rank shapes are given for each op; call them inside ``jax.shard_map``. Accumulation
is float32; inputs may be float32, bfloat16 or float16.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import triton

from jax_triton_dist import dtypes
from jax_triton_dist.collectives import all_gather, all_reduce
from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel
from jax_triton_dist.kernels.gemm_collectives import (
    all_gather_matmul_kernel,
    matmul_reduce_scatter_kernel,
)
from jax_triton_dist.tiles import gemm_tiles
from jax_triton_dist.triton_call import Workspace, axis_size, triton_call

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "GEMM_DTYPES"]

GEMM_DTYPES = dtypes.GEMM_DTYPES


def _check_gemm(x: Any, w: Any, fn: str) -> tuple[jax.Array, jax.Array]:
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{fn}: x and w must be 2-D, got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"{fn}: x is {x.shape} and w is {w.shape}: x.shape[1] must equal "
                         "w.shape[0] (the per-rank K)")
    if x.dtype != w.dtype:
        raise TypeError(f"{fn}: x and w must have one dtype, got {x.dtype} and {w.dtype}")
    dtypes.check_dtype(x.dtype, GEMM_DTYPES, fn)
    return x, w


def _dot(a, b, dtype):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _check_dim(value: int, fn: str, what: str) -> None:
    if value != 0:
        raise NotImplementedError(f"{fn}: {what}={value}: only 0 (the rows of x) is supported")


# ---------------------------------------------------------------------------
# all_gather_matmul <-> matmul_reduce_scatter
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, axis_name):
    world = axis_size(axis_name)
    (m, k), n = x.shape, w.shape[1]
    tiles = gemm_tiles(m, n, k, copies=world)
    grid = world * triton.cdiv(m, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"])
    return triton_call(
        all_gather_matmul_kernel, x, w,
        out_shape=jax.ShapeDtypeStruct((world * m, n), x.dtype),
        workspace=[Workspace((2, world), jnp.int32)], symmetric=[0],
        grid=(grid,), axis_name=axis_name, num_stages=3, m=m, N=n, K=k, **tiles,
    )


def _all_gather_matmul_fwd(x, w, axis_name):
    return _all_gather_matmul(x, w, axis_name), (x, w)


def _all_gather_matmul_bwd(axis_name, residuals, g):
    x, w = residuals
    dx = _matmul_reduce_scatter(g, w.T, axis_name)  # d(all_gather(x)) = g @ w.T, scattered
    dw = _dot(all_gather(x, axis_name, tiled=True).T, g, w.dtype)
    return dx, dw


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


def all_gather_matmul(x: Any, w: Any, axis_name: str, *, gather_axis: int = 0) -> jax.Array:
    """``all_gather(x, tiled=True) @ w`` in one kernel (column-parallel layer).

    Each rank stages its rows in the symmetric heap and announces them; output tiles of its
    own rows are computed first, then the tiles of each peer's rows around the ring, read
    straight from the peer's memory as soon as its announcement lands.

    Args:
      x: per-rank ``[m, K]``: this rank's rows (the sequence/batch shard).
      w: per-rank ``[K, N_local]``: this rank's weight columns.
      axis_name: the manual mesh axis the rows are split over.
      gather_axis: must be 0 (the rows of ``x``).

    Returns:
      Per-rank ``[num_ranks * m, N_local]`` in ``x.dtype`` (float32 accumulation).
    """
    x, w = _check_gemm(x, w, "all_gather_matmul")
    _check_dim(gather_axis, "all_gather_matmul", "gather_axis")
    axis_size(axis_name)
    return _all_gather_matmul(x, w, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, axis_name):
    world = axis_size(axis_name)
    (rows, k), n = x.shape, w.shape[1]
    seg = rows // world
    tiles = gemm_tiles(seg, n, k, copies=world)
    per_segment = triton.cdiv(seg, tiles["BLOCK_M"]) * triton.cdiv(n, tiles["BLOCK_N"])
    return triton_call(
        matmul_reduce_scatter_kernel, x, w,
        out_shape=jax.ShapeDtypeStruct((seg, n), x.dtype),
        workspace=[Workspace((2, world, seg, n), jnp.float32),
                   Workspace((2, world, per_segment), jnp.int32)],
        grid=(world * per_segment,), axis_name=axis_name, num_stages=3,
        seg=seg, N=n, K=k, **tiles,
    )


def _matmul_reduce_scatter_fwd(x, w, axis_name):
    return _matmul_reduce_scatter(x, w, axis_name), (x, w)


def _matmul_reduce_scatter_bwd(axis_name, residuals, g):
    x, w = residuals
    dx = _all_gather_matmul(g, w.T, axis_name)  # all_gather(g) @ w.T
    dw = _dot(x.T, all_gather(g, axis_name, tiled=True), w.dtype)
    return dx, dw


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def matmul_reduce_scatter(x: Any, w: Any, axis_name: str, *,
                          scatter_dimension: int = 0) -> jax.Array:
    """``psum_scatter(x @ w, scatter_dimension=0, tiled=True)`` in one kernel (row-parallel
    layer).

    Output tiles come segment by segment, the peers' segments first and the own segment
    last; each peer tile is pushed to its owner as soon as it is computed, and the own
    segment's tiles sum every rank's partial (float32, rank order) while others still
    compute.

    Args:
      x: per-rank ``[M, K_local]``; ``M`` must divide by the number of ranks.
      w: per-rank ``[K_local, N]``.
      axis_name: the manual mesh axis the K dimension is split over.
      scatter_dimension: must be 0 (rank r gets rows ``[r M / n, (r + 1) M / n)``).

    Returns:
      Per-rank ``[M / num_ranks, N]`` in ``x.dtype``.
    """
    x, w = _check_gemm(x, w, "matmul_reduce_scatter")
    _check_dim(scatter_dimension, "matmul_reduce_scatter", "scatter_dimension")
    world = axis_size(axis_name)
    if x.shape[0] % world:
        raise ValueError(f"matmul_reduce_scatter: x has {x.shape[0]} rows, which do not divide "
                         f"by the {world} ranks of axis {axis_name!r}")
    return _matmul_reduce_scatter(x, w, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, axis_name):
    world = axis_size(axis_name)
    (m, k), n = x.shape, w.shape[1]
    config = gemm_tiles(m, n, k)
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    return triton_call(
        matmul_all_reduce_kernel, x, w,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        workspace=[Workspace((2, world, m, n), jnp.float32), Workspace((2, world, tiles),
                                                                         jnp.int32)],
        grid=(tiles,), axis_name=axis_name, num_stages=3,
        M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=n, stride_bn=1, **config,
    )


def _matmul_all_reduce_fwd(x, w, axis_name):
    return _matmul_all_reduce(x, w, axis_name), (x, w)


def _matmul_all_reduce_bwd(axis_name, residuals, g):
    x, w = residuals
    total = all_reduce(g, axis_name)  # every rank's cotangent reaches every rank's partial
    return _dot(total, w.T, x.dtype), _dot(x.T, total, w.dtype)


_matmul_all_reduce.defvjp(_matmul_all_reduce_fwd, _matmul_all_reduce_bwd)


def matmul_all_reduce(x: Any, w: Any, axis_name: str) -> jax.Array:
    """``jax.lax.psum(x @ w, axis_name)`` in one kernel: each output tile is pushed to the
    other ranks as soon as it is computed and summed there (row-parallel layer, decode).

    Args:
      x: per-rank ``[M, K_local]``: this rank's slice of the K dimension.
      w: per-rank ``[K_local, N]``: the matching rows of the weight.
      axis_name: the manual mesh axis the K dimension is split over.

    Returns:
      ``[M, N]``, the same on every rank, in ``x.dtype`` (accumulated in float32).

    Meant for small M: the workspace holds every rank's float32 partial product
    (``2 * num_ranks * M * N * 4`` bytes per rank).
    """
    x, w = _check_gemm(x, w, "matmul_all_reduce")
    axis_size(axis_name)
    return _matmul_all_reduce(x, w, axis_name)
