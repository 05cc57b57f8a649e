"""Collectives over ``jax.vmap`` axes (``vmap(f, axis_name='i')`` with ``psum(x, 'i')``
inside), as ``jax.lax`` defines them.

A vmap axis is not a device axis: its members are slices of one array on one device, so a
collective over it is local array work (a sum over the mapped dimension, a move of it),
with no communication. A reduction over a tuple mixing mesh and vmap axes reduces the
vmap part locally and the rest with the kernel; the data-movement ops take one vmap axis
alone (``jax.lax`` refuses the mixed case too).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]

_REDUCERS = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


def _only(axes, name, fn):
    if tuple(axes) != (name,):
        raise NotImplementedError(
            f"{fn} over {tuple(axes)}: a vmap axis ({name!r}) can only be gathered or "
            "scattered alone (as in jax.lax)")


def _split(axis, factor, x):
    shape = list(x.shape)
    size = shape.pop(axis)
    shape[axis:axis] = [factor, size // factor]
    return x.reshape(shape)


def _fold(axis, x):
    shape = list(x.shape)
    shape[axis:axis + 2] = [shape[axis] * shape[axis + 1]]
    return x.reshape(shape)


def _reduce_members(x, d, batch, op):
    """The reduction over the vmap axis of ``x`` mapped at ``d`` (None: every member
    holds ``x``)."""
    if d is None:
        return x * jnp.asarray(batch, x.dtype) if op == "sum" else x
    if op == "sum":
        return jnp.sum(x, axis=d, dtype=x.dtype)
    return _REDUCERS[op](x, axis=d)


def all_reduce(name, batch, x, d, *, axes, size, bind, **params):
    """``(result, None)``: reduce over the vmap axis here, over the others with ``bind``."""
    out = _reduce_members(x, d, batch, params["op"])
    rest = tuple(a for a in axes if a != name)
    if rest:
        out = bind(out, axes=rest, size=size // batch, **params)
    return out, None


def all_gather(name, batch, x, d, *, axes, axis, tiled, **_):
    _only(axes, name, "all_gather")
    if d is None:
        y = jnp.broadcast_to(jnp.expand_dims(x, axis), x.shape[:axis] + (batch,) + x.shape[axis:])
    else:
        y = jnp.moveaxis(x, d, axis)
    return (_fold(axis, y) if tiled else y), None


def reduce_scatter(name, batch, x, d, *, axes, dim, tiled, op, **_):
    _only(axes, name, "reduce_scatter")
    y = _reduce_members(x, d, batch, op)
    return (_split(dim, batch, y) if tiled else y), dim


def all_to_all(name, batch, x, d, *, axes, split_axis, concat_axis, **_):
    _only(axes, name, "all_to_all")
    if d is None:
        x, d = jnp.broadcast_to(x, (batch,) + x.shape), 0
    if split_axis == concat_axis:
        axis = split_axis + (d <= split_axis)
        out_d = d
        x = _split(axis, batch, x)
        d += axis <= d
        return _fold(axis, jnp.moveaxis(x, (d, axis), (axis, d))), out_d
    concatenated = _fold(concat_axis, jnp.moveaxis(x, d, concat_axis))
    return _split(split_axis, batch, concatenated), split_axis
