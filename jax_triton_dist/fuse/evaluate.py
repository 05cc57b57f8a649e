"""Evaluates a jaxpr with the matched patterns replaced by the project's ops.

Equations are bound as JAX would bind them, except: matched pairs become one fused op;
with ``collectives=True`` the remaining collectives become the project's; and the
higher-order equations whose bodies hold a rewrite are rebuilt around rewritten bodies —
``shard_map`` (``jax.shard_map`` with the same mesh, specs and checks), ``jit`` (inlined),
``scan``, ``cond``, ``while``, ``checkpoint`` (their ``jax.lax`` / ``jax.checkpoint``
forms with the same options), ``custom_jvp_call`` / ``custom_vjp_call`` (the primal body is
rewritten; the user's derivative rules are kept, so under differentiation they run as the
user wrote them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from jax_triton_dist import collectives as jtd_collectives
from jax_triton_dist import fused as jtd_fused
from jax_triton_dist.fuse import patterns

__all__ = ["Options", "evaluate", "has_work"]


@dataclasses.dataclass
class Options:
    collectives: bool
    rewrites: list  # (op, where) of each rewrite made
    misses: list  # NearMiss of each pattern left


def _subjaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, jcore.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jcore.Jaxpr):
                found.append(v)
    return found


def has_work(jaxpr, collectives: bool) -> bool:
    """Whether ``jaxpr`` (or a body inside it) holds a pattern, or a collective to replace."""
    matches, misses = patterns.find(jaxpr)
    if matches or misses:
        return True
    for eqn in jaxpr.eqns:
        if collectives and eqn.primitive.name in patterns.COLLECTIVES:
            return True
        if any(has_work(sub, collectives) for sub in _subjaxprs(eqn)):
            return True
    return False


def _groups(groups):
    return None if groups is None else [list(g) for g in groups]


def _fused(match: patterns.Match, read) -> Any:
    fn = getattr(jtd_fused, match.op)
    dims = {"all_gather_matmul": {"gather_axis": match.axis},
            "matmul_reduce_scatter": {"scatter_dimension": match.axis}}.get(match.op, {})
    if match.bias is not None or match.activation is not None:
        dims.update(bias=None if match.bias is None else read(match.bias),
                    activation=match.activation)
    return fn(read(match.x), read(match.w), match.axis_name,
              axis_index_groups=_groups(match.groups),
              w_layout="nk" if match.transpose_w else "kn", **dims)


def _collective(eqn, values: list) -> list | None:
    """The project's op for a collective equation, or None to bind JAX's."""
    name, p = eqn.primitive.name, eqn.params
    axis = patterns._axis(p.get("axis_name", p.get("axes")))
    if axis is None:
        return None
    groups = _groups(p.get("axis_index_groups"))
    if name == "all_gather":
        return [jtd_collectives.all_gather(values[0], axis, axis=p["all_gather_dimension"],
                               tiled=p["tiled"], axis_index_groups=groups)]
    if name == "reduce_scatter":
        return [jtd_collectives.reduce_scatter(
            values[0], axis, scatter_dimension=p["scatter_dimension"], tiled=p["tiled"],
            axis_index_groups=groups)]
    if name == "all_to_all":  # the primitive splits and concatenates (lax.all_to_all reshapes)
        return [jtd_collectives.all_to_all(values[0], axis, p["split_axis"], p["concat_axis"],
                                           tiled=True, axis_index_groups=groups)]
    op = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}[name]
    return [jtd_collectives.all_reduce(v, axis, op=op, axis_index_groups=groups) for v in values]


def _bind(eqn, values: list) -> list:
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
        out = eqn.primitive.bind(*subfuns, *values, **params)
    else:
        out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _shard_map(eqn, values: list, options: Options) -> list:
    p = eqn.params
    body = p["jaxpr"]
    in_specs = p.get("in_specs", p.get("in_names"))
    out_specs = p.get("out_specs", p.get("out_names"))
    manual = p.get("newly_manual_axes", p.get("manual_axes"))
    if in_specs is None or out_specs is None or manual is None:
        raise NotImplementedError(f"jtd.fuse: shard_map parameters {sorted(p)} of this jax "
                                  "version are not understood")

    def rewritten(*args):
        return tuple(evaluate(body, [], args, options))

    mapped = jax.shard_map(rewritten, mesh=p["mesh"], in_specs=tuple(in_specs),
                           out_specs=tuple(out_specs), check_vma=p.get("check_vma", True),
                           axis_names=frozenset(manual))
    return list(mapped(*values))


def _closed(closed, options):
    def run(*args):
        return evaluate(closed.jaxpr, closed.consts, args, options)
    return run


def _scan_counts(eqn) -> tuple[int, int]:
    """``(consts, carry)`` operands of a scan equation. Newer jax no longer has them as
    parameters: carries keep their rank in and out of the body, scanned operands and
    stacked results have one more dimension than the body sees."""
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    body = p["jaxpr"].jaxpr
    n_carry = 0
    for outer, inner in zip(eqn.outvars, body.outvars, strict=True):
        if outer.aval.ndim != inner.aval.ndim:
            break
        n_carry += 1
    n_xs = 0
    for outer, inner in zip(reversed(eqn.invars), reversed(body.invars), strict=True):
        if outer.aval.ndim != inner.aval.ndim + 1:
            break
        n_xs += 1
    return len(eqn.invars) - n_carry - n_xs, n_carry


def _scan(eqn, values, options):
    p = eqn.params
    n_consts, n_carry = _scan_counts(eqn)
    consts, init, xs = (values[:n_consts], values[n_consts:n_consts + n_carry],
                        values[n_consts + n_carry:])
    run = _closed(p["jaxpr"], options)

    def body(carry, x):
        outs = run(*consts, *carry, *x)
        return list(outs[:n_carry]), list(outs[n_carry:])

    carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return list(carry) + list(ys)


def _cond(eqn, values, options):
    branches = [_closed(b, options) for b in eqn.params["branches"]]
    index, operands = values[0], values[1:]
    outs = jax.lax.switch(index, [lambda *a, b=b: tuple(b(*a)) for b in branches], *operands)
    return list(outs)


def _while(eqn, values, options):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = values[:nc], values[nc:nc + nb], values[nc + nb:]
    cond, body = _closed(p["cond_jaxpr"], options), _closed(p["body_jaxpr"], options)
    out = jax.lax.while_loop(lambda c: cond(*cond_consts, *c)[0],
                             lambda c: list(body(*body_consts, *c)), list(init))
    return list(out)


def _checkpoint(eqn, values, options):
    p = eqn.params
    jaxpr = p["jaxpr"]

    def run(*args):
        return evaluate(jaxpr, [], args, options)

    return list(jax.checkpoint(run, prevent_cse=p.get("prevent_cse", True),
                               policy=p.get("policy"))(*values))


def _custom(eqn, values, options):
    """custom_jvp_call / custom_vjp_call: the primal body rewritten, the rules kept."""
    closed = eqn.params["call_jaxpr"]
    rewritten = jax.make_jaxpr(lambda *a: evaluate(closed.jaxpr, closed.consts, a, options))(
        *values)
    return _bind(eqn.replace(params=dict(eqn.params, call_jaxpr=rewritten)), values)


_HIGHER_ORDER = {"shard_map": _shard_map, "scan": _scan, "cond": _cond, "while": _while,
                 "checkpoint": _checkpoint, "remat": _checkpoint, "remat2": _checkpoint,
                 "custom_jvp_call": _custom, "custom_vjp_call": _custom}
_INLINED = ("pjit", "jit", "closed_call", "core_call")


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any], options: Options) -> list:
    """``jaxpr``'s outputs on ``args``, with the rewrites."""
    env: dict[Any, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    def write(var, value):
        if not isinstance(var, jcore.DropVar):
            env[var] = value

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        write(var, value)
    for var, value in zip(jaxpr.invars, args, strict=True):
        write(var, value)
    matches, misses = patterns.find(jaxpr)
    options.misses.extend(misses)
    skipped = {i for m in matches for i in (m.first, m.second, *m.absorbed) if i != m.last}
    fused = {m.last: m for m in matches}
    for index, eqn in enumerate(jaxpr.eqns):
        if index in skipped:
            continue
        if index in fused:
            match = fused[index]
            outs = [_fused(match, read)]
            epilogue = "+".join(([] if match.bias is None else ["bias"])
                                + ([match.activation] if match.activation else []))
            options.rewrites.append((match.op + (f" with {epilogue}" if epilogue else ""),
                                     match.where))
        else:
            values = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            outs = None
            if options.collectives and name in patterns.COLLECTIVES:
                outs = _collective(eqn, values)
                if outs is not None:
                    options.rewrites.append((f"collective {name}", patterns.location(eqn)))
            if outs is None and name in _INLINED and "jaxpr" in eqn.params or (
                    outs is None and name in _INLINED and "call_jaxpr" in eqn.params):
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                if has_work(inner.jaxpr, options.collectives):
                    outs = evaluate(inner.jaxpr, inner.consts, values, options)
            if outs is None and name in _HIGHER_ORDER and any(
                    has_work(sub, options.collectives) for sub in _subjaxprs(eqn)):
                outs = _HIGHER_ORDER[name](eqn, values, options)
            if outs is None:
                outs = _bind(eqn, values)
        for var, value in zip(eqn.outvars, outs, strict=True):
            write(var, value)
    return [read(v) for v in jaxpr.outvars]
