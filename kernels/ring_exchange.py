"""Ring exchange: every rank sends its block to the next rank (push, one flag per call)."""

import triton
import triton.language as tl

import jax_triton_dist.language as dl


@triton.jit
def ring_shift_kernel(
    # Pointers
    x_ptr,  # [n] this rank's data
    out_ptr,  # [n] receives the data of rank (rank - 1) mod num_ranks
    buf_ptr,  # symmetric workspace [2, n]: receive slots, alternating by epoch
    flag_ptr,  # symmetric workspace [2] int32: "slot filled in epoch e" flags
    # Sizes
    n,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    """One program moves all ``n`` elements.

    Slots alternate by epoch, so a rank one call ahead never overwrites a slot its
    successor still reads: finishing call e+1 needs the predecessor's data of e+1,
    which (around the ring) needs the successor to have finished call e.
    """
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    slot = epoch % 2
    dst = (me + 1) % world

    # ---- push x into the successor's receive slot, then raise its flag ----
    remote = dl.symm_at(buf_ptr + slot * n, dst)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(remote + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    dl.notify(flag_ptr + slot, dst, epoch, "set", "sys")

    # ---- wait for the predecessor's data, copy it out ----
    token = dl.wait(flag_ptr + slot, 1, "sys", "acquire", epoch)
    local = dl.consume_token(buf_ptr + slot * n, token)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(local + offs, mask=mask), mask=mask)
