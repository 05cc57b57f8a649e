"""``all_gather_matmul`` and ``matmul_reduce_scatter`` with a bias and an activation fused
into the kernel's epilogue, as JAX primitives.

Operands ``(x, w, bias)`` (``bias`` is ``[N]``; without ``has_bias`` a placeholder). Their
JVP needs the pre-activation: it runs the plain fused op (which writes ``z = op(x, w)``),
applies ``activation(z + bias)`` in XLA and differentiates that; the tangent is linear in
the plain fused primitives, so reverse mode transposes through them. So the epilogue runs
in the kernel when the op is not differentiated (inference), and under differentiation the
kernel writes the pre-activation the backward needs anyway.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_triton_dist.collectives import primitives as collective
from jax_triton_dist.fused import launch, primitives

__all__ = ["ACTIVATIONS", "activation_fn", "bind"]

ACTIVATIONS = {
    "none": lambda v: v,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}
"""The epilogue activations, as ``jnp`` functions (the kernels compute the same in f32)."""

_PLAIN = {"all_gather_matmul": primitives.bind_all_gather_matmul,
          "matmul_reduce_scatter": primitives.bind_matmul_reduce_scatter}
_RUN = {"all_gather_matmul": launch.all_gather_matmul,
        "matmul_reduce_scatter": launch.matmul_reduce_scatter}
_PRIMS = {name: Primitive(f"jtd_{name}_epilogue") for name in _PLAIN}


def activation_fn(name: str):
    """The ``jnp`` function of activation ``name``."""
    return ACTIVATIONS[name]


def bind(op: str, x, w, bias, *, activation: str, has_bias: bool, **params):
    """``activation(op(x, w) + bias)`` through the epilogue primitive of ``op``."""
    x, w = primitives._operands(x, w, params["axes"])
    return _PRIMS[op].bind(x, w, bias, activation=activation, has_bias=has_bias, **params)


def _reference(op, x, w, bias, *, activation, has_bias, **params):
    """The same with the plain fused op and an XLA epilogue (float32)."""
    z = _PLAIN[op](x, w, **params).astype(jnp.float32)
    if has_bias:
        z = z + bias.astype(jnp.float32)
    return ACTIVATIONS[activation](z).astype(x.dtype)


def _abstract(op):
    plain = {"all_gather_matmul": primitives._all_gather_matmul_abstract,
             "matmul_reduce_scatter": primitives._matmul_reduce_scatter_abstract}[op]

    def rule(x, w, bias, *, activation, has_bias, **params):
        del bias, activation, has_bias
        return plain(x, w, **params)
    return rule


def _jvp(op):
    def rule(primals, tangents, *, activation, has_bias, **params):
        x, w, bias = primals
        dx, dw, db = tangents
        z = _PLAIN[op](x, w, **params).astype(jnp.float32)
        pre = z + bias.astype(jnp.float32) if has_bias else z
        dz = jnp.zeros_like(z)
        if type(dx) is not ad.Zero:
            dz = dz + _PLAIN[op](dx, w, **params).astype(jnp.float32)
        if type(dw) is not ad.Zero:
            dz = dz + _PLAIN[op](x, dw, **params).astype(jnp.float32)
        if has_bias and type(db) is not ad.Zero:
            dz = dz + collective.vary(db, params["axes"]).astype(jnp.float32)
        y, dy = jax.jvp(ACTIVATIONS[activation], (pre,), (dz,))
        return y.astype(x.dtype), dy.astype(x.dtype)
    return rule


def _batch(op):
    def rule(args, dims, *, activation, has_bias, **params):
        (x, w, bias), (bx, bw, bb) = args, dims
        prim = _PRIMS[op]
        if bw is None and bb is None:  # the batch is one more leading dimension of x
            out = prim.bind(jnp.moveaxis(x, bx, 0), w, bias, activation=activation,
                            has_bias=has_bias, **dict(params, axis=params["axis"] + 1))
            return out, 0
        # A batched weight or bias: no single GEMM to fold into; the plain fused op (its own
        # batching rule) with the epilogue in XLA.
        fn = functools.partial(_reference, op, activation=activation, has_bias=has_bias,
                               **params)
        return jax.vmap(fn, in_axes=(bx, bw, bb))(x, w, bias), 0
    return rule


def _lowering(op):
    def run(x, w, bias, *, activation, has_bias, **params):
        return _RUN[op](x, w, bias if has_bias else None, activation=activation, **params)

    def rule(ctx, x, w, bias, **params):
        return mlir.lower_fun(functools.partial(run, **params), multiple_results=False)(
            ctx, x, w, bias)
    return rule


for _op, _prim in _PRIMS.items():
    _prim.def_impl(primitives._no_impl(_prim.name))
    _prim.def_abstract_eval(_abstract(_op))
    ad.primitive_jvps[_prim] = _jvp(_op)
    batching.primitive_batchers[_prim] = _batch(_op)
    mlir.register_lowering(_prim, _lowering(_op))
del _op, _prim
