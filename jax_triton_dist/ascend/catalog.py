"""Every kernel of ``kernels/`` as the ops launch it, for the Ascend lowering.

A :class:`Case` is one kernel with the pointer types, scalars and constexprs its op passes
(block and tile choices come from :mod:`jax_triton_dist.tiles` for the Ascend target), at
a given rank count, and the distributed operations its source implies there
(:class:`Expected`): the lowering check fails a kernel whose HIVM IR lost any of them.

Pure Python: imported where triton-ascend runs (no JAX, no built extension).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import triton

from jax_triton_dist import tiles

__all__ = ["Expected", "Case", "RANKS", "cases", "case_names"]

RANKS = (2, 8)
"""Rank counts every kernel is lowered at."""


@dataclasses.dataclass(frozen=True)
class Expected:
    """Distributed operations in the kernel's code at a rank count, counted statically
    (a loop over ranks with ``R`` iterations counts its body ``R`` times; a branch counts
    once): flag writes (``dl.notify``), waits (``dl.wait``, one per flag) and block
    barriers (one before each notify and after each wait, plus the kernel's own)."""

    notifies: int
    waits: int
    barriers: int = -1  # default: notifies + waits

    def barrier_count(self) -> int:
        return self.notifies + self.waits if self.barriers < 0 else self.barriers


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel launch as an op makes it."""

    name: str
    kernel: str  # "module:function" of the @triton.jit kernel
    pointers: dict[str, str]  # parameter -> Triton element type ("fp32", "bf16", "i32")
    scalars: dict[str, int | float]  # scalar parameters (int32, or float32 for floats)
    constexprs: dict[str, Any]
    expected: Expected

    def resolve(self):
        """The ``@triton.jit`` kernel."""
        module, name = self.kernel.split(":")
        return getattr(importlib.import_module(module), name)

    def signature(self) -> tuple[dict[str, str], dict[str, Any]]:
        """Triton 3.2's ``ASTSource`` signature (every parameter, constexprs marked) and
        constants, in the kernel's parameter order."""
        import inspect

        params = inspect.signature(self.resolve().fn).parameters
        signature, constants = {}, {}
        for name in params:
            if name in self.pointers:
                signature[name] = "*" + self.pointers[name]
            elif name in self.scalars:
                signature[name] = "fp32" if isinstance(self.scalars[name], float) else "i32"
            elif name in self.constexprs:
                signature[name] = "constexpr"
                constants[name] = self.constexprs[name]
            else:
                raise ValueError(f"catalog case {self.name}: no value for parameter {name}")
        return signature, constants


_EXCHANGE = "jax_triton_dist.kernels.exchange:push_exchange_kernel"
_EXCHANGE_VARIANTS = {  # the op each (SEND_CHUNKS, REDUCE) serves
    "all_gather": (False, "none"), "reduce_scatter": (True, "sum"),
    "all_reduce_one_shot": (False, "sum"), "all_to_all": (True, "none"),
    "all_reduce_max": (False, "max"),
}


def _push_exchange(ranks: int) -> list[Case]:
    n = 4096
    block, _ = tiles.exchange_block(n)
    out = []
    for op, (send_chunks, reduce) in _EXCHANGE_VARIANTS.items():
        # push: one notify per peer; receive: one wait per peer (copy) or per rank in the
        # rank-ordered reduction (the own rank's iteration does not wait, but is code).
        waits = ranks - 1 if reduce == "none" else ranks
        out.append(Case(
            f"push_exchange[{op}]", _EXCHANGE,
            {"x_ptr": "fp32", "out_ptr": "fp32", "slots_ptr": "fp32", "flags_ptr": "i32"},
            {"n": n}, {"SEND_CHUNKS": send_chunks, "REDUCE": reduce, "BLOCK": block},
            Expected(notifies=ranks - 1, waits=waits)))
    return out


def _two_shot(ranks: int) -> Case:
    n = 8192
    chunk = triton.cdiv(n, ranks)
    block, _ = tiles.exchange_block(chunk)
    return Case(
        "two_shot_all_reduce", "jax_triton_dist.kernels.allreduce:two_shot_all_reduce_kernel",
        {"x_ptr": "bf16", "out_ptr": "bf16", "rs_slots_ptr": "bf16", "ag_slots_ptr": "bf16",
         "flags_ptr": "i32"},
        {"n": n, "chunk": chunk}, {"REDUCE": "sum", "BLOCK": block},
        Expected(notifies=2 * (ranks - 1), waits=ranks + ranks - 1))


def _ring() -> Case:
    return Case(
        "ring_shift", "jax_triton_dist.kernels.ring_exchange:ring_shift_kernel",
        {"x_ptr": "fp32", "out_ptr": "fp32", "buf_ptr": "fp32", "flag_ptr": "i32"},
        {"n": 4096}, {"BLOCK": 1024}, Expected(notifies=1, waits=1))


def _gemm() -> Case:
    m, n, k = 1024, 1024, 1024
    config = tiles.gemm_tiles(m, n, k, target="ascend")
    config.pop("num_warps")
    return Case(
        "gemm_tile", "jax_triton_dist.kernels.gemm:matmul_kernel",
        {"a_ptr": "bf16", "b_ptr": "bf16", "c_ptr": "bf16"},
        {"M": m, "N": n, "K": k, "stride_am": k, "stride_bk": n, "stride_cm": n},
        dict(config, stride_ak=1, stride_bn=1, stride_cn=1, PERSISTENT=False, USE_TMA=False,
             FLATTEN=False, TMA_STORE=False, WARP_SPECIALIZE=False, SUBTILE=False),
        Expected(0, 0))


def _gemm_with_workspaces(name: str, kernel: str, m: int, n: int, k: int, tile_m: int,
                          constexprs: dict) -> Case:
    """A GEMM tile kernel with float32 shares and int32 tile counts (split-K, stream-K),
    at Ascend's table tile for ``tile_m`` rows."""
    config = tiles.gemm_tiles(tile_m, n, k, target="ascend")
    config.pop("num_warps")
    return Case(
        name, f"jax_triton_dist.kernels.gemm:{kernel}",
        {"a_ptr": "bf16", "b_ptr": "bf16", "c_ptr": "bf16", "partial_ptr": "fp32",
         "counts_ptr": "i32"},
        {"M": m, "N": n, "K": k, "stride_am": k, "stride_bk": n, "stride_cm": n},
        dict(config, stride_ak=1, stride_bn=1, stride_cn=1, **constexprs),
        Expected(0, 0, barriers=1))  # the barrier before a share's count moves


def _gemm_split_k() -> Case:
    # a decode shape
    return _gemm_with_workspaces("gemm_split_k", "matmul_split_k_kernel", 128, 1024, 4096,
                                 128, {"SPLIT_K": 2})


def _gemm_stream_k() -> Case:
    # 256 decode tiles (64x64): 12 whole waves of Ascend's 20 cores and 16 tiles split. At
    # the large tile (128x128x32) the runs' loop overflows the unified buffer
    # (bishengir-compile: "ub overflow, requires 2111488 bits while 1572864 bits available")
    return _gemm_with_workspaces("gemm_stream_k", "matmul_stream_k_kernel", 1024, 1024, 1024,
                                 64, {"FLATTEN": False, "TMA_STORE": False, "USE_TMA": False,
                                      "IN_STEP": False, "SLOTS": 2})


# The fused kernels' stream-K workspaces (the shares' slots, the tiles' counts)
_STREAM_K_WORKSPACES = {"partial_ptr": "fp32", "counts_ptr": "i32"}


def _gemm_tiles(m: int, n: int, k: int, copies: int,
               persistent: bool = False) -> dict[str, int]:
    """The op's tile on Ascend. Persistent forms (not in Ascend's config space: they are
    lowered to check the loop around the tile body) take the decode tile: at the large one
    the loop's buffers and the exchange's bf16 partials overflow the unified buffer
    (bishengir-compile, GEMM+RS: "ub overflow, requires 1848576 bits while 1572864 bits
    available")."""
    if persistent:  # the tile of a decode-sized problem of the same n and k
        config = tiles.gemm_tiles(min(m, 64), n, k, target="ascend")
    else:
        config = tiles.gemm_tiles(m, n, k, copies=copies, target="ascend")
    config.pop("num_warps")
    return dict(config, PERSISTENT=persistent, USE_TMA=False)


def _fused(ranks: int, persistent: bool = False) -> list[Case]:
    """The fused GEMM kernels; ``persistent``: their persistent variants (a loop over
    tiles around the same body: the same flag writes and waits in the IR)."""
    m, n, k = 256, 1024, 1024  # per-rank rows, columns, reduction
    suffix = "_persistent" if persistent else ""
    ag = Case(
        "all_gather_matmul" + suffix,
        "jax_triton_dist.kernels.gemm_collectives:all_gather_matmul_kernel",
        {"x_ptr": "bf16", "w_ptr": "bf16", "bias_ptr": "bf16", "c_ptr": "bf16",
         "flags_ptr": "i32", **_STREAM_K_WORKSPACES},
        {"m": m, "N": n, "K": k, "R": m, "stride_wk": n},
        dict(_gemm_tiles(m, n, k, ranks, persistent), stride_wn=1, BATCHED=False,
             HAS_BIAS=False, ACTIVATION="none", W_NK=False, STREAM_K=False, TMA_STORE=False,
             FLATTEN=False, SUBTILE=False),
        # program 0 announces to every peer; a tile of a peer's shard waits once
        Expected(notifies=ranks - 1, waits=1))
    rs = Case(
        "matmul_reduce_scatter" + suffix,
        "jax_triton_dist.kernels.gemm_collectives:matmul_reduce_scatter_kernel",
        {"x_ptr": "bf16", "w_ptr": "bf16", "bias_ptr": "bf16", "c_ptr": "bf16",
         "slots_ptr": "bf16", "flags_ptr": "i32",  # partials in the output's type
         **_STREAM_K_WORKSPACES},
        {"seg": m, "N": n, "K": k, "R": m, "stride_wk": n},
        dict(_gemm_tiles(m, n, k, ranks, persistent), stride_wn=1, BATCHED=False,
             HAS_BIAS=False, ACTIVATION="none", W_NK=False, STREAM_K=False, FLATTEN=False,
             TMA_STORE=False, SUBTILE=False, SUM_TMA=False),
        # a peer segment's tile is pushed once; the own segment's tile waits per rank;
        # keep_tile adds a barrier
        Expected(notifies=1, waits=ranks, barriers=1 + ranks + 1))
    decode_m = 128
    ar = Case(
        "matmul_all_reduce" + suffix,
        "jax_triton_dist.kernels.gemm_allreduce:matmul_all_reduce_kernel",
        {"a_ptr": "bf16", "b_ptr": "bf16", "c_ptr": "bf16", "slots_ptr": "bf16",
         "flags_ptr": "i32", **_STREAM_K_WORKSPACES},
        {"M": decode_m, "N": n, "K": k, "stride_am": k, "stride_bk": n},
        dict(_gemm_tiles(decode_m, n, k, 1, persistent), stride_ak=1, stride_bn=1,
             B_NK=False, STREAM_K=False, TWO_SHOT=False, FLATTEN=False, TMA_STORE=False,
             SUBTILE=False),
        Expected(notifies=ranks - 1, waits=ranks, barriers=(ranks - 1) + ranks + 1))
    # two-shot: the owner's branch waits per rank and pushes its sum to every peer, the
    # other branch pushes one partial; every rank then waits for the sums it copies.
    # Persistent: one flag per peer for a program's partials and one for its sums.
    notifies = 2 * (ranks - 1) if persistent else ranks
    two_shot = dataclasses.replace(
        ar, name="matmul_all_reduce_two_shot" + suffix,
        constexprs=dict(ar.constexprs, TWO_SHOT=True),
        expected=Expected(notifies=notifies, waits=ranks + 1,
                          barriers=notifies + (ranks + 1) + 1))
    return [ag, rs, ar, two_shot]


def _moe(ranks: int) -> list[Case]:
    t, h, k, local_experts = 64, 256, 2, 2
    capacity = ranks * t * k
    # announce_and_wait: program 0 notifies every peer; every program waits for each peer
    announce = Expected(notifies=ranks - 1, waits=ranks - 1)
    dispatch = Case(
        "moe_dispatch", "jax_triton_dist.kernels.moe:moe_dispatch_kernel",
        {"tokens_ptr": "bf16", "order_ptr": "i32", "recv_offsets_ptr": "i32",
         "recv_counts_ptr": "i32", "out_ptr": "bf16", "flags_ptr": "i32"},
        {"H": h, "S": t * k, "E_local": local_experts, "C": capacity},
        tiles.moe_dispatch_blocks(local_experts * capacity, h), announce)
    combine = Case(
        "moe_combine", "jax_triton_dist.kernels.moe:moe_combine_kernel",
        {"expert_out_ptr": "bf16", "dest_rank_ptr": "i32", "dest_row_ptr": "i32",
         "weights_ptr": "fp32", "out_ptr": "bf16", "flags_ptr": "i32"},
        {"T": t, "K": k, "H": h}, tiles.moe_combine_blocks(t, h), announce)
    return [dispatch, combine]


def _attention(ranks: int) -> list[Case]:
    b, s, h, kvh, d = 1, 128, 4, 2, 64  # per rank
    blocks = tiles.attention_blocks(s, target="ascend")
    forward = {key: value for key, value in
               tiles.attention_configs(s, d, target="ascend", forward=True)[0].items()
               if key in ("USE_TMA", "SPLIT_MASKED")}
    sizes = {"B": b, "H": h, "KVH": kvh, "scale": 0.125}
    options = dict(blocks, HEAD_DIM=d, CAUSAL=True, ZIGZAG=False)
    module = "jax_triton_dist.kernels.attention:"
    grads = {"q_ptr": "bf16", "do_ptr": "bf16", "lse_ptr": "fp32", "delta_ptr": "fp32",
             "k_ptr": "bf16", "v_ptr": "bf16"}
    return [
        Case("sequence_parallel_attention", module + "sequence_parallel_attention_kernel",
             {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "o_ptr": "bf16",
              "lse_ptr": "fp32", "flags_ptr": "i32"}, dict(sizes, S=s),
             {**options, **forward},
             # program 0 announces to every peer; the loop over ranks waits for each
             Expected(notifies=ranks - 1, waits=ranks)),
        Case("attention_bwd_delta", module + "attention_bwd_delta_kernel",
             {"o_ptr": "bf16", "do_ptr": "bf16", "delta_ptr": "fp32"}, {"rows": b * s * h},
             {"HEAD_DIM": d, "BLOCK": tiles.attention_delta_rows(d)}, Expected(0, 0)),
        Case("attention_bwd_dkdv", module + "attention_bwd_dkdv_kernel",
             dict(grads, dk_ptr="fp32", dv_ptr="fp32"), dict(sizes, SQ=s), options,
             Expected(0, 0)),
        Case("attention_bwd_dq", module + "attention_bwd_dq_kernel", dict(grads, dq_ptr="bf16"),
             dict(sizes, SQ=s), options, Expected(0, 0)),
        Case("flash_decode", module + "flash_decode_kernel",
             {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "lengths_ptr": "i32",
              "o_ptr": "bf16", "slots_o_ptr": "fp32", "slots_lse_ptr": "fp32",
              "flags_ptr": "i32"}, dict(sizes, S=s),
             {"HEAD_DIM": d, "GROUP": 16, "BLOCK_N": blocks["BLOCK_N"]},
             # a partial pushed to every rank (itself included), every rank's waited for
             Expected(notifies=ranks, waits=ranks)),
    ]


def _device_calls(ranks: int) -> Case:
    # putmem_signal: 1 notify; signal_wait_until: 1 wait; barrier_all: a notify per rank and
    # a wait on every rank's counter; a barrier per notify and per wait call
    return Case(
        "shmem_device_calls", "jax_triton_dist.ascend.device_calls:device_calls_kernel",
        {"x_ptr": "fp32", "out_ptr": "fp32", "buf_ptr": "fp32", "sig_ptr": "i32"},
        {"n": 4096}, {"BLOCK": 1024},
        Expected(notifies=1 + ranks, waits=1 + ranks, barriers=(1 + ranks) + 2))


def cases(ranks: int) -> list[Case]:
    """Every kernel of ``kernels/`` at ``ranks`` ranks (the fused GEMM kernels also in
    their persistent form), and a kernel making every ``dl`` SHMEM device call
    (``device_calls``)."""
    return (_push_exchange(ranks)
            + [_two_shot(ranks), _ring(), _gemm(), _gemm_split_k(), _gemm_stream_k()]
            + _fused(ranks)
            + _fused(ranks, persistent=True) + _moe(ranks) + _attention(ranks)
            + [_device_calls(ranks)])


def case_names() -> list[str]:
    """Names of the cases (the same at every rank count)."""
    return [case.name for case in cases(RANKS[0])]
