"""Expert-parallel MoE dispatch and combine: pull kernels over staged symmetric buffers.

Dispatch: every rank stages its tokens and, per global expert, the list of its tokens
routed there (in routing order); program 0 announces them to every rank. Each rank then
pulls, for each of its local experts, the rows every source routed to it, at the offsets
that the (already exchanged) per-source counts give: source blocks follow one another in
rank order. Combine is the reverse: each rank stages its experts' outputs and every source
pulls the rows of its own tokens back and sums them with the routing weights.

No program waits for another program of its launch (only for peers' announcements, made
first), so both kernels run in the interpreter and on GPUs alike.
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.exchange import epoch_half, notify_peers


@triton.jit
def announce_and_wait(flags_ptr, me, world, epoch):
    """Program 0 raises this rank's "staged" flag on every rank; every program then waits
    (acquire) for every other rank's flag, which orders its later loads of their buffers."""
    flags = epoch_half(flags_ptr, epoch, world)
    if tl.program_id(0) == 0:
        notify_peers(flags + me, me, world, epoch)
    for i in range(1, world):
        dl.wait(flags + (me + i) % world, 1, "sys", "acquire", epoch)


@triton.jit
def moe_dispatch_kernel(
    # Pointers
    tokens_ptr,  # staged [T, H]: this rank's tokens
    order_ptr,  # staged int32 [E, S]: per global expert, its routed token indices in order
    recv_offsets_ptr,  # int32 [num_ranks, E_local]: where source s's block for expert e starts
    recv_counts_ptr,  # int32 [num_ranks, E_local]: how many rows source s sends to expert e
    out_ptr,  # [E_local, C, H]: rows routed to this rank's experts; rows past the count are 0
    flags_ptr,  # symmetric workspace int32 [2, num_ranks]
    # Sizes
    H, S, E_local, C,
    # Meta-parameters
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program ``pid`` fills rows ``[pid * BLOCK_R, (pid + 1) * BLOCK_R)`` of ``out`` viewed as
    ``[E_local * C, H]``."""
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    announce_and_wait(flags_ptr, me, world, epoch)

    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < E_local * C
    expert = rows // C
    slot = rows % C
    # ---- the source whose block holds each slot: the last with offset <= slot ----
    src = tl.zeros([BLOCK_R], dtype=tl.int32)
    for s in range(1, world):
        start = tl.load(recv_offsets_ptr + s * E_local + expert, mask=in_range, other=0)
        src = tl.where(slot >= start, s, src)
    start = tl.load(recv_offsets_ptr + src * E_local + expert, mask=in_range, other=0)
    count = tl.load(recv_counts_ptr + src * E_local + expert, mask=in_range, other=0)
    valid = in_range & (slot - start < count)
    # ---- which of the source's tokens: its routing list for this (global) expert ----
    position = tl.minimum(tl.maximum(slot - start, 0), S - 1)
    order_rows = order_ptr + (me * E_local + tl.minimum(expert, E_local - 1)) * S + position
    token_index = tl.load(dl.symm_at(order_rows, src), mask=valid, other=0)
    token_rows = dl.symm_at(tokens_ptr + token_index * H, src)  # each row on its source
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = valid[:, None] & (cols[None, :] < H)
        values = tl.load(token_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        store_mask = in_range[:, None] & (cols[None, :] < H)
        tl.store(out_ptr + rows[:, None] * H + cols[None, :], values, mask=store_mask)


@triton.jit
def moe_combine_kernel(
    # Pointers
    expert_out_ptr,  # staged [E_local, C, H]: this rank's experts' outputs
    dest_rank_ptr,  # int32 [T, K]: the rank that owns each (token, choice)'s expert
    dest_row_ptr,  # int32 [T, K]: its row in that rank's [E_local * C] rows, -1 if dropped
    weights_ptr,  # float32 [T, K]: routing weights
    out_ptr,  # [T, H]: sum over choices of weight * expert output
    flags_ptr,  # symmetric workspace int32 [2, num_ranks]
    # Sizes
    T, K, H,
    # Meta-parameters
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program ``pid`` combines tokens ``[pid * BLOCK_T, (pid + 1) * BLOCK_T)`` (float32)."""
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    announce_and_wait(flags_ptr, me, world, epoch)

    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tokens < T
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for i in range(0, K):
            dest = tl.load(dest_rank_ptr + tokens * K + i, mask=in_range, other=0)
            row = tl.load(dest_row_ptr + tokens * K + i, mask=in_range, other=-1)
            weight = tl.load(weights_ptr + tokens * K + i, mask=in_range, other=0.0)
            mask = (row >= 0)[:, None] & (cols[None, :] < H)
            rows = dl.symm_at(expert_out_ptr + tl.maximum(row, 0) * H, dest)  # on its owner
            values = tl.load(rows[:, None] + cols[None, :], mask=mask, other=0.0)
            acc += weight[:, None] * values.to(tl.float32)
        mask = in_range[:, None] & (cols[None, :] < H)
        tl.store(out_ptr + tokens[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
