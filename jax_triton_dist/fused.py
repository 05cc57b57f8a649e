"""Fused GEMM + communication ops: the matrix work and the collective in one kernel.

Per-rank shapes are given for each op; call them inside ``jax.shard_map``. Accumulation
is float32; inputs may be float32, bfloat16 or float16.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jax_triton_dist.collectives import all_reduce
from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel
from jax_triton_dist.triton_call import Workspace, axis_size, triton_call

__all__ = ["matmul_all_reduce", "GEMM_DTYPES"]

GEMM_DTYPES = frozenset(np.dtype(d) for d in ("float32", jnp.bfloat16, "float16"))
"""Input element types of the fused GEMM ops."""


def _check_gemm(x: Any, w: Any, fn: str) -> tuple[jax.Array, jax.Array]:
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{fn}: x and w must be 2-D, got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"{fn}: x is {x.shape} and w is {w.shape}: x.shape[1] must equal "
                         "w.shape[0] (the per-rank K)")
    if x.dtype != w.dtype:
        raise TypeError(f"{fn}: x and w must have one dtype, got {x.dtype} and {w.dtype}")
    if x.dtype not in GEMM_DTYPES:
        raise TypeError(f"{fn}: unsupported dtype {x.dtype}; supported: "
                        + ", ".join(sorted(d.name for d in GEMM_DTYPES)))
    return x, w


def _block(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, axis_name):
    world = axis_size(axis_name)
    (m, k), n = x.shape, w.shape[1]
    block_m, block_n, block_k = _block(m, 64), _block(n, 128), _block(k, 64)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return triton_call(
        matmul_all_reduce_kernel, x, w,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        workspace=[Workspace((2, world, m, n), jnp.float32), Workspace((2, world, tiles),
                                                                         jnp.int32)],
        grid=(tiles,), axis_name=axis_name, num_warps=4, num_stages=3,
        M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=n, stride_bn=1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
    )


def _matmul_all_reduce_fwd(x, w, axis_name):
    return _matmul_all_reduce(x, w, axis_name), (x, w)


def _matmul_all_reduce_bwd(axis_name, residuals, g):
    x, w = residuals
    total = all_reduce(g, axis_name)  # every rank's cotangent reaches every rank's partial
    dx = jnp.dot(total, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(x.T, total, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


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
