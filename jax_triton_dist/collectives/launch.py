"""What each collective runs: its kernels on canonical layouts (the lowering of the
collective primitives, ``primitives.py``).

Every function takes the per-rank operand and the primitive's parameters: ``axes`` (the
mesh axes of the team), ``groups`` (``axis_index_groups`` or None) and ``size`` (ranks per
team). Data moves as bits and reductions run in the types ``element_types`` gives. The
exchange kernels' block sizes and warps are autotuned on GPUs (``tiles.exchange_configs``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton

from jax_triton_dist import autotune, tiles
from jax_triton_dist.collectives import element_types
from jax_triton_dist.kernels.allreduce import two_shot_all_reduce_kernel
from jax_triton_dist.kernels.exchange import push_exchange_kernel
from jax_triton_dist.triton_call import Workspace, triton_call

__all__ = ["ONE_SHOT_MAX_BYTES", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]

ONE_SHOT_MAX_BYTES = 256 * 1024
"""``all_reduce(method="auto")`` uses one-shot up to this many bytes per rank, else two-shot."""


def _tuned(kernel, n: int):
    """``kernel`` autotuned over the exchange configs of ``n`` elements per block (the
    fixed choice first: what runs on CPU and with tuning off; every config's outputs
    checked against the first's while tuning)."""
    return autotune.autotune([autotune.Config.from_table(c)
                              for c in tiles.exchange_configs(n)], check=True)(kernel)


def _programs(n: int):
    return lambda meta: triton.cdiv(max(n, 1), meta["BLOCK"])


def _push_exchange(x: jax.Array, axes, groups, size: int, *, send_chunks: bool,
                   reduce: str) -> jax.Array:
    """``x``: [size, n] (row p for rank p) if ``send_chunks`` else [n].

    Returns [size, n] (by source) if ``reduce == "none"``, else [n].
    """
    n = x.shape[-1]
    programs = _programs(n)
    out_shape = (size, n) if reduce == "none" else (n,)
    return triton_call(
        _tuned(push_exchange_kernel, n), x, n=n,
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype),
        workspace=lambda meta: [Workspace((2, size, n), x.dtype),
                                Workspace((2, size, programs(meta)), jnp.int32)],
        grid=lambda meta: (programs(meta),), axis_name=axes, axis_index_groups=groups,
        SEND_CHUNKS=send_chunks, REDUCE=reduce,
    )


def _two_shot(x: jax.Array, axes, groups, size: int, reduce: str) -> jax.Array:
    n = x.shape[0]
    chunk = triton.cdiv(n, size)
    programs = _programs(chunk)
    return triton_call(
        _tuned(two_shot_all_reduce_kernel, chunk), x, n=n, chunk=chunk,
        out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
        workspace=lambda meta: [Workspace((2, size, chunk), x.dtype),
                                Workspace((2, size, chunk), x.dtype),
                                Workspace((2, 2, size, programs(meta)), jnp.int32)],
        grid=lambda meta: (programs(meta),), axis_name=axes, axis_index_groups=groups,
        REDUCE=reduce,
    )


def _exchange_bits(chunks: jax.Array, axes, groups, size: int, *, send_chunks: bool
                   ) -> jax.Array:
    """Moves ``chunks`` (``[size, ...]`` one part per destination if ``send_chunks``, else
    one part for all) and returns ``[size, ...]`` by source, as bits."""
    bits = element_types.to_bits(chunks)
    part = bits.shape[1:] if send_chunks else bits.shape
    if bits.size == 0:
        received = jnp.zeros((size,) + part, bits.dtype)
    else:
        flat = bits.reshape(size, -1) if send_chunks else bits.reshape(-1)
        rows = _push_exchange(flat, axes, groups, size, send_chunks=send_chunks, reduce="none")
        received = rows.reshape((size,) + part)
    return element_types.from_bits(received, chunks.dtype)


def _split(x: jax.Array, dim: int, size: int, tiled: bool) -> jax.Array:
    """``x`` as ``[size, ...]``: its parts along ``dim`` (tiled: ``size`` equal blocks;
    else the dimension itself, of length ``size``) moved to the front."""
    if tiled:
        x = x.reshape(x.shape[:dim] + (size, x.shape[dim] // size) + x.shape[dim + 1:])
    return jnp.moveaxis(x, dim, 0)


def _join(parts: jax.Array, dim: int, tiled: bool) -> jax.Array:
    """Inverse of :func:`_split`: ``[size, ...]`` put at ``dim`` (tiled: concatenated)."""
    stacked = jnp.moveaxis(parts, 0, dim)
    if not tiled:
        return stacked
    shape = stacked.shape
    return stacked.reshape(shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2:])


def all_gather(x: jax.Array, *, axes, groups, size: int, axis: int, tiled: bool,
               invariant: bool = False) -> jax.Array:
    """Every rank's ``x``, stacked (or concatenated, ``tiled``) at ``axis``."""
    del invariant  # typing only
    rows = _exchange_bits(x, axes, groups, size, send_chunks=False)
    return _join(rows, axis, tiled)


def all_to_all(x: jax.Array, *, axes, groups, size: int, split_axis: int, concat_axis: int
               ) -> jax.Array:
    """Block ``p`` of ``x`` along ``split_axis`` to rank ``p``; the received blocks
    concatenated along ``concat_axis`` in source order."""
    chunks = _split(x, split_axis, size, True)
    received = _exchange_bits(chunks, axes, groups, size, send_chunks=True)
    return _join(received, concat_axis, True)


def _reduce(flat: jax.Array, axes, groups, size: int, *, send_chunks: bool, op: str,
            method: str = "one_shot") -> jax.Array:
    if method == "two_shot":
        return _two_shot(flat, axes, groups, size, op)
    return _push_exchange(flat, axes, groups, size, send_chunks=send_chunks, reduce=op)


def all_reduce(x: jax.Array, *, axes, groups, size: int, op: str, method: str,
               invariant: bool = False) -> jax.Array:
    """The reduction of every rank's ``x`` with ``op``."""
    del invariant  # typing only
    work = element_types.to_reduction(x, element_types.reduction_type(x.dtype, op,
                                                                      "all_reduce"))
    if work.size == 0:
        return x
    if method == "auto":
        nbytes = work.size * work.dtype.itemsize
        method = "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"
    out = _reduce(work.reshape(-1), axes, groups, size, send_chunks=False, op=op,
                  method=method)
    return element_types.from_reduction(out.reshape(work.shape), x.dtype)


def reduce_scatter(x: jax.Array, *, axes, groups, size: int, dim: int, tiled: bool, op: str
                   ) -> jax.Array:
    """Part ``r`` (along ``dim``) of the reduction of every rank's ``x``, on rank ``r``."""
    chunks = _split(x, dim, size, tiled)
    out_shape = chunks.shape[1:]
    work = element_types.to_reduction(chunks, element_types.reduction_type(
        x.dtype, op, "reduce_scatter"))
    if work.size == 0:
        return jnp.zeros(out_shape, x.dtype)
    part = work.shape[1:]
    out = _reduce(work.reshape(size, -1), axes, groups, size, send_chunks=True, op=op)
    return element_types.from_reduction(out.reshape(part), x.dtype)
