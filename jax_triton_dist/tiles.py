"""Block and tile choices of the ops' kernels, per compile target.

Pure Python (Triton's integer helpers only): the JAX wrappers (collectives, fused GEMM
ops, MoE) and the Ascend lowering (``jax_triton_dist.ascend``, which runs where JAX is not
installed) take their kernels' constexprs from here, so a kernel is lowered for Ascend
with the constexprs the op really uses.
"""

from __future__ import annotations

import triton

__all__ = ["TARGETS", "MAX_EXCHANGE_BLOCK", "exchange_block", "exchange_configs", "gemm_tiles",
           "gemm_configs", "gemm_shared_bytes", "fill_programs", "split_k_configs",
           "stream_k_configs", "gemm_tile_configs",
           "attention_blocks", "attention_configs", "attention_delta_rows",
           "moe_dispatch_blocks", "moe_combine_blocks"]

TARGETS = ("cuda", "ascend")
MAX_EXCHANGE_BLOCK = 4096

# Programs that fill the device: one per SM of an H100/H200 (132); one per AI core of an
# Ascend 910B (20: the cube core count of its target description).
_FILL_PROGRAMS = {"cuda": 132, "ascend": 20}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for problems that fill the device, and for decode
# shapes (more, smaller tiles). Ascend's on-chip unified buffer is 192 KiB: its
# bishengir-compile reports "ub overflow" for 128x128x64 and 64x64x128 (measured), so its
# tiles halve BLOCK_K.
_GEMM_TILES = {
    "cuda": {"large": (128, 128, 64, 8), "decode": (64, 64, 128, 4)},
    "ascend": {"large": (128, 128, 32, 4), "decode": (64, 64, 64, 4)},
}


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")


def exchange_block(n: int) -> tuple[int, int]:
    """``(BLOCK, programs)`` of the push-exchange and two-shot kernels for ``n`` elements
    per block: one program per ``BLOCK`` elements, ``BLOCK`` at most 4096."""
    block = min(triton.next_power_of_2(max(n, 1)), MAX_EXCHANGE_BLOCK)
    return block, triton.cdiv(max(n, 1), block)


def exchange_configs(n: int, target: str = "cuda") -> list[dict[str, int]]:
    """The autotuner's configs of the exchange kernels for ``n`` elements per block:
    :func:`exchange_block`'s ``BLOCK`` with 4 warps first, then (CUDA) smaller blocks and
    8 warps, without repeats. Each is ``{"BLOCK": ..., "num_warps": ...}``."""
    _check_target(target)
    first = {"BLOCK": exchange_block(n)[0], "num_warps": 4}
    configs = [first]
    if target == "cuda":
        for block in (MAX_EXCHANGE_BLOCK, 2048, 1024):
            for warps in (4, 8):
                config = {"BLOCK": min(block, first["BLOCK"]), "num_warps": warps}
                if config not in configs:
                    configs.append(config)
    return configs


def _block(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


def gemm_tiles(m: int, n: int, k: int, copies: int = 1, target: str = "cuda") -> dict[str, int]:
    """Tile shape and warps for ``copies`` ``[m, k] @ [k, n]`` products in one grid.

    Large tiles when they give enough programs to fill the device; else (decode shapes)
    smaller tiles, which give 4x the programs. Clamped to the problem (any shape runs; on
    CPU the interpreter takes the CUDA tiles).
    """
    _check_target(target)
    large = copies * triton.cdiv(m, 128) * triton.cdiv(n, 128) >= _FILL_PROGRAMS[target]
    bm, bn, bk, warps = _GEMM_TILES[target]["large" if large else "decode"]
    return {"BLOCK_M": _block(m, bm), "BLOCK_N": _block(n, bn), "BLOCK_K": _block(k, bk),
            "GROUP_M": 8, "num_warps": warps}


# The autotuner's GEMM space on CUDA (after the table's choice): (BLOCK_M, BLOCK_N, BLOCK_K,
# num_warps, num_stages, PERSISTENT). Persistent configs run fill_programs() programs.
_CUDA_SPACE = {
    "large": [(128, 256, 64, 8, 3, False), (256, 128, 64, 8, 3, False),
              (128, 128, 64, 4, 4, False), (128, 64, 64, 4, 4, False),
              (64, 128, 64, 4, 4, False), (128, 128, 64, 8, 3, True),
              (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, False),
              (128, 256, 64, 8, 4, True), (256, 128, 64, 8, 3, True)],
    "decode": [(64, 64, 64, 4, 4, False), (32, 64, 128, 4, 4, False),
               (64, 128, 64, 4, 4, False), (128, 64, 64, 4, 3, False),
               (64, 64, 128, 4, 3, True),
               # narrow, deep tiles: more programs and fewer K steps each, for the fused
               # ops (which have no split-K form) at decode shapes
               (64, 32, 256, 4, 3, False), (32, 32, 256, 4, 3, False),
               (32, 64, 256, 4, 3, False)],
}


# Shared memory one program of an H100/H200 may use (227 KiB), which the GEMM configs'
# buffers must fit: launching a kernel that asks for more fails.
_SHARED_MEMORY = {"cuda": 227 * 1024}


def gemm_shared_bytes(config: dict[str, int | bool], itemsize: int = 2) -> int:
    """Shared memory of a GEMM config with ``itemsize``-byte operands: ``num_stages``
    buffers of A's ``[BLOCK_M, BLOCK_K]`` and B's ``[BLOCK_K, BLOCK_N]`` blocks, plus the
    output tile's staging buffer of a ``TMA_STORE`` config (half a tile with ``SUBTILE``).
    Triton 3.6's sm_90a build of the GEMM tile kernel asks for this plus a few barriers
    (``tests/test_cuda_compile.py``)."""
    operands = config["BLOCK_K"] * (config["BLOCK_M"] + config["BLOCK_N"]) * itemsize
    output = config["BLOCK_M"] * config["BLOCK_N"] * itemsize if config.get("TMA_STORE") else 0
    if config.get("SUBTILE"):
        output //= 2
    return config["num_stages"] * operands + output


def fill_programs(target: str = "cuda") -> int:
    """Programs that fill the device: a persistent kernel's grid."""
    _check_target(target)
    return _FILL_PROGRAMS[target]


def gemm_configs(m: int, n: int, k: int, copies: int = 1, target: str = "cuda",
                 tma: bool = False, tile_kernel: bool = False,
                 stream_k: bool = False, tma_store: bool = False,
                 flatten: bool = False) -> list[dict[str, int | bool]]:
    """The autotuner's configs for ``copies`` ``[m, k] @ [k, n]`` products in one grid:
    :func:`gemm_tiles`' choice first (with ``num_stages`` 3), then the target's space for
    the problem's size, clamped to the problem, without repeats. Each is a dict of the
    constexprs (``PERSISTENT`` and ``USE_TMA`` among them) and ``num_warps`` /
    ``num_stages``. ``tma``: the caller's operands allow tensor descriptors (unit inner
    strides; weights ``[K, N]`` or ``[N, K]``): each CUDA config also comes in its ``USE_TMA`` form,
    where ``k`` and ``n`` keep rows 16-byte aligned for any element type. ``tile_kernel``:
    the configs of the GEMM tile kernel (``kernels/gemm.py``), whose persistent ``USE_TMA``
    configs also come in forms most fused kernels (tile loops that wait on flags, stores
    that go to peers) lack: ``FLATTEN`` (its tile and K loops pipelined as one) and
    ``TMA_STORE`` (output tiles stored through a descriptor), each and both, and the
    ``TMA_STORE`` ones again with ``SUBTILE`` (stored in two halves: half the staging
    buffer, so that 128x256x64 blocks fit four stages); and those of
    8 warps (the large tiles) in ``WARP_SPECIALIZE`` forms, with ``TMA_STORE`` (which they
    need: ``kernels/gemm.py``) and ``num_warps`` 4 (Triton 3.6 warp-specializes a Hopper
    kernel compiled with 4 warps only, and runs it with 12: a producer and two consumer
    warp groups). ``stream_k``: each persistent config also comes with ``STREAM_K`` (the
    tiles of a partial last wave shared out by K blocks: ``kernels/gemm.py``'s
    ``stream_k_runs``) where its tiles leave a partial last wave of :func:`fill_programs`
    programs. ``tma_store``: the caller's kernel can store its output tiles through a
    descriptor: each ``USE_TMA`` config also comes in its ``TMA_STORE`` form, and each
    persistent one also with ``SUBTILE`` (the fused AG+GEMM, whose output is local).
    ``flatten``: the caller's persistent ``USE_TMA`` forms can pipeline their tile and K
    loops as one: each also comes with ``FLATTEN`` (AG+GEMM, whose waits come once per
    shard, before a shard's tile loop; GEMM+RS, whose peers' segments' loops only push
    and whose own segment's waits come before its loop; GEMM+AR at one rank, a loop of
    stores). Configs whose 2-byte operands overflow shared memory
    (:func:`gemm_shared_bytes`) are left out."""
    first = {**gemm_tiles(m, n, k, copies, target), "num_stages": 3, "PERSISTENT": False,
             "USE_TMA": False}
    configs = [first]
    if target != "cuda":
        return configs
    large = copies * triton.cdiv(m, 128) * triton.cdiv(n, 128) >= _FILL_PROGRAMS[target]
    for bm, bn, bk, warps, stages, persistent in _CUDA_SPACE["large" if large else "decode"]:
        config = {"BLOCK_M": _block(m, bm), "BLOCK_N": _block(n, bn), "BLOCK_K": _block(k, bk),
                  "GROUP_M": 8, "num_warps": warps, "num_stages": stages,
                  "PERSISTENT": persistent, "USE_TMA": False}
        if config not in configs:
            configs.append(config)
    if tma and k % 16 == 0 and n % 16 == 0:
        configs += [dict(config, USE_TMA=True) for config in configs]
        if tile_kernel:
            persistent = [c for c in configs if c["USE_TMA"] and c["PERSISTENT"]]
            configs += [dict(c, FLATTEN=True) for c in persistent]
            configs += [dict(c, TMA_STORE=True, FLATTEN=flat) for flat in (False, True)
                        for c in persistent]
            configs += [dict(c, TMA_STORE=True, FLATTEN=flat, SUBTILE=True)
                        for flat in (False, True) for c in persistent]
            configs += [dict(c, num_warps=4, WARP_SPECIALIZE=True, TMA_STORE=True)
                        for c in configs if c["USE_TMA"] and c["num_warps"] == 8
                        and not c.get("FLATTEN") and not c.get("TMA_STORE")]
    if tma_store:
        plain = [c for c in configs if c["USE_TMA"] and not c.get("TMA_STORE")]
        configs += [dict(c, TMA_STORE=True) for c in plain]
        configs += [dict(c, TMA_STORE=True, SUBTILE=True) for c in plain if c["PERSISTENT"]]
    if flatten:
        configs += [dict(c, FLATTEN=True) for c in configs
                    if c["USE_TMA"] and c["PERSISTENT"] and not c.get("FLATTEN")]
    if stream_k:
        configs += [dict(c, STREAM_K=True) for c in configs if c["PERSISTENT"]
                    and not c.get("WARP_SPECIALIZE") and (
            copies * triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"])
            % _FILL_PROGRAMS[target])]
    # bf16 / f16 operands must fit (float32 ones that do not are skipped when tuning)
    configs = [c for c in configs if gemm_shared_bytes(c) <= _SHARED_MEMORY[target]]
    return configs


# (BLOCK_M, BLOCK_N) caps of the attention kernels: query rows and key rows per block.
_ATTENTION_BLOCKS = {"cuda": (64, 64), "ascend": (32, 32)}


def attention_blocks(seq: int, target: str = "cuda") -> dict[str, int]:
    """``BLOCK_M`` / ``BLOCK_N`` (query and key rows per block) of the attention kernels
    for ``seq`` local rows, clamped to the problem (at least 16, as ``tl.dot`` needs)."""
    _check_target(target)
    bm, bn = _ATTENTION_BLOCKS[target]
    return {"BLOCK_M": _block(seq, bm), "BLOCK_N": _block(seq, bn)}


# The autotuner's attention space on CUDA after the table's choice: (BLOCK_M, BLOCK_N,
# num_warps, num_stages). The forward kernel and each backward kernel tune over it
# separately; the forward kernel's first ``_ATTENTION_TMA`` also come with tensor-
# descriptor loads (``USE_TMA``).
_ATTENTION_SPACE = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
                    (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4), (64, 32, 4, 4)]
_ATTENTION_TMA = 4


def attention_configs(seq: int, head_dim: int, target: str = "cuda",
                      forward: bool = False) -> list[dict[str, int | bool]]:
    """The autotuner's configs of the attention kernels for ``seq`` local rows: the
    table's :func:`attention_blocks` first (``num_warps`` 4, or 8 past ``head_dim`` 64;
    ``num_stages`` 2), then (CUDA) the space above clamped to the problem, without
    repeats. Each is a dict of ``BLOCK_M``, ``BLOCK_N``, ``num_warps`` and ``num_stages``;
    ``forward``: the forward kernel's, which also set ``USE_TMA`` (keys and values through
    tensor descriptors: CUDA) and ``SPLIT_MASKED`` (an unmasked loop over the key blocks
    every query sees, then a masked one; False on Ascend, whose unified buffer does not
    hold two loop bodies at its blocks: bishengir-compile reports "ub overflow")."""
    _check_target(target)
    extra = {"USE_TMA": False, "SPLIT_MASKED": target == "cuda"} if forward else {}
    first = {**attention_blocks(seq, target), **extra,
             "num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}
    configs = [first]
    if target != "cuda":
        return configs
    space = [(entry, {}) for entry in _ATTENTION_SPACE]
    if forward:
        space += [(entry, {"USE_TMA": True}) for entry in _ATTENTION_SPACE[:_ATTENTION_TMA]]
    for (bm, bn, warps, stages), form in space:
        config = {"BLOCK_M": _block(seq, bm), "BLOCK_N": _block(seq, bn), **extra, **form,
                  "num_warps": warps, "num_stages": stages}
        if config not in configs:
            configs.append(config)
    return configs


def attention_delta_rows(head_dim: int) -> int:
    """Rows per program of the backward's ``rowsum(dO * O)`` kernel: 8192 elements of
    each operand a program (at least 16 rows, at most 128)."""
    return max(16, min(128, 8192 // head_dim))


def split_k_configs(m: int, n: int, k: int, target: str = "cuda") -> list[dict[str, int]]:
    """Split-K configs of the GEMM tile (``kernels/gemm.py``'s ``matmul_split_k_kernel``)
    for problems with too few output tiles to fill the device (decode shapes): the decode
    tile with K split 2, 3 or 4 ways where each split keeps at least 4 K blocks; none
    for problems that fill the device, or off CUDA."""
    _check_target(target)
    if target != "cuda":
        return []
    bm, bn, bk, warps = _GEMM_TILES[target]["decode"]
    bm, bn, bk = _block(m, bm), _block(n, bn), _block(k, bk)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if tiles >= _FILL_PROGRAMS[target]:
        return []
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
             "num_stages": 3, "SPLIT_K": split} for split in (2, 3, 4)
            if triton.cdiv(k, bk) >= 4 * split]


def stream_k_configs(m: int, n: int, k: int, target: str = "cuda") -> list[dict[str, int | bool]]:
    """Configs of the stream-K GEMM tile (``kernels/gemm.py``'s ``matmul_stream_k_kernel``,
    :func:`fill_programs` programs): the ``STREAM_K`` forms of :func:`gemm_configs`
    (``tma=True``, ``tile_kernel=True``): through pointers, through descriptors, and
    through descriptors with both ``FLATTEN`` and ``TMA_STORE`` (whole output tiles: the
    stream-K kernel has no ``SUBTILE`` form); then the descriptor forms
    again with ``IN_STEP`` (the split tiles' K blocks shared out in step:
    ``stream_k_split``). None where tiles fill whole waves, or off CUDA."""
    configs = [c for c in gemm_configs(m, n, k, target=target, tma=True, tile_kernel=True,
                                       stream_k=True)
               if c.get("STREAM_K") and c.get("FLATTEN", False) == c.get("TMA_STORE", False)
               and not c.get("SUBTILE")]
    return configs + [dict(c, IN_STEP=True) for c in configs if c["USE_TMA"]]


def stream_k_slots(programs: int, tiles: int, blocks: int, in_step: bool = False) -> int:
    """Shares a program of a stream-K grid holds at most (the partial workspace's slots per
    program): the most tiles any program's run of split K blocks meets under
    ``kernels/gemm.py``'s ``stream_k_split`` (``tiles`` output tiles of ``blocks`` K blocks
    on ``programs`` programs; ``in_step``: its ``IN_STEP`` layout). 2 without ``in_step``
    (a run meets at most two tiles); with it, a tail run may meet more."""
    if not in_step:
        return 2
    split = tiles % programs
    head = split * blocks // programs
    heads = split if head else 0
    tail = blocks - head
    share, extra = divmod(split * tail, programs - heads)
    most = 1
    for q in range(programs - heads):
        start = q * share + min(q, extra)
        end = start + share + (q < extra)
        if end > start:
            most = max(most, (end - 1) // tail - start // tail + 1)
    return most


def gemm_tile_configs(m: int, n: int, k: int, target: str = "cuda") -> list[dict[str, int | bool]]:
    """Every config of the GEMM tile kernels (``kernels/gemm.py``) for ``[m, k] @ [k, n]``
    with unit inner strides, in the order they are tried: :func:`gemm_configs` (``tma``,
    ``tile_kernel``), then :func:`split_k_configs`, then :func:`stream_k_configs`."""
    return (gemm_configs(m, n, k, target=target, tma=True, tile_kernel=True)
            + split_k_configs(m, n, k, target) + stream_k_configs(m, n, k, target))


def moe_dispatch_blocks(rows: int, h: int) -> dict[str, int]:
    """``BLOCK_R`` (rows of the expert inputs per program) and ``BLOCK_H`` of dispatch."""
    return {"BLOCK_R": min(64, triton.next_power_of_2(max(rows, 1))),
            "BLOCK_H": min(128, triton.next_power_of_2(h))}


def moe_combine_blocks(t: int, h: int) -> dict[str, int]:
    """``BLOCK_T`` (tokens per program) and ``BLOCK_H`` of combine."""
    return {"BLOCK_T": min(32, triton.next_power_of_2(max(t, 1))),
            "BLOCK_H": min(128, triton.next_power_of_2(h))}
