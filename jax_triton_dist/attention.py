"""Attention across ranks: sequence-parallel flash attention (context parallelism) and
distributed flash-decode, as fused distributed kernels (``kernels/attention.py``).

``sequence_parallel_attention``: the sequence is sharded over ``axis_name``; one kernel
runs flash attention (online softmax) of the local queries over every rank's keys and
values, reading each peer's block straight from its symmetric memory as soon as the peer
announces it (own block first, then around the ring), so no all-gather waits in front of
the compute. Differentiable: the backward pass gathers keys and values (the project's
``all_gather``), computes ``rowsum(dO * O)`` once, runs two flash-attention backward
kernels (key/value gradients of every key from the local queries; query gradients) and
reduce-scatters the key/value gradients (``reduce_scatter``) back to their ranks.

Causal load balance: with ``layout="zigzag"`` each rank's local sequence is two chunks of
the global one, ``r`` and ``2 * ranks - 1 - r`` (of ``2 * ranks`` equal chunks), so every
rank has the same number of unmasked (query, key) pairs; :func:`zigzag` and
:func:`unzigzag` reorder a global sequence so that plain ``P(axis)`` sharding gives that
layout. With ``layout="contiguous"`` rank ``r`` holds the ``r``-th slice and causal work
grows with ``r`` (the kernel skips the blocks that are masked out).

``flash_decode``: the KV cache is split along its sequence over ``axis_name``; every rank
computes its partial attention and log-sum-exp, pushes both to every rank, and combines
all partials in the same kernel, so every rank gets the full result.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jax_triton_dist import autotune, tiles
from jax_triton_dist.axis_names import axis_size
from jax_triton_dist.collectives import all_gather, reduce_scatter
from jax_triton_dist.kernels.attention import (
    attention_bwd_delta_kernel,
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
    flash_decode_kernel,
    sequence_parallel_attention_kernel,
)
from jax_triton_dist.runtime import jax_compat
from jax_triton_dist.triton_call import Workspace, triton_call

__all__ = ["sequence_parallel_attention", "flash_decode", "zigzag", "unzigzag", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, fn: str) -> tuple[int, ...]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name} must be [batch, seq, heads, head_dim] per rank, "
                             f"got shape {x.shape}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {x.dtype}; expected float32, bfloat16 "
                            "or float16")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{fn}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    b, s, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have one shape, got {k.shape} and {v.shape}")
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"{fn}: k and v must be [batch={b}, seq={s}, kv_heads, "
                         f"head_dim={d}] like q (per rank), got {k.shape}")
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"{fn}: kv_heads={kvh} must divide heads={h} (grouped-query "
                         "attention)")
    if d < 16 or d & (d - 1):
        raise ValueError(f"{fn}: head_dim must be a power of two of at least 16, got {d}")
    return b, s, h, kvh, d


def _scale(scale: float | None, d: int) -> float:
    return float(1.0 / math.sqrt(d) if scale is None else scale)


def _tuned(kernel, s: int, d: int, forward: bool) -> autotune.Autotuned:
    """``kernel`` with the attention configs of ``s`` local rows (``tiles.attention_configs``:
    the table's first, which runs on CPU and with tuning off; tuned on GPUs, every config's
    outputs checked against the first's)."""
    return autotune.autotune([autotune.Config.from_table(c)
                              for c in tiles.attention_configs(s, d, forward=forward)],
                             check=True)(kernel)


def _attention_forward(q, k, v, axis_name, causal, scale, zigzag):
    b, s, h, kvh, d = q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    world = axis_size(axis_name)
    return triton_call(
        _tuned(sequence_parallel_attention_kernel, s, d, forward=True), q, k, v,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, s, h), jnp.float32)),
        workspace=[Workspace((2, world), jnp.int32)], symmetric=[1, 2],
        grid=lambda meta: (b * h * triton.cdiv(s, meta["BLOCK_M"]),), axis_name=axis_name,
        B=b, S=s, H=h, KVH=kvh, scale=scale, HEAD_DIM=d, CAUSAL=causal, ZIGZAG=zigzag)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(q, k, v, axis_name, causal, scale, zigzag):
    return _attention_forward(q, k, v, axis_name, causal, scale, zigzag)[0]


def _attention_fwd(q, k, v, axis_name, causal, scale, zigzag):
    out, lse = _attention_forward(q, k, v, axis_name, causal, scale, zigzag)
    return out, (q, k, v, out, lse)


def _attention_bwd(axis_name, causal, scale, zigzag, residuals, dout):
    q, k, v, out, lse = residuals
    b, s, h, d = q.shape
    kvh = k.shape[2]
    world = axis_size(axis_name)
    k_all = all_gather(k, axis_name, axis=1, tiled=True)  # [b, world * s, kvh, d]
    v_all = all_gather(v, axis_name, axis=1, tiled=True)
    common = dict(axis_name=axis_name, B=b, SQ=s, H=h, KVH=kvh, scale=scale, HEAD_DIM=d,
                  CAUSAL=causal, ZIGZAG=zigzag)
    dout = dout.astype(q.dtype)
    rows = b * s * h
    block = tiles.attention_delta_rows(d)
    delta = triton_call(attention_bwd_delta_kernel, out, dout,
                        out_shape=jax.ShapeDtypeStruct((b, s, h), jnp.float32),
                        grid=(triton.cdiv(rows, block),), axis_name=axis_name, rows=rows,
                        HEAD_DIM=d, BLOCK=block)
    dk_all, dv_all = triton_call(
        _tuned(attention_bwd_dkdv_kernel, s, d, forward=False), q, dout, lse, delta, k_all,
        v_all,
        out_shape=(jax.ShapeDtypeStruct(k_all.shape, jnp.float32),
                   jax.ShapeDtypeStruct(v_all.shape, jnp.float32)),
        grid=lambda meta: (b * kvh * world * triton.cdiv(s, meta["BLOCK_N"]),), **common)
    dq = triton_call(_tuned(attention_bwd_dq_kernel, s, d, forward=False), q, dout, lse, delta,
                     k_all, v_all, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                     grid=lambda meta: (b * h * triton.cdiv(s, meta["BLOCK_M"]),), **common)
    # Every rank holds its queries' share of every key's gradient: sum them on the
    # keys' own ranks.
    dk = reduce_scatter(dk_all, axis_name, scatter_dimension=1, tiled=True)
    dv = reduce_scatter(dv_all, axis_name, scatter_dimension=1, tiled=True)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def sequence_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: Any, *,
                                causal: bool = False, scale: float | None = None,
                                layout: str = "contiguous") -> jax.Array:
    """Attention of this rank's queries over the whole sequence, sharded over
    ``axis_name`` (context / sequence parallelism), in one fused distributed kernel.

    Call it inside ``jax.shard_map``. Per rank:

    Args:
      q: ``[batch, seq_local, heads, head_dim]``.
      k, v: ``[batch, seq_local, kv_heads, head_dim]`` (``kv_heads`` divides ``heads``:
        grouped-query attention).
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      causal: mask keys after each query's global position.
      scale: score scale (default ``1 / sqrt(head_dim)``).
      layout: ``"contiguous"`` (rank ``r`` holds the ``r``-th slice of the sequence) or
        ``"zigzag"`` (chunks ``r`` and ``2 * ranks - 1 - r`` of ``2 * ranks``: balanced
        causal work; see :func:`zigzag`).

    Returns:
      ``[batch, seq_local, heads, head_dim]`` in ``q``'s dtype (float32 accumulation), the
      same as ``jax.nn.dot_product_attention`` over the gathered sequence for these rows.
      Differentiable with respect to ``q``, ``k`` and ``v``.

    Raises:
      ValueError: shapes that do not fit (ranks, heads, head_dim a power of two >= 16,
        zigzag with an odd local sequence), an unknown layout.
      TypeError: dtypes other than float32, bfloat16, float16, or mixed.

    Example::

        def layer(q, k, v):
            return jtd.sequence_parallel_attention(q, k, v, "sp", causal=True)

        out = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P(None, "sp"),
                                    out_specs=P(None, "sp")))(q, k, v)
    """
    fn = "sequence_parallel_attention"
    _, s, _, _, d = _check_qkv(q, k, v, fn)
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and s % 2:
        raise ValueError(f"{fn}: layout='zigzag' needs an even local sequence (two chunks "
                         f"per rank), got seq_local={s}")
    return _attention(q, k, v, axis_name, bool(causal), _scale(scale, d), layout == "zigzag")


def zigzag(x: jax.Array, ranks: int, axis: int = 1) -> jax.Array:
    """Reorders a global sequence so that sharding ``axis`` into ``ranks`` equal blocks
    gives each rank chunks ``r`` and ``2 * ranks - 1 - r`` (the ``"zigzag"`` layout of
    :func:`sequence_parallel_attention`). Outside ``shard_map``."""
    return jnp.take(x, _zigzag_order(x.shape[axis], ranks), axis=axis)


def unzigzag(x: jax.Array, ranks: int, axis: int = 1) -> jax.Array:
    """Inverse of :func:`zigzag`."""
    return jnp.take(x, np.argsort(_zigzag_order(x.shape[axis], ranks)), axis=axis)


def _zigzag_order(length: int, ranks: int) -> np.ndarray:
    if length % (2 * ranks):
        raise ValueError(f"zigzag: the sequence ({length}) must split into 2 * ranks = "
                         f"{2 * ranks} equal chunks")
    chunks = np.arange(length).reshape(2 * ranks, -1)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * ranks - 1 - r]])
                           for r in range(ranks)])


def flash_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, axis_name: Any, *,
                 kv_lengths: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """One decoding step's attention over a KV cache split along its sequence over
    ``axis_name``, in one distributed kernel: every rank attends over its slice, the
    partials are combined across ranks by their log-sum-exps, every rank gets the result.

    Call it inside ``jax.shard_map``. Per rank:

    Args:
      q: ``[batch, heads, head_dim]``, the same on every rank.
      k_cache, v_cache: ``[batch, seq_local, kv_heads, head_dim]``: rank ``r`` holds cache
        positions ``[r * seq_local, (r + 1) * seq_local)``.
      axis_name: the mesh axis (or tuple of axes) the cache is split over.
      kv_lengths: ``[batch]`` int32, the valid length of each row's whole cache (rows at
        or past it are ignored; a rank may hold none); default: every row is valid.
      scale: score scale (default ``1 / sqrt(head_dim)``).

    Returns:
      ``[batch, heads, head_dim]`` in ``q``'s dtype, the same on every rank and typed so
      (invariant over ``axis_name``, like ``psum``'s result: return it with ``out_specs``
      that leave the axis out); a row with ``kv_lengths == 0`` gets zeros. Not
      differentiable (inference).

    Raises:
      ValueError: shapes that do not fit; TypeError: unsupported dtypes.
    """
    fn = "flash_decode"
    if q.ndim != 3:
        raise ValueError(f"{fn}: q must be [batch, heads, head_dim] per rank, got {q.shape}")
    b, h, d = q.shape
    _check_qkv(q.reshape(b, 1, h, d), k_cache[:, :1], v_cache[:, :1], fn)
    s = k_cache.shape[1]
    world = axis_size(axis_name)
    if kv_lengths is None:
        kv_lengths = jnp.full((b,), world * s, jnp.int32)
    if kv_lengths.shape != (b,):
        raise ValueError(f"{fn}: kv_lengths must be [batch={b}], got {kv_lengths.shape}")
    if kv_lengths.dtype != jnp.int32:
        kv_lengths = kv_lengths.astype(jnp.int32)
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return flash_decode_p.bind(q, k_cache, v_cache, kv_lengths, axes=axes, size=world,
                               scale=_scale(scale, d))


# ---------------------------------------------------------------------------
# flash_decode as a primitive: its result is the same on every rank, and typed so
# (invariant over the axes under shard_map's checks, like psum's)
# ---------------------------------------------------------------------------

flash_decode_p = Primitive("jtd_flash_decode")


def _flash_decode_abstract(q, k, v, lengths, *, axes, size, scale):
    del size, scale
    varying = frozenset().union(*(jax_compat.aval_varying(a) for a in (q, k, v, lengths)))
    out = q.update(shape=q.shape, dtype=q.dtype, weak_type=False)
    return jax_compat.with_varying(out, varying - frozenset(axes))


def _flash_decode_launch(q, k_cache, v_cache, kv_lengths, *, axes, size, scale):
    """The kernel launch (what the primitive lowers to)."""
    b, h, d = q.shape
    s, kvh = k_cache.shape[1], k_cache.shape[2]
    axis_name = axes[0] if len(axes) == 1 else axes
    return triton_call(
        flash_decode_kernel, q, k_cache, v_cache, kv_lengths,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        workspace=[Workspace((2, size, b, h, d), jnp.float32),
                   Workspace((2, size, b, h), jnp.float32),
                   Workspace((2, size, b * kvh), jnp.int32)],
        grid=(b * kvh,), axis_name=axis_name, num_warps=4, num_stages=2,
        B=b, S=s, H=h, KVH=kvh, scale=scale, HEAD_DIM=d,
        GROUP=max(16, triton.next_power_of_2(h // kvh)),
        BLOCK_N=tiles.attention_blocks(s)["BLOCK_N"])


def _flash_decode_outside(*args, **params):
    raise ValueError("flash_decode must be called inside jax.shard_map")


flash_decode_p.def_impl(_flash_decode_outside)
flash_decode_p.def_abstract_eval(_flash_decode_abstract)
mlir.register_lowering(flash_decode_p, lambda ctx, *args, **params: mlir.lower_fun(
    functools.partial(_flash_decode_launch, **params), multiple_results=False)(ctx, *args))
