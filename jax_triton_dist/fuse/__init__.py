"""``jtd.fuse``: the project's fused kernels for unmodified ``jax.lax`` code.

``jtd.fuse(fn)`` traces ``fn`` to a jaxpr and evaluates it with these patterns replaced
wherever they occur inside a ``shard_map`` body — also inside ``jit``, ``scan``, ``cond``,
``while_loop``, ``checkpoint`` and the primal bodies of ``custom_jvp`` / ``custom_vjp``:

* ``jax.lax.all_gather(x, axis, tiled=True)`` (rows) feeding ``x_all @ w`` ->
  :func:`jtd.all_gather_matmul`;
* ``x @ w`` feeding ``jax.lax.psum_scatter(..., scatter_dimension=0, tiled=True)`` ->
  :func:`jtd.matmul_reduce_scatter`;
* ``x @ w`` feeding ``jax.lax.psum`` -> :func:`jtd.matmul_all_reduce`;
* with ``collectives=True``, the remaining ``all_gather``, ``psum_scatter``, ``psum``,
  ``pmax``, ``pmin`` and ``all_to_all`` -> the project's collectives.

``x @ w`` is any ``dot_general`` (``jnp.dot``, ``@``, ``jnp.einsum('mk,kn')``,
``lax.dot_general``) of a 2-D activation with a 2-D weight in ``[K, N]`` or ``[N, K]``
layout (the latter is transposed for the kernel). A pair is rewritten only when the fused op
computes the same thing (see ``fuse/patterns.py``); every pair left alone is reported with
the reason. The result has ``fn``'s signature; it composes with ``jax.jit``, ``jax.grad``
(the fused ops' own derivative rules take over), ``jax.vmap``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from jax_triton_dist.fuse import evaluate as _evaluate
from jax_triton_dist.fuse.patterns import NearMiss

__all__ = ["fuse", "Report", "NearMiss"]


@dataclasses.dataclass
class Report:
    """What one trace of a fused function rewrote and left.

    Attributes:
      rewrites: ``(op, source location)`` of each rewrite.
      near_misses: each pattern left as it was, with the reason.
    """

    rewrites: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"jtd.fuse: {len(self.rewrites)} rewrite(s), {len(self.near_misses)} near "
                 "miss(es)"]
        lines += [f"  rewrote {op} at {where}" for op, where in self.rewrites]
        lines += [f"  left {m.op} at {m.where}: {m.reason}" for m in self.near_misses]
        return "\n".join(lines)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "aval")


def fuse(fn: Callable, *, collectives: bool = False, report: bool = False) -> Callable:
    """``fn`` with its all_gather/dot, dot/psum_scatter and dot/psum pairs fused.

    Args:
      fn: a function that calls ``jax.shard_map`` (jitted or not), or a ``shard_map`` body.
      collectives: also replace the remaining ``jax.lax`` collectives with the project's.
      report: log (absl, WARNING level) each rewrite with its source location and each
        near miss with the reason, every time the function is traced.

    Returns:
      A function with ``fn``'s signature. Its ``last_report`` attribute holds the
      :class:`Report` of its latest trace.

    Example::

        def mlp(x, w1, w2):                       # plain jax.lax code
            h = jax.nn.gelu(jax.lax.all_gather(x, "tp", tiled=True) @ w1)
            return jax.lax.psum_scatter(h @ w2, "tp", tiled=True)

        layer = jax.jit(jax.shard_map(jtd.fuse(mlp), mesh=mesh, in_specs=..., out_specs=...))
    """

    @functools.wraps(fn)
    def fused(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def traced(*values):
            full = list(leaves)
            for i, v in zip(dynamic, values, strict=True):
                full[i] = v
            a, k = jax.tree.unflatten(tree, full)
            return fn(*a, **k)

        values = [leaves[i] for i in dynamic]
        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*values)
        options = _evaluate.Options(collectives, [], [])
        outs = _evaluate.evaluate(closed.jaxpr, closed.consts, values, options)
        result = Report(options.rewrites, options.misses)
        fused.last_report = result
        if report:
            logging.warning("%s", result)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    fused.last_report = None
    return fused
