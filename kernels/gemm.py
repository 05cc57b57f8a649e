"""GEMM tiles: the matrix work inside the fused GEMM + communication ops."""

import triton
import triton.language as tl

from jax_triton_dist.swizzle import grouped_tile


@triton.jit
def tile_descriptor(ptr, rows, cols, stride_row, stride_col,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A tensor descriptor (TMA) of the ``[rows, cols]`` matrix at ``ptr`` moving
    ``[BLOCK_R, BLOCK_C]`` blocks: unit ``stride_col``, 16-byte aligned rows; blocks past
    the edges read as zeros. Made in the kernel: once per program where every tile reads
    the same matrix (the descriptor is written to global scratch and fenced)."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[stride_row, stride_col],
                                     block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def weight_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, B_NK: tl.constexpr):
    """The :func:`tile_descriptor` of a weight ``B`` (element ``(k, n)`` at ``k * stride_bk +
    n * stride_bn``) as it lies in memory: ``[K, N]`` moving ``[BLOCK_K, BLOCK_N]`` blocks,
    or (``B_NK``: stored ``[N, K]``, unit ``stride_bk``) ``[N, K]`` moving ``[BLOCK_N,
    BLOCK_K]`` blocks, which :func:`matmul_tile_tma` transposes in shared memory."""
    if B_NK:  # (one return: Triton visits the code after a constexpr branch that returns)
        desc = tile_descriptor(b_ptr, N, K, stride_bn, stride_bk, BLOCK_N, BLOCK_K)
    else:
        desc = tile_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N)
    return desc


@triton.jit
def matmul_tile_tma(a_desc, b_desc, row, col, k_start, k_end,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    B_NK: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False):
    """``A[row:row + BLOCK_M, k_start:k_end] @ B[k_start:k_end, col:col + BLOCK_N]``
    accumulated in float32 (``k_start`` a multiple of ``BLOCK_K``; ``0, K`` for the whole
    tile), A and B read through descriptors (A's blocks ``[BLOCK_M, BLOCK_K]``; B's as
    :func:`weight_descriptor` makes them for ``B_NK``; blocks past K read as zeros).

    ``WARP_SPECIALIZE``: the K loop is warp-specialized — on sm_90 Triton 3.6 does it for
    kernels compiled with ``num_warps=4`` only, and then gives the kernel a producer warp
    group issuing the bulk tensor loads and two consumer warp groups splitting the tile's
    rows (12 warps in all), as cuBLAS's Hopper kernels are built; with other warp counts,
    or a run-time ``if`` that has an ``else`` anywhere in the kernel, the loop stays as it
    is (checked by ``tests/test_gemm.py``)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        b = b_desc.load([col, k]).T if B_NK else b_desc.load([k, col])
        acc = tl.dot(a_desc.load([row, k]), b, acc)
    return acc


@triton.jit
def matmul_tile(
    a_ptr, b_ptr,  # A [M, K], B [K, N]
    pid_m, pid_n,
    M, N, k_start, k_end,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``A[pid_m tile, k_start:k_end] @ B[k_start:k_end, pid_n tile]`` accumulated in
    float32 (``0, K`` for the whole tile), through pointers (rows past ``M`` wrap around:
    mask them when storing)."""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    return _mma(a_ptr + offs_m[:, None] * stride_am, b_ptr, pid_n, N, k_start, k_end,
                stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def matmul_rows_tile(
    a_ptr, b_ptr,  # A: rows (i // R) * S + i % R of a [*, K] array; B [K, N]
    pid_m, pid_n,
    M, N, k_start, k_end, R, S,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """:func:`matmul_tile` of ``M`` rows taken ``R`` at a time every ``S`` rows (a block of
    each batch of a ``[batch, S, K]`` array)."""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rows = (offs_m // R) * S + offs_m % R
    return _mma(a_ptr + rows[:, None] * stride_am, b_ptr, pid_n, N, k_start, k_end,
                stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _mma(a_rows, b_ptr, pid_n, N, k_start, k_end, stride_ak, stride_bk, stride_bn,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of a tile over columns ``k_start:k_end`` of A: ``a_rows`` points at the
    tile's rows of A (first column)."""
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_rows + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_end - k_start, BLOCK_K)):
        k_left = k_end - k_start - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores a float32 tile into ``C`` (converted to C's element type), masked at edges."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_rows_tile(c_ptr, acc, pid_m, pid_n, M, N, R, S, stride_cm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`store_tile` into rows ``(i // R) * S + i % R`` of ``C`` (a block of each batch
    of a ``[batch, S, N]`` array)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = (offs_m // R) * S + offs_m % R
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_tile(c_ptr, pid_m, pid_n, M, N, stride_cm, stride_cn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Loads tile ``(pid_m, pid_n)`` of ``C`` (zeros past the edges)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    return tl.load(c_ptrs, mask=mask, other=0.0)


@triton.jit
def matmul_kernel(
    # Pointers
    a_ptr, b_ptr, c_ptr,
    # Sizes
    M, N, K,
    # Strides
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False, SUBTILE: tl.constexpr = False,
):
    """``C = A @ B``, one output tile per program in grouped (L2-friendly) order; or
    (``PERSISTENT``) fewer programs, each looping over tiles ``program, program + programs,
    ...`` of that order. ``USE_TMA``: A and B through tensor descriptors made once per
    program, as the fused kernels read their weights. ``FLATTEN`` (persistent, with
    ``USE_TMA``): the tile loop and the K loop are flattened into one software-pipelined
    loop, so a tile's first loads overlap the previous tile's last MMAs and its store.
    ``TMA_STORE`` (with ``USE_TMA``): output tiles go out through a descriptor of C (a bulk
    asynchronous copy from shared memory, clipped at the edges) instead of per-thread
    stores. ``WARP_SPECIALIZE`` (with ``USE_TMA`` and ``TMA_STORE``, not ``FLATTEN``;
    ``num_warps=4``): the K loop warp-specialized (:func:`matmul_tile_tma`). It needs
    ``TMA_STORE``: on an H100 with Triton 3.6 the warp-specialized tile stored through
    per-thread stores gave wrong products (relative error 0.7-1.1 at every benchmark shape,
    BENCHMARKS.md), through the descriptor the right ones. ``SUBTILE`` (with
    ``TMA_STORE``): each output tile goes out as two ``[BLOCK_M, BLOCK_N / 2]`` halves, so
    its staging buffer takes half the shared memory, which leaves room for a fourth stage
    of 128x256x64 operand blocks (:func:`jax_triton_dist.tiles.gemm_shared_bytes`)."""
    tl.static_assert(TMA_STORE or not SUBTILE, "matmul_kernel: SUBTILE needs TMA_STORE")
    tl.static_assert(TMA_STORE or not WARP_SPECIALIZE,
                     "matmul_kernel: WARP_SPECIALIZE needs TMA_STORE (Triton 3.6 on sm_90 "
                     "miscompiles the warp-specialized tile's per-thread stores)")
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    step = tl.num_programs(0) if PERSISTENT else tiles_m * tiles_n
    if USE_TMA:
        a_desc, b_desc, c_desc = _descriptors(a_ptr, b_ptr, c_ptr, M, N, K, stride_am,
                                              stride_ak, stride_bk, stride_bn, stride_cm,
                                              stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, TMA_STORE,
                                              SUBTILE)
        _tma_tiles(a_desc, b_desc, c_desc, c_ptr, tl.program_id(0), step, M, N, K, stride_cm,
                   stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FLATTEN, TMA_STORE,
                   WARP_SPECIALIZE, SUBTILE)
    else:
        _pointer_tiles(a_ptr, b_ptr, c_ptr, tl.program_id(0), step, M, N, K, stride_am,
                       stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                       BLOCK_K, GROUP_M)


@triton.jit
def _pointer_tiles(a_ptr, b_ptr, c_ptr, first, step, M, N, K, stride_am, stride_ak, stride_bk,
                   stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Whole tiles ``first, first + step, ...`` of the grouped order, through pointers."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(first, tiles_m * tiles_n, step):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = matmul_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, 0, K, stride_am, stride_ak,
                          stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
        store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


@triton.jit
def _descriptors(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TMA_STORE: tl.constexpr,
                 SUBTILE: tl.constexpr = False):
    """Tensor descriptors of A, B and (:func:`output_descriptor`) C, once per program."""
    a_desc = tile_descriptor(a_ptr, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K)
    b_desc = tile_descriptor(b_ptr, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N)
    c_desc = output_descriptor(c_ptr, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, TMA_STORE,
                               SUBTILE)
    return a_desc, b_desc, c_desc


@triton.jit
def output_descriptor(c_ptr, M, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr,
                      SUBTILE: tl.constexpr = False):
    """What :func:`store_output` stores through: with ``TMA_STORE`` a tensor descriptor of
    the ``[M, N]`` output moving ``[BLOCK_M, BLOCK_N]`` blocks (``SUBTILE``: halves of
    them, ``BLOCK_N / 2`` columns), else C's pointer."""
    c_desc = c_ptr
    if TMA_STORE:
        c_desc = tile_descriptor(c_ptr, M, N, stride_cm, stride_cn, BLOCK_M,
                                 BLOCK_N // 2 if SUBTILE else BLOCK_N)
    return c_desc


@triton.jit
def split_columns(tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(tile[:, :BLOCK_N / 2], tile[:, BLOCK_N / 2:])`` of a ``[BLOCK_M, BLOCK_N]`` tile."""
    halves = tl.permute(tl.reshape(tile, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(halves)


@triton.jit
def store_output(c_desc, c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr,
                 SUBTILE: tl.constexpr = False):
    """A finished float32 tile into C: through C's :func:`output_descriptor`
    (``TMA_STORE``; in two halves of ``BLOCK_N / 2`` columns with ``SUBTILE``) or
    :func:`store_tile`."""
    if TMA_STORE:
        if SUBTILE:
            left, right = split_columns(acc, BLOCK_M, BLOCK_N)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(c_ptr.dtype.element_ty))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2],
                         right.to(c_ptr.dtype.element_ty))
        else:
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_ptr.dtype.element_ty))
    else:
        store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


@triton.jit
def _tma_tiles(a_desc, b_desc, c_desc, c_ptr, first, step, M, N, K, stride_cm, stride_cn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
               WARP_SPECIALIZE: tl.constexpr, SUBTILE: tl.constexpr = False):
    """Whole tiles ``first, first + step, ...`` of the grouped order, read through
    descriptors (``FLATTEN``: the tile and K loops pipelined as one; ``WARP_SPECIALIZE``:
    the K loop warp-specialized)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(first, tiles_m * tiles_n, step, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = matmul_tile_tma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, K,
                              BLOCK_M, BLOCK_N, BLOCK_K, False, WARP_SPECIALIZE)
        store_output(c_desc, c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
                     BLOCK_M, BLOCK_N, TMA_STORE, SUBTILE)


@triton.jit
def matmul_stream_k_kernel(
    # Pointers
    a_ptr, b_ptr, c_ptr,
    partial_ptr,  # workspace float32 [programs, SLOTS, BLOCK_M, BLOCK_N]: shares of tiles
    counts_ptr,  # workspace int32 [tiles]: K blocks done per tile (zero between calls)
    # Sizes
    M, N, K,
    # Strides
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
    USE_TMA: tl.constexpr = True, IN_STEP: tl.constexpr = False, SLOTS: tl.constexpr = 2,
):
    """``C = A @ B`` by a persistent grid (hybrid stream-K), A and B through tensor
    descriptors (or, without ``USE_TMA``, pointers; ``FLATTEN`` and ``TMA_STORE`` need
    descriptors): the tiles that would form a last, partial wave (``tiles % programs`` of
    them, the first of the grouped order; all tiles when there are fewer tiles than
    programs) are cut into their K blocks, and each program takes an equal run of those
    blocks (:func:`stream_k_runs`), its shares of tiles merged by :func:`stream_k_share`
    and :func:`stream_k_sum`;
    then every program takes whole tiles of the rest as :func:`matmul_kernel`'s persistent
    form does. So no program idles through a last wave, and none waits for another.
    ``IN_STEP``: the split tiles' K blocks are shared out so that the programs move through
    K together (:func:`stream_k_split`: each split tile's first blocks to a program of its
    own, the rest of every split tile in runs to the other programs), where the runs above
    start at staggered K offsets; ``SLOTS``: shares per program the partial workspace holds
    (:func:`jax_triton_dist.tiles.stream_k_slots`; 2 without ``IN_STEP``).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    blocks = tl.cdiv(K, BLOCK_K)
    a_desc, b_desc, c_desc = a_ptr, b_ptr, c_ptr
    if USE_TMA:
        a_desc, b_desc, c_desc = _descriptors(a_ptr, b_ptr, c_ptr, M, N, K, stride_am,
                                              stride_ak, stride_bk, stride_bn, stride_cm,
                                              stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, TMA_STORE)
    split_tiles, block, end, head, heads, share, extra = stream_k_split(
        pid, programs, tiles_m * tiles_n, blocks, IN_STEP)
    first_tile = block // blocks  # (without IN_STEP; the tile of a run's first block)
    if IN_STEP:
        first_tile, _, _ = split_chunk(block, block + 1, blocks, split_tiles, head)
    while block < end:
        if IN_STEP:
            tile, k_first, k_last = split_chunk(block, end, blocks, split_tiles, head)
        else:
            tile, k_first, k_last = stream_k_chunk(block, end, blocks)
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        k_start, k_end = k_columns(k_first, k_last, K, BLOCK_K, True)
        if USE_TMA:
            acc = matmul_tile_tma(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_start,
                                  k_end, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = matmul_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, k_start, k_end, stride_am,
                              stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
        if (k_first == 0) & (k_last == blocks):
            store_output(c_desc, c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn,
                         BLOCK_M, BLOCK_N, TMA_STORE)
        elif share_tile(acc, partial_ptr, counts_ptr, pid * SLOTS + tile - first_tile, tile,
                        k_last - k_first, blocks, BLOCK_M, BLOCK_N):
            SUB: tl.constexpr = BLOCK_M // 4
            for part in range(0, 4):
                total = sum_shares(partial_ptr, tile, blocks, head, heads, share, extra,
                                   part * SUB, SLOTS, SUB, BLOCK_M, BLOCK_N)
                store_tile(c_ptr, total, pid_m * 4 + part, pid_n, M, N, stride_cm, stride_cn,
                           SUB, BLOCK_N)
        block += k_last - k_first
    if USE_TMA:
        _tma_tiles(a_desc, b_desc, c_desc, c_ptr, split_tiles + pid, programs, M, N, K,
                   stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FLATTEN, TMA_STORE,
                   False)
    else:
        _pointer_tiles(a_ptr, b_ptr, c_ptr, split_tiles + pid, programs, M, N, K, stride_am,
                       stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, BLOCK_M, BLOCK_N,
                       BLOCK_K, GROUP_M)


@triton.jit
def _run_start(p, share, extra):
    """First K block of program ``p``'s run (runs of ``share + 1`` blocks, then ``share``)."""
    return p * share + tl.minimum(p, extra)


@triton.jit
def _run_of(block, share, extra):
    """The program whose run holds K block ``block`` (the inverse of :func:`_run_start`)."""
    long_runs = extra * (share + 1)
    p = block // (share + 1)
    if block >= long_runs:
        p = extra + (block - long_runs) // tl.maximum(share, 1)
    return p


@triton.jit
def stream_k_split(pid, programs, tiles, blocks, IN_STEP: tl.constexpr = False):
    """Stream-K's split of ``tiles`` output tiles of ``blocks`` K blocks each over
    ``programs`` programs: ``(split_tiles, start, end, head, heads, share, extra)``. The
    first ``split_tiles`` tiles (``tiles % programs``: those of a partial last wave) are
    cut into K blocks; program ``pid`` takes blocks ``start:end`` of their numbering
    (:func:`split_chunk` reads a block's tile and K block) and then whole tiles
    ``split_tiles + pid``, ``+ programs``, ... Without ``IN_STEP`` (``head`` 0) the blocks
    are numbered tile by tile and shared out in runs of ``share + 1`` blocks to the first
    ``extra`` programs, then ``share``: at most one tile's blocks, so a run meets at most
    two tiles, and the runs start at staggered K offsets. ``IN_STEP``: each split tile's
    first ``head`` blocks (``split_tiles * blocks // programs``, when that is not 0) go to a
    program of their own (``heads`` programs, tile ``pid`` for program ``pid``), numbered
    first; the rest of every split tile (its tail), numbered tail by tail, go in runs as
    above to the other programs; so the programs of the split move through K in step."""
    split_tiles = tiles % programs
    head = 0
    heads = 0
    if IN_STEP:
        head = split_tiles * blocks // programs
        heads = tl.where(head > 0, split_tiles, 0)
    tails = split_tiles * (blocks - head)
    share = tails // (programs - heads)
    extra = tails % (programs - heads)
    start = pid * head
    end = start + head
    if pid >= heads:
        start = heads * head + _run_start(pid - heads, share, extra)
        end = heads * head + _run_start(pid - heads + 1, share, extra)
    return split_tiles, start, end, head, heads, share, extra


@triton.jit
def stream_k_runs(pid, programs, tiles, blocks):
    """:func:`stream_k_split` without ``IN_STEP`` (the fused kernels' split):
    ``(split_tiles, start, end, share, extra)``; blocks numbered tile by tile
    (:func:`stream_k_chunk`)."""
    split_tiles, start, end, head, heads, share, extra = stream_k_split(pid, programs, tiles,
                                                                        blocks)
    return split_tiles, start, end, share, extra


@triton.jit
def k_columns(k_first, k_last, K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """Columns ``k_start, k_end`` of A read for K blocks ``k_first:k_last`` (``SPLIT``: a
    stream-K share), else for the whole tile (``0, K``)."""
    k_start = 0
    k_end = K
    if SPLIT:
        k_start = k_first * BLOCK_K
        k_end = tl.minimum(k_last * BLOCK_K, K)
    return k_start, k_end


@triton.jit
def split_chunk(block, end, blocks, split_tiles, head):
    """``(tile, k_first, k_last)``: the tile of block ``block`` of :func:`stream_k_split`'s
    numbering and its K blocks ``k_first:k_last`` in the run up to ``end``."""
    heads_end = split_tiles * head
    if block < heads_end:
        tile = block // tl.maximum(head, 1)
        k_first = block - tile * head
        k_last = tl.minimum(head, k_first + end - block)
    else:
        tail = blocks - head
        tile = (block - heads_end) // tail
        k_first = head + block - heads_end - tile * tail
        k_last = tl.minimum(blocks, k_first + end - block)
    return tile, k_first, k_last


@triton.jit
def stream_k_chunk(block, end, blocks):
    """:func:`split_chunk` of the numbering tile by tile (no heads: :func:`stream_k_runs`)."""
    tile = block // blocks
    k_first = block - tile * blocks
    return tile, k_first, tl.minimum(blocks, k_first + end - block)


@triton.jit
def share_tile(acc, partial_ptr, counts_ptr, slot, tile, count, blocks,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes a program's float32 share ``acc`` of ``tile`` (``count`` of its K blocks, not
    all) into ``slot`` of ``partial_ptr`` (float32 ``[slots, BLOCK_M, BLOCK_N]``) and adds
    ``count`` to the tile's count (``counts_ptr``, int32 per tile, zero between calls).
    True for the program that completes the count: it has reset the count and sums the
    shares (:func:`sum_shares`). No program waits."""
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(partial_ptr + slot * BLOCK_M * BLOCK_N + offsets, acc)
    tl.debug_barrier()  # every thread's share is written before the count moves
    done = tl.atomic_add(counts_ptr + tile, count, sem="acq_rel")
    complete = done + count == blocks
    if complete:
        tl.atomic_xchg(counts_ptr + tile, 0, sem="relaxed")  # for the next call
    return complete


@triton.jit
def stream_k_share(acc, partial_ptr, counts_ptr, pid, tile, k_first, k_last, blocks, share,
                   extra, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`share_tile` of program ``pid``'s share of ``tile`` (K blocks
    ``k_first:k_last`` of :func:`stream_k_runs`' split) into its slot of ``partial_ptr``
    (float32 ``[programs, 2, BLOCK_M, BLOCK_N]``: its run's first and second tile)."""
    slot = 2 * pid + tile - _run_start(pid, share, extra) // blocks
    return share_tile(acc, partial_ptr, counts_ptr, slot, tile, k_last - k_first, blocks,
                      BLOCK_M, BLOCK_N)


@triton.jit
def sum_shares(partial_ptr, tile, blocks, head, heads, share, extra, row, SLOTS: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``row:row + ROWS`` of the float32 sum of ``tile``'s shares under
    :func:`stream_k_split`'s split (program ``p``'s shares in slots ``p * SLOTS``, ``+ 1``,
    ... in the order of its run), head first, then the tail's runs in program order (the
    same sum whichever program completed the tile)."""
    offsets = (row + tl.arange(0, ROWS))[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    if heads > 0:
        total += tl.load(partial_ptr + tile * SLOTS * BLOCK_M * BLOCK_N + offsets,
                         cache_modifier=".cg")
    tail = blocks - head
    for q in range(_run_of(tile * tail, share, extra),
                   _run_of(tile * tail + tail - 1, share, extra) + 1):
        slot = (heads + q) * SLOTS + tile - _run_start(q, share, extra) // tail
        total += tl.load(partial_ptr + slot * BLOCK_M * BLOCK_N + offsets, cache_modifier=".cg")
    return total


@triton.jit
def stream_k_sum(partial_ptr, tile, blocks, share, extra, row, ROWS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`sum_shares` of :func:`stream_k_runs`' split (two slots per program)."""
    return sum_shares(partial_ptr, tile, blocks, 0, 0, share, extra, row, 2, ROWS, BLOCK_M,
                      BLOCK_N)


@triton.jit
def matmul_split_k_kernel(
    # Pointers
    a_ptr, b_ptr, c_ptr,
    partial_ptr,  # workspace float32 [M, N]: the splits' sum (zero between calls)
    counts_ptr,  # workspace int32 [tiles]: splits done per tile (zero between calls)
    # Sizes
    M, N, K,
    # Strides
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    # Meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """``C = A @ B`` with the K dimension split over ``SPLIT_K`` programs per output tile
    (for few, deep tiles: decode shapes). Each split adds its float32 partial into the
    tile's sum atomically; the split that completes the tile (its count reaches
    ``SPLIT_K``) stores C and zeroes the sum and the count for the next call."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = pid % (tiles_m * tiles_n)
    split = pid // (tiles_m * tiles_n)
    pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)

    # ---- this split's share of K ----
    k_blocks = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_start = split * k_blocks * BLOCK_K
    k_len = tl.minimum(k_blocks * BLOCK_K, K - k_start)
    acc = matmul_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, k_start, k_start + k_len, stride_am,
                      stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)

    # ---- add it to the tile's sum; the last split of this call finishes the tile ----
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    sums = partial_ptr + rows[:, None] * N + cols[None, :]
    tl.atomic_add(sums, acc, mask=mask, sem="relaxed")
    tl.debug_barrier()  # every thread's share is added before the count moves
    done = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel") + 1
    if done == SPLIT_K:
        tl.atomic_xchg(counts_ptr + tile, 0, sem="relaxed")  # for the next call
        total = tl.load(sums, mask=mask, other=0.0, cache_modifier=".cg")
        c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(sums, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=mask)
