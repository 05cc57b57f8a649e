"""Axis names: the mesh axes a kernel or a collective runs over, and the teams they make.

An axis name is one manual mesh axis of the enclosing ``jax.shard_map`` or a tuple of them
(as for ``jax.lax.psum(x, ('dp', 'tp'))``). The devices that share every other mesh
coordinate form one team; a device's rank is its index over the named axes, row-major in
the order they are named. ``axis_index_groups`` splits each such team further, as in
``jax.lax``: a team is one group, a rank is the position in its group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from jax_triton_dist.runtime.call_site import TeamAxes

__all__ = ["UnboundAxisError", "as_tuple", "manual_axes", "vmap_axis_size", "manual_mesh",
           "team", "axis_size", "check_groups"]


class UnboundAxisError(NameError, ValueError):
    """An axis name that no enclosing ``shard_map`` binds (a ``NameError``, as in
    ``jax.lax``, and a ``ValueError``)."""


def as_tuple(axis_name: Any, fn: str) -> tuple[Hashable, ...]:
    """``axis_name`` as a tuple of names.

    Raises:
      ValueError: a name appears twice.
    """
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if len(set(names)) != len(names):
        raise ValueError(f"{fn}: axis_name {axis_name!r} names an axis twice")
    return names


def manual_axes() -> frozenset[str]:
    """The enclosing shard_map's manual axes (empty outside any)."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    return frozenset(getattr(mesh, "manual_axes", names)) & frozenset(names)


def vmap_axis_size(name: Hashable) -> int | None:
    """The size of ``name`` if a ``jax.vmap`` (not a mesh) binds it, else None."""
    if name in manual_axes():
        return None
    try:
        return int(jax.lax.axis_size(name))
    except (NameError, ValueError, KeyError, TypeError):
        return None


def manual_mesh(axis_name: Any) -> tuple[tuple[str, ...], dict[str, int]]:
    """The enclosing shard_map's manual axes (in mesh order) and every mesh axis's size.

    Raises:
      UnboundAxisError: not inside ``jax.shard_map``.
      NotImplementedError: the shard_map is manual over only some axes of size > 1.
    """
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if not names:
        raise UnboundAxisError(
            f"axis_name={axis_name!r}: jax_triton_dist ops must be called inside "
            "jax.shard_map: the kernel's rank and num_ranks come from mesh axes"
        )
    manual = set(getattr(mesh, "manual_axes", names))
    sizes = dict(zip(names, mesh.axis_sizes, strict=True))
    auto = {a: sizes[a] for a in names if a not in manual and sizes[a] > 1}
    if auto:
        raise NotImplementedError(
            f"axis_name={axis_name!r}: the enclosing shard_map leaves mesh axes {auto} to the "
            "compiler (not manual): jax_triton_dist needs every mesh axis of size > 1 "
            "manual, since a kernel's team is found from the manual coordinates; make the "
            "shard_map manual over all axes (the default axis_names)")
    return tuple(a for a in names if a in manual), sizes


def _positions(axis_name: Any, fn: str) -> tuple[TeamAxes, tuple[Hashable, ...]]:
    names = as_tuple(axis_name, fn)
    if not names:
        raise ValueError(f"{fn}: axis_name is an empty tuple; name at least one mesh axis")
    manual, sizes = manual_mesh(axis_name)
    for name in names:
        if name not in manual:
            raise UnboundAxisError(
                f"axis_name {name!r} is not a manual axis of the enclosing "
                f"shard_map (manual axes: {list(manual)})"
            )
    team_axes = TeamAxes(manual, tuple(sizes[a] for a in manual),
                         tuple(manual.index(n) for n in names))
    return team_axes, names


def axis_size(axis_name: Any) -> int:
    """Devices along ``axis_name`` (the product of the sizes, for a tuple) in the enclosing
    ``shard_map``.

    Raises:
      ValueError: not inside ``shard_map``, or a name that is not one of its manual axes.
    """
    return _positions(axis_name, "axis_size")[0].num_ranks


def check_groups(groups: Any, size: int, fn: str, *, equal: bool = True
                 ) -> tuple[tuple[int, ...], ...] | None:
    """``axis_index_groups`` as a tuple of tuples, checked against an axis of ``size``.

    Raises:
      ValueError: the groups do not cover ``range(size)`` exactly once, or (``equal``)
        have different sizes.
    """
    if groups is None:
        return None
    try:
        canonical = tuple(tuple(int(i) for i in np.asarray(g).reshape(-1)) for g in groups)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: axis_index_groups must be a sequence of sequences of ints, "
                        f"got {groups!r}") from None
    flat = [i for g in canonical for i in g]
    if sorted(flat) != list(range(size)):
        raise ValueError(f"{fn}: axis_index_groups must cover all indices exactly once: got "
                         f"{[list(g) for g in canonical]} for an axis of size {size}")
    if equal and len({len(g) for g in canonical}) != 1:
        raise ValueError(
            f"{fn}: axis_index_groups must all be the same size, got sizes "
            f"{[len(g) for g in canonical]} (only psum, pmax and pmin take groups of "
            "different sizes, as in jax.lax)")
    return canonical


def team(axis_name: Any, fn: str, groups: Sequence[Sequence[int]] | None = None) -> TeamAxes:
    """The teams of a call over ``axis_name`` (and ``axis_index_groups``, of equal sizes)
    in the enclosing ``shard_map``.

    Raises:
      ValueError: not inside ``shard_map``, unknown or repeated axis, bad groups.
    """
    team_axes, _ = _positions(axis_name, fn)
    checked = check_groups(groups, team_axes.num_ranks, fn)
    if checked is None:
        return team_axes
    return TeamAxes(team_axes.mesh_axes, team_axes.sizes, team_axes.axes, checked)
