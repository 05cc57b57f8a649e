"""Two-shot all-reduce: reduce-scatter, then all-gather of the reduced chunks, in one kernel.

(The one-shot all-reduce is ``exchange.push_exchange_kernel`` with a reduction.)
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.exchange import epoch_half, reduce_in_rank_order


@triton.jit
def two_shot_all_reduce_kernel(
    # Pointers
    x_ptr,  # [n] this rank's contribution
    out_ptr,  # [n] the reduction over ranks
    rs_slots_ptr,  # symmetric workspace [2, num_ranks, chunk]: phase-1 receive slots
    ag_slots_ptr,  # symmetric workspace [2, num_ranks, chunk]: phase-2 receive slots
    flags_ptr,  # symmetric workspace [2, 2, num_ranks, num_programs] int32
    # Sizes
    n,
    chunk,  # cdiv(n, num_ranks): rank r reduces elements [r * chunk, (r + 1) * chunk)
    # Meta-parameters
    REDUCE: tl.constexpr,  # "sum", "max" or "min"
    BLOCK: tl.constexpr,
):
    """Program ``pid`` handles elements ``[pid * BLOCK, (pid + 1) * BLOCK)`` of every chunk.

    Each rank moves ``2 (num_ranks - 1) / num_ranks`` of the data instead of the one-shot
    ``num_ranks - 1`` times: the method for large messages.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    rs_slots = epoch_half(rs_slots_ptr, epoch, world * chunk)
    ag_slots = epoch_half(ag_slots_ptr, epoch, world * chunk)
    flags = epoch_half(flags_ptr, epoch, 2 * world * num_programs)
    rs_flags = flags
    ag_flags = flags + world * num_programs
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_chunk = offs < chunk

    # ---- phase 1: chunk `peer` of x goes to slot `me` of rank `peer` (not to myself) ----
    for i in range(1, world):
        peer = (me + i) % world
        mask = in_chunk & (peer * chunk + offs < n)
        values = tl.load(x_ptr + peer * chunk + offs, mask=mask)
        tl.store(dl.symm_at(rs_slots + me * chunk + offs, peer), values, mask=mask)
        dl.notify(rs_flags + me * num_programs + pid, peer, epoch, "set", "sys")

    # ---- reduce my chunk in rank order (my own part straight from x) ----
    mine = in_chunk & (me * chunk + offs < n)
    own = tl.load(x_ptr + me * chunk + offs, mask=mine)
    acc = reduce_in_rank_order(own, rs_slots, rs_flags, chunk, offs, mine, pid, num_programs,
                               me, world, epoch, REDUCE)
    reduced = acc.to(out_ptr.dtype.element_ty)

    # ---- phase 2: my reduced chunk to my output and to slot `me` of every other rank ----
    tl.store(out_ptr + me * chunk + offs, reduced, mask=mine)
    for i in range(1, world):
        peer = (me + i) % world
        tl.store(dl.symm_at(ag_slots + me * chunk + offs, peer), reduced, mask=mine)
        dl.notify(ag_flags + me * num_programs + pid, peer, epoch, "set", "sys")
    for i in range(1, world):
        src = (me + world - i) % world
        mask = in_chunk & (src * chunk + offs < n)
        token = dl.wait(ag_flags + src * num_programs + pid, 1, "sys", "acquire", epoch)
        values = tl.load(dl.consume_token(ag_slots + src * chunk + offs, token), mask=mask)
        tl.store(out_ptr + src * chunk + offs, values, mask=mask)
