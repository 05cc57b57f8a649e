"""Fused GEMM + communication ops: the matrix work and the collective in one kernel.

Per-rank shapes are given for each op; call them inside ``jax.shard_map`` (jitted or
eager). Accumulation is float32; inputs may be float32, bfloat16 or float16. Like the
collectives they take a mesh axis or a tuple of them and ``axis_index_groups``, and are
JAX primitives: differentiable in both modes (the ops transpose into each other) and
batched by ``jax.vmap`` into one kernel call (see ``fused/primitives.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_triton_dist import axis_names, dtypes
from jax_triton_dist.compiler_axes import every_axis_manual
from jax_triton_dist.fused import epilogue, primitives

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "GEMM_DTYPES",
           "W_LAYOUTS"]

GEMM_DTYPES = dtypes.GEMM_DTYPES

Groups = Sequence[Sequence[int]] | None


W_LAYOUTS = ("kn", "nk")
"""``w_layout`` of the fused ops: ``"kn"`` (``w`` is ``[K, N]``) or ``"nk"`` (``[N, K]``, as a
``dot_general`` contracting the weight's dimension 1 has it; read in place — through its
strides or, in the tensor-descriptor configs, as ``[BLOCK_N, BLOCK_K]`` blocks transposed in
shared memory — never transposed in memory)."""


def _check_gemm(x: Any, w: Any, fn: str, w_layout: str = "kn"
                ) -> tuple[jax.Array, jax.Array]:
    x, w = jnp.asarray(x), jnp.asarray(w)
    if w_layout not in W_LAYOUTS:
        raise ValueError(f"{fn}: w_layout must be one of {W_LAYOUTS}, got {w_layout!r}")
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(f"{fn}: x must be [..., rows, K] and w 2-D, got shapes {x.shape} "
                         f"and {w.shape}")
    k_dim = 0 if w_layout == "kn" else 1
    if x.shape[-1] != w.shape[k_dim]:
        raise ValueError(f"{fn}: x is {x.shape} and w is {w.shape} ({w_layout!r} layout): "
                         f"x.shape[-1] must equal w.shape[{k_dim}] (the per-rank K)")
    if x.dtype != w.dtype:
        raise TypeError(f"{fn}: x and w must have one dtype, got {x.dtype} and {w.dtype}")
    dtypes.check_dtype(x.dtype, GEMM_DTYPES, fn)
    return x, w


def _check_dim(value: int, ndim: int, fn: str, what: str) -> int:
    """``value`` as a dimension of an ``ndim``-D ``x`` other than its last (K)."""
    if not isinstance(value, int) or not -ndim <= value < ndim:
        raise ValueError(f"{fn}: {what}={value!r} is not a dimension of a {ndim}-D x")
    value %= ndim
    if value == ndim - 1:
        raise ValueError(f"{fn}: {what}={value} is x's last dimension, which the GEMM "
                         "contracts; gather or scatter one of the others (e.g. the sequence "
                         "dimension of [batch, seq, d_model])")
    return value


def _team(axis_name: Any, groups: Groups, fn: str) -> dict[str, Any]:
    team = axis_names.team(axis_name, fn, groups)
    return dict(axes=axis_names.as_tuple(axis_name, fn), groups=team.groups,
                size=team.num_ranks)


def _with_epilogue(op: str, x, w, bias, activation, w_layout: str, params: dict):
    """The plain fused primitive, or its epilogue variant with a bias / activation."""
    activation = activation or "none"
    if activation not in epilogue.ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of "
                         f"{sorted(a for a in epilogue.ACTIVATIONS if a != 'none')} or None, "
                         f"got {activation!r}")
    if bias is None and activation == "none":
        bind = {"all_gather_matmul": primitives.bind_all_gather_matmul,
                "matmul_reduce_scatter": primitives.bind_matmul_reduce_scatter}[op]
        return bind(x, w, **params)
    n = w.shape[0] if w_layout == "nk" else w.shape[1]
    has_bias = bias is not None
    if has_bias:
        bias = jnp.asarray(bias)
        if bias.shape != (n,):
            raise ValueError(f"{op}: bias must be [N] = ({n},), got {bias.shape}")
        bias = bias.astype(x.dtype)
    else:
        bias = jnp.zeros((n,), x.dtype)
    return epilogue.bind(op, x, w, bias, activation=activation, has_bias=has_bias, **params)


@every_axis_manual
def all_gather_matmul(x: Any, w: Any, axis_name: Any, *, gather_axis: int = 0,
                      axis_index_groups: Groups = None, w_layout: str = "kn",
                      bias: Any = None, activation: str | None = None) -> jax.Array:
    """``all_gather(x, tiled=True) @ w`` in one kernel (column-parallel layer).

    Each rank stages its rows in the symmetric heap and announces them; output tiles of its
    own rows are computed first, then the tiles of each peer's rows around the ring, read
    straight from the peer's memory as soon as its announcement lands.

    Args:
      x: per-rank ``[..., m, ..., K]``: this rank's shard of the gathered dimension
        (``[m, K]`` rows, or e.g. ``[batch, seq_local, d_model]`` gathered along the
        sequence).
      w: per-rank ``[K, N_local]``: this rank's weight columns.
      w_layout: ``"kn"`` (``w`` as above) or ``"nk"`` (``w`` stored transposed, ``[N, K]``:
        read through strides, no transpose is made).
      bias: optional ``[N]`` added to every output row, in the kernel's epilogue.
      activation: optional ``"relu"``, ``"silu"``, ``"gelu"`` (exact) or ``"gelu_tanh"``,
        applied after the bias in the epilogue. Differentiable: under differentiation the
        kernel writes the pre-activation (the backward needs it) and XLA applies the
        epilogue.
      axis_name: the manual mesh axis (or tuple of axes) the rows are split over.
      gather_axis: the dimension of ``x`` gathered (any but the last); the dimensions
        before it are batch entries, each gathered in place by the kernel.
      axis_index_groups: groups of indices along ``axis_name`` that gather among
        themselves.

    Returns:
      Per-rank ``x``'s shape with ``gather_axis`` ``num_ranks`` times longer and ``N_local``
      last, in ``x.dtype`` (float32 accumulation).
    """
    x, w = _check_gemm(x, w, "all_gather_matmul", w_layout)
    axis = _check_dim(gather_axis, x.ndim, "all_gather_matmul", "gather_axis")
    params = dict(w_nk=w_layout == "nk", axis=axis,
                  **_team(axis_name, axis_index_groups, "all_gather_matmul"))
    return _with_epilogue("all_gather_matmul", x, w, bias, activation, w_layout, params)


@every_axis_manual
def matmul_reduce_scatter(x: Any, w: Any, axis_name: Any, *, scatter_dimension: int = 0,
                          axis_index_groups: Groups = None, w_layout: str = "kn",
                          bias: Any = None, activation: str | None = None) -> jax.Array:
    """``psum_scatter(x @ w, scatter_dimension, tiled=True)`` in one kernel (row-parallel
    layer).

    Output tiles come segment by segment, the peers' segments first and the own segment
    last; each peer tile is pushed to its owner as soon as it is computed, and the own
    segment's tiles sum every rank's partial (in float32; partials travel in the output's
    type, see ``fused.launch.partial_dtype``) while others still compute. Where the
    output's rows are a multiple of 16 bytes the own partial is not written out: it stays
    in registers and the peers' are added to it, in rank order after it (each output
    element is summed by one rank, so the result is the same on every run).

    Args:
      x: per-rank ``[..., M, ..., K_local]``; the scattered dimension must divide by the
        number of ranks.
      w: per-rank ``[K_local, N]``.
      w_layout: ``"kn"`` (``w`` as above) or ``"nk"`` (``w`` stored transposed, ``[N, K]``:
        read through strides, no transpose is made).
      bias: optional ``[N]`` added to every output row, in the kernel's epilogue.
      activation: optional ``"relu"``, ``"silu"``, ``"gelu"`` (exact) or ``"gelu_tanh"``,
        applied after the bias in the epilogue. Differentiable: under differentiation the
        kernel writes the pre-activation (the backward needs it) and XLA applies the
        epilogue.
      axis_name: the manual mesh axis (or tuple of axes) the K dimension is split over.
      scatter_dimension: the dimension scattered (any but the last): rank r gets its
        ``r``-th block of it, for every entry of the dimensions before it.
      axis_index_groups: groups of indices along ``axis_name`` that reduce among
        themselves.

    Returns:
      Per-rank ``x``'s shape with ``scatter_dimension`` divided by ``num_ranks`` and ``N``
      last, in ``x.dtype``.
    """
    x, w = _check_gemm(x, w, "matmul_reduce_scatter", w_layout)
    axis = _check_dim(scatter_dimension, x.ndim, "matmul_reduce_scatter", "scatter_dimension")
    team = _team(axis_name, axis_index_groups, "matmul_reduce_scatter")
    if x.shape[axis] % team["size"]:
        raise ValueError(f"matmul_reduce_scatter: dimension {axis} of x has {x.shape[axis]} "
                         f"entries, which do not divide by the {team['size']} ranks of axis "
                         f"{axis_name!r}")
    params = dict(w_nk=w_layout == "nk", axis=axis, **team)
    return _with_epilogue("matmul_reduce_scatter", x, w, bias, activation, w_layout, params)


@every_axis_manual
def matmul_all_reduce(x: Any, w: Any, axis_name: Any, *,
                      axis_index_groups: Groups = None, w_layout: str = "kn") -> jax.Array:
    """``jax.lax.psum(x @ w, axis_name)`` in one kernel: each output tile is pushed to the
    other ranks as soon as it is computed and summed there (row-parallel layer, decode).

    Args:
      x: per-rank ``[..., M, K_local]``: this rank's slice of the K dimension.
      w: per-rank ``[K_local, N]``: the matching rows of the weight.
      w_layout: ``"kn"`` (``w`` as above) or ``"nk"`` (``w`` stored transposed, ``[N, K]``:
        read through strides, no transpose is made).
      axis_name: the manual mesh axis (or tuple of axes) the K dimension is split over.
      axis_index_groups: groups of indices along ``axis_name`` that reduce among
        themselves.

    Returns:
      ``[M, N]``, the same on every rank, in ``x.dtype`` (accumulated in float32); like
      ``psum``, invariant over ``axis_name`` without ``axis_index_groups``.

    Meant for small M: the workspace holds every rank's partial product in the output's
    type (float32 for float32; ``2 * num_ranks * M * N * itemsize`` bytes per rank).
    """
    x, w = _check_gemm(x, w, "matmul_all_reduce", w_layout)
    return primitives.bind_matmul_all_reduce(
        x, w, w_nk=w_layout == "nk",
        **_team(axis_name, axis_index_groups, "matmul_all_reduce"))
