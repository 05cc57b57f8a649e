"""Attention across ranks: sequence-parallel flash attention (forward in one distributed
kernel, backward kernels for the gathered keys) and distributed flash-decode.

Layouts (per rank, contiguous): queries, keys, values and outputs ``[batch, seq, heads,
head_dim]`` (keys and values ``kv_heads`` heads; query head ``h`` reads key head
``h // (heads // kv_heads)``); log-sum-exps ``[batch, seq, heads]`` float32.

Sequence positions (for causal masks) depend on how the global sequence is split:
``ZIGZAG`` False: rank ``r`` holds positions ``[r * S, (r + 1) * S)``; True: the global
sequence is cut into ``2 * num_ranks`` chunks of ``S / 2`` and rank ``r`` holds chunks
``r`` and ``2 * num_ranks - 1 - r`` (so every rank has the same causal work).

Softmax runs online (flash attention) in float32 with base-2 exponentials; rows that see
no unmasked key get a zero output and a log-sum-exp of ``-inf``.
"""

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels.exchange import epoch_half, notify_peers

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def sequence_position(index, rank, world, S, ZIGZAG: tl.constexpr):
    """Global sequence position of local row ``index`` of ``rank`` (``S`` rows a rank)."""
    if ZIGZAG:
        chunk = S // 2
        first = index < chunk
        return tl.where(first, rank * chunk + index,
                        (2 * world - 1 - rank) * chunk + index - chunk)
    else:
        return rank * S + index


@triton.jit
def causal_key_rows(last_q, src, world, S, ZIGZAG: tl.constexpr):
    """How many of rank ``src``'s local key rows come at or before global position
    ``last_q``: they always form a prefix of its rows (in zigzag order the second chunk
    comes after the first)."""
    if ZIGZAG:
        chunk = S // 2
        first = tl.minimum(tl.maximum(last_q - src * chunk + 1, 0), chunk)
        second = tl.minimum(tl.maximum(last_q - (2 * world - 1 - src) * chunk + 1, 0), chunk)
        return first + second
    else:
        return tl.minimum(tl.maximum(last_q - src * S + 1, 0), S)


@triton.jit
def query_rows(pid, S, H, KVH, BLOCK_M: tl.constexpr):
    """Program ``pid``'s batch entry, query head, key/value head and query rows. The last
    query block comes first: under a causal mask it has the most keys to visit, and the
    lighter blocks then fill the device's tail."""
    blocks_m = tl.cdiv(S, BLOCK_M)
    bh = pid // blocks_m
    h = bh % H
    offs_m = (blocks_m - 1 - pid % blocks_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    return bh // H, h, h // (H // KVH), offs_m


@triton.jit
def online_softmax_step(acc, m_i, l_i, qk, v):
    """One key block of online softmax: ``qk`` (base-2 scaled scores, ``-inf`` where
    masked) against values ``v``; returns the updated ``(acc, m_i, l_i)``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _key_block(ptr, desc, offs_n, start, n_valid, rows_base, row_stride,
               HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``start + offs_n`` (``[BLOCK_N, HEAD_DIM]``) of a key or value matrix whose row
    ``j`` starts at ``ptr + rows_base + j * row_stride``; rows at or past ``n_valid`` read
    as zeros (``MASKED``; tensor descriptors zero-fill past the matrix on their own)."""
    if USE_TMA:
        return desc.load([start, 0])
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        rows = ptr + rows_base + (start + offs_n)[:, None] * row_stride + offs_d[None, :]
        if MASKED:
            return tl.load(rows, mask=(start + offs_n < n_valid)[:, None], other=0.0)
        else:
            return tl.load(rows)


@triton.jit
def _attend(acc, m_i, l_i, q, k_src, v_src, k_desc, v_desc, lo, hi, S, rows_base,
            row_stride, pos_q, src, world, qk_scale, HEAD_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
            ZIGZAG: tl.constexpr, USE_TMA: tl.constexpr):
    """Online softmax of ``q`` over rank ``src``'s key rows ``[lo, hi)`` (``lo`` a multiple
    of ``BLOCK_N``). ``MASKED`` False: every row in range is valid and causally visible
    to every query of the block (no mask is built: the hot loop); True: rows past ``S``
    and (``CAUSAL``) keys after a query's position are masked out."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k = _key_block(k_src, k_desc, offs_n, start, S, rows_base, row_stride, HEAD_DIM,
                       MASKED, USE_TMA)
        v = _key_block(v_src, v_desc, offs_n, start, S, rows_base, row_stride, HEAD_DIM,
                       MASKED, USE_TMA)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = (start + offs_n < S)[None, :]
            if CAUSAL:
                pos_k = sequence_position(start + offs_n, src, world, S, ZIGZAG)
                keep = keep & (pos_k[None, :] <= pos_q[:, None])
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i,
                                                tl.where(keep, qk * qk_scale, float("-inf")),
                                                v)
        else:
            # every score is finite: no guard for rows that have seen nothing
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def sequence_parallel_attention_kernel(
    # Pointers
    q_ptr,  # [B, S, H, D] this rank's queries
    k_ptr,  # [B, S, KVH, D] this rank's keys, staged in the symmetric heap by the runtime
    v_ptr,  # [B, S, KVH, D] this rank's values, staged likewise
    o_ptr,  # [B, S, H, D] attention of the local queries over the whole sequence
    lse_ptr,  # [B, S, H] float32 log-sum-exp of each row's scores (for the backward pass)
    flags_ptr,  # symmetric workspace int32 [2, num_ranks]: "rank s staged its keys, values"
    # Sizes
    B, S, H, KVH,
    scale,
    # Meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr, USE_TMA: tl.constexpr = False,
    SPLIT_MASKED: tl.constexpr = True,
):
    """Program ``(b, h, query block)``: flash attention over every rank's keys and values,
    this rank's first (local, no wait), then each peer's around the ring, read from the
    peer's symmetric copy once its flag has landed. Program 0 announces this rank's copy.

    Per rank (``SPLIT_MASKED``), two loops over key blocks: the blocks every query of the
    block sees whole (no mask built), then the rest up to the last key any of its queries
    sees (causal: the diagonal blocks; else the ragged tail past a multiple of
    ``BLOCK_N``); else one masked loop over them all (a smaller on-chip footprint). Causal
    blocks after the block's last query are never visited (loop bounds, not branches:
    Ascend's pipeline rejects a branch around the block's matmuls). ``USE_TMA``: keys and
    values move through tensor descriptors made here (CUDA; 16-byte aligned rows).
    """
    pid = tl.program_id(0)
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    flags = epoch_half(flags_ptr, epoch, world)
    if pid == 0:
        notify_peers(flags + me, me, world, epoch)

    b, h, kvh, offs_m = query_rows(pid, S, H, KVH, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + ((b * S + offs_m) * H + h)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_rows, mask=(offs_m < S)[:, None], other=0.0)
    pos_q = sequence_position(offs_m, me, world, S, ZIGZAG)
    pos_q = tl.where(offs_m < S, pos_q, -1)  # padded rows: no key is causal for them
    last_q = tl.max(pos_q, 0)
    first_q = tl.min(tl.where(offs_m < S, pos_q, last_q), 0)
    qk_scale = scale * LOG2E
    rows_base = (b * S * KVH + kvh) * HEAD_DIM  # row j of (b, kvh): rows_base + j * stride
    row_stride = KVH * HEAD_DIM

    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # ---- every rank's keys: my own first, then around the ring ----
    for i in range(0, world):
        src = (me + i) % world
        if src != me:
            dl.wait(flags + src, 1, "sys", "acquire", epoch)
        k_src = dl.symm_at(k_ptr, src)
        v_src = dl.symm_at(v_ptr, src)
        k_desc = k_src
        v_desc = v_src
        if USE_TMA:
            k_desc = tl.make_tensor_descriptor(k_src + rows_base, shape=[S, HEAD_DIM],
                                               strides=[row_stride, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])
            v_desc = tl.make_tensor_descriptor(v_src + rows_base, shape=[S, HEAD_DIM],
                                               strides=[row_stride, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])
        rows_end = S
        whole = S // BLOCK_N * BLOCK_N
        if CAUSAL:
            rows_end = causal_key_rows(last_q, src, world, S, ZIGZAG)
            whole = causal_key_rows(first_q, src, world, S, ZIGZAG) // BLOCK_N * BLOCK_N
        if SPLIT_MASKED:
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_src, v_src, k_desc, v_desc, 0, whole,
                                    S, rows_base, row_stride, pos_q, src, world, qk_scale,
                                    HEAD_DIM, BLOCK_N, False, CAUSAL, ZIGZAG, USE_TMA)
        else:
            whole = 0
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_src, v_src, k_desc, v_desc, whole,
                                rows_end, S, rows_base, row_stride, pos_q, src, world,
                                qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, ZIGZAG, USE_TMA)

    # ---- normalise; store the output and the log-sum-exp (natural log) ----
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    o_rows = o_ptr + ((b * S + offs_m) * H + h)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=(offs_m < S)[:, None])
    tl.store(lse_ptr + (b * S + offs_m) * H + h, lse, mask=offs_m < S)


@triton.jit
def _probabilities(scores, lse, keep, scale):
    """``softmax`` probabilities recomputed from raw scores (``q . k``) and the forward
    pass's log-sum-exps (broadcast to ``scores``' shape by the caller); zero where not
    ``keep`` and on rows that saw no key."""
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    return tl.where(keep, tl.exp2((scores * scale - lse_safe) * LOG2E), 0.0)


@triton.jit
def attention_bwd_delta_kernel(
    o_ptr, do_ptr,  # [rows, D] outputs and output gradients ([B, SQ, H, D] flattened)
    delta_ptr,  # [rows] float32: rowsum(dO * O)
    rows,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """The backward pass's per-row term ``delta = rowsum(dO * O)`` (float32), once per row
    before the gradient kernels, which then read one float a query row instead of a row
    of ``O`` in every inner iteration."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs < rows
    at = offs[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(o_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + offs, tl.sum(o * do, 1), mask=valid)


@triton.jit
def _query_block(q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, offs_m, SQ, H,
                 HEAD_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A block of query rows for the backward pass: queries (``[HEAD_DIM, BLOCK_M]`` when
    ``TRANSPOSED``, read so from memory), output gradients, the forward pass's
    log-sum-exps and ``delta`` (:func:`attention_bwd_delta_kernel`); zeros past ``SQ``."""
    valid_q = offs_m < SQ
    offs_d = tl.arange(0, HEAD_DIM)
    rows = ((b * SQ + offs_m) * H + h)[:, None] * HEAD_DIM + offs_d[None, :]
    if TRANSPOSED:
        columns = ((b * SQ + offs_m) * H + h)[None, :] * HEAD_DIM + offs_d[:, None]
        q = tl.load(q_ptr + columns, mask=valid_q[None, :], other=0.0)
    else:
        q = tl.load(q_ptr + rows, mask=valid_q[:, None], other=0.0)
    do = tl.load(do_ptr + rows, mask=valid_q[:, None], other=0.0)
    lse = tl.load(lse_ptr + (b * SQ + offs_m) * H + h, mask=valid_q, other=0.0)
    delta = tl.load(delta_ptr + (b * SQ + offs_m) * H + h, mask=valid_q, other=0.0)
    return q, do, lse, delta


@triton.jit
def attention_bwd_dkdv_kernel(
    # Pointers
    q_ptr, do_ptr,  # [B, SQ, H, D] this rank's queries and output gradients
    lse_ptr,  # [B, SQ, H] float32 (the forward pass's)
    delta_ptr,  # [B, SQ, H] float32 rowsum(dO * O) (attention_bwd_delta_kernel)
    k_ptr, v_ptr,  # [B, SK, KVH, D] every rank's keys and values (SK = num_ranks * SQ)
    dk_ptr, dv_ptr,  # [B, SK, KVH, D] float32: this rank's queries' share of their gradients
    # Sizes
    B, SQ, H, KVH,
    scale,
    # Meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr,
):
    """Program ``(b, kv head, rank src, key block of src's rows)``: the gradients of that
    key block from every query head of the group and every local query block. Row ``j``
    of the gathered keys is row ``j % SQ`` of rank ``j // SQ``. Causal: the local query
    blocks wholly before the block's first key are not visited (a loop bound). Works on
    transposed scores (keys by queries; queries read transposed) so that no computed
    block is transposed in registers; the softmax scale is applied to ``dK`` once."""
    pid = tl.program_id(0)
    me = dl.rank()
    world = dl.num_ranks()
    SK = world * SQ
    blocks_n = tl.cdiv(SQ, BLOCK_N)
    bkv = pid // (world * blocks_n)
    b = bkv // KVH
    kvh = bkv % KVH
    src = pid // blocks_n % world
    group = H // KVH
    offs_local = (pid % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = src * SQ + offs_local
    offs_d = tl.arange(0, HEAD_DIM)
    valid_k = offs_local < SQ
    pos_k = sequence_position(offs_local, src, world, SQ, ZIGZAG)
    kv_rows = ((b * SK + offs_n) * KVH + kvh)[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + kv_rows, mask=valid_k[:, None], other=0.0)
    v = tl.load(v_ptr + kv_rows, mask=valid_k[:, None], other=0.0)
    lo = 0
    if CAUSAL:
        # my query rows before the block's first key see none of it: they form a prefix
        first_k = tl.min(tl.where(valid_k, pos_k, tl.max(pos_k, 0)), 0)
        lo = causal_key_rows(first_k - 1, me, world, SQ, ZIGZAG) // BLOCK_M * BLOCK_M
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for g in range(0, group):
        h = kvh * group + g
        for start in range(lo, SQ, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            valid_q = offs_m < SQ
            pos_q = sequence_position(offs_m, me, world, SQ, ZIGZAG)
            q_t, do, lse, delta = _query_block(q_ptr, do_ptr, lse_ptr, delta_ptr, b, h,
                                               offs_m, SQ, H, HEAD_DIM, True)
            keep = valid_k[:, None] & valid_q[None, :]
            if CAUSAL:
                keep = keep & (pos_k[:, None] <= pos_q[None, :])
            p_t = _probabilities(tl.dot(k, q_t), lse[None, :], keep, scale)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do)).to(tl.float32)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t))
    tl.store(dk_ptr + kv_rows, dk * scale, mask=valid_k[:, None])
    tl.store(dv_ptr + kv_rows, dv, mask=valid_k[:, None])


@triton.jit
def attention_bwd_dq_kernel(
    # Pointers
    q_ptr, do_ptr,  # [B, SQ, H, D] this rank's queries and output gradients
    lse_ptr,  # [B, SQ, H] float32
    delta_ptr,  # [B, SQ, H] float32 rowsum(dO * O)
    k_ptr, v_ptr,  # [B, SK, KVH, D] every rank's keys and values (SK = num_ranks * SQ)
    dq_ptr,  # [B, SQ, H, D]: gradient of this rank's queries
    # Sizes
    B, SQ, H, KVH,
    scale,
    # Meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ZIGZAG: tl.constexpr,
):
    """Program ``(b, h, query block)``: the gradient of those queries over every key, rank
    by rank. Causal: only the prefix of each rank's key rows at or before the block's last
    query is visited (a loop bound)."""
    pid = tl.program_id(0)
    me = dl.rank()
    world = dl.num_ranks()
    SK = world * SQ
    b, h, kvh, offs_m = query_rows(pid, SQ, H, KVH, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    valid_q = offs_m < SQ
    pos_q = sequence_position(offs_m, me, world, SQ, ZIGZAG)
    last_q = tl.max(tl.where(valid_q, pos_q, -1), 0)
    q, do, lse, delta = _query_block(q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, offs_m, SQ, H,
                                     HEAD_DIM, False)
    rows = ((b * SQ + offs_m) * H + h)[:, None] * HEAD_DIM + offs_d[None, :]
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for src in range(0, world):
        rows_end = SQ
        if CAUSAL:
            rows_end = causal_key_rows(last_q, src, world, SQ, ZIGZAG)
        for start in range(0, rows_end, BLOCK_N):
            offs_local = start + tl.arange(0, BLOCK_N)
            valid_k = offs_local < SQ
            pos_k = sequence_position(offs_local, src, world, SQ, ZIGZAG)
            kv_rows = ((b * SK + src * SQ + offs_local) * KVH + kvh)[:, None] * HEAD_DIM \
                + offs_d[None, :]
            k = tl.load(k_ptr + kv_rows, mask=valid_k[:, None], other=0.0)
            v = tl.load(v_ptr + kv_rows, mask=valid_k[:, None], other=0.0)
            keep = valid_q[:, None] & valid_k[None, :]
            if CAUSAL:
                keep = keep & (pos_k[None, :] <= pos_q[:, None])
            p = _probabilities(tl.dot(q, tl.trans(k)), lse[:, None], keep, scale)
            dp = tl.dot(do, tl.trans(v)).to(tl.float32)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + rows, (dq * scale).to(dq_ptr.dtype.element_ty), mask=valid_q[:, None])


@triton.jit
def flash_decode_kernel(
    # Pointers
    q_ptr,  # [B, H, D] the queries (the same on every rank)
    k_ptr, v_ptr,  # [B, S, KVH, D] this rank's slice of the key and value caches
    lengths_ptr,  # [B] int32 valid cache length of each batch row (whole sequence)
    o_ptr,  # [B, H, D] attention over the whole cache (every rank gets it)
    slots_o_ptr,  # symmetric workspace float32 [2, num_ranks, B, H, D]: ranks' partials
    slots_lse_ptr,  # symmetric workspace float32 [2, num_ranks, B, H]: their log-sum-exps
    flags_ptr,  # symmetric workspace int32 [2, num_ranks, B * KVH]
    # Sizes
    B, S, H, KVH,
    scale,
    # Meta-parameters
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``(b, kv head)``: the group's query heads over this rank's valid cache rows
    (partial output and log-sum-exp), pushed to every rank; then every rank's partials
    of that group combined by their log-sum-exps (rank order: the same bits everywhere).
    ``GROUP``: query heads per kv head, padded to a power of two of at least 16."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    slots_o = epoch_half(slots_o_ptr, epoch, world * B * H * HEAD_DIM)
    slots_lse = epoch_half(slots_lse_ptr, epoch, world * B * H)
    flags = epoch_half(flags_ptr, epoch, world * programs)
    b = pid // KVH
    kvh = pid % KVH
    heads = H // KVH
    offs_g = tl.arange(0, GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    valid_g = offs_g < heads
    h = kvh * heads + offs_g
    q = tl.load(q_ptr + (b * H + h)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=valid_g[:, None], other=0.0)
    local = tl.minimum(tl.maximum(tl.load(lengths_ptr + b) - me * S, 0), S)  # my valid rows

    # ---- this rank's partial attention over its valid rows ----
    acc = tl.zeros((GROUP, HEAD_DIM), dtype=tl.float32)
    m_i = tl.full((GROUP,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP,), dtype=tl.float32)
    for start in range(0, S, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        rows = ((b * S + offs_n) * KVH + kvh)[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + rows, mask=(offs_n < local)[:, None], other=0.0)
        v = tl.load(v_ptr + rows, mask=(offs_n < local)[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * (scale * LOG2E)
        qk = tl.where((offs_n < local)[None, :], qk, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, v)
    seen = l_i > 0.0
    partial = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))

    # ---- push it into slot `me` of every rank (mine included), raise flag (me, pid) ----
    o_rows = (b * H + h)[:, None] * HEAD_DIM + offs_d[None, :]
    for i in range(0, world):
        peer = (me + i) % world
        tl.store(dl.symm_at(slots_o + me * B * H * HEAD_DIM + o_rows, peer), partial,
                 mask=valid_g[:, None])
        tl.store(dl.symm_at(slots_lse + me * B * H + b * H + h, peer), lse, mask=valid_g)
        dl.notify(flags + me * programs + pid, peer, epoch, "set", "sys")

    # ---- combine every rank's partial, weighted by exp(lse_r - max lse) ----
    top = tl.full((GROUP,), float("-inf"), dtype=tl.float32)
    for src in range(0, world):
        token = dl.wait(flags + src * programs + pid, 1, "sys", "acquire", epoch)
        lse_src = tl.load(dl.consume_token(slots_lse + src * B * H + b * H + h, token),
                          mask=valid_g, other=float("-inf"))
        top = tl.maximum(top, lse_src)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((GROUP, HEAD_DIM), dtype=tl.float32)
    weight = tl.zeros((GROUP,), dtype=tl.float32)
    for src in range(0, world):
        lse_src = tl.load(slots_lse + src * B * H + b * H + h, mask=valid_g,
                          other=float("-inf"))
        w = tl.exp(lse_src - top_safe)
        part = tl.load(slots_o + src * B * H * HEAD_DIM + o_rows, mask=valid_g[:, None],
                       other=0.0)
        total += w[:, None] * part
        weight += w
    out = total / tl.where(weight > 0.0, weight, 1.0)[:, None]
    tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=valid_g[:, None])
