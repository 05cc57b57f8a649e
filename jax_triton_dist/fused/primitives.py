"""The fused GEMM + collective ops as JAX primitives.

* **Types.** The result varies over what either operand varies over (operands are first
  cast to vary over the op's axes); ``matmul_all_reduce`` without ``axis_index_groups`` is
  invariant over its axes under ``check_vma=True``, as ``psum(x @ w)`` is.
* **Autodiff.** Each op is bilinear: the JVP is ``op(dx, w) + op(x, dw)``, and the
  transposes go through each other — ``all_gather_matmul``'s ``x`` cotangent is a
  ``matmul_reduce_scatter`` and ``matmul_reduce_scatter``'s is an ``all_gather_matmul``
  (the weights' cotangents gather with the project's ``all_gather``).
* **Weight layout.** ``w_nk``: ``w`` is stored ``[N, K]`` (``dot_general`` contracting its
  dimension 1); the kernels read it through strides. The transposes use it too: the
  ``x`` cotangent of one op is the other op on the same ``w`` read the other way round, so
  no transposed weight is ever materialised.
* **vmap.** A batch of ``x`` folds into its rows and a batch of ``w`` into its columns:
  one kernel call for the batch. With both batched there is no single GEMM to fold into:
  the op runs as the project's collective plus a batched XLA matmul (not fused).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_triton_dist.collectives import primitives as collective
from jax_triton_dist.fused import launch
from jax_triton_dist.runtime import jax_compat

__all__ = ["all_gather_matmul_p", "matmul_reduce_scatter_p", "matmul_all_reduce_p",
           "bind_all_gather_matmul", "bind_matmul_reduce_scatter", "bind_matmul_all_reduce"]

all_gather_matmul_p = Primitive("jtd_all_gather_matmul")
matmul_reduce_scatter_p = Primitive("jtd_matmul_reduce_scatter")
matmul_all_reduce_p = Primitive("jtd_matmul_all_reduce")


def _operands(x, w, axes):
    return collective.vary(x, axes), collective.vary(w, axes)


def bind_all_gather_matmul(x, w, *, axes, groups, size, w_nk=False, axis=0):
    return all_gather_matmul_p.bind(*_operands(x, w, axes), axes=axes, groups=groups,
                                    size=size, w_nk=w_nk, axis=axis)


def bind_matmul_reduce_scatter(x, w, *, axes, groups, size, w_nk=False, axis=0):
    return matmul_reduce_scatter_p.bind(*_operands(x, w, axes), axes=axes, groups=groups,
                                        size=size, w_nk=w_nk, axis=axis)


def bind_matmul_all_reduce(x, w, *, axes, groups, size, w_nk=False):
    invariant = groups is None and jax_compat.checking_vma()
    return matmul_all_reduce_p.bind(*_operands(x, w, axes), axes=axes, groups=groups,
                                    size=size, invariant=invariant, w_nk=w_nk)


def _kn(w, w_nk):
    """The weight as ``[K, N]`` for an XLA dot (a transposed view when stored ``[N, K]``)."""
    return w.T if w_nk else w


def _stored(dw, w_nk):
    """A ``[K, N]`` weight cotangent in the weight's stored layout."""
    return dw.T if w_nk else dw


def _n(w, w_nk):
    return w.shape[0] if w_nk else w.shape[1]


def _dot(a, b, dtype):
    """``a @ b`` accumulated in float32, in ``dtype`` (batched over leading dimensions)."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype)


# ---------------------------------------------------------------------------
# Abstract evaluation
# ---------------------------------------------------------------------------


def _result(x, w, shape, minus=frozenset()):
    vma = jax_compat.aval_varying(x) | jax_compat.aval_varying(w)
    out = x.update(shape=tuple(shape), weak_type=False)
    return jax_compat.with_varying(out, vma - minus)


def _resized(shape, axis, size, n):
    """``shape`` with dimension ``axis`` of size ``size`` and the last ``n``."""
    return shape[:axis] + (size,) + shape[axis + 1:-1] + (n,)


def _all_gather_matmul_abstract(x, w, *, axes, groups, size, w_nk, axis):
    del axes, groups
    return _result(x, w, _resized(x.shape, axis, size * x.shape[axis], _n(w, w_nk)))


def _matmul_reduce_scatter_abstract(x, w, *, axes, groups, size, w_nk, axis):
    del axes, groups
    return _result(x, w, _resized(x.shape, axis, x.shape[axis] // size, _n(w, w_nk)))


def _matmul_all_reduce_abstract(x, w, *, axes, groups, size, invariant, w_nk):
    del groups, size
    return _result(x, w, x.shape[:-1] + (_n(w, w_nk),),
                   frozenset(axes) if invariant else frozenset())


# ---------------------------------------------------------------------------
# Transposes (one operand undefined; ``ad.defbilinear`` derives the JVP)
# ---------------------------------------------------------------------------


def _gather(v, axes, groups, size, axis=0):
    return collective.bind_all_gather(v, axes=axes, groups=groups, size=size, axis=axis,
                                      tiled=True)


def _flat(v):
    """``[..., C]`` as ``[rows, C]``."""
    return v.reshape(-1, v.shape[-1])


def _all_gather_matmul_dx(ct, x, w, *, axes, groups, size, w_nk, axis):
    del x  # d(all_gather(x) @ w) / dx: ct @ w.T, each rank's rows scattered back
    return bind_matmul_reduce_scatter(ct, w, axes=axes, groups=groups, size=size,
                                      w_nk=not w_nk, axis=axis)


def _all_gather_matmul_dw(ct, x, w, *, axes, groups, size, w_nk, axis):
    gathered = _gather(x, axes, groups, size, axis)
    return _stored(_dot(_flat(gathered).T, _flat(ct), w.aval.dtype), w_nk)


def _matmul_reduce_scatter_dx(ct, x, w, *, axes, groups, size, w_nk, axis):
    del x  # all_gather(ct) @ w.T
    return bind_all_gather_matmul(ct, w, axes=axes, groups=groups, size=size,
                                  w_nk=not w_nk, axis=axis)


def _matmul_reduce_scatter_dw(ct, x, w, *, axes, groups, size, w_nk, axis):
    gathered = _gather(ct, axes, groups, size, axis)
    return _stored(_dot(_flat(x).T, _flat(gathered), w.aval.dtype), w_nk)


def _reduced_cotangent(ct, axes, groups, size, invariant):
    """Every rank's share of ``psum(x @ w)``'s cotangent (see the all_reduce transpose)."""
    if invariant:
        return collective.vary(ct, axes)
    return collective.bind_all_reduce(ct, axes=axes, groups=groups, size=size, op="sum",
                                      method="auto")


def _matmul_all_reduce_dx(ct, x, w, *, axes, groups, size, invariant, w_nk):
    total = _reduced_cotangent(ct, axes, groups, size, invariant)
    return _dot(total, _kn(w, w_nk).T, x.aval.dtype)


def _matmul_all_reduce_dw(ct, x, w, *, axes, groups, size, invariant, w_nk):
    total = _reduced_cotangent(ct, axes, groups, size, invariant)
    return _stored(_dot(_flat(x).T, _flat(total), w.aval.dtype), w_nk)


# ---------------------------------------------------------------------------
# vmap: a batch of x is one more leading dimension; a batch of w folds into its columns
# ---------------------------------------------------------------------------


def _columns(w, d, w_nk):
    """``w`` batched at ``d`` with the batch folded into its columns, batch-major: ``[K, B *
    N]`` (stored ``[B * N, K]`` for ``w_nk``)."""
    if w_nk:
        w = jnp.moveaxis(w, d, 0)
        return w.reshape(-1, w.shape[2])
    w = jnp.moveaxis(w, d, 1)
    return w.reshape(w.shape[0], -1)


def _unfold_columns(out, batch):
    """``[..., B * N]`` back to ``[..., B, N]``: the batch just before the last dimension."""
    return out.reshape(out.shape[:-1] + (batch, -1)), out.ndim - 1


def _batched_kn(w, d, w_nk):
    """``w`` batched at ``d`` as ``[B, K, N]``."""
    w = jnp.moveaxis(w, d, 0)
    return jnp.swapaxes(w, 1, 2) if w_nk else w


def _batched_product(x, w, dx, dw, w_nk):
    """Both operands batched (at ``dx``, ``dw``): the float32 products ``[B, ..., N]``, the
    batch first; the partials a batched reduction then sums."""
    x, w = jnp.moveaxis(x, dx, 0), _batched_kn(w, dw, w_nk)
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    product = jnp.matmul(flat, w, preferred_element_type=jnp.float32)
    return product.reshape(x.shape[:-1] + (-1,))


def _all_gather_matmul_batch(args, dims, *, axes, groups, size, w_nk, axis):
    (x, w), (dx, dw) = args, dims
    params = dict(axes=axes, groups=groups, size=size)
    if dx is not None and dw is not None:
        x, w = jnp.moveaxis(x, dx, 0), _batched_kn(w, dw, w_nk)
        gathered = collective.bind_all_gather(x, axis=axis + 1, tiled=True, **params)
        flat = gathered.reshape(gathered.shape[0], -1, gathered.shape[-1])
        return _dot(flat, w, x.dtype).reshape(gathered.shape[:-1] + (-1,)), 0
    if dw is None:  # the batch is one more leading dimension of x
        out = bind_all_gather_matmul(jnp.moveaxis(x, dx, 0), w, w_nk=w_nk, axis=axis + 1,
                                     **params)
        return out, 0
    out = bind_all_gather_matmul(x, _columns(w, dw, w_nk), w_nk=w_nk, axis=axis, **params)
    return _unfold_columns(out, w.shape[dw])


def _matmul_reduce_scatter_batch(args, dims, *, axes, groups, size, w_nk, axis):
    (x, w), (dx, dw) = args, dims
    params = dict(axes=axes, groups=groups, size=size)
    if dx is not None and dw is not None:
        out = collective.bind_reduce_scatter(_batched_product(x, w, dx, dw, w_nk),
                                             dim=axis + 1, tiled=True, op="sum", **params)
        return out.astype(x.dtype), 0
    if dw is None:
        out = bind_matmul_reduce_scatter(jnp.moveaxis(x, dx, 0), w, w_nk=w_nk, axis=axis + 1,
                                         **params)
        return out, 0
    out = bind_matmul_reduce_scatter(x, _columns(w, dw, w_nk), w_nk=w_nk, axis=axis,
                                     **params)
    return _unfold_columns(out, w.shape[dw])


def _matmul_all_reduce_batch(args, dims, *, axes, groups, size, invariant, w_nk):
    (x, w), (dx, dw) = args, dims
    params = dict(axes=axes, groups=groups, size=size)
    if dx is not None and dw is not None:
        out = collective.all_reduce_p.bind(_batched_product(x, w, dx, dw, w_nk), op="sum",
                                           method="auto", invariant=invariant, **params)
        return out.astype(x.dtype), 0
    if dw is None:
        out = matmul_all_reduce_p.bind(jnp.moveaxis(x, dx, 0), w, invariant=invariant,
                                       w_nk=w_nk, **params)
        return out, 0
    out = matmul_all_reduce_p.bind(x, _columns(w, dw, w_nk), invariant=invariant, w_nk=w_nk,
                                   **params)
    return _unfold_columns(out, w.shape[dw])


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def _lowering(run):
    def rule(ctx, x, w, **params):
        return mlir.lower_fun(functools.partial(run, **params), multiple_results=False)(
            ctx, x, w)
    return rule


def _no_impl(name):
    def impl(*args, **params):
        raise ValueError(f"{name} must be called inside jax.shard_map")
    return impl


for _prim, _abstract, _dx, _dw, _batch, _run in (
        (all_gather_matmul_p, _all_gather_matmul_abstract, _all_gather_matmul_dx,
         _all_gather_matmul_dw, _all_gather_matmul_batch, launch.all_gather_matmul),
        (matmul_reduce_scatter_p, _matmul_reduce_scatter_abstract, _matmul_reduce_scatter_dx,
         _matmul_reduce_scatter_dw, _matmul_reduce_scatter_batch,
         launch.matmul_reduce_scatter),
        (matmul_all_reduce_p, _matmul_all_reduce_abstract, _matmul_all_reduce_dx,
         _matmul_all_reduce_dw, _matmul_all_reduce_batch, launch.matmul_all_reduce)):
    _prim.def_impl(_no_impl(_prim.name))
    _prim.def_abstract_eval(_abstract)
    ad.defbilinear(_prim, _dx, _dw)
    batching.primitive_batchers[_prim] = _batch
    mlir.register_lowering(_prim, _lowering(_run))
del _prim, _abstract, _dx, _dw, _batch, _run
