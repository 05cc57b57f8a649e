"""Push exchange: the kernel behind all_gather, reduce_scatter, all_to_all and the one-shot
all-reduce.

Every rank pushes a block to every other rank's receive slots (``slots[src]`` on the
receiver), raises one flag per (source, program) there, waits for every source's flag in
its own heap, then either copies the received blocks out or reduces them. A rank's own
block goes straight from its input to its output, never through a slot.

Workspaces are double-buffered by epoch parity, so flags never need a reset and a rank
one call ahead never overwrites a slot that a slower rank still reads: finishing call
e + 1 needs every peer's data of e + 1, which every peer pushes only after finishing e.
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl


@triton.jit
def epoch_half(ptr, epoch, half_size):
    """``ptr`` advanced to this call's half of a double-buffered workspace."""
    return ptr + (epoch % 2) * half_size


@triton.jit
def notify_peers(flag, me, world, epoch):
    """Raises ``flag`` (this rank's entry of a symmetric flag array) to ``epoch`` on every
    other rank, ``me + 1`` first, each a system-scope release."""
    for i in range(1, world):
        dl.notify(flag, (me + i) % world, epoch, "set", "sys")


@triton.jit
def combine(acc, values, REDUCE: tl.constexpr):
    """``acc (+|max|min) values`` for ``REDUCE`` = ``"sum"``, ``"max"``, ``"min"``."""
    if REDUCE == "sum":
        return acc + values
    elif REDUCE == "max":
        return tl.maximum(acc, values)
    else:
        return tl.minimum(acc, values)


@triton.jit
def reduce_in_rank_order(own, slots, flags, stride, offs, mask, pid, num_programs, me, world,
                         epoch, REDUCE: tl.constexpr):
    """Reduces every rank's block: this rank's ``own`` values, and each source's block in
    ``slots + src * stride`` once its flag ``flags[src, pid]`` reaches ``epoch``.

    Sums run in rank order, floating types in float32 (float64 in float64), so every rank
    computes the same bits; max/min need no order. Returns the accumulator.
    """
    if own.dtype.is_fp64():
        acc_dtype = tl.float64
    elif own.dtype.is_floating():
        acc_dtype = tl.float32
    else:
        acc_dtype = own.dtype
    acc = tl.zeros(own.shape, dtype=acc_dtype) if REDUCE == "sum" else own.to(acc_dtype)
    for src in range(0, world):
        if src == me:
            if REDUCE == "sum":
                acc += own.to(acc_dtype)
        else:
            token = dl.wait(flags + src * num_programs + pid, 1, "sys", "acquire", epoch)
            values = tl.load(dl.consume_token(slots + src * stride + offs, token), mask=mask)
            acc = combine(acc, values.to(acc_dtype), REDUCE)
    return acc


@triton.jit
def push_exchange_kernel(
    # Pointers
    x_ptr,  # [num_ranks, n] if SEND_CHUNKS (row p goes to rank p), else [n] (sent to all)
    out_ptr,  # [num_ranks, n] received blocks by source if REDUCE == "none", else [n]
    slots_ptr,  # symmetric workspace [2, num_ranks, n]: receive slots by epoch parity
    flags_ptr,  # symmetric workspace [2, num_ranks, num_programs] int32
    # Sizes
    n,
    # Meta-parameters
    SEND_CHUNKS: tl.constexpr,
    REDUCE: tl.constexpr,  # "none", "sum", "max" or "min"
    BLOCK: tl.constexpr,
):
    """Program ``pid`` moves elements ``[pid * BLOCK, (pid + 1) * BLOCK)`` of every block.

    Reductions run in rank order (floating types in float32, float64 in float64) on every
    rank, so every rank computes bit-identical results.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    slots = epoch_half(slots_ptr, epoch, world * n)
    flags = epoch_half(flags_ptr, epoch, world * num_programs)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n

    own_ptr = x_ptr + me * n if SEND_CHUNKS else x_ptr  # the block I keep

    # ---- push: my block for `peer` into its slot `me`, then raise flag (me, pid) there ----
    for i in range(1, world):
        peer = (me + i) % world  # walk the ring from my successor
        if SEND_CHUNKS:
            values = tl.load(x_ptr + peer * n + offs, mask=mask)
        else:
            values = tl.load(x_ptr + offs, mask=mask)
        tl.store(dl.symm_at(slots + me * n + offs, peer), values, mask=mask)
        dl.notify(flags + me * num_programs + pid, peer, epoch, "set", "sys")

    # ---- receive: my own block directly, the others after their flags ----
    own = tl.load(own_ptr + offs, mask=mask)
    if REDUCE == "none":
        tl.store(out_ptr + me * n + offs, own, mask=mask)
        for i in range(1, world):
            src = (me + world - i) % world
            token = dl.wait(flags + src * num_programs + pid, 1, "sys", "acquire", epoch)
            block = dl.consume_token(slots + src * n + offs, token)
            tl.store(out_ptr + src * n + offs, tl.load(block, mask=mask), mask=mask)
    else:
        acc = reduce_in_rank_order(own, slots, flags, n, offs, mask, pid, num_programs, me,
                                   world, epoch, REDUCE)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
