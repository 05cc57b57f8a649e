"""Which equations of a jaxpr ``jtd.fuse`` rewrites, and why the others are left.

A *match* pairs two equations: a collective and the ``dot_general`` it feeds (all_gather
-> dot: ``all_gather_matmul``) or is fed by (dot -> psum_scatter: ``matmul_reduce_scatter``;
dot -> psum: ``matmul_all_reduce``). It is rewritten only when the fused op computes the
same thing: the layouts and dimension numbers the fused kernels take, equal operand dtypes
the kernels support, the result in that dtype, default precision, and an intermediate
(the gathered operand, the product) that nothing else reads. Every pair that is not
rewritten is a *near miss* with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.extend import core as jcore

__all__ = ["Match", "NearMiss", "find", "location", "COLLECTIVES", "SUM_PRIMITIVES"]

SUM_PRIMITIVES = ("psum", "psum_invariant")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "pmax", "pmin") + SUM_PRIMITIVES
FUSED_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Match:
    """A pair of equations the fused op ``op`` replaces (``first`` runs before ``second``;
    the result is ``second``'s). ``transpose_w``: the weight is ``[N, K]`` (dimension
    numbers contract its dimension 1): the fused op reads it in that layout."""

    op: str
    first: int
    second: int
    x: Any  # the activation operand (a jaxpr atom)
    w: Any  # the weight operand
    axis_name: Any
    groups: Any
    transpose_w: bool
    where: str
    axis: int = 0  # the dimension gathered or scattered (leading dimensions are batches)


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A collective next to a dot that was left as it was."""

    op: str
    where: str
    reason: str


def location(eqn) -> str:
    """``file:line (function)`` of the user code that made ``eqn``."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - only a label
        return "<unknown>"


def _uses(jaxpr) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                counts[v] = counts.get(v, 0) + 1
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var):
            counts[v] = counts.get(v, 0) + 1
    return counts


def _axis(names: Any) -> Any:
    names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
    if not all(isinstance(n, str) for n in names):
        return None
    return names[0] if len(names) == 1 else names


def _dot_problem(dot, lhs_var) -> tuple[str | None, bool]:
    """Why ``dot`` (whose left operand is ``lhs_var``) is not ``[M, K] @ w``; and whether
    w is ``[N, K]``."""
    lhs, rhs = dot.invars
    (contract, batch) = dot.params["dimension_numbers"]
    if lhs is not lhs_var:
        return "the collective's operand is the dot's right operand (the fused ops take it "\
               "on the left)", False
    if batch[0] or batch[1]:
        return "the dot has batch dimensions", False
    if lhs.aval.ndim < 2 or rhs.aval.ndim != 2:
        return (f"operands of rank {lhs.aval.ndim} and {rhs.aval.ndim}: the fused ops take "
                "[..., rows, K] @ [K, N] (a 2-D weight)"), False
    if tuple(contract[0]) != (lhs.aval.ndim - 1,) or tuple(contract[1]) not in ((0,), (1,)):
        return (f"contracting dimensions {tuple(contract[0])} x {tuple(contract[1])}: the "
                "fused ops contract the activation's last dimension"), False
    dtype = np.dtype(lhs.aval.dtype).name
    if np.dtype(rhs.aval.dtype) != np.dtype(lhs.aval.dtype):
        return f"operand dtypes differ ({dtype} x {np.dtype(rhs.aval.dtype).name})", False
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype}: the fused kernels take {', '.join(FUSED_DTYPES)}", False
    preferred = dot.params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) != np.dtype(lhs.aval.dtype):
        return (f"preferred_element_type {np.dtype(preferred).name} differs from the operands' "
                f"{dtype}: the fused ops return the operand dtype"), False
    precision = dot.params.get("precision")
    if precision is not None and any(str(p) not in ("DEFAULT", "Precision.DEFAULT", "None")
                                     for p in (precision if isinstance(precision, tuple)
                                               else (precision,))):
        return f"precision {precision}: the fused kernels use the default dot precision", False
    return None, tuple(contract[1]) == (1,)


def find(jaxpr) -> tuple[list[Match], list[NearMiss]]:
    """The matches and near misses among ``jaxpr``'s own equations (not its sub-jaxprs)."""
    uses = _uses(jaxpr)
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    matches: list[Match] = []
    misses: list[NearMiss] = []
    claimed: set[int] = set()

    def prod(atom):
        return producer.get(atom) if isinstance(atom, jcore.Var) else None

    for j, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "dot_general":
            gathers = [prod(v) for v in eqn.invars]
            gathers = [i for i in gathers if i is not None
                       and jaxpr.eqns[i].primitive.name == "all_gather"]
            if not gathers:
                continue
            i = gathers[0]
            gather = jaxpr.eqns[i]
            where = location(eqn)
            p = gather.params
            reason, transpose = _dot_problem(eqn, gather.outvars[0])
            if not p["tiled"] or p["all_gather_dimension"] == gather.invars[0].aval.ndim - 1:
                reason = (f"all_gather(tiled={p['tiled']}, axis={p['all_gather_dimension']}): "
                          "all_gather_matmul gathers a dimension other than the contracted "
                          "one, tiled")
            elif uses.get(gather.outvars[0], 0) != 1:
                reason = "the gathered operand is also used elsewhere"
            elif _axis(p["axis_name"]) is None:
                reason = "positional (pmap) axes"
            elif i in claimed or j in claimed:
                reason = "one of its equations is already part of another fused op"
            if reason:
                misses.append(NearMiss("all_gather_matmul", where, reason))
                continue
            matches.append(Match("all_gather_matmul", i, j, gather.invars[0], eqn.invars[1],
                                 _axis(p["axis_name"]), p.get("axis_index_groups"),
                                 transpose, where, p["all_gather_dimension"]))
            claimed |= {i, j}
        elif name == "reduce_scatter" or (name in SUM_PRIMITIVES and len(eqn.invars) == 1):
            i = prod(eqn.invars[0])
            if i is None or jaxpr.eqns[i].primitive.name != "dot_general":
                continue
            dot = jaxpr.eqns[i]
            op = "matmul_reduce_scatter" if name == "reduce_scatter" else "matmul_all_reduce"
            where = location(eqn)
            p = eqn.params
            axis = _axis(p["axis_name"] if name == "reduce_scatter" else p["axes"])
            reason, transpose = _dot_problem(dot, dot.invars[0])
            if reason is None and name == "reduce_scatter" and (
                    not p["tiled"] or p["scatter_dimension"] == eqn.invars[0].aval.ndim - 1):
                reason = (f"psum_scatter(tiled={p['tiled']}, scatter_dimension="
                          f"{p['scatter_dimension']}): matmul_reduce_scatter scatters a "
                          "dimension other than the product's last, tiled")
            elif reason is None and uses.get(dot.outvars[0], 0) != 1:
                reason = "the product is also used elsewhere"
            elif reason is None and axis is None:
                reason = "positional (pmap) axes"
            elif reason is None and (i in claimed or j in claimed):
                reason = "its dot is already part of another fused op"
            if reason:
                misses.append(NearMiss(op, where, reason))
                continue
            matches.append(Match(op, i, j, dot.invars[0], dot.invars[1], axis,
                                 p.get("axis_index_groups"), transpose, where,
                                 p.get("scatter_dimension", 0)))
            claimed |= {i, j}
    return matches, misses
