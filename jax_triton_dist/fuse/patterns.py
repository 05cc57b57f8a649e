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
    bias: Any = None  # a [N] atom added to the result, folded into the epilogue
    activation: str | None = None  # folded into the epilogue
    last: int = -1  # the equation whose result the fused op gives (second, or the epilogue's)
    absorbed: tuple[int, ...] = ()  # epilogue equations replaced too


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


# ---------------------------------------------------------------------------
# Epilogues: a bias add and an activation after an all_gather_matmul / matmul_reduce_scatter
# ---------------------------------------------------------------------------

_EPILOGUE_OPS = ("all_gather_matmul", "matmul_reduce_scatter")


_PLACEMENT = ("mesh", "sharding", "layout")


def _is_rule(value) -> bool:
    """A derivative-rule function or thunk among a custom_jvp / custom_vjp's parameters."""
    return callable(value) or type(value).__name__ in ("WrappedFun", "HashableFunction")


def _signature(jaxpr) -> list:
    """What ``jaxpr`` computes, up to variable names, ``pvary`` casts and varying-axes
    annotations: each equation's primitive, parameters and literal operands, in order."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    out = []
    constants = {}  # pvary casts of literals: the literal
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pvary":
            if all(isinstance(v, jcore.Literal) for v in eqn.invars):
                constants.update({o: v for o, v in zip(eqn.outvars, eqn.invars, strict=True)})
            continue
        params = []
        for key in sorted(eqn.params):
            if any(word in key for word in _PLACEMENT):
                continue  # where it runs (differs inside shard_map), not what it computes
            value = eqn.params[key]
            if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                params.append((key, _signature(value)))
            elif not _is_rule(value):
                params.append((key, repr(value)))
        atoms = [constants.get(v, v) if isinstance(v, jcore.Var) else v for v in eqn.invars]
        literals = [repr(np.asarray(v.val).tolist()) for v in atoms
                    if isinstance(v, jcore.Literal)]
        out.append((eqn.primitive.name, params, literals))
    return out


def _same_params(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if any(word in key for word in _PLACEMENT):
            continue
        if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            if _signature(x) != _signature(y):
                return False
        elif _is_rule(x):
            continue  # rule thunks of custom_jvp / custom_vjp: compared through their jaxprs
        elif x != y:
            return False
    return True


def _templates(aval) -> dict[str, Any]:
    """The jaxprs of the epilogue activations on values of type ``aval`` (traced with this
    jax, so a user's jax.nn call matches whatever form it takes here)."""
    import jax

    from jax_triton_dist.fused.epilogue import ACTIVATIONS

    sds = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return {name: jax.make_jaxpr(fn)(sds).jaxpr for name, fn in ACTIVATIONS.items()
            if name != "none"}


def _match_template(jaxpr, start: int, var, template, uses) -> tuple[int, Any] | None:
    """If the equations from ``start`` compute ``template`` of ``var`` (``pvary`` of
    constants allowed in between), ``(index after them, result var)``."""
    env = {template.invars[0]: var}
    inside: dict[Any, int] = {}  # uses of each variable by the matched equations
    i = start
    for t_eqn in template.eqns:
        while i < len(jaxpr.eqns) and jaxpr.eqns[i].primitive.name == "pvary" and all(
                not isinstance(v, jcore.Var) or v not in _chain_vars(env) for v in
                jaxpr.eqns[i].invars):
            i += 1  # a pvary of a constant the activation uses
        if i >= len(jaxpr.eqns):
            return None
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name != t_eqn.primitive.name or not _same_params(eqn.params,
                                                                           t_eqn.params):
            return None
        if len(eqn.invars) != len(t_eqn.invars):
            return None
        for u, t in zip(eqn.invars, t_eqn.invars, strict=True):
            if isinstance(t, jcore.Literal):
                value = _literal_value(u, jaxpr, i)
                if value is None or not np.array_equal(np.asarray(value), np.asarray(t.val)):
                    return None
            elif env.get(t) is not u:
                return None
            else:
                inside[u] = inside.get(u, 0) + 1
        for u, t in zip(eqn.outvars, t_eqn.outvars, strict=True):
            env[t] = u
        i += 1
    out = env.get(template.outvars[0])
    inner = [v for v in env.values() if v is not out]
    if out is None or any(uses.get(v, 0) != inside.get(v, 0) for v in inner):
        return None  # an intermediate (or the GEMM's result) is also used elsewhere
    return i, out


def _chain_vars(env: dict) -> set:
    return set(env.values())


def _literal_value(atom, jaxpr, index: int):
    """The constant value of ``atom``: a literal, or a pvary of one made just before."""
    if isinstance(atom, jcore.Literal):
        return atom.val
    for eqn in reversed(jaxpr.eqns[:index]):
        if atom in eqn.outvars:
            if eqn.primitive.name == "pvary" and isinstance(eqn.invars[0], jcore.Literal):
                return eqn.invars[0].val
            return None
    return None


def _consumer(jaxpr, j: int, var) -> int | None:
    """The first equation after ``j`` that reads ``var``."""
    for k in range(j + 1, len(jaxpr.eqns)):
        if any(v is var for v in jaxpr.eqns[k].invars):
            return k
    return None


def _epilogue(jaxpr, j: int, uses, producer) -> tuple[Any, str | None, int, tuple[int, ...]]:
    """A bias add and/or an activation right after equation ``j``:
    ``(bias atom or None, activation or None, last equation, equations absorbed)``."""
    var = jaxpr.eqns[j].outvars[0]
    bias, activation, last, absorbed = None, None, j, []
    consumer = _consumer(jaxpr, j, var)
    if consumer is not None and uses.get(var, 0) == 1:
        eqn = jaxpr.eqns[consumer]
        if eqn.primitive.name == "add":
            other = eqn.invars[1] if eqn.invars[0] is var else eqn.invars[0]
            b = producer.get(other) if isinstance(other, jcore.Var) else None
            src = jaxpr.eqns[b] if b is not None else None
            if (src is not None and src.primitive.name == "broadcast_in_dim"
                    and src.invars[0].aval.ndim == 1
                    and tuple(src.params["broadcast_dimensions"]) == (var.aval.ndim - 1,)
                    and all(d in (1, v) for d, v in zip(src.outvars[0].aval.shape[:-1],
                                                        var.aval.shape[:-1], strict=True))
                    and eqn.outvars[0].aval.shape == var.aval.shape
                    and uses.get(other, 0) == 1):
                bias, var, last = src.invars[0], eqn.outvars[0], consumer
                absorbed += [b, consumer]
    i = _consumer(jaxpr, last, var)
    if i is None:
        return bias, activation, last, tuple(sorted(set(absorbed)))
    for name, template in _templates(var.aval).items():
        found = _match_template(jaxpr, i, var, template, uses)
        if found is not None:
            end, out = found
            # the activation's equations; pvary casts of its constants stay (unused)
            absorbed += [k for k in range(i, end) if jaxpr.eqns[k].primitive.name != "pvary"]
            activation, last = name, producer[out]
            break
    return bias, activation, last, tuple(sorted(set(absorbed)))



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
    folded = []
    for match in matches:
        if match.op not in _EPILOGUE_OPS:
            folded.append(dataclasses.replace(match, last=match.second))
            continue
        bias, activation, last, absorbed = _epilogue(jaxpr, match.second, uses, producer)
        if bias is not None and np.dtype(bias.aval.dtype) != np.dtype(
                jaxpr.eqns[match.second].outvars[0].aval.dtype):
            bias, activation, last, absorbed = None, None, match.second, ()
        folded.append(dataclasses.replace(match, bias=bias, activation=activation, last=last,
                                          absorbed=absorbed))
    return folded, misses
