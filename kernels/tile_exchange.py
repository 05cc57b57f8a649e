"""Partial GEMM output tiles exchanged through symmetric slots: the epilogues of
GEMM + ReduceScatter and GEMM + AllReduce.

Slots are float32 ``[num_ranks, rows, cols]`` (slot ``src`` holds rank ``src``'s partial),
flags int32 ``[num_ranks, tiles]`` (flag ``(src, tile)``: "rank src's partial of tile has
landed"), both already advanced to this call's epoch half. Every access forms its
addresses from the tile's indices, so no block of offsets or pointers stays live beside
the accumulator (a 128x128 float32 accumulator takes 64 registers per thread at 8 warps;
holding its offsets and mask too made the kernels spill).
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.gemm import load_tile, store_tile


@triton.jit
def push_tile(acc, slots, flags, peer, me, rows, cols, pid_m, pid_n, tile, num_tiles, epoch,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores ``acc`` (tile ``(pid_m, pid_n)``) into slot ``me`` of rank ``peer``, then
    raises flag ``(me, tile)`` there."""
    store_tile(dl.symm_at(slots, peer) + me * rows * cols, acc, pid_m, pid_n, rows, cols, cols,
               1, BLOCK_M, BLOCK_N)
    dl.notify(flags + me * num_tiles + tile, peer, epoch, "set", "sys")


@triton.jit
def add_peer_tiles(acc, slots, flags, me, world, rows, cols, pid_m, pid_n, tile, num_tiles,
                   epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``acc`` plus every other rank's partial of the tile, each once its flag reaches
    ``epoch``; sources ``me - 1, me - 2, ...`` (the order in which an own-last
    GEMM + ReduceScatter finishes them).

    The order of the sum depends on ``me``: for tiles that only rank ``me`` reduces.
    """
    for i in range(1, world):
        src = (me + world - i) % world
        token = dl.wait(flags + src * num_tiles + tile, 1, "sys", "acquire", epoch)
        part = dl.consume_token(slots + src * rows * cols, token)
        acc += load_tile(part, pid_m, pid_n, rows, cols, cols, 1, BLOCK_M, BLOCK_N)
    return acc


@triton.jit
def sum_tiles_in_rank_order(slots, flags, me, world, rows, cols, pid_m, pid_n, tile,
                            num_tiles, epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Float32 sum of every rank's partial of the tile in rank order, so every rank computes
    the same bits. This rank's own partial must already be in its slot, visible to the
    whole program; the others are read once their flag reaches ``epoch``."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for src in range(0, world):
        if src != me:
            dl.wait(flags + src * num_tiles + tile, 1, "sys", "acquire", epoch)
        total += load_tile(slots + src * rows * cols, pid_m, pid_n, rows, cols, cols, 1,
                           BLOCK_M, BLOCK_N)
    return total
