"""All-reduce kernels."""

import triton
import triton.language as tl

import jax_triton_dist.language as dl


@triton.jit
def one_shot_all_reduce_kernel(
    # Pointers
    x_ptr,  # [n] this rank's contribution
    out_ptr,  # [n] the sum over ranks
    buf_ptr,  # symmetric workspace [2, num_ranks, n]: every rank's block, by epoch parity
    flag_ptr,  # symmetric workspace [2, num_ranks, num_programs] int32
    # Sizes
    n,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    """Push all-reduce: program ``pid`` owns elements ``[pid * BLOCK, (pid + 1) * BLOCK)``.

    Each rank pushes its block into slot ``rank`` of every rank, raises one flag per
    (source, program) there, waits for all sources' flags, and sums in rank order (the
    same order on every rank, so every rank gets bit-identical results). Accumulates in
    float32 for floating types.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    slot = epoch % 2
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    slot_buf = buf_ptr + slot * world * n
    slot_flags = flag_ptr + slot * world * num_programs

    # ---- push this rank's block to every rank ----
    x = tl.load(x_ptr + offs, mask=mask)
    for peer in range(0, world):
        tl.store(dl.symm_at(slot_buf + me * n + offs, peer), x, mask=mask)
    for peer in range(0, world):
        dl.notify(slot_flags + me * num_programs + pid, peer, epoch, "set", "sys")

    # ---- wait for every source's block, reduce in rank order ----
    acc_dtype = tl.float32 if x.dtype.is_floating() else x.dtype
    acc = tl.zeros([BLOCK], dtype=acc_dtype)
    for src in range(0, world):
        token = dl.wait(slot_flags + src * num_programs + pid, 1, "sys", "acquire", epoch)
        block = dl.consume_token(slot_buf + src * n + offs, token)
        acc += tl.load(block, mask=mask)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
