"""The collectives as JAX primitives, with the rules ``jax.lax``'s own collectives have.

* **Types.** Shapes as in ``jax.lax``. Under ``shard_map(check_vma=True)`` a sum or max or
  min without ``axis_index_groups`` is invariant over its axes (its result can be returned
  with ``out_specs=P()``), every other result varies as its operand does; operands are
  first cast to vary over the op's axes, as ``jax.lax`` does.
* **Autodiff.** Every op is linear in its operand: the JVP sends the tangent through the
  same op (so ``jax.jvp``, ``linearize``, ``jacfwd`` and ``hessian`` work), and the
  transposes pair all_gather with the reduce-scatter sum, all_to_all with its inverse, and
  a sum with a sum (its invariant form with a cast to varying, as ``jax.lax.psum``).
  Max and min are not differentiable (as ``pmax`` and ``pmin``).
* **vmap.** A mapped dimension becomes one more dimension of the data the kernel moves:
  one kernel call for the whole batch.
* **Lowering.** Each op lowers to the project's custom call (``launch.py``).

Parameters shared by every primitive: ``axes`` (tuple of mesh axis names), ``groups``
(``axis_index_groups`` as a tuple of tuples, or None) and ``size`` (ranks per team).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_triton_dist import axis_names
from jax_triton_dist.collectives import launch, vmap_axes
from jax_triton_dist.runtime import jax_compat

__all__ = ["all_gather_p", "reduce_scatter_p", "all_reduce_p", "all_to_all_p", "vary_p",
           "vary", "bind_all_gather", "bind_reduce_scatter", "bind_all_reduce",
           "bind_all_to_all"]

vary_p = Primitive("jtd_vary")
all_gather_p = Primitive("jtd_all_gather")
reduce_scatter_p = Primitive("jtd_reduce_scatter")
all_reduce_p = Primitive("jtd_all_reduce")
all_to_all_p = Primitive("jtd_all_to_all")


# ---------------------------------------------------------------------------
# Binding: operands cast to vary over the op's axes first
# ---------------------------------------------------------------------------


def vary(x, axes):
    """``x`` cast to vary over the mesh axes among ``axes`` where it does not yet, when
    ``shard_map`` checks varying axes (as ``jax.lax.pcast(..., to="varying")``, but its
    transpose, a sum, runs the project's kernel)."""
    if not jax_compat.checking_vma():
        return x
    mesh = axis_names.manual_axes()
    missing = tuple(a for a in axes if a in mesh and a not in jax_compat.varying_axes(x))
    if not missing:
        return x
    return vary_p.bind(x, axes=missing, size=axis_names.axis_size(missing))


def bind_all_gather(x, *, axes, groups, size, axis, tiled, invariant=False):
    """``invariant``: the result is typed as not varying over ``axes`` (``jax.lax``'s
    ``all_gather(..., to="invarying")``; no groups)."""
    return all_gather_p.bind(vary(x, axes), axes=axes, groups=groups, size=size,
                             axis=axis, tiled=tiled, invariant=invariant)


def bind_reduce_scatter(x, *, axes, groups, size, dim, tiled, op):
    return reduce_scatter_p.bind(vary(x, axes), axes=axes, groups=groups,
                                 size=size, dim=dim, tiled=tiled, op=op)


def bind_all_reduce(x, *, axes, groups, size, op, method):
    invariant = groups is None and jax_compat.checking_vma()
    return all_reduce_p.bind(vary(x, axes), axes=axes, groups=groups, size=size,
                             op=op, method=method, invariant=invariant)


def bind_all_to_all(x, *, axes, groups, size, split_axis, concat_axis):
    """The tiled all_to_all (untiled calls add and remove unit dimensions around it)."""
    return all_to_all_p.bind(vary(x, axes), axes=axes, groups=groups, size=size,
                             split_axis=split_axis, concat_axis=concat_axis)


# ---------------------------------------------------------------------------
# Abstract evaluation
# ---------------------------------------------------------------------------


def _result(aval, shape, varying=None, dtype=None):
    out = aval.update(shape=tuple(shape), dtype=aval.dtype if dtype is None else dtype,
                      weak_type=False)
    vma = jax_compat.aval_varying(aval)
    return jax_compat.with_varying(out, vma if varying is None else varying(vma))


def _vary_abstract(aval, *, axes, size):
    del size
    return _result(aval, aval.shape, varying=lambda vma: vma | frozenset(axes))


def _all_gather_abstract(aval, *, axes, groups, size, axis, tiled, invariant):
    del groups
    shape = list(aval.shape)
    if tiled:
        shape[axis] *= size
    else:
        shape.insert(axis, size)
    if invariant:
        return _result(aval, shape, varying=lambda vma: vma - frozenset(axes))
    return _result(aval, shape)


def _reduce_scatter_abstract(aval, *, axes, groups, size, dim, tiled, op):
    del axes, groups, op
    shape = list(aval.shape)
    if tiled:
        shape[dim] //= size
    else:
        del shape[dim]
    return _result(aval, shape)


def _all_reduce_abstract(aval, *, axes, groups, size, op, method, invariant):
    del groups, size, op, method
    if invariant:
        return _result(aval, aval.shape, varying=lambda vma: vma - frozenset(axes))
    return _result(aval, aval.shape)


def _all_to_all_abstract(aval, *, axes, groups, size, split_axis, concat_axis):
    del axes, groups
    shape = list(aval.shape)
    shape[split_axis] //= size
    shape[concat_axis] *= size
    return _result(aval, shape)


# ---------------------------------------------------------------------------
# Autodiff: linear ops
# ---------------------------------------------------------------------------


def _vary_transpose(ct, x, *, axes, size):
    del x
    return [bind_all_reduce(ct, axes=axes, groups=None, size=size, op="sum", method="auto")]


def _all_gather_transpose(ct, x, *, axes, groups, size, axis, tiled, invariant):
    del x
    if invariant:  # one value for the team: each rank's share is its own block of it
        block = ct.shape[axis] // size if tiled else 1
        index = jax.lax.axis_index(axes) * block
        own = jax.lax.dynamic_slice_in_dim(vary(ct, axes), index, block, axis=axis)
        return [own if tiled else jnp.squeeze(own, axis)]
    return [bind_reduce_scatter(ct, axes=axes, groups=groups, size=size, dim=axis, tiled=tiled,
                                op="sum")]


def _not_differentiable(fn, op):
    raise NotImplementedError(f"{fn}(op={op!r}) is not differentiable; only op='sum' is (as "
                              "jax.lax.pmax and pmin are not)")


def _reduce_scatter_transpose(ct, x, *, axes, groups, size, dim, tiled, op):
    del x
    if op != "sum":
        _not_differentiable("reduce_scatter", op)
    return [bind_all_gather(ct, axes=axes, groups=groups, size=size, axis=dim, tiled=tiled)]


def _all_reduce_transpose(ct, x, *, axes, groups, size, op, method, invariant):
    del x
    if op != "sum":
        _not_differentiable("all_reduce", op)
    if invariant:  # the result is one value for the team: each rank's share is all of it
        return [vary(ct, axes)]
    return [bind_all_reduce(ct, axes=axes, groups=groups, size=size, op=op, method=method)]


def _all_to_all_transpose(ct, x, *, axes, groups, size, split_axis, concat_axis):
    del x
    return [bind_all_to_all(ct, axes=axes, groups=groups, size=size, split_axis=concat_axis,
                            concat_axis=split_axis)]


def _checked_linear_jvp(prim, fn):
    """The linear JVP ``deflinear2`` gave ``prim``, for ``op="sum"`` only."""
    linear = ad.primitive_jvps[prim]

    def jvp(primals, tangents, **params):
        if params["op"] != "sum":
            _not_differentiable(fn, params["op"])
        return linear(primals, tangents, **params)
    return jvp


# ---------------------------------------------------------------------------
# vmap: the mapped dimension is one more dimension of the data
# ---------------------------------------------------------------------------


def _vary_batch(args, dims, *, axes, size):
    (x,), (d,) = args, dims
    return vary_p.bind(x, axes=axes, size=size), d


def _named(standard, named_rule, bind):
    """A batching rule aware of vmap axis names: ``named_rule`` when the op runs over the
    vmapped axis itself (``vmap_axes.py``), else ``standard``."""
    def rule(axis_data, args, dims, **params):
        if axis_data.name in params["axes"]:
            (x,), (d,) = args, dims
            return named_rule(axis_data.name, axis_data.size, x, d, bind=bind, **params)
        if all(d is None for d in dims):
            return bind(*args, **params), None
        return standard(args, dims, **params)
    return rule


def _all_gather_batch(args, dims, *, axes, groups, size, axis, tiled, invariant):
    (x,), (d,) = args, dims
    if d <= axis:
        axis += 1
    elif not tiled:
        d += 1
    return bind_all_gather(x, axes=axes, groups=groups, size=size, axis=axis, tiled=tiled,
                           invariant=invariant), d


def _reduce_scatter_batch(args, dims, *, axes, groups, size, dim, tiled, op):
    (x,), (d,) = args, dims
    if d <= dim:
        dim += 1
    elif not tiled:
        d -= 1
    out = bind_reduce_scatter(x, axes=axes, groups=groups, size=size, dim=dim, tiled=tiled,
                              op=op)
    return out, d


def _all_reduce_batch(args, dims, *, axes, groups, size, op, method, invariant):
    (x,), (d,) = args, dims
    return all_reduce_p.bind(x, axes=axes, groups=groups, size=size, op=op, method=method,
                             invariant=invariant), d


def _all_to_all_batch(args, dims, *, axes, groups, size, split_axis, concat_axis):
    (x,), (d,) = args, dims
    out = bind_all_to_all(x, axes=axes, groups=groups, size=size,
                          split_axis=split_axis + (d <= split_axis),
                          concat_axis=concat_axis + (d <= concat_axis))
    return out, d


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def _no_impl(name):
    def impl(*args, **params):
        raise ValueError(f"{name} must be called inside jax.shard_map")
    return impl


def _lowering(run):
    def rule(ctx, x, **params):
        return mlir.lower_fun(functools.partial(run, **params), multiple_results=False)(ctx, x)
    return rule


vary_p.def_impl(_no_impl(vary_p.name))
vary_p.def_abstract_eval(_vary_abstract)
ad.deflinear2(vary_p, _vary_transpose)
batching.primitive_batchers[vary_p] = _vary_batch
mlir.register_lowering(vary_p, lambda ctx, x, **params: [x])

for _prim, _abstract, _transpose, _batch, _vmap_axis, _run in (
        (all_gather_p, _all_gather_abstract, _all_gather_transpose, _all_gather_batch,
         vmap_axes.all_gather, launch.all_gather),
        (reduce_scatter_p, _reduce_scatter_abstract, _reduce_scatter_transpose,
         _reduce_scatter_batch, vmap_axes.reduce_scatter, launch.reduce_scatter),
        (all_reduce_p, _all_reduce_abstract, _all_reduce_transpose, _all_reduce_batch,
         vmap_axes.all_reduce, launch.all_reduce),
        (all_to_all_p, _all_to_all_abstract, _all_to_all_transpose, _all_to_all_batch,
         vmap_axes.all_to_all, launch.all_to_all)):
    _prim.def_impl(_no_impl(_prim.name))
    _prim.def_abstract_eval(_abstract)
    ad.deflinear2(_prim, _transpose)
    batching.fancy_primitive_batchers[_prim] = _named(_batch, _vmap_axis, _prim.bind)
    mlir.register_lowering(_prim, _lowering(_run))
ad.primitive_jvps[all_reduce_p] = _checked_linear_jvp(all_reduce_p, "all_reduce")
ad.primitive_jvps[reduce_scatter_p] = _checked_linear_jvp(reduce_scatter_p, "reduce_scatter")
del _prim, _abstract, _transpose, _batch, _vmap_axis, _run
