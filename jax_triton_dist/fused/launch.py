"""What each fused op runs: its kernel on 2-D operands (the lowering of the fused
primitives, ``primitives.py``).

Every function takes this rank's ``x`` and ``w`` and the primitive's parameters: ``axes``
(the mesh axes of the team), ``groups`` (``axis_index_groups`` or None), ``size`` (ranks per
team), ``w_nk`` (``w`` is stored ``[N, K]``: the kernels read it in place, through its
strides or its own tensor descriptor, no transpose is made), ``axis`` (the dimension of
``x`` gathered or scattered; ``x`` is ``[..., K]`` with any leading dimensions: the
dimensions before ``axis`` are batch entries, and the kernels read and write each entry's
block of rows in place).

Tiles: each call's kernel is autotuned over ``tiles.gemm_configs`` (non-persistent and
persistent configs); the fixed table's choice comes first, so the CPU backend and runs
with tuning off use it. The kernels' stream-K forms (``STREAM_K``) are not in that space:
measured on an H100 (BENCHMARKS.md), the stream-K GEMM tile was slower than the persistent
one at every benchmark shape, so tuning them would only cost time; a space that holds them
(``tiles.gemm_configs(..., stream_k=True)``) runs them with the workspaces and grid below.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jax_triton_dist import autotune, tiles
from jax_triton_dist.collectives.launch import ONE_SHOT_MAX_BYTES
from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel
from jax_triton_dist.kernels.gemm_collectives import (
    all_gather_matmul_kernel,
    matmul_reduce_scatter_kernel,
)
from jax_triton_dist.triton_call import Workspace, triton_call

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "partial_dtype"]


def _weight(w: jax.Array, w_nk: bool) -> tuple[int, int, int]:
    """``(N, stride_wk, stride_wn)`` of a weight stored ``[K, N]`` or ``[N, K]``."""
    if w_nk:
        return w.shape[0], 1, w.shape[1]
    return w.shape[1], w.shape[1], 1


def _rows(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    """``(batch entries, rows per entry)`` of an ``[..., K]`` operand split at ``axis``."""
    return math.prod(shape[:axis]), math.prod(shape[axis:-1])


def _epilogue(x: jax.Array, bias: jax.Array | None, activation: str) -> dict:
    """The bias operand (a placeholder when there is none) and the epilogue constexprs."""
    operand = bias if bias is not None else jnp.zeros((1,), x.dtype)
    return {"bias": operand, "HAS_BIAS": bias is not None, "ACTIVATION": activation}


def partial_dtype(dtype) -> jnp.dtype:
    """The element type of the partial products GEMM+RS and GEMM+AR exchange: the output's
    (bfloat16 / float16: what an unfused ``dot`` + ``psum_scatter`` exchanges, half the
    bytes of float32), float32 for float32 outputs. Each rank's partial is rounded once
    from its float32 accumulator; the partials are summed in float32 (GEMM+AR: in rank
    order; GEMM+RS: the owner's own first, then the peers' in rank order) and rounded once
    more, where a bf16 collective would round at every step."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)


STREAM_K = False  # whether the ops tune over their kernels' stream-K forms (see above)


def reduce_scatter_exchange(size: int, seg: int, n: int, tiles_per_segment: int,
                            dtype) -> list[tuple[tuple[int, ...], np.dtype]]:
    """GEMM+RS's symmetric workspaces (``kernels/gemm_collectives.py``) as ``(shape,
    dtype)``, each in two halves by epoch parity: the partials' slots ``[2, ranks, seg,
    n]`` (:func:`partial_dtype` of the output's ``dtype``) and the flags ``[2, ranks,
    tiles of a segment]``."""
    return [((2, size, seg, n), partial_dtype(dtype)),
            ((2, size, tiles_per_segment), np.dtype(np.int32))]


def reduce_scatter_sums_tma(size: int, n: int, dtype) -> bool:
    """Whether GEMM+RS sums its own segment's tiles reading the peers' partials through
    the slots' tensor descriptor (its ``SUM_TMA``): with peers, where a slot row of ``n``
    partials (:func:`partial_dtype` of ``dtype``) is a multiple of 16 bytes, as
    descriptors need."""
    return size > 1 and n * partial_dtype(dtype).itemsize % 16 == 0


def all_reduce_exchange(size: int, m: int, n: int, tiles: int,
                        dtype) -> list[tuple[tuple[int, ...], np.dtype]]:
    """GEMM+AR's symmetric workspaces (``kernels/gemm_allreduce.py``) as ``(shape,
    dtype)``, each in two halves by epoch parity: the slots ``[2, ranks, m, n]``
    (:func:`partial_dtype`) and the flags ``[2, 2, ranks, tiles]`` (an area for the
    partials, one for the two-shot exchange's sums)."""
    return [((2, size, m, n), partial_dtype(dtype)), ((2, 2, size, tiles), np.dtype(np.int32))]

# GEMM+AR's exchanges (``kernels/gemm_allreduce.py``), each tuned with every GEMM config
# where the team has more than one rank: one-shot (every rank sums every tile) and
# two-shot (each tile summed by its owner rank, the sum pushed to the others). The first
# form's configs run on CPU and with tuning off: one-shot for outputs up to
# ``all_reduce``'s ``ONE_SHOT_MAX_BYTES`` per rank, two-shot above (the same rule).
ALL_REDUCE_FORMS = ({"TWO_SHOT": False}, {"TWO_SHOT": True})  # one-shot first


def _all_reduce_forms(size: int, nbytes: int) -> tuple[dict, ...]:
    """:data:`ALL_REDUCE_FORMS` in the order the op tunes them for ``size`` ranks and an
    output of ``nbytes`` per rank (its default first); one-shot alone at one rank."""
    if size == 1:
        return ALL_REDUCE_FORMS[:1]
    return ALL_REDUCE_FORMS if nbytes <= ONE_SHOT_MAX_BYTES else ALL_REDUCE_FORMS[::-1]


def _tuned(kernel, m: int, n: int, k: int, copies: int, tma: bool = True,
           tma_store: bool = False, flatten: bool = False,
           forms: tuple[dict, ...] = ({},)) -> autotune.Autotuned:
    """``kernel`` with the GEMM configs of ``copies`` ``[m, k] @ [k, n]`` products: the
    fixed table's first (what runs on CPU and with tuning off), tuned on GPUs; with their
    tensor-descriptor forms where ``tma`` (weights of either layout: an ``[N, K]`` one is
    read in ``[BLOCK_N, BLOCK_K]`` blocks and transposed in shared memory), and where
    ``tma_store`` with output tiles stored through a descriptor too, and where ``flatten``
    with the persistent ones' tile and K loops pipelined as one; each in every
    one of the kernel's ``forms`` (constexprs; the first form's come first). Every
    config's outputs are checked against the first's while tuning
    (``autotune(check=True)``)."""
    configs = tiles.gemm_configs(m, n, k, copies, tma=tma, stream_k=STREAM_K,
                                 tma_store=tma_store, flatten=flatten)
    clash = {key for c in configs for form in forms for key in c.keys() & form.keys()}
    if clash:  # a form would silently replace the config's value
        raise ValueError(f"{kernel.fn.__name__}: GEMM configs set {sorted(clash)}, which the "
                         f"kernel's forms {list(forms)} set")
    return autotune.autotune([autotune.Config.from_table(dict(c, **form))
                              for form in forms for c in configs], check=True)(kernel)


def _grid(tiles_of: Callable[[dict], int]) -> Callable[[dict], tuple[int]]:
    """One program per tile, or (persistent configs) at most a device's worth, or
    (stream-K configs) a device's worth."""
    def grid(meta: dict) -> tuple[int]:
        if meta.get("STREAM_K"):
            return (tiles.fill_programs(),)
        count = tiles_of(meta)
        return (min(count, tiles.fill_programs()) if meta["PERSISTENT"] else count,)
    return grid


def _stream_k_workspaces(meta: dict, tile_count: int) -> list[Workspace]:
    """The stream-K shares' slots (float32 ``[programs, 2, BLOCK_M, BLOCK_N]``) and the
    tiles' block counts (int32); one element each for other configs (unused)."""
    if not meta.get("STREAM_K"):
        return [Workspace((1,), jnp.float32), Workspace((1,), jnp.int32)]
    return [Workspace((tiles.fill_programs(), 2, meta["BLOCK_M"], meta["BLOCK_N"]),
                      jnp.float32), Workspace((tile_count,), jnp.int32)]


def all_gather_matmul(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, axes,
                      groups, size: int, w_nk: bool = False, axis: int = 0,
                      activation: str = "none") -> jax.Array:
    """``activation(all_gather(x, axis=axis, tiled=True) @ w + bias)``."""
    k = x.shape[-1]
    n, stride_wk, stride_wn = _weight(w, w_nk)
    batch, rows = _rows(x.shape, axis)
    m = batch * rows
    out_shape = x.shape[:axis] + (size * x.shape[axis],) + x.shape[axis + 1:-1] + (n,)
    epilogue = _epilogue(x, bias, activation)

    def num_tiles(meta: dict) -> int:
        return size * triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])

    return triton_call(
        _tuned(all_gather_matmul_kernel, m, n, k, size, tma_store=batch == 1, flatten=True),
        x.reshape(m, k), w, epilogue.pop("bias"),
        out_shape=jax.ShapeDtypeStruct((size * m, n), x.dtype),
        workspace=lambda meta: [Workspace((2, size), jnp.int32),
                                *_stream_k_workspaces(meta, num_tiles(meta))],
        symmetric=[0], grid=_grid(num_tiles),
        axis_name=axes, axis_index_groups=groups, m=m, N=n, K=k, R=rows,
        stride_wk=stride_wk, stride_wn=stride_wn, BATCHED=batch > 1, W_NK=w_nk, **epilogue,
    ).reshape(out_shape)


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *,
                          axes, groups, size: int, w_nk: bool = False, axis: int = 0,
                          activation: str = "none") -> jax.Array:
    """``activation(psum_scatter(x @ w, scatter_dimension=axis, tiled=True) + bias)``."""
    k = x.shape[-1]
    n, stride_wk, stride_wn = _weight(w, w_nk)
    batch, rows = _rows(x.shape, axis)
    per_rank = rows // size  # rows of one batch entry in each rank's segment
    seg = batch * per_rank
    out_shape = x.shape[:axis] + (x.shape[axis] // size,) + x.shape[axis + 1:-1] + (n,)
    epilogue = _epilogue(x, bias, activation)

    def per_segment(meta: dict) -> int:
        return triton.cdiv(seg, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])

    return triton_call(
        _tuned(matmul_reduce_scatter_kernel, seg, n, k, size, tma=batch == 1,
               tma_store=size == 1 and batch == 1, flatten=batch == 1),
        x.reshape(batch * rows, k), w,
        epilogue.pop("bias"), out_shape=jax.ShapeDtypeStruct((seg, n), x.dtype),
        workspace=lambda meta: [
            *(Workspace(*w) for w in reduce_scatter_exchange(size, seg, n, per_segment(meta),
                                                              x.dtype)),
            *_stream_k_workspaces(meta, size * per_segment(meta))],
        grid=_grid(lambda meta: size * per_segment(meta)), axis_name=axes,
        axis_index_groups=groups, seg=seg, N=n, K=k, R=per_rank, stride_wk=stride_wk,
        stride_wn=stride_wn, BATCHED=batch > 1, W_NK=w_nk,
        SUM_TMA=reduce_scatter_sums_tma(size, n, x.dtype), **epilogue,
    ).reshape(out_shape)


def matmul_all_reduce(x: jax.Array, w: jax.Array, *, axes, groups, size: int,
                      invariant: bool = False, w_nk: bool = False) -> jax.Array:
    """``psum(x @ w)``: ``[m, n]``."""
    del invariant  # typing only
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    n, stride_wk, stride_wn = _weight(w, w_nk)

    def num_tiles(meta: dict) -> int:
        return triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])

    return triton_call(
        _tuned(matmul_all_reduce_kernel, m, n, k, 1, tma_store=size == 1, flatten=size == 1,
               forms=_all_reduce_forms(size, m * n * x.dtype.itemsize)), x.reshape(m, k), w,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        workspace=lambda meta: [
            *(Workspace(*w) for w in all_reduce_exchange(size, m, n, num_tiles(meta),
                                                          x.dtype)),
            *_stream_k_workspaces(meta, num_tiles(meta))],
        grid=_grid(num_tiles), axis_name=axes, axis_index_groups=groups,
        M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=stride_wk, stride_bn=stride_wn,
        B_NK=w_nk,
    ).reshape(lead + (n,))
