"""GEMM + AllReduce in one kernel: ``psum(A @ B)`` for small M (decode)."""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.exchange import epoch_half, notify_peers
from jax_triton_dist.kernels.gemm import (
    k_columns,
    matmul_tile,
    matmul_tile_tma,
    output_descriptor,
    store_output,
    store_tile,
    stream_k_chunk,
    stream_k_runs,
    stream_k_share,
    stream_k_sum,
    tile_descriptor,
    weight_descriptor,
)
from jax_triton_dist.kernels.tile_exchange import (
    copy_owned_sums,
    copy_sum_tile,
    keep_tile,
    push_tile,
    share_partial,
    sum_tile,
    tile_owner,
    wait_tile,
)
from jax_triton_dist.swizzle import grouped_tile


@triton.jit
def matmul_all_reduce_kernel(
    # Pointers
    a_ptr,  # [M, K] this rank's activations (its K shard)
    b_ptr,  # [K, N] this rank's weights (the same K shard)
    c_ptr,  # [M, N] the sum over ranks of A @ B
    slots_ptr,  # symmetric workspace [2, num_ranks, M, N]: every rank's partial tiles
    flags_ptr,  # symmetric workspace int32 [2, 2, num_ranks, num_tiles] (see below)
    partial_ptr,  # STREAM_K: workspace float32 [programs, 2, BLOCK_M, BLOCK_N] (else unused)
    counts_ptr,  # STREAM_K: workspace int32 [tiles], zero between calls (else unused)
    # Sizes
    M, N, K,
    # Strides
    stride_am, stride_ak, stride_bk, stride_bn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    B_NK: tl.constexpr = False, STREAM_K: tl.constexpr = False,
    TWO_SHOT: tl.constexpr = False, FLATTEN: tl.constexpr = False,
    TMA_STORE: tl.constexpr = False, SUBTILE: tl.constexpr = False,
):
    """Each output tile: this rank's partial is computed, pushed (in the slots' type) to
    every other rank as soon as it is done, then all ranks' partials of that tile are
    summed in float32, in rank order. The exchange of tile t overlaps the GEMM of the
    other tiles; no separate all-reduce pass runs over the output.

    ``TWO_SHOT``: each tile belongs to one rank (``tile_exchange.tile_owner``: ``t %
    num_ranks`` with one program a tile; a persistent program's tiles spread over the
    ranks). The other ranks push their
    partial to that owner only; the owner sums the tile (the same order and rounding as
    above), stores it and pushes the sum to every other rank, which copy it into their
    output at the end of the kernel. Each rank then sends ``2 (R - 1) / R`` of its output's
    bytes instead of ``R - 1`` times them, and reads one sum per tile instead of ``R``
    partials: the form for large outputs or many ranks (the tuner chooses). The partials
    never wait and the sums wait only on partials, so the waits cannot form a cycle.

    Flags, per epoch: ``[2, num_ranks, num_tiles]``, flag ``(0, src, t)`` "rank src's
    partial(s) have landed", ``(1, src, t)`` "rank src's sums have landed" (the
    per-program two-shot exchange; the per-tile one raises its sums' flags among the
    partials', at ``(0, owner, tile)``, which no partial uses).

    One program per tile, or (``PERSISTENT``) fewer programs, all resident at once, each
    looping over tiles ``program, program + programs, ...``; without ``STREAM_K`` a
    program sends all its partials first and raises one flag per peer, then sums (and,
    two-shot, sends all its sums and raises one flag per peer, then copies the peers'
    sums): ``_program_tiles``. ``STREAM_K`` (with
    ``PERSISTENT``): the tiles that would form a partial last wave (at decode shapes, all
    of them) are shared out by K blocks first; the program that completes a tile's
    partial exchanges it. With one rank (nothing to exchange) the whole tiles are one
    loop of stores, as the GEMM tile's: ``FLATTEN`` (with ``PERSISTENT`` and ``USE_TMA``)
    pipelines its tile and K loops as one, ``TMA_STORE`` (with ``USE_TMA``; ``SUBTILE``:
    in halves) stores through a descriptor of C; with more ranks both change nothing (the
    tiles' waits would stop the pipelining; the sums are stored as they are summed).
    """
    tl.static_assert(not FLATTEN or (PERSISTENT and USE_TMA),
                     "matmul_all_reduce_kernel: FLATTEN needs PERSISTENT and USE_TMA")
    tl.static_assert(not TMA_STORE or USE_TMA,
                     "matmul_all_reduce_kernel: TMA_STORE needs USE_TMA")
    tl.static_assert(TMA_STORE or not SUBTILE,
                     "matmul_all_reduce_kernel: SUBTILE needs TMA_STORE")
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    slots = epoch_half(slots_ptr, epoch, world * M * N)
    flags = epoch_half(flags_ptr, epoch, 2 * world * tiles_m * tiles_n)
    a_desc = a_ptr  # USE_TMA: descriptors made once per program
    b_desc = b_ptr
    if USE_TMA:
        a_desc = tile_descriptor(a_ptr, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K)
        b_desc = weight_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, B_NK)
    blocks = tl.cdiv(K, BLOCK_K)
    first = tl.program_id(0)
    if PERSISTENT and STREAM_K:
        split, block, end, share, extra = stream_k_runs(tl.program_id(0), tl.num_programs(0),
                                                        tiles_m * tiles_n, blocks)
        while block < end:
            tile, k_first, k_last = stream_k_chunk(block, end, blocks)
            _matmul_all_reduce_tile(tile, k_first, k_last, blocks, share, extra, a_ptr, b_ptr,
                                    a_desc, b_desc, c_ptr, slots, flags, partial_ptr,
                                    counts_ptr, me, world, epoch, M, N, K, stride_am,
                                    stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N,
                                    BLOCK_K, GROUP_M, USE_TMA, B_NK, TWO_SHOT, True)
            block += k_last - k_first
        first += split
    if world == 1:  # nothing to exchange (one tile a program without PERSISTENT)
        _one_rank_tiles(first, a_ptr, b_ptr, a_desc, b_desc, c_ptr, M, N, K, stride_am,
                        stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                        USE_TMA, B_NK, FLATTEN, TMA_STORE, SUBTILE)
    elif PERSISTENT and not STREAM_K:
        _program_tiles(first, a_ptr, b_ptr, a_desc, b_desc, c_ptr, slots, flags, me, world,
                       epoch, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M,
                       BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, B_NK, TWO_SHOT)
    elif PERSISTENT:
        for tile in range(first, tiles_m * tiles_n, tl.num_programs(0)):
            _matmul_all_reduce_tile(tile, 0, blocks, blocks, 0, 0, a_ptr, b_ptr, a_desc,
                                    b_desc, c_ptr, slots, flags, partial_ptr, counts_ptr, me,
                                    world, epoch, M, N, K, stride_am, stride_ak, stride_bk,
                                    stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA,
                                    B_NK, TWO_SHOT, False)
    else:
        _matmul_all_reduce_tile(tl.program_id(0), 0, blocks, blocks, 0, 0, a_ptr, b_ptr,
                                a_desc, b_desc, c_ptr, slots, flags, partial_ptr, counts_ptr,
                                me, world, epoch, M, N, K, stride_am, stride_ak, stride_bk,
                                stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, B_NK,
                                TWO_SHOT, False)
    if TWO_SHOT and (STREAM_K or not PERSISTENT):  # (_program_tiles copies its own sums)
        _copy_sums(c_ptr, slots, flags, tl.program_id(0), tl.num_programs(0), me, world,
                   epoch, M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def _product(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, k_start, k_end, stride_am,
             stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr, B_NK: tl.constexpr):
    """This rank's partial of tile ``(pid_m, pid_n)``, K columns ``k_start:k_end``, read
    through the descriptors (``USE_TMA``) or the pointers."""
    if USE_TMA:
        acc = matmul_tile_tma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_start, k_end,
                              BLOCK_M, BLOCK_N, BLOCK_K, B_NK)
    else:
        acc = matmul_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, k_start, k_end, stride_am,
                          stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def _program_tiles(first, a_ptr, b_ptr, a_desc, b_desc, c_ptr, slots, flags, me, world, epoch,
                   M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   USE_TMA: tl.constexpr, B_NK: tl.constexpr, TWO_SHOT: tl.constexpr):
    """A persistent program's whole tiles ``first, first + programs, ...``, several ranks,
    with one flag per peer for each step instead of one per tile and peer (each is a
    system-scope release, whose fence stalls the program: BENCHMARKS.md). Program ``p``
    of every rank computes the same tiles (the same grid over the same order), so its flag
    ``(src, p)`` covers exactly what program ``p`` elsewhere waits for.

    One-shot: every partial kept and copied to every peer, flag ``(0, me, p)`` raised at
    each; once every peer's has landed, the tiles summed in rank order. Two-shot: each
    partial kept (tiles this rank owns) or pushed to its owner, flag ``(0, me, p)``; once
    every peer's has landed, the owned tiles summed and the sums pushed to every peer,
    flag ``(1, me, p)``; once the owners' have landed, their sums copied into ``C``."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    if first < num_tiles:
        for tile in range(first, num_tiles, tl.num_programs(0)):
            pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
            acc = _product(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, 0, K, stride_am,
                           stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA,
                           B_NK)
            owner = tile_owner(tile, tl.num_programs(0), num_tiles, world)
            if not TWO_SHOT:
                share_partial(acc, slots, flags, me, world, M, N, pid_m, pid_n, tile,
                              num_tiles, epoch, BLOCK_M, BLOCK_N, NOTIFY=False)
            elif owner == me:
                keep_tile(acc, slots, me, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N)
            else:
                push_tile(acc, slots, flags, owner, me, M, N, pid_m, pid_n, tile, num_tiles,
                          epoch, BLOCK_M, BLOCK_N, NOTIFY=False)
        notify_peers(flags + me * num_tiles + first, me, world, epoch)
        wait_tile(flags, me, world, first, num_tiles, epoch)
        for tile in range(first, num_tiles, tl.num_programs(0)):
            # one-shot: every tile
            if (tile_owner(tile, tl.num_programs(0), num_tiles, world) == me) | (not TWO_SHOT):
                pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
                sum_tile(c_ptr, slots, flags, me, world, M, N, pid_m, pid_n, tile, num_tiles,
                         epoch, c_ptr, BLOCK_M, BLOCK_N, False, "none", BROADCAST=TWO_SHOT,
                         WAITED=True, NOTIFY=False)
        if TWO_SHOT:
            sums = flags + world * num_tiles
            notify_peers(sums + me * num_tiles + first, me, world, epoch)
            wait_tile(sums, me, world, first, num_tiles, epoch)  # once, not once a tile
            copy_owned_sums(c_ptr, slots, me, world, M, N, first, tl.num_programs(0), BLOCK_M,
                            BLOCK_N, GROUP_M)


@triton.jit
def _one_rank_tiles(first, a_ptr, b_ptr, a_desc, b_desc, c_ptr, M, N, K, stride_am, stride_ak,
                    stride_bk, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, USE_TMA: tl.constexpr,
                    B_NK: tl.constexpr, FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
                    SUBTILE: tl.constexpr):
    """One rank's whole tiles ``first, first + programs, ...``: the GEMM's tile loop, stores
    only (``FLATTEN``: pipelined with the K loop; ``TMA_STORE``: through C's descriptor)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    c_desc = output_descriptor(c_ptr, M, N, N, 1, BLOCK_M, BLOCK_N, TMA_STORE, SUBTILE)
    for tile in tl.range(first, tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = _product(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, 0, K, stride_am,
                       stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_NK)
        store_output(c_desc, c_ptr, acc, pid_m, pid_n, M, N, N, 1, BLOCK_M, BLOCK_N, TMA_STORE,
                     SUBTILE)


@triton.jit
def _matmul_all_reduce_tile(tile, k_first, k_last, blocks, share, extra, a_ptr, b_ptr, a_desc,
                            b_desc, c_ptr, slots, flags, partial_ptr, counts_ptr, me, world,
                            epoch, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            USE_TMA: tl.constexpr, B_NK: tl.constexpr,
                            TWO_SHOT: tl.constexpr, SPLIT: tl.constexpr):
    """Output tile number ``tile`` (grouped order); ``SPLIT``: only its K blocks
    ``k_first:k_last``, a stream-K share (exchanged by the program that completes the tile)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
    k_start, k_end = k_columns(k_first, k_last, K, BLOCK_K, SPLIT)

    # ---- this rank's partial tile ----
    acc = _product(a_ptr, b_ptr, a_desc, b_desc, pid_m, pid_n, M, N, k_start, k_end,
                   stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K,
                   USE_TMA, B_NK)
    if SPLIT:  # a stream-K share: finished by the program that completes the tile
        if (k_first == 0) & (k_last == blocks):
            _all_reduce_finish(acc, c_ptr, slots, flags, tile, pid_m, pid_n, me, world, epoch, M, N,
                               tiles_m * tiles_n, BLOCK_M, BLOCK_N, TWO_SHOT)
        elif stream_k_share(acc, partial_ptr, counts_ptr, tl.program_id(0), tile, k_first,
                            k_last, blocks, share, extra, BLOCK_M, BLOCK_N):
            total = stream_k_sum(partial_ptr, tile, blocks, share, extra, 0, BLOCK_M, BLOCK_M,
                                 BLOCK_N)
            _all_reduce_finish(total, c_ptr, slots, flags, tile, pid_m, pid_n, me, world, epoch, M,
                               N, tiles_m * tiles_n, BLOCK_M, BLOCK_N, TWO_SHOT)
    else:
        _all_reduce_finish(acc, c_ptr, slots, flags, tile, pid_m, pid_n, me, world, epoch, M,
                           N, tiles_m * tiles_n, BLOCK_M, BLOCK_N, TWO_SHOT)


@triton.jit
def _all_reduce_finish(acc, c_ptr, slots, flags, tile, pid_m, pid_n, me, world, epoch, M, N,
                       num_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       TWO_SHOT: tl.constexpr):
    """A finished partial tile: stored (one rank); or kept, forwarded to every peer and
    summed with theirs; or (``TWO_SHOT``) pushed to the tile's owner, or kept and summed
    there, the sum pushed to every peer."""
    if world == 1:  # nothing to exchange (folds away when the rank count is compiled in)
        store_tile(c_ptr, acc, pid_m, pid_n, M, N, N, 1, BLOCK_M, BLOCK_N)
    elif TWO_SHOT:
        owner = tile_owner(tile, tl.num_programs(0), num_tiles, world)
        if owner == me:
            keep_tile(acc, slots, me, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N)
            sum_tile(c_ptr, slots, flags, me, world, M, N, pid_m, pid_n, tile, num_tiles, epoch,
                     c_ptr, BLOCK_M, BLOCK_N, False, "none", BROADCAST=True)
        else:
            push_tile(acc, slots, flags, owner, me, M, N, pid_m, pid_n, tile, num_tiles, epoch,
                      BLOCK_M, BLOCK_N)
    else:
        # ---- keep it in the own slot, copy it from there into slot `me` of every other
        # rank and raise flag (me, tile) there; then sum every rank's partial of this tile
        # in rank order (the same bits on every rank) and store ----
        share_partial(acc, slots, flags, me, world, M, N, pid_m, pid_n, tile, num_tiles, epoch,
                      BLOCK_M, BLOCK_N)
        sum_tile(c_ptr, slots, flags, me, world, M, N, pid_m, pid_n, tile, num_tiles, epoch,
                 c_ptr, BLOCK_M, BLOCK_N, False, "none")


@triton.jit
def _copy_sums(c_ptr, slots, flags, first, step, me, world, epoch, M, N,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``TWO_SHOT``'s last step: tiles ``first, first + step, ...`` that other ranks own,
    copied into ``C`` from the slot their owner pushed the sum to, once it has landed.
    Any program may copy any tile (the sums do not depend on who computed the partials),
    so the split of the tiles among programs is the plain one, stream-K or not."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(first, tiles_m * tiles_n, step):
        owner = tile_owner(tile, step, tiles_m * tiles_n, world)
        if owner != me:
            pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
            copy_sum_tile(c_ptr, slots, flags, owner, M, N, pid_m, pid_n, tile,
                          tiles_m * tiles_n, epoch, BLOCK_M, BLOCK_N)
