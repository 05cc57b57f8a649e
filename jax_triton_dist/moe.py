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
Not differentiable yet.
"""

from __future__ import annotations

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


@every_axis_manual
def moe_dispatch(tokens: Any, expert_ids: Any, axis_name: str, *, num_experts: int,
                 capacity: int | None = None) -> tuple[jax.Array, MoERouting]:
    """Sends each (token, choice) to the rank owning its expert; see the module docstring.

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
    (t, h), k = tokens.shape, expert_ids.shape[1]
    local_experts = num_experts // world
    capacity = world * t * k if capacity is None else int(capacity)
    if capacity <= 0:
        raise ValueError(f"moe_dispatch: capacity must be positive, got {capacity}")

    # ---- local routing tables: position of each entry in its expert's list ----
    flat = expert_ids.reshape(-1)  # entry i = (token i // k, choice i % k)
    onehot = (flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :])
    position = (jnp.cumsum(onehot, axis=0, dtype=jnp.int32) - 1)[jnp.arange(t * k), flat]
    counts = onehot.sum(axis=0, dtype=jnp.int32)  # [E]
    order = jnp.zeros((num_experts, t * k), jnp.int32).at[flat, position].set(
        jnp.arange(t * k, dtype=jnp.int32) // k)

    # ---- exchange counts; offsets of each source's block on the owner, and back ----
    recv_counts = all_to_all(counts.reshape(world, local_experts), axis_name, 0, 0)
    recv_offsets = jnp.cumsum(recv_counts, axis=0, dtype=jnp.int32) - recv_counts
    my_offsets = all_to_all(recv_offsets, axis_name, 0, 0)  # [dest, E/n]: my block's start
    dest_rank = flat // local_experts
    local = flat % local_experts
    slot = my_offsets[dest_rank, local] + position
    fits = slot < capacity
    dest_row = jnp.where(fits, local * capacity + slot, -1)

    blocks = moe_dispatch_blocks(local_experts * capacity, h)
    expert_inputs = triton_call(
        moe_dispatch_kernel, tokens, order, recv_offsets, recv_counts,
        out_shape=jax.ShapeDtypeStruct((local_experts, capacity, h), tokens.dtype),
        workspace=[Workspace((2, world), jnp.int32)], symmetric=[0, 1],
        grid=(triton.cdiv(local_experts * capacity, blocks["BLOCK_R"]),), axis_name=axis_name,
        H=h, S=t * k, E_local=local_experts, C=capacity, **blocks,
    )
    routing = MoERouting(dest_rank.reshape(t, k), dest_row.reshape(t, k), recv_counts,
                         jnp.sum(~fits, dtype=jnp.int32))
    return expert_inputs, routing


@every_axis_manual
def moe_combine(expert_outputs: Any, routing: MoERouting, weights: Any,
                axis_name: str) -> jax.Array:
    """Brings the experts' outputs back to their tokens: ``sum_i weights[t, i] * out[t, i]``.

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
    weights = jnp.asarray(weights, jnp.float32)
    axis_size(axis_name)
    t, k = routing.dest_rank.shape
    if weights.shape != (t, k):
        raise ValueError(f"moe_combine: weights must be {(t, k)}, got {weights.shape}")
    if expert_outputs.ndim != 3:
        raise ValueError(f"moe_combine: expert_outputs must be [E/n, C, H], got "
                         f"{expert_outputs.shape}")
    h = expert_outputs.shape[2]
    blocks = moe_combine_blocks(t, h)
    return triton_call(
        moe_combine_kernel, expert_outputs, routing.dest_rank, routing.dest_row, weights,
        out_shape=jax.ShapeDtypeStruct((t, h), expert_outputs.dtype),
        workspace=[Workspace((2, axis_size(axis_name)), jnp.int32)], symmetric=[0],
        grid=(triton.cdiv(t, blocks["BLOCK_T"]),), axis_name=axis_name, T=t, K=k, H=h,
        **blocks,
    )
