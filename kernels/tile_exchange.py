"""Partial GEMM output tiles exchanged through symmetric slots: the epilogues of
GEMM + ReduceScatter and GEMM + AllReduce.

Slots are ``[num_ranks, rows, cols]`` of the partials' element type (slot ``src`` holds rank
``src``'s partial, rounded from its float32 accumulator; ``fused.launch.partial_dtype``),
flags int32 ``[num_ranks, tiles]`` (flag ``(src, tile)``: "rank src's partial of tile has
landed"; a persistent kernel may instead raise one flag per program for all its pushes,
``NOTIFY=False`` here, at an index it defines, and pass that index as ``tile`` to the
waits), both already advanced to this call's epoch half. Every access forms its
addresses from the tile's indices, so no block of offsets or pointers stays live beside
the accumulator (a 128x128 float32 accumulator takes 64 registers per thread at 8 warps;
holding its offsets and mask too made the kernels spill), and sums run over row blocks of
the tile.
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.epilogue import apply_epilogue
from jax_triton_dist.kernels.exchange import notify_peers
from jax_triton_dist.kernels.gemm import load_tile, store_tile
from jax_triton_dist.swizzle import grouped_tile


@triton.jit
def push_tile(acc, slots, flags, peer, me, rows, cols, pid_m, pid_n, tile, num_tiles, epoch,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NOTIFY: tl.constexpr = True):
    """Stores ``acc`` (tile ``(pid_m, pid_n)``) into slot ``me`` of rank ``peer``, then
    raises flag ``(me, tile)`` there (``NOTIFY``; else the caller raises a flag that covers
    several pushes: each flag is a system-scope release, whose fence stalls the program)."""
    store_tile(dl.symm_at(slots, peer) + me * rows * cols, acc, pid_m, pid_n, rows, cols, cols,
               1, BLOCK_M, BLOCK_N)
    if NOTIFY:
        dl.notify(flags + me * num_tiles + tile, peer, epoch, "set", "sys")


@triton.jit
def keep_tile(acc, slots, me, rows, cols, pid_m, pid_n, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Stores ``acc`` (this rank's partial of the tile) into this rank's own slot, visible
    to the whole program afterwards; the accumulator's registers are free again."""
    store_tile(slots + me * rows * cols, acc, pid_m, pid_n, rows, cols, cols, 1, BLOCK_M,
               BLOCK_N)
    tl.debug_barrier()


@triton.jit
def forward_tile(slots, flags, peer, me, rows, cols, pid_m, pid_n, tile, num_tiles, epoch,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr = 2,
                 NOTIFY: tl.constexpr = True):
    """Copies this rank's kept partial of the tile (:func:`keep_tile`) into slot ``me`` of
    rank ``peer``, ``BLOCK_M / SPLIT`` rows at a time, then (``NOTIFY``; else the caller
    raises a flag that covers several copies) raises flag ``(me, tile)`` there. Holds no
    accumulator: for pushing one tile to many peers, one peer after the other, each flag
    raised as soon as its copy is out. (Reading each block back once and storing it to
    every peer before the first flag — fewer reads — ran 11-15% slower at 8 ranks sharing
    an H100: BENCHMARKS.md, 2026-12-07 tenth session.)"""
    _copy_tile(dl.symm_at(slots, peer) + me * rows * cols, slots + me * rows * cols, rows, cols,
               pid_m, pid_n, BLOCK_M, BLOCK_N, SPLIT)
    if NOTIFY:
        dl.notify(flags + me * num_tiles + tile, peer, epoch, "set", "sys")


@triton.jit
def share_partial(acc, slots, flags, me, world, rows, cols, pid_m, pid_n, tile, num_tiles,
                  epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  NOTIFY: tl.constexpr = True):
    """Keeps ``acc`` (this rank's partial of the tile) in slot ``me`` (:func:`keep_tile`)
    and copies it into slot ``me`` of every other rank, ``me + 1`` first. ``NOTIFY``: each
    copy read back from the own slot (:func:`forward_tile`, which holds no accumulator) and
    flag ``(me, tile)`` raised at each as its copy is out. Without it (the caller raises
    flags that cover the copies) the partial, rounded to the slots' type once, is stored
    from registers into every slot: no read-back, whose loads, one after the other, left a
    persistent GEMM+AR program waiting on memory for each peer of each tile."""
    if NOTIFY:
        keep_tile(acc, slots, me, rows, cols, pid_m, pid_n, BLOCK_M, BLOCK_N)
        for i in range(1, world):
            forward_tile(slots, flags, (me + i) % world, me, rows, cols, pid_m, pid_n, tile,
                         num_tiles, epoch, BLOCK_M, BLOCK_N)
    else:
        partial = acc.to(slots.dtype.element_ty)
        keep_tile(partial, slots, me, rows, cols, pid_m, pid_n, BLOCK_M, BLOCK_N)
        for i in range(1, world):
            push_tile(partial, slots, flags, (me + i) % world, me, rows, cols, pid_m, pid_n,
                      tile, num_tiles, epoch, BLOCK_M, BLOCK_N, NOTIFY=False)


@triton.jit
def _copy_tile(dst, src, rows, cols, pid_m, pid_n, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Copies tile ``(pid_m, pid_n)`` of the ``[rows, cols]`` matrix at ``src`` to ``dst``,
    ``BLOCK_M / SPLIT`` rows at a time (no accumulator-sized block held; the parts
    unrolled, so that a loop of copies around it is the innermost loop, which Triton
    pipelines). Rows past ``rows`` are masked out: ``rows`` 0 copies nothing."""
    SUB: tl.constexpr = BLOCK_M // SPLIT
    for part in tl.static_range(SPLIT):
        sub_m = pid_m * SPLIT + part
        store_tile(dst, load_tile(src, sub_m, pid_n, rows, cols, cols, 1, SUB, BLOCK_N), sub_m,
                   pid_n, rows, cols, cols, 1, SUB, BLOCK_N)


@triton.jit
def wait_tile(flags, me, world, tile, num_tiles, epoch):
    """Acquires every peer's flag ``(src, tile)`` at ``epoch``: their partials of the tile
    have landed in this rank's slots."""
    for src in range(0, world):
        if src != me:
            dl.wait(flags + src * num_tiles + tile, 1, "sys", "acquire", epoch)


@triton.jit
def sum_tile(c_ptr, slots, flags, me, world, rows, cols, pid_m, pid_n, tile, num_tiles,
             epoch, bias_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SPLIT: tl.constexpr = 2,
             BROADCAST: tl.constexpr = False, WAITED: tl.constexpr = False,
             NOTIFY: tl.constexpr = True):
    """Stores into ``C`` the float32 sum, in rank order, of every rank's partial of the
    tile: this rank's kept one (:func:`keep_tile`) and the peers', each read once its flag
    reaches ``epoch``. Every rank summing a tile gets the same bits. Sums ``BLOCK_M /
    SPLIT`` rows at a time: 128x128 tiles at 8 warps fit in 128 registers a thread. The
    epilogue (``kernels/epilogue.py``) applies to the sum. ``BROADCAST``: the sum, as
    stored into ``C``, also goes into slot ``me`` of every other rank, and flag ``(me,
    tile)`` is raised there (:func:`copy_sum_tile` takes it from there; ``NOTIFY=False``:
    the caller raises flags that cover several sums). ``WAITED``: the caller has already
    acquired the peers' flags of the tile (:func:`wait_tile`)."""
    if not WAITED:
        wait_tile(flags, me, world, tile, num_tiles, epoch)
    SUB: tl.constexpr = BLOCK_M // SPLIT
    for part in range(0, SPLIT):
        sub_m = pid_m * SPLIT + part
        total = tl.zeros((SUB, BLOCK_N), dtype=tl.float32)
        # a pipelined loop: the next ranks' loads are in flight while one is added (one
        # after the other, a program waits on memory once per rank: sm_90a, three ahead;
        # their buffers reuse the K loop's shared memory)
        for src in tl.range(0, world, num_stages=4):
            total += load_tile(slots + src * rows * cols, sub_m, pid_n, rows, cols, cols, 1,
                               SUB, BLOCK_N).to(tl.float32)
        total = apply_epilogue(total, bias_ptr, pid_n, cols, BLOCK_N, HAS_BIAS, ACTIVATION)
        store_tile(c_ptr, total, sub_m, pid_n, rows, cols, cols, 1, SUB, BLOCK_N)
        if BROADCAST:  # rounded as C holds it, so every rank gets C's bits
            result = total.to(c_ptr.dtype.element_ty)
            for i in range(1, world):
                store_tile(dl.symm_at(slots, (me + i) % world) + me * rows * cols, result,
                           sub_m, pid_n, rows, cols, cols, 1, SUB, BLOCK_N)
    if BROADCAST and NOTIFY:
        notify_peers(flags + me * num_tiles + tile, me, world, epoch)


@triton.jit
def slots_descriptor(slots, world, rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tensor descriptor (TMA) of the slots as ``[num_ranks, rows, cols]``, moving one
    rank's ``[BLOCK_M, BLOCK_N]`` tile (rows of 16 bytes' multiple; past the edges zeros):
    made once per program, for :func:`sum_own_tile`."""
    return tl.make_tensor_descriptor(slots, shape=[world, rows, cols],
                                     strides=[rows * cols, cols, 1],
                                     block_shape=[1, BLOCK_M, BLOCK_N])


@triton.jit
def sum_own_tile(acc, c_ptr, slots, slots_desc, flags, me, world, rows, cols, pid_m, pid_n,
                 tile, num_tiles, epoch, bias_ptr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                 SUM_TMA: tl.constexpr, WAITED: tl.constexpr = False):
    """Stores into ``C`` the float32 sum of every rank's partial of the tile, this rank's
    being ``acc``; the epilogue applies to the sum. ``WAITED``: the caller has already
    acquired the peers' flags of the tile (:func:`wait_tile`).

    ``SUM_TMA`` (``slots_desc`` from :func:`slots_descriptor`): ``acc``, rounded to the
    slots' type as a pushed partial is, stays in registers and the peers' partials are
    added to it in rank order, each read through the descriptor, the next ones' reads in
    flight meanwhile (one after the other, they cost GEMM+RS 5-10% in the one-GPU proxy:
    BENCHMARKS.md) — no write and read-back
    of this rank's partial, and no block of addresses beside the accumulator (read through
    pointers, a whole 128x256 tile's addresses spill the float32 accumulator at 8 warps,
    ptxas for sm_90a; through the descriptor it fits: ``tests/test_cuda_compile.py``). This
    rank's partial comes first, so the order depends on the rank: for tiles that one rank
    alone sums (GEMM+RS's own segment). Otherwise :func:`keep_tile`, then
    :func:`sum_tile` (rank order: the same bits on every rank)."""
    if SUM_TMA:
        if not WAITED:
            wait_tile(flags, me, world, tile, num_tiles, epoch)
        total = acc.to(slots.dtype.element_ty).to(tl.float32)
        # the peers in rank order; a pipelined loop, so the next peers' bulk loads are in
        # flight while one is added (sm_90a: two loads ahead)
        for i in tl.range(0, world - 1, num_stages=3):
            src = i + (i >= me).to(tl.int32)
            part = slots_desc.load([src, pid_m * BLOCK_M, pid_n * BLOCK_N])
            total += part.reshape(BLOCK_M, BLOCK_N).to(tl.float32)
        total = apply_epilogue(total, bias_ptr, pid_n, cols, BLOCK_N, HAS_BIAS, ACTIVATION)
        store_tile(c_ptr, total, pid_m, pid_n, rows, cols, cols, 1, BLOCK_M, BLOCK_N)
    else:
        keep_tile(acc, slots, me, rows, cols, pid_m, pid_n, BLOCK_M, BLOCK_N)
        sum_tile(c_ptr, slots, flags, me, world, rows, cols, pid_m, pid_n, tile, num_tiles,
                 epoch, bias_ptr, BLOCK_M, BLOCK_N, HAS_BIAS, ACTIVATION, WAITED=WAITED)


@triton.jit
def copy_sum_tile(c_ptr, slots, flags, owner, rows, cols, pid_m, pid_n, tile, num_tiles,
                  epoch, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr = 2):
    """Copies into ``C`` the sum of tile ``(pid_m, pid_n)`` that rank ``owner`` pushed into
    slot ``owner`` (:func:`sum_tile` with ``BROADCAST``), once flag ``(owner, tile)``
    reaches ``epoch`` (a persistent program that acquires its owners' flags once copies
    its tiles with :func:`copy_owned_sums`)."""
    dl.wait(flags + owner * num_tiles + tile, 1, "sys", "acquire", epoch)
    _copy_tile(c_ptr, slots + owner * rows * cols, rows, cols, pid_m, pid_n, BLOCK_M, BLOCK_N,
               SPLIT)


@triton.jit
def tile_owner(tile, programs, num_tiles, world):
    """The rank that sums tile ``tile`` of ``num_tiles`` in a two-shot exchange whose grid
    has ``programs`` programs, program ``p`` taking tiles ``p, p + programs, ...``: the
    programs' lists of tiles laid end to end and dealt to the ranks in turn, so that each
    program's tiles, and all the tiles, are spread evenly over the ranks. With one program
    a tile this is ``tile % world``; in a persistent grid ``tile % world`` would give all
    of a program's tiles one owner whenever ``programs`` is a multiple of ``world`` (16
    programs a rank at 8 ranks, 66 at 2 on 132 SMs): a few programs of each rank would do
    every sum while the others waited for them."""
    p = tile % programs
    before = p * (num_tiles // programs) + tl.minimum(p, num_tiles % programs)
    return (before + tile // programs) % world


@triton.jit
def copy_owned_sums(c_ptr, slots, me, world, rows, cols, first, step, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr = 2):
    """Copies into ``C`` the sums of the tiles ``first, first + step, ...`` (grouped order)
    that other ranks own (:func:`tile_owner` in a grid of ``step`` programs), each from the
    slot its owner pushed it to (:func:`sum_tile` with ``BROADCAST``); the caller has
    acquired the owners' flags. One pipelined loop over the tiles, the next tiles' loads in
    flight while one is stored (one after the other, a program waits on memory for each
    tile); a tile this rank owns, whose sum is in ``C`` already, is masked out (no rows),
    so that no branch stops the pipelining."""
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(cols, BLOCK_N)
    for tile in tl.range(first, tiles_m * tiles_n, step, num_stages=3):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        owner = tile_owner(tile, step, tiles_m * tiles_n, world)
        _copy_tile(c_ptr, slots + owner * rows * cols, tl.where(owner == me, 0, rows), cols,
                   pid_m, pid_n, BLOCK_M, BLOCK_N, SPLIT)
