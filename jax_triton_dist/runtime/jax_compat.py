"""What differs between the jax versions we support (0.10.x in CI, 0.11.x on the GPU machine)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import jax

__all__ = ["varying_axes", "result_types"]

_SDS_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Manual mesh axes along which ``x`` varies (empty when shard_map does not check)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def result_types(shapes: Sequence[tuple[tuple[int, ...], object]], varying: frozenset[str],
                 like: jax.Array) -> list[jax.ShapeDtypeStruct]:
    """Result types of a custom call inside shard_map that vary over ``varying``.

    ``like`` is an operand whose type carries the enclosing shard_map's manual axes.
    """
    if not varying:
        return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    if "manual_axis_type" in _SDS_PARAMS:
        # The type must also name the enclosing mesh, whose axes are Manual.
        aval = jax.typeof(like)
        mat = aval.mat.update(varying=varying)
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
        return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=mat)
                for shape, dtype in shapes]
    return [jax.ShapeDtypeStruct(shape, dtype, vma=varying) for shape, dtype in shapes]
