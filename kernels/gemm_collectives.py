"""AllGather + GEMM and GEMM + ReduceScatter, each one kernel (tensor-parallel MLP layers).

Both walk their output tiles in a rank-dependent order (``jax_triton_dist.swizzle``) so
that the work needing no communication comes where it hides the communication, and no
program ever waits for a later program of its own launch.
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.epilogue import apply_epilogue
from jax_triton_dist.kernels.exchange import epoch_half, notify_peers
from jax_triton_dist.kernels.gemm import (
    k_columns,
    matmul_rows_tile,
    matmul_tile,
    matmul_tile_tma,
    output_descriptor,
    split_columns,
    store_output,
    store_rows_tile,
    store_tile,
    stream_k_chunk,
    stream_k_runs,
    stream_k_share,
    stream_k_sum,
    tile_descriptor,
    weight_descriptor,
)
from jax_triton_dist.kernels.tile_exchange import (
    push_tile,
    slots_descriptor,
    sum_own_tile,
    wait_tile,
)
from jax_triton_dist.swizzle import grouped_tile, own_last_tile, rank_rotated_tile


@triton.jit
def all_gather_matmul_kernel(
    # Pointers
    x_ptr,  # [m, K] this rank's rows, staged in the symmetric heap by the runtime
    w_ptr,  # [K, N] this rank's weight columns (element (k, n) at k*stride_wk + n*stride_wn)
    bias_ptr,  # [N] added to every row when HAS_BIAS
    c_ptr,  # [num_ranks * m, N] act(all_gather(x) @ w + bias); batched: [m / R, num_ranks * R, N]
    flags_ptr,  # symmetric workspace int32 [2, num_ranks]: "rank s staged its rows"
    partial_ptr,  # STREAM_K: workspace float32 [programs, 2, BLOCK_M, BLOCK_N] (else unused)
    counts_ptr,  # STREAM_K: workspace int32 [tiles], zero between calls (else unused)
    # Sizes
    m, N, K,
    R,  # batched: rows of one batch entry per rank (x is [m / R, R, K], gathered along R)
    # Strides of w: (N, 1) for a [K, N] weight, (1, K) for an [N, K] one
    stride_wk, stride_wn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BATCHED: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    ACTIVATION: tl.constexpr = "none", PERSISTENT: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, W_NK: tl.constexpr = False, STREAM_K: tl.constexpr = False,
    TMA_STORE: tl.constexpr = False, FLATTEN: tl.constexpr = False,
    SUBTILE: tl.constexpr = False,
):
    """Program 0 announces this rank's staged rows to every rank. Tiles come in rank-rotated
    order: this rank's own rows first (local, no wait), then each peer's shard around the
    ring, read straight from the peer's symmetric buffer once its flag has landed.

    ``PERSISTENT``: a grid of fewer programs than tiles (all resident at once), each
    looping over tiles ``program, program + programs, ...`` of that order. ``STREAM_K``
    (with ``PERSISTENT``): the first tiles of that order that would form a partial last
    wave (all of them when there are fewer tiles than programs: decode shapes) are
    shared out by K blocks first (``kernels/gemm.py``'s ``stream_k_runs``), then the rest
    go whole. ``TMA_STORE`` (with ``USE_TMA``, not ``BATCHED``): output tiles go out
    through one descriptor of C as ``[num_ranks, m, N]`` (made once per program; a block
    ``[1, BLOCK_M, BLOCK_N]`` is clipped at its shard's last row) instead of per-thread
    stores; ``SUBTILE``: in two ``[1, BLOCK_M, BLOCK_N / 2]`` halves (half the staging
    buffer: room for a fourth stage of 128x256x64 blocks). ``FLATTEN`` (with
    ``PERSISTENT`` and ``USE_TMA``): each shard's tile loop and K loop are pipelined as
    one, as the GEMM tile's ``FLATTEN`` form (the shard's wait comes before its loop, so
    the loop holds no spin loop to stop the pipelining).
    """
    tl.static_assert(not TMA_STORE or (USE_TMA and not BATCHED),
                     "all_gather_matmul_kernel: TMA_STORE needs USE_TMA and unbatched rows")
    tl.static_assert(TMA_STORE or not SUBTILE, "all_gather_matmul_kernel: SUBTILE needs TMA_STORE")
    tl.static_assert(not FLATTEN or (PERSISTENT and USE_TMA),
                     "all_gather_matmul_kernel: FLATTEN needs PERSISTENT and USE_TMA")
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    flags = epoch_half(flags_ptr, epoch, world)
    if tl.program_id(0) == 0:
        notify_peers(flags + me, me, world, epoch)
    w_desc = w_ptr  # USE_TMA: the weights' descriptor, made once per program
    if USE_TMA:
        w_desc = weight_descriptor(w_ptr, K, N, stride_wk, stride_wn, BLOCK_K, BLOCK_N, W_NK)
    c_desc = c_ptr  # TMA_STORE: C's descriptor, made once per program
    if TMA_STORE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[world, m, N], strides=[m * N, N, 1],
                                           block_shape=[1, BLOCK_M,
                                                        BLOCK_N // 2 if SUBTILE else BLOCK_N])
    blocks = tl.cdiv(K, BLOCK_K)
    # The last shard this program acquired (its own needs no wait) and, USE_TMA, the
    # descriptor of that shard's rows: a persistent program's tiles come shard after shard,
    # so it waits and makes a descriptor once per shard, not once per tile.
    waited = me
    a_desc = me
    if USE_TMA:
        a_desc = tile_descriptor(x_ptr, m, K, K, 1, BLOCK_M, BLOCK_K)
    if PERSISTENT:
        num_tiles = world * tl.cdiv(m, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        first = tl.program_id(0)
        if STREAM_K:
            split, block, end, share, extra = stream_k_runs(tl.program_id(0),
                                                            tl.num_programs(0), num_tiles,
                                                            blocks)
            while block < end:
                tile, k_first, k_last = stream_k_chunk(block, end, blocks)
                waited, a_desc = _all_gather_matmul_tile(
                    tile, k_first, k_last, blocks, share, extra, waited, a_desc, x_ptr, w_ptr,
                    w_desc, bias_ptr, c_ptr, c_desc, flags, partial_ptr, counts_ptr, me, world,
                    epoch, m, N, K, R, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                    GROUP_M, BATCHED, HAS_BIAS, ACTIVATION, USE_TMA, W_NK, TMA_STORE, SUBTILE,
                    True)
                block += k_last - k_first
            first += split
        # Whole tiles first, first + programs, ... of the order, shard by shard: one wait
        # and one descriptor per shard, then a tile loop free of waits (FLATTEN pipelines it).
        shard_tiles = num_tiles // world
        for step in range(0, world):
            start = _first_tile_from(first, step * shard_tiles)
            if start < (step + 1) * shard_tiles:
                waited, a_desc = _all_gather_shard_tiles(
                    start, step, waited, a_desc, x_ptr, w_ptr, w_desc, bias_ptr, c_ptr, c_desc,
                    flags, me, world, epoch, m, N, K, R, stride_wk, stride_wn, BLOCK_M,
                    BLOCK_N, BLOCK_K, GROUP_M, BATCHED, HAS_BIAS, ACTIVATION, USE_TMA, W_NK,
                    TMA_STORE, SUBTILE, FLATTEN)
    else:
        _all_gather_matmul_tile(tl.program_id(0), 0, blocks, blocks, 0, 0, waited, a_desc,
                                x_ptr, w_ptr, w_desc, bias_ptr, c_ptr, c_desc, flags,
                                partial_ptr, counts_ptr, me, world, epoch, m, N, K, R,
                                stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                BATCHED, HAS_BIAS, ACTIVATION, USE_TMA, W_NK, TMA_STORE,
                                SUBTILE, False)


@triton.jit
def _all_gather_matmul_tile(tile, k_first, k_last, blocks, share, extra, waited, a_desc, x_ptr,
                            w_ptr, w_desc, bias_ptr, c_ptr, c_desc, flags, partial_ptr,
                            counts_ptr, me, world, epoch, m, N, K, R, stride_wk, stride_wn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BATCHED: tl.constexpr,
                            HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                            USE_TMA: tl.constexpr, W_NK: tl.constexpr,
                            TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr,
                            SPLIT: tl.constexpr):
    """Output tile number ``tile`` of the rank-rotated order; ``SPLIT``: only its K blocks
    ``k_first:k_last``, a stream-K share (finished by the program that completes the tile).
    ``waited``: the shard whose flag this program acquired last (a persistent program's
    tiles come shard after shard, so it waits once per shard, not once per tile); ``a_desc``
    (``USE_TMA``): that shard's descriptor, made again only when the shard changes. Returns
    the tile's shard, acquired now or before, and its descriptor."""
    tiles_m = tl.cdiv(m, BLOCK_M)
    pid_m, pid_n, shard = rank_rotated_tile(tile, tiles_m, tl.cdiv(N, BLOCK_N), me, world,
                                            GROUP_M, 1)
    local_m = pid_m - shard * tiles_m
    k_start, k_end = k_columns(k_first, k_last, K, BLOCK_K, SPLIT)
    # The own shard needs no wait, and symm_at maps it to itself: one pointer for every
    # shard (a pointer chosen by a run-time branch defeats Ascend's pointer analysis).
    if (shard != me) & (shard != waited):
        dl.wait(flags + shard, 1, "sys", "acquire", epoch)
    a_ptr = dl.symm_at(x_ptr, shard)
    if USE_TMA:
        if shard != waited:  # a descriptor per shard (each its own buffer), kept while it lasts
            a_desc = tile_descriptor(a_ptr, m, K, K, 1, BLOCK_M, BLOCK_K)
        acc = matmul_tile_tma(a_desc, w_desc, local_m * BLOCK_M, pid_n * BLOCK_N, k_start,
                              k_end, BLOCK_M, BLOCK_N, BLOCK_K, W_NK)
    else:
        acc = matmul_tile(a_ptr, w_ptr, local_m, pid_n, m, N, k_start, k_end, K, 1, stride_wk,
                          stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT:  # a stream-K share: finished by the program that completes the tile
        if (k_first == 0) & (k_last == blocks):
            _all_gather_store(acc, bias_ptr, c_ptr, c_desc, shard, local_m, pid_n, world, m,
                              N, R, BLOCK_M, BLOCK_N, BATCHED, HAS_BIAS, ACTIVATION,
                              TMA_STORE, SUBTILE)
        elif stream_k_share(acc, partial_ptr, counts_ptr, tl.program_id(0), tile, k_first,
                            k_last, blocks, share, extra, BLOCK_M, BLOCK_N):
            total = stream_k_sum(partial_ptr, tile, blocks, share, extra, 0, BLOCK_M, BLOCK_M,
                                 BLOCK_N)
            _all_gather_store(total, bias_ptr, c_ptr, c_desc, shard, local_m, pid_n, world,
                              m, N, R, BLOCK_M, BLOCK_N, BATCHED, HAS_BIAS, ACTIVATION,
                              TMA_STORE, SUBTILE)
    else:
        _all_gather_store(acc, bias_ptr, c_ptr, c_desc, shard, local_m, pid_n, world, m, N,
                          R, BLOCK_M, BLOCK_N, BATCHED, HAS_BIAS, ACTIVATION, TMA_STORE,
                          SUBTILE)
    return shard, a_desc


@triton.jit
def _all_gather_shard_tiles(start, step, waited, a_desc, x_ptr, w_ptr, w_desc, bias_ptr, c_ptr,
                            c_desc, flags, me, world, epoch, m, N, K, R, stride_wk, stride_wn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            BATCHED: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ACTIVATION: tl.constexpr, USE_TMA: tl.constexpr,
                            W_NK: tl.constexpr, TMA_STORE: tl.constexpr,
                            SUBTILE: tl.constexpr, FLATTEN: tl.constexpr):
    """A persistent program's whole tiles ``start, start + programs, ...`` of the ``step``-th
    shard of the rank-rotated order (rank ``me + step``'s rows): the shard's flag acquired
    and (``USE_TMA``) its descriptor made unless ``waited`` is that shard already, then the
    tiles. Returns the shard and its descriptor (``waited`` and ``a_desc`` of the next)."""
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    shard = (me + step) % world
    if (shard != me) & (shard != waited):
        dl.wait(flags + shard, 1, "sys", "acquire", epoch)
    a_ptr = dl.symm_at(x_ptr, shard)
    if USE_TMA:  # noqa: SIM102 - a constexpr branch: without it a_desc holds no descriptor
        if shard != waited:
            a_desc = tile_descriptor(a_ptr, m, K, K, 1, BLOCK_M, BLOCK_K)
    first = step * tiles_m * tiles_n
    for tile in tl.range(start, first + tiles_m * tiles_n, tl.num_programs(0), flatten=FLATTEN):
        local_m, pid_n = grouped_tile(tile - first, tiles_m, tiles_n, GROUP_M)
        if USE_TMA:
            acc = matmul_tile_tma(a_desc, w_desc, local_m * BLOCK_M, pid_n * BLOCK_N, 0, K,
                                  BLOCK_M, BLOCK_N, BLOCK_K, W_NK)
        else:
            acc = matmul_tile(a_ptr, w_ptr, local_m, pid_n, m, N, 0, K, K, 1, stride_wk,
                              stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
        _all_gather_store(acc, bias_ptr, c_ptr, c_desc, shard, local_m, pid_n, world, m, N, R,
                          BLOCK_M, BLOCK_N, BATCHED, HAS_BIAS, ACTIVATION, TMA_STORE, SUBTILE)
    return shard, a_desc


@triton.jit
def _all_gather_store(acc, bias_ptr, c_ptr, c_desc, shard, local_m, pid_n, world, m, N, R,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BATCHED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                      TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr):
    """The epilogue of a finished tile of shard ``shard``, stored in place (``TMA_STORE``:
    through C's ``[num_ranks, m, N]`` descriptor, in two halves with ``SUBTILE``)."""
    acc = apply_epilogue(acc, bias_ptr, pid_n, N, BLOCK_N, HAS_BIAS, ACTIVATION)
    if TMA_STORE:
        row = local_m * BLOCK_M
        if SUBTILE:
            HALF: tl.constexpr = BLOCK_N // 2
            left, right = split_columns(acc, BLOCK_M, BLOCK_N)
            c_desc.store([shard, row, pid_n * BLOCK_N],
                         left.to(c_ptr.dtype.element_ty).reshape([1, BLOCK_M, HALF]))
            c_desc.store([shard, row, pid_n * BLOCK_N + HALF],
                         right.to(c_ptr.dtype.element_ty).reshape([1, BLOCK_M, HALF]))
        else:
            c_desc.store([shard, row, pid_n * BLOCK_N],
                         acc.to(c_ptr.dtype.element_ty).reshape([1, BLOCK_M, BLOCK_N]))
    elif BATCHED:  # row (b, i) of the shard goes to row b * num_ranks * R + shard * R + i
        store_rows_tile(c_ptr + shard * R * N, acc, local_m, pid_n, m, N, R, world * R, N,
                        BLOCK_M, BLOCK_N)
    else:
        store_tile(c_ptr + shard * m * N, acc, local_m, pid_n, m, N, N, 1, BLOCK_M, BLOCK_N)


@triton.jit
def matmul_reduce_scatter_kernel(
    # Pointers
    x_ptr,  # [M, K] this rank's activations (its K shard)
    w_ptr,  # [K, N] the matching weight rows (element (k, n) at k*stride_wk + n*stride_wn)
    bias_ptr,  # [N] added to the reduced rows when HAS_BIAS
    c_ptr,  # [M / num_ranks, N] this rank's segment of act(psum(x @ w) + bias)
    slots_ptr,  # symmetric workspace [2, num_ranks, M / num_ranks, N] (partials' type)
    flags_ptr,  # symmetric workspace int32 [2, num_ranks, tiles per segment]
    partial_ptr,  # STREAM_K: workspace float32 [programs, 2, BLOCK_M, BLOCK_N] (else unused)
    counts_ptr,  # STREAM_K: workspace int32 [tiles], zero between calls (else unused)
    # Sizes
    seg, N, K,  # seg = M / num_ranks rows per segment
    R,  # batched: rows of one batch entry per segment (x is [seg / R, num_ranks * R, K])
    # Strides of w: (N, 1) for a [K, N] weight, (1, K) for an [N, K] one
    stride_wk, stride_wn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BATCHED: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    ACTIVATION: tl.constexpr = "none", PERSISTENT: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, W_NK: tl.constexpr = False, STREAM_K: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
    SUBTILE: tl.constexpr = False, SUM_TMA: tl.constexpr = False,
):
    """Tiles come segment by segment, the peers' segments first (rank+1, rank+2, ...) and
    this rank's own last. A peer segment's partial tile is pushed (in the slots' type) into
    its owner's slot as soon as it is computed; the own segment's tiles then sum every
    rank's partial in float32. Only the last programs wait, and only for other ranks'
    earlier tiles. ``SUM_TMA`` (several ranks, the slots' rows a multiple of 16 bytes;
    one rank's tiles have nothing to sum, so no slots' descriptor is made): an own tile's
    partial stays in registers and the peers' are added to it in rank order, read through a
    descriptor of the slots (``tile_exchange.sum_own_tile``); otherwise it is written to its
    slot and every rank's is summed in rank order.

    ``PERSISTENT``: a grid of fewer programs than tiles (all resident at once), each
    looping over tiles ``program, program + programs, ...`` of that order (each program's
    pushes all come before its waits); without ``STREAM_K`` a program raises one flag per
    peer, after its last push, instead of one per tile (``_reduce_scatter_tiles``).
    ``STREAM_K`` (with ``PERSISTENT``): the first tiles
    of that order that would form a partial last wave are shared out by K blocks first,
    then the rest go whole (a program's work still runs in the order, so its pushes still
    come before its waits). ``FLATTEN`` (with ``PERSISTENT`` and ``USE_TMA``): the tile
    loops and K loop are pipelined as one, as the GEMM tile's ``FLATTEN`` form: the peers'
    segments' loop (pushes only; with ``STREAM_K`` its per-tile releases keep it from
    being pipelined), the own segment's (its program acquires every flag of its tiles
    first, so that its loop of sums holds no spin loop: Triton 3.6's loop fusion fails on
    one) and one rank's tiles (no exchange). ``TMA_STORE`` (with
    ``USE_TMA``, unbatched; ``SUBTILE``: in halves): one rank's tiles go out through a
    descriptor of C, as the GEMM tile's; with more ranks it changes nothing (the owners'
    sums are stored as they are summed).
    """
    tl.static_assert(not FLATTEN or (PERSISTENT and USE_TMA),
                     "matmul_reduce_scatter_kernel: FLATTEN needs PERSISTENT and USE_TMA")
    tl.static_assert(not TMA_STORE or (USE_TMA and not BATCHED),
                     "matmul_reduce_scatter_kernel: TMA_STORE needs USE_TMA and unbatched rows")
    tl.static_assert(TMA_STORE or not SUBTILE,
                     "matmul_reduce_scatter_kernel: SUBTILE needs TMA_STORE")
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    tiles_per_segment = tl.cdiv(seg, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    slots = epoch_half(slots_ptr, epoch, world * seg * N)
    flags = epoch_half(flags_ptr, epoch, world * tiles_per_segment)
    x_desc = x_ptr  # USE_TMA (unbatched): descriptors of all of x and w, once per program
    w_desc = w_ptr
    if USE_TMA:
        x_desc = tile_descriptor(x_ptr, world * seg, K, K, 1, BLOCK_M, BLOCK_K)
        w_desc = weight_descriptor(w_ptr, K, N, stride_wk, stride_wn, BLOCK_K, BLOCK_N, W_NK)
    c_desc = output_descriptor(c_ptr, seg, N, N, 1, BLOCK_M, BLOCK_N, TMA_STORE, SUBTILE)
    slots_desc = slots  # SUM_TMA: the slots' descriptor, once per program
    if SUM_TMA:
        slots_desc = slots_descriptor(slots, world, seg, N, BLOCK_M, BLOCK_N)
    blocks = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        first = tl.program_id(0)
        if STREAM_K:
            split, block, end, share, extra = stream_k_runs(tl.program_id(0),
                                                            tl.num_programs(0),
                                                            world * tiles_per_segment, blocks)
            while block < end:
                tile, k_first, k_last = stream_k_chunk(block, end, blocks)
                _matmul_reduce_scatter_tile(tile, k_first, k_last, blocks, share, extra,
                                            x_ptr, w_ptr, x_desc, w_desc, bias_ptr, c_ptr,
                                            slots, slots_desc, flags, partial_ptr, counts_ptr,
                                            me, world, epoch, seg, N, K, R, stride_wk,
                                            stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                            BATCHED, HAS_BIAS, ACTIVATION, USE_TMA, W_NK,
                                            SUM_TMA, True)
                block += k_last - k_first
            first += split
        # Whole tiles first, first + programs, ... of the order: the peers' segments in one
        # loop (pushes only), then their flags, then the own segment (sums; with FLATTEN its
        # waits all come first). One rank (folded where the rank count is compiled in): one
        # loop of stores.
        whole = world * tiles_per_segment
        if world == 1:  # nothing to exchange: the GEMM's tile loop, stores only
            _reduce_scatter_tiles(
                first, whole, x_ptr, w_ptr, x_desc, w_desc, bias_ptr, c_ptr, c_desc, slots,
                slots_desc, flags, me, world, epoch, seg, N, K, R, stride_wk, stride_wn,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BATCHED, HAS_BIAS, ACTIVATION, USE_TMA,
                W_NK, "store", FLATTEN, TMA_STORE, SUBTILE, SUM_TMA)
        else:
            own = whole - tiles_per_segment
            _reduce_scatter_tiles(
                first, own, x_ptr, w_ptr, x_desc, w_desc, bias_ptr, c_ptr, c_ptr, slots,
                slots_desc, flags, me, world, epoch, seg, N, K, R, stride_wk, stride_wn,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BATCHED, HAS_BIAS, ACTIVATION, USE_TMA,
                W_NK, "push", FLATTEN, False, False, SUM_TMA, not STREAM_K)
            if not STREAM_K:
                _notify_owners(first, flags, me, world, epoch, tiles_per_segment)
            _reduce_scatter_tiles(
                _first_tile_from(first, own), whole, x_ptr, w_ptr, x_desc, w_desc, bias_ptr,
                c_ptr, c_ptr, slots, slots_desc, flags, me, world, epoch, seg, N, K, R,
                stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BATCHED, HAS_BIAS,
                ACTIVATION, USE_TMA, W_NK, "sum", FLATTEN, False, False, SUM_TMA, not STREAM_K)
    elif world == 1:  # one tile a program, stored as the persistent loop above stores it
        _reduce_scatter_tiles(
            tl.program_id(0), tiles_per_segment, x_ptr, w_ptr, x_desc, w_desc, bias_ptr, c_ptr,
            c_desc, slots, slots_desc, flags, me, world, epoch, seg, N, K, R, stride_wk,
            stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BATCHED, HAS_BIAS, ACTIVATION,
            USE_TMA, W_NK, "store", False, TMA_STORE, SUBTILE, SUM_TMA)
    else:
        _matmul_reduce_scatter_tile(tl.program_id(0), 0, blocks, blocks, 0, 0, x_ptr, w_ptr,
                                    x_desc, w_desc, bias_ptr, c_ptr, slots, slots_desc, flags,
                                    partial_ptr, counts_ptr, me, world, epoch, seg, N, K, R,
                                    stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                    BATCHED, HAS_BIAS, ACTIVATION, USE_TMA, W_NK, SUM_TMA,
                                    False)


@triton.jit
def _matmul_reduce_scatter_tile(tile, k_first, k_last, blocks, share, extra, x_ptr, w_ptr,
                                x_desc, w_desc, bias_ptr, c_ptr, slots, slots_desc, flags,
                                partial_ptr, counts_ptr, me, world, epoch, seg, N, K, R,
                                stride_wk, stride_wn, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, BATCHED: tl.constexpr,
                                HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                                USE_TMA: tl.constexpr, W_NK: tl.constexpr,
                                SUM_TMA: tl.constexpr, SPLIT: tl.constexpr):
    """Output tile number ``tile`` of the own-segment-last order (``USE_TMA`` applies to
    unbatched rows); ``SPLIT``: only its K blocks ``k_first:k_last``, a stream-K share
    (pushed or summed by the program that completes the tile)."""
    tiles_m = tl.cdiv(seg, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n, segment = own_last_tile(tile, tiles_m, tiles_n, me, world, GROUP_M)
    local_m = pid_m - segment * tiles_m
    k_start, k_end = k_columns(k_first, k_last, K, BLOCK_K, SPLIT)

    acc = _reduce_scatter_product(segment, local_m, pid_n, k_start, k_end, x_ptr, w_ptr,
                                  x_desc, w_desc, world, seg, N, K, R, stride_wk, stride_wn,
                                  BLOCK_M, BLOCK_N, BLOCK_K, BATCHED, USE_TMA, W_NK)
    if SPLIT:  # a stream-K share: finished by the program that completes the tile
        if (k_first == 0) & (k_last == blocks):
            _reduce_scatter_finish(acc, bias_ptr, c_ptr, slots, slots_desc, flags, segment,
                                   local_m, pid_n, me, world, epoch, seg, N, tiles_m, tiles_n,
                                   BLOCK_M, BLOCK_N, HAS_BIAS, ACTIVATION, SUM_TMA)
        elif stream_k_share(acc, partial_ptr, counts_ptr, tl.program_id(0), tile, k_first,
                            k_last, blocks, share, extra, BLOCK_M, BLOCK_N):
            total = stream_k_sum(partial_ptr, tile, blocks, share, extra, 0, BLOCK_M, BLOCK_M,
                                 BLOCK_N)
            _reduce_scatter_finish(total, bias_ptr, c_ptr, slots, slots_desc, flags, segment,
                                   local_m, pid_n, me, world, epoch, seg, N, tiles_m, tiles_n,
                                   BLOCK_M, BLOCK_N, HAS_BIAS, ACTIVATION, SUM_TMA)
    else:
        _reduce_scatter_finish(acc, bias_ptr, c_ptr, slots, slots_desc, flags, segment, local_m,
                               pid_n, me, world, epoch, seg, N, tiles_m, tiles_n, BLOCK_M,
                               BLOCK_N, HAS_BIAS, ACTIVATION, SUM_TMA)


@triton.jit
def _reduce_scatter_product(segment, local_m, pid_n, k_start, k_end, x_ptr, w_ptr, x_desc,
                            w_desc, world, seg, N, K, R, stride_wk, stride_wn,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BATCHED: tl.constexpr,
                            USE_TMA: tl.constexpr, W_NK: tl.constexpr):
    """This rank's partial of tile ``(local_m, pid_n)`` of ``segment``, K columns
    ``k_start:k_end`` (``USE_TMA`` applies to unbatched rows)."""
    if BATCHED:  # segment row (b, i) is row b * num_ranks * R + segment * R + i of x
        acc = matmul_rows_tile(x_ptr + segment * R * K, w_ptr, local_m, pid_n, seg, N,
                               k_start, k_end, R, world * R, K, 1, stride_wk, stride_wn,
                               BLOCK_M, BLOCK_N, BLOCK_K)
    elif USE_TMA:  # a tile past the segment's end reads the next one's rows: not stored
        acc = matmul_tile_tma(x_desc, w_desc, segment * seg + local_m * BLOCK_M,
                              pid_n * BLOCK_N, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K,
                              W_NK)
    else:
        acc = matmul_tile(x_ptr + segment * seg * K, w_ptr, local_m, pid_n, seg, N, k_start,
                          k_end, K, 1, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def _reduce_scatter_tiles(start, end, x_ptr, w_ptr, x_desc, w_desc, bias_ptr, c_ptr, c_desc,
                          slots, slots_desc, flags, me, world, epoch, seg, N, K, R, stride_wk,
                          stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BATCHED: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                          USE_TMA: tl.constexpr, W_NK: tl.constexpr, FINISH: tl.constexpr,
                          FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
                          SUBTILE: tl.constexpr, SUM_TMA: tl.constexpr,
                          PROGRAM_FLAGS: tl.constexpr = False):
    """A persistent program's whole tiles ``start, start + programs, ...`` below ``end`` of
    the own-segment-last order, each finished as ``FINISH`` says: ``"push"`` to its owner
    (the peers' segments: one loop over all of them, so one set of pipeline buffers serves
    them), ``"sum"`` with the peers' partials (the own segment, the last), or ``"store"``
    (one rank: the product is the result, stored through ``c_desc``, C's
    :func:`output_descriptor`, with ``TMA_STORE``). ``FLATTEN``: the tile and K loops
    pipelined as one; the sums' flags all acquired before that loop (a spin loop inside it
    would stop the loop fusion).

    Flags: one per pushed tile (flag ``(src, tile)``, the tile's row-major index, raised
    after its push), or (``PROGRAM_FLAGS``) one per program and peer, raised by
    :func:`_notify_owners` after the program's last push — a release inside the push loop
    keeps Triton 3.6 from pipelining it, and each system-scope release stalls the program
    (on one H100 with 8 ranks, flags raised per tile cost GEMM+RS 10% of its time in the
    pointer form and the flattened descriptor form its pipelining: BENCHMARKS.md,
    ``scripts/rs_ablation.py``). The owner's tile at position ``q`` of its segment's order
    then waits for flag ``(src, q mod programs)`` of each peer (:func:`_flag_index`)."""
    tiles_m = tl.cdiv(seg, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    programs = tl.num_programs(0)
    if FLATTEN and FINISH == "sum":  # every wait first: the loop below holds no spin loop
        for tile in range(start, end, programs):
            wait_tile(flags, me, world, _flag_index(tile % num_tiles, tiles_m, tiles_n,
                                                    programs, GROUP_M, PROGRAM_FLAGS),
                      num_tiles, epoch)
    for tile in tl.range(start, end, programs, flatten=FLATTEN):
        q = tile % num_tiles  # position in its segment's order
        segment = (me + 1 + tile // num_tiles) % world
        local_m, pid_n = grouped_tile(q, tiles_m, tiles_n, GROUP_M)
        acc = _reduce_scatter_product(segment, local_m, pid_n, 0, K, x_ptr, w_ptr, x_desc,
                                      w_desc, world, seg, N, K, R, stride_wk, stride_wn,
                                      BLOCK_M, BLOCK_N, BLOCK_K, BATCHED, USE_TMA, W_NK)
        if FINISH == "push":
            push_tile(acc, slots, flags, segment, me, seg, N, local_m, pid_n,
                      local_m * tiles_n + pid_n, num_tiles, epoch, BLOCK_M, BLOCK_N,
                      NOTIFY=not PROGRAM_FLAGS)
        elif FINISH == "sum":  # the own segment (segment == me) of several ranks
            sum_own_tile(acc, c_ptr, slots, slots_desc, flags, me, world, seg, N, local_m,
                         pid_n, _flag_index(q, tiles_m, tiles_n, programs, GROUP_M,
                                            PROGRAM_FLAGS),
                         num_tiles, epoch, bias_ptr, BLOCK_M, BLOCK_N, HAS_BIAS, ACTIVATION,
                         SUM_TMA, WAITED=FLATTEN)
        else:
            acc = apply_epilogue(acc, bias_ptr, pid_n, N, BLOCK_N, HAS_BIAS, ACTIVATION)
            store_output(c_desc, c_ptr, acc, local_m, pid_n, seg, N, N, 1, BLOCK_M, BLOCK_N,
                         TMA_STORE, SUBTILE)


@triton.jit
def _notify_owners(first, flags, me, world, epoch, num_tiles):
    """Raises, at each peer whose segment a persistent program (tiles ``first, first +
    programs, ...``) pushed tiles of, flag ``(me, q)``, ``q`` the position of the
    program's first tile of that segment in the segment's order — after all its pushes,
    which the first release drains. A program's tiles of a segment sit at positions
    ``q, q + programs, ...`` on every rank alike (every rank runs the same grid over the
    same order), so the owner finds the flag of any of them at ``position mod programs``
    (:func:`_flag_index`)."""
    for step in range(0, world - 1):
        start = _first_tile_from(first, step * num_tiles)
        if start < (step + 1) * num_tiles:
            dl.notify(flags + me * num_tiles + start - step * num_tiles,
                      (me + 1 + step) % world, epoch, "set", "sys")


@triton.jit
def _flag_index(q, tiles_m, tiles_n, programs, GROUP_M: tl.constexpr,
                PROGRAM_FLAGS: tl.constexpr):
    """The flag that covers the tile at position ``q`` of a segment's tile order: the
    pushing program's (``PROGRAM_FLAGS``: ``q mod programs``, see
    :func:`_notify_owners`), else the tile's own (its row-major index)."""
    index = q % programs
    if not PROGRAM_FLAGS:
        local_m, pid_n = grouped_tile(q, tiles_m, tiles_n, GROUP_M)
        index = local_m * tiles_n + pid_n
    return index


@triton.jit
def _first_tile_from(first, lo):
    """The first of a persistent program's tiles ``first, first + programs, ...`` that is
    at least ``lo``."""
    behind = tl.maximum(lo - first, 0)
    return first + (behind + tl.num_programs(0) - 1) // tl.num_programs(0) * tl.num_programs(0)


@triton.jit
def _reduce_scatter_finish(acc, bias_ptr, c_ptr, slots, slots_desc, flags, segment, local_m,
                           pid_n, me, world, epoch, seg, N, tiles_m, tiles_n,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                           SUM_TMA: tl.constexpr):
    """A finished partial tile of ``segment``: pushed to its owner, or (the own segment)
    summed with the peers' partials (``tile_exchange.sum_own_tile``)."""
    local_tile = local_m * tiles_n + pid_n
    if world == 1:  # nothing to exchange (folds away when the rank count is compiled in)
        acc = apply_epilogue(acc, bias_ptr, pid_n, N, BLOCK_N, HAS_BIAS, ACTIVATION)
        store_tile(c_ptr, acc, local_m, pid_n, seg, N, N, 1, BLOCK_M, BLOCK_N)
    elif segment != me:
        push_tile(acc, slots, flags, segment, me, seg, N, local_m, pid_n, local_tile,
                  tiles_m * tiles_n, epoch, BLOCK_M, BLOCK_N)
    else:
        sum_own_tile(acc, c_ptr, slots, slots_desc, flags, me, world, seg, N, local_m, pid_n,
                     local_tile, tiles_m * tiles_n, epoch, bias_ptr, BLOCK_M, BLOCK_N, HAS_BIAS,
                     ACTIVATION, SUM_TMA)
