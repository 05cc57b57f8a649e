"""Expert-parallel MoE: dispatch routed tokens to the ranks that own their experts, and
combine the experts' outputs back (the "reverse all-to-all" of Triton-distributed-ascend).

Per rank, with ``n`` ranks on ``axis_name`` and ``E`` experts (rank r owns experts
``[r E/n, (r+1) E/n)``):

* ``moe_dispatch(tokens [T, H], expert_ids [T, k], ...)`` returns ``expert_inputs
  [E/n, C, H]`` (each local expert's rows: source rank 0's tokens in routing order, then
  rank 1's, ...; rows past the expert's count are zero) and a :class:`MoERouting`.
* ``moe_combine(expert_outputs [E/n, C, H], routing, weights [T, k], ...)`` returns
  ``[T, H]``: for each token, the weighted sum of its k experts' outputs.

Counts and offsets are exchanged on the device (two small ``all_to_all``); there is no
host round trip. Rows that do not fit the capacity ``C`` are dropped from dispatch and
from combine and counted in ``routing.dropped`` (per rank); the default capacity
``n * T * k`` can hold any routing, so nothing is dropped unless a smaller one is asked for.
Both are differentiable (each one's backward is the other kernel: see ``_move`` and
``_pull``); the routing itself (integers) has no gradient.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import triton

from jax_triton_dist.collectives import all_to_all
from jax_triton_dist.compiler_axes import every_axis_manual
from jax_triton_dist.kernels.moe import moe_combine_kernel, moe_dispatch_kernel
from jax_triton_dist.tiles import moe_combine_blocks, moe_dispatch_blocks
from jax_triton_dist.triton_call import Workspace, axis_size, triton_call

__all__ = ["MoERouting", "moe_dispatch", "moe_combine"]


class MoERouting(NamedTuple):
    """Where each routed (token, choice) went; produced by :func:`moe_dispatch`.

    Attributes:
      dest_rank: int32 [T, k]: the rank owning the chosen expert.
      dest_row: int32 [T, k]: its row in that rank's ``[E/n * C]`` expert rows; -1 if dropped.
      recv_counts: int32 [n, E/n]: rows each source sent to each local expert.
      dropped: int32 scalar: this rank's (token, choice) pairs that did not fit the capacity.
    """

    dest_rank: jax.Array
    dest_row: jax.Array
    recv_counts: jax.Array
    dropped: jax.Array


def _check(tokens, expert_ids, num_experts, world) -> None:
    if tokens.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(f"moe_dispatch: tokens must be [T, H] and expert_ids [T, k], got "
                         f"{tokens.shape} and {expert_ids.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"moe_dispatch: expert_ids must be integers, got {expert_ids.dtype}")
    if num_experts % world:
        raise ValueError(f"moe_dispatch: num_experts={num_experts} does not divide by the "
                         f"{world} ranks")


def _tables(flat: jax.Array, valid: jax.Array, entry_row: jax.Array, axis_name: str,
            num_experts: int, world: int, capacity: int):
    """Routing tables of entries ``flat`` (their global experts; ``valid`` marks those that
    take part; ``entry_row`` is the row each one sends): ``(order, recv_offsets,
    recv_counts, dest_rank, dest_row, fits)``. Counts and offsets are exchanged across the
    ranks (two small all_to_all)."""
    s = flat.shape[0]
    local_experts = num_experts // world
    onehot = (flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :]) & valid[:, None]
    position = (jnp.cumsum(onehot, axis=0, dtype=jnp.int32) - 1)[jnp.arange(s), flat]
    counts = onehot.sum(axis=0, dtype=jnp.int32)  # [E]
    target = jnp.where(valid, flat, num_experts)  # entries that take no part: dropped below
    order = jnp.zeros((num_experts, s), jnp.int32).at[target, position].set(entry_row,
                                                                            mode="drop")
    recv_counts = all_to_all(counts.reshape(world, local_experts), axis_name, 0, 0)
    recv_offsets = jnp.cumsum(recv_counts, axis=0, dtype=jnp.int32) - recv_counts
    my_offsets = all_to_all(recv_offsets, axis_name, 0, 0)  # [dest, E/n]: my block's start
    dest_rank = flat // local_experts
    local = flat % local_experts
    slot = my_offsets[dest_rank, local] + position
    fits = valid & (slot < capacity)
    dest_row = jnp.where(fits, local * capacity + slot, -1)
    return order, recv_offsets, recv_counts, dest_rank, dest_row, fits


def _move_kernel(rows, order, recv_offsets, recv_counts, axis_name, local_experts, capacity):
    world = axis_size(axis_name)
    h = rows.shape[1]
    blocks = moe_dispatch_blocks(local_experts * capacity, h)
    return triton_call(
        moe_dispatch_kernel, rows, order, recv_offsets, recv_counts,
        out_shape=jax.ShapeDtypeStruct((local_experts, capacity, h), rows.dtype),
        workspace=[Workspace((2, world), jnp.int32)], symmetric=[0, 1],
        grid=(triton.cdiv(local_experts * capacity, blocks["BLOCK_R"]),), axis_name=axis_name,
        H=h, S=order.shape[1], E_local=local_experts, C=capacity, **blocks,
    )


def _pull_kernel(expert_outputs, dest_rank, dest_row, weights, axis_name):
    t, k = dest_rank.shape
    h = expert_outputs.shape[2]
    blocks = moe_combine_blocks(t, h)
    return triton_call(
        moe_combine_kernel, expert_outputs, dest_rank, dest_row, weights.astype(jnp.float32),
        out_shape=jax.ShapeDtypeStruct((t, h), expert_outputs.dtype),
        workspace=[Workspace((2, axis_size(axis_name)), jnp.int32)], symmetric=[0],
        grid=(triton.cdiv(t, blocks["BLOCK_T"]),), axis_name=axis_name, T=t, K=k, H=h,
        **blocks,
    )


# Differentiable data movement. `_move` sends rows to expert slots (dispatch); `_pull` brings
# expert rows back to (token, choice) entries with weights (combine). Each is the other's
# adjoint: the cotangent of a dispatched slot returns to the entry that filled it, and a
# combined token's cotangent, times each choice's weight, goes to the slot that choice read.


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _move(rows, order, recv_offsets, recv_counts, dest_rank, dest_row, axis_name,
          local_experts, capacity):
    """``rows [R, H]`` to expert slots ``[E/n, C, H]``; ``dest_rank`` / ``dest_row`` are
    ``[R, k]``: the slot each (row, choice) entry filled (-1: none)."""
    return _move_kernel(rows, order, recv_offsets, recv_counts, axis_name, local_experts,
                        capacity)


def _move_fwd(rows, order, recv_offsets, recv_counts, dest_rank, dest_row, axis_name,
              local_experts, capacity):
    out = _move(rows, order, recv_offsets, recv_counts, dest_rank, dest_row, axis_name,
                local_experts, capacity)
    return out, (dest_rank, dest_row, out)


def _move_bwd(axis_name, local_experts, capacity, residuals, ct):
    dest_rank, dest_row, out = residuals
    # after the forward kernel (see _pull_bwd)
    ct, dest_rank, dest_row, _ = jax.lax.optimization_barrier((ct, dest_rank, dest_row, out))
    kept = (dest_row >= 0).astype(jnp.float32)
    return (_pull(ct, dest_rank, dest_row, kept, axis_name), None, None, None, None, None)


_move.defvjp(_move_fwd, _move_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _pull(expert_outputs, dest_rank, dest_row, weights, axis_name):
    """``sum_i weights[t, i] * expert_outputs[dest_rank[t, i]][dest_row[t, i]]``."""
    return _pull_kernel(expert_outputs, dest_rank, dest_row, weights, axis_name)


def _pull_fwd(expert_outputs, dest_rank, dest_row, weights, axis_name):
    out = _pull(expert_outputs, dest_rank, dest_row, weights, axis_name)
    return out, (expert_outputs, dest_rank, dest_row, weights, out)


def _pull_bwd(axis_name, residuals, ct):
    expert_outputs, dest_rank, dest_row, weights, out = residuals
    # Every distributed kernel below runs after the forward kernel (its result is a
    # residual) and after the one before it: kernels without a data dependency may start in
    # different orders on different devices, and ranks waiting in different kernels for
    # each other would stop until the wait timeout.
    ct, dest_rank, dest_row, _ = jax.lax.optimization_barrier((ct, dest_rank, dest_row, out))
    local_experts, capacity, h = expert_outputs.shape
    world = axis_size(axis_name)
    t, k = dest_rank.shape
    # d expert_outputs: each choice's weighted cotangent goes to the slot it read, through
    # the dispatch kernel with the kept entries only (their slots come out as before).
    valid = (dest_row >= 0).reshape(-1)
    flat = jnp.where(valid, dest_rank.reshape(-1) * local_experts
                     + jnp.maximum(dest_row.reshape(-1), 0) // capacity, 0)
    order, recv_offsets, recv_counts, ranks, rows, _ = _tables(
        flat, valid, jnp.arange(t * k, dtype=jnp.int32), axis_name, world * local_experts,
        world, capacity)
    scaled = (weights.astype(jnp.float32)[:, :, None] * ct.astype(jnp.float32)[:, None, :])
    d_outputs = _move(scaled.reshape(t * k, h).astype(expert_outputs.dtype), order,
                      recv_offsets, recv_counts, ranks.reshape(t * k, 1),
                      rows.reshape(t * k, 1), axis_name, local_experts, capacity)
    # d weights[t, i]: the cotangent against the row choice i read.
    ones = jnp.ones((t, 1), jnp.float32)
    columns, after = [], d_outputs
    for i in range(k):
        _, outputs = jax.lax.optimization_barrier((after, expert_outputs))
        after = _pull(outputs, dest_rank[:, i:i + 1], dest_row[:, i:i + 1], ones, axis_name)
        columns.append(jnp.sum(ct.astype(jnp.float32) * after.astype(jnp.float32), axis=1))
    d_weights = jnp.stack(columns, axis=1).astype(weights.dtype)
    # What uses d_outputs next (dispatch's backward pull) comes after the pulls above.
    d_outputs, d_weights = jax.lax.optimization_barrier((d_outputs, d_weights))
    return d_outputs, None, None, d_weights


_pull.defvjp(_pull_fwd, _pull_bwd)


@every_axis_manual
def moe_dispatch(tokens: Any, expert_ids: Any, axis_name: str, *, num_experts: int,
                 capacity: int | None = None) -> tuple[jax.Array, MoERouting]:
    """Sends each (token, choice) to the rank owning its expert; see the module docstring.

    Differentiable in ``tokens``: a token's gradient is the sum of the gradients of the
    slots its choices filled (dropped choices give none).

    Args:
      tokens: per-rank ``[T, H]``.
      expert_ids: per-rank int ``[T, k]`` in ``[0, num_experts)`` (top-k routing).
      axis_name: the manual mesh axis the experts are spread over.
      num_experts: total experts; must divide by the number of ranks.
      capacity: rows per local expert (``C``); default ``n * T * k``.

    Returns:
      ``(expert_inputs [E/n, C, H], routing)``.
    """
    tokens, expert_ids = jnp.asarray(tokens), jnp.asarray(expert_ids)
    world = axis_size(axis_name)
    _check(tokens, expert_ids, num_experts, world)
    expert_ids = expert_ids.astype(jnp.int32)
    t, k = expert_ids.shape
    local_experts = num_experts // world
    capacity = world * t * k if capacity is None else int(capacity)
    if capacity <= 0:
        raise ValueError(f"moe_dispatch: capacity must be positive, got {capacity}")
    flat = expert_ids.reshape(-1)  # entry i = (token i // k, choice i % k)
    order, recv_offsets, recv_counts, dest_rank, dest_row, fits = _tables(
        flat, jnp.ones(flat.shape, bool), jnp.arange(t * k, dtype=jnp.int32) // k, axis_name,
        num_experts, world, capacity)
    dest_rank, dest_row = dest_rank.reshape(t, k), dest_row.reshape(t, k)
    expert_inputs = _move(tokens, order, recv_offsets, recv_counts, dest_rank, dest_row,
                          axis_name, local_experts, capacity)
    routing = MoERouting(dest_rank, dest_row, recv_counts, jnp.sum(~fits, dtype=jnp.int32))
    return expert_inputs, routing


@every_axis_manual
def moe_combine(expert_outputs: Any, routing: MoERouting, weights: Any,
                axis_name: str) -> jax.Array:
    """Brings the experts' outputs back to their tokens: ``sum_i weights[t, i] * out[t, i]``.

    Differentiable in ``expert_outputs`` (each slot gets its token's gradient times the
    choice's weight; slots no choice filled get zero) and in ``weights``.

    Args:
      expert_outputs: per-rank ``[E/n, C, H]``: the local experts' outputs, row for row
        as :func:`moe_dispatch` delivered their inputs.
      routing: from :func:`moe_dispatch`.
      weights: per-rank ``[T, k]`` routing weights (dropped choices contribute nothing).
      axis_name: the manual mesh axis of the dispatch.

    Returns:
      Per-rank ``[T, H]`` in ``expert_outputs.dtype`` (accumulated in float32).
    """
    expert_outputs = jnp.asarray(expert_outputs)
    weights = jnp.asarray(weights)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        weights = weights.astype(jnp.float32)
    axis_size(axis_name)
    t, k = routing.dest_rank.shape
    if weights.shape != (t, k):
        raise ValueError(f"moe_combine: weights must be {(t, k)}, got {weights.shape}")
    if expert_outputs.ndim != 3:
        raise ValueError(f"moe_combine: expert_outputs must be [E/n, C, H], got "
                         f"{expert_outputs.shape}")
    return _pull(expert_outputs, routing.dest_rank, routing.dest_row, weights, axis_name)
