"""Ops called in a partially-manual ``shard_map``: mesh axes left to the compiler.

A ``shard_map`` may be manual over some mesh axes only (``axis_names={'tp'}``, or a
``jax.vmap`` over an explicitly sharded axis, which leaves that axis to the compiler). A
kernel's team is found from every device's mesh coordinates, and the coordinates along
compiler-managed ("auto") axes are not visible to the program. So each public op is
wrapped by :func:`every_axis_manual`: inside such a ``shard_map`` it runs in a nested
``shard_map`` that is manual over the remaining axes too, with its operands replicated
over them. The compiler replicates them first (an XLA all-gather over those axes when the
operands are sharded over them) and every device along those axes computes the same
result; the op's own communication still runs in its kernels.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jax_triton_dist import axis_names

__all__ = ["compiler_axes", "every_axis_manual"]


def compiler_axes() -> frozenset[str]:
    """The mesh axes of size > 1 that the enclosing ``shard_map`` leaves to the compiler
    (empty outside any ``shard_map``, or when it is manual over all of them)."""
    manual = axis_names.manual_axes()
    if not manual:
        return frozenset()
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
                     if a not in manual and n > 1)


def _holds_array(value: Any) -> bool:
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value))


def every_axis_manual(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a public op that names its team with ``axis_name``; see the module
    docstring. Its positional arguments holding JAX arrays go through the nested
    ``shard_map``; the others (kernels, Python scalars, options) and keywords stay as given.

    An ``axis_name`` naming a compiler-managed axis raises ``UnboundAxisError`` (as
    ``jax.lax`` does). Operands and results are replicated over the compiler-managed axes
    (``P()``), Explicit and Auto alike; under ``jax.jit`` the nested map is inlined, eagerly
    it runs as one jitted call (eager ``shard_map`` cannot run a custom primitive on
    operands sharded over an Explicit axis it does not manage).
    """
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        auto = compiler_axes()
        if not auto:
            return fn(*args, **kwargs)
        named = signature.bind(*args, **kwargs).arguments.get("axis_name")
        for name in axis_names.as_tuple(named, fn.__name__):
            if name in auto:
                raise axis_names.UnboundAxisError(
                    f"{fn.__name__}: axis_name {name!r} is not a manual axis of the enclosing "
                    f"shard_map (manual axes: {sorted(axis_names.manual_axes())})")
        traced = [i for i, a in enumerate(args) if _holds_array(a)]

        def body(*arrays: Any) -> Any:
            full = list(args)
            for i, a in zip(traced, arrays, strict=True):
                full[i] = a
            return fn(*full, **kwargs)

        nested = jax.shard_map(body, in_specs=(P(),) * len(traced), out_specs=P(),
                               axis_names=auto)
        return jax.jit(nested)(*(args[i] for i in traced))

    return wrapper
