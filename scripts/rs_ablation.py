"""GPU machine, diagnosis: where GEMM+RS's extra time goes in the one-GPU overlap proxy.

Runs ``matmul_reduce_scatter_kernel`` at the proxy's shape (``bench/overlap.py``'s
``SHAPES``) with ranks sharing the GPU (``one_gpu.time_ranks``), each *variant* with one
piece of its exchange changed or taken out, against the GEMM alone with the same config.
Variants other than ``as-is`` give wrong results on purpose (nothing checks them): they
exist to time what the piece costs.

    as-is          the kernel as shipped
    gpu-flags      per-tile flags raised, and all flags awaited, at GPU scope instead of
                   system scope (the kernel's per-program flags stay system-scope)
    no-flags       no per-tile flags raised, no flags awaited (the own segment sums
                   whatever has landed)
    no-reads       the own segment stores its own partial, reading no peer's
    serial-reads   the own segment reads the peers' partials (``SUM_TMA``) one after the
                   other, as before 2026-12-07's tenth session, not in a pipelined loop

(Not storing the pushed partials is no variant: the compiler then drops those tiles' whole
products, which times nothing.)

Each variant runs in a process of its own (its patched helpers compile to their own
kernels). Prints one JSON line per (variant, config, ranks) and, with ``--json``, writes
them all.

    python3 scripts/rs_ablation.py --ranks 2 8 --iters 5 --json rs_ablation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.kernels import gemm_collectives as gc
from jax_triton_dist.kernels import tile_exchange as te
from jax_triton_dist.kernels.epilogue import apply_epilogue
from jax_triton_dist.kernels.gemm import store_tile
from jax_triton_dist.kernels.tile_exchange import sum_own_tile as shipped_sum_own_tile

VARIANTS = ("as-is", "gpu-flags", "no-flags", "no-reads", "serial-reads")
# The proxy's fixed tile (pointer loads) and the tuner's usual choice for this op (tensor
# descriptors, tile and K loops flattened); both sum their own tiles as the op does
# (``fused.launch.reduce_scatter_sums_tma``: through the slots' descriptor here)
CONFIGS = {
    "table": ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, 8, 3),
    "tma-flat": ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
                  "USE_TMA": True, "FLATTEN": True}, 8, 3),
}


# What the patched helpers do (set by _patch before anything compiles)
RAISE_FLAGS = tl.constexpr(True)
SCOPE = tl.constexpr("sys")


@triton.jit
def push_tile(acc, slots, flags, peer, me, rows, cols, pid_m, pid_n, tile, num_tiles, epoch,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NOTIFY: tl.constexpr = True):
    store_tile(dl.symm_at(slots, peer) + me * rows * cols, acc, pid_m, pid_n, rows, cols, cols,
               1, BLOCK_M, BLOCK_N)
    if NOTIFY and RAISE_FLAGS:
        dl.notify(flags + me * num_tiles + tile, peer, epoch, "set", SCOPE)


@triton.jit
def wait_tile(flags, me, world, tile, num_tiles, epoch):
    if RAISE_FLAGS:
        for src in range(0, world):
            if src != me:
                dl.wait(flags + src * num_tiles + tile, 1, SCOPE, "acquire", epoch)


@triton.jit
def sum_own_tile_no_reads(acc, c_ptr, slots, slots_desc, flags, me, world, rows, cols, pid_m,
                          pid_n, tile, num_tiles, epoch, bias_ptr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ACTIVATION: tl.constexpr, SUM_TMA: tl.constexpr,
                          WAITED: tl.constexpr = False):
    if not WAITED:
        wait_tile(flags, me, world, tile, num_tiles, epoch)
    acc = apply_epilogue(acc, bias_ptr, pid_n, cols, BLOCK_N, HAS_BIAS, ACTIVATION)
    store_tile(c_ptr, acc, pid_m, pid_n, rows, cols, cols, 1, BLOCK_M, BLOCK_N)


@triton.jit
def sum_own_tile_serial(acc, c_ptr, slots, slots_desc, flags, me, world, rows, cols, pid_m,
                        pid_n, tile, num_tiles, epoch, bias_ptr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                        ACTIVATION: tl.constexpr, SUM_TMA: tl.constexpr,
                        WAITED: tl.constexpr = False):
    if SUM_TMA:
        if not WAITED:
            wait_tile(flags, me, world, tile, num_tiles, epoch)
        total = acc.to(slots.dtype.element_ty).to(tl.float32)
        for src in range(0, world):
            if src != me:
                part = slots_desc.load([src, pid_m * BLOCK_M, pid_n * BLOCK_N])
                total += part.reshape(BLOCK_M, BLOCK_N).to(tl.float32)
        total = apply_epilogue(total, bias_ptr, pid_n, cols, BLOCK_N, HAS_BIAS, ACTIVATION)
        store_tile(c_ptr, total, pid_m, pid_n, rows, cols, cols, 1, BLOCK_M, BLOCK_N)
    else:  # (the pointer form reads the partials through sum_tile, unchanged)
        shipped_sum_own_tile(acc, c_ptr, slots, slots_desc, flags, me, world, rows, cols,
                             pid_m, pid_n, tile, num_tiles, epoch, bias_ptr, BLOCK_M, BLOCK_N,
                             HAS_BIAS, ACTIVATION, SUM_TMA, WAITED)


def _patch(variant: str) -> None:
    """Replaces the exchange helpers the kernel module calls, for ``variant``."""
    global RAISE_FLAGS, SCOPE
    if variant == "as-is":
        return
    SCOPE = tl.constexpr("gpu" if variant == "gpu-flags" else "sys")
    RAISE_FLAGS = tl.constexpr(variant != "no-flags")
    gc.push_tile = push_tile
    gc.wait_tile = wait_tile
    te.wait_tile = wait_tile
    if variant == "no-reads":
        gc.sum_own_tile = sum_own_tile_no_reads
    if variant == "serial-reads":
        gc.sum_own_tile = sum_own_tile_serial


def _measure(variant: str, ranks: list[int], iters: int) -> list[dict]:
    _patch(variant)
    import numpy as np

    from jax_triton_dist import one_gpu, tiles
    from jax_triton_dist.bench.overlap import (
        BF16,
        NO_STREAM_K,
        SHAPES,
        _bf16,
    )
    from jax_triton_dist.fused.launch import reduce_scatter_exchange, reduce_scatter_sums_tma
    from jax_triton_dist.kernels.gemm import matmul_kernel
    from jax_triton_dist.kernels.gemm_collectives import matmul_reduce_scatter_kernel

    m, n, k = SHAPES["matmul_reduce_scatter"]
    rng = np.random.default_rng(0)
    x, w, bias = _bf16(rng, (m, k)), _bf16(rng, (k, n), k ** -0.5), _bf16(rng, (1,))
    rows = []
    for name, (config, warps, stages) in CONFIGS.items():
        for world in ranks:
            programs = max(1, tiles.fill_programs() // world)
            seg = m // world
            per_segment = triton.cdiv(seg, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
            fused = one_gpu.time_ranks(
                matmul_reduce_scatter_kernel, world, inputs=lambda c, r: [x, w, bias],
                outputs=[((seg, n), BF16)],
                workspaces=[*reduce_scatter_exchange(world, seg, n, per_segment, BF16),
                            *NO_STREAM_K],
                grid=(programs,), calls=iters, num_warps=warps, num_stages=stages,
                kwargs=dict(seg=seg, N=n, K=k, R=seg, stride_wk=n, stride_wn=1,
                            PERSISTENT=True,
                            SUM_TMA=reduce_scatter_sums_tma(world, n, BF16), **config))
            row = {"variant": variant, "config": name, "ranks": world,
                   "fused_us": statistics.median(fused) * 1e6}
            if variant == "as-is":
                gemm = one_gpu.time_ranks(
                    matmul_kernel, world, inputs=lambda c, r: [x, w], outputs=[((m, n), BF16)],
                    workspaces=[], grid=(programs,), calls=iters, num_warps=warps,
                    num_stages=stages,
                    kwargs=dict(M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=n,
                                stride_bn=1, stride_cm=n, stride_cn=1, PERSISTENT=True,
                                **config))
                row["gemm_us"] = statistics.median(gemm) * 1e6
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _measure(args.one, args.ranks, args.iters)
        return
    rows = []
    for variant in args.variants:
        run = subprocess.run(
            [sys.executable, __file__, "--one", variant, "--iters", str(args.iters),
             "--ranks", *map(str, args.ranks)], capture_output=True, text=True, timeout=600)
        got = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode:
            print(f"{variant}: exit {run.returncode}: {run.stderr[-2000:]}", flush=True)
        for row in got:
            print(json.dumps(row), flush=True)
        rows += got
    gemm = {(r["config"], r["ranks"]): r["gemm_us"] for r in rows if "gemm_us" in r}
    print(f"{'variant':<10} {'config':<9} {'ranks':>5} {'fused us':>9} {'GEMM us':>8} {'ratio':>6}")
    for r in rows:
        g = gemm.get((r["config"], r["ranks"]))
        print(f"{r['variant']:<10} {r['config']:<9} {r['ranks']:>5} {r['fused_us']:>9.1f} "
              f"{g or float('nan'):>8.1f} {r['fused_us'] / g if g else float('nan'):>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
