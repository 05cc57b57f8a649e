"""What differs between the jax versions we support (0.10.x in CI, 0.11.x on the GPU machine)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["aval_varying", "varying_axes", "result_types", "is_traced", "checking_vma",
           "with_varying"]

_SDS_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def aval_varying(aval: Any) -> frozenset[str]:
    """Manual mesh axes along which values of type ``aval`` vary."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def varying_axes(x: jax.Array) -> frozenset[str]:
    """Manual mesh axes along which ``x`` varies (empty when shard_map does not check)."""
    return aval_varying(jax.typeof(x))


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a tracer (a value that may differ between ranks), not a constant."""
    return isinstance(x, jax.core.Tracer)


def checking_vma() -> bool:
    """Whether the enclosing ``shard_map`` checks how values vary (``check_vma=True``)."""
    from jax._src import config  # the flag shard_map sets while it traces its body

    return bool(config._check_vma.value)


def with_varying(aval: Any, varying: frozenset[str]) -> Any:
    """``aval`` typed as varying over exactly ``varying`` (an abstract-eval result)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=frozenset(varying)))
    return aval.update(vma=frozenset(varying))


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
