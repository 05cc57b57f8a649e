"""GEMM + AllReduce in one kernel: ``psum(A @ B)`` for small M (decode)."""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.exchange import epoch_half
from jax_triton_dist.kernels.gemm import (
    matmul_tile,
    matmul_tile_tma,
    store_tile,
    tile_descriptor,
    weight_descriptor,
)
from jax_triton_dist.kernels.tile_exchange import forward_tile, keep_tile, sum_tile
from jax_triton_dist.swizzle import grouped_tile


@triton.jit
def matmul_all_reduce_kernel(
    # Pointers
    a_ptr,  # [M, K] this rank's activations (its K shard)
    b_ptr,  # [K, N] this rank's weights (the same K shard)
    c_ptr,  # [M, N] the sum over ranks of A @ B
    slots_ptr,  # symmetric workspace [2, num_ranks, M, N]: every rank's partial tiles
    flags_ptr,  # symmetric workspace int32 [2, num_ranks, num_tiles]
    # Sizes
    M, N, K,
    # Strides
    stride_am, stride_ak, stride_bk, stride_bn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    B_NK: tl.constexpr = False,
):
    """Each output tile: this rank's partial is computed, pushed (in the slots' type) to
    every other rank as soon as it is done, then all ranks' partials of that tile are
    summed in float32, in rank order. The exchange of tile t overlaps the GEMM of the
    other tiles; no separate all-reduce pass runs over the output.

    One program per tile, or (``PERSISTENT``) fewer programs, all resident at once, each
    looping over tiles ``program, program + programs, ...``.
    """
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    slots = epoch_half(slots_ptr, epoch, world * M * N)
    flags = epoch_half(flags_ptr, epoch, world * tiles_m * tiles_n)
    a_desc = a_ptr  # USE_TMA: descriptors made once per program
    b_desc = b_ptr
    if USE_TMA:
        a_desc = tile_descriptor(a_ptr, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K)
        b_desc = weight_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, B_NK)
    if PERSISTENT:
        for tile in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
            _matmul_all_reduce_tile(tile, a_ptr, b_ptr, a_desc, b_desc, c_ptr, slots, flags,
                                    me, world, epoch, M, N, K, stride_am, stride_ak,
                                    stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                    USE_TMA, B_NK)
    else:
        _matmul_all_reduce_tile(tl.program_id(0), a_ptr, b_ptr, a_desc, b_desc, c_ptr, slots,
                                flags, me, world, epoch, M, N, K, stride_am, stride_ak,
                                stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                USE_TMA, B_NK)


@triton.jit
def _matmul_all_reduce_tile(tile, a_ptr, b_ptr, a_desc, b_desc, c_ptr, slots, flags, me,
                            world, epoch, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            USE_TMA: tl.constexpr, B_NK: tl.constexpr):
    """Output tile number ``tile`` (grouped order)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)

    # ---- this rank's partial tile ----
    if USE_TMA:
        acc = matmul_tile_tma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, BLOCK_M,
                              BLOCK_N, BLOCK_K, B_NK)
    else:
        acc = matmul_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, K, stride_am, stride_ak,
                          stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)

    if world == 1:  # nothing to exchange (folds away when the rank count is compiled in)
        store_tile(c_ptr, acc, pid_m, pid_n, M, N, N, 1, BLOCK_M, BLOCK_N)
    else:
        # ---- keep it in the own slot, copy it from there into slot `me` of every other
        # rank and raise flag (me, tile) there; then sum every rank's partial of this tile
        # in rank order (the same bits on every rank) and store ----
        keep_tile(acc, slots, me, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N)
        for i in range(1, world):
            forward_tile(slots, flags, (me + i) % world, me, M, N, pid_m, pid_n, tile,
                         num_tiles, epoch, BLOCK_M, BLOCK_N)
        sum_tile(c_ptr, slots, flags, me, world, M, N, pid_m, pid_n, tile, num_tiles, epoch,
                 c_ptr, BLOCK_M, BLOCK_N, False, "none")
