"""Tile-order helpers for GEMM + communication kernels, as ``@triton.jit`` functions.

A GEMM kernel with ``tiles_m x tiles_n`` output tiles maps its program (or persistent
loop) index ``tile`` through one of these to the tile ``(pid_m, pid_n)`` it computes:

* :func:`grouped_tile` — groups of ``GROUP_M`` rows of tiles walked column by column, so
  consecutive programs share A and B tiles in L2 (Triton's matmul tutorial order).
* :func:`rank_rotated_tile` — AllGather+GEMM: the M tiles come in shards, one per rank
  (shard ``s`` holds rank ``s``'s rows). The order starts with the own rank's shard — the
  data already local — and then walks the ring (``DIRECTION`` +1: rank+1, rank+2, ...;
  -1: rank-1, rank-2, ..., the order in which a ring all-gather delivers shards).
* :func:`own_last_tile` — GEMM+ReduceScatter: the M tiles form one output segment per rank
  (segment ``p`` is reduced on rank ``p``). Peers' segments come first, starting with
  rank+1, and the own segment last, so each finished segment can be sent while the rest
  is computed.

Every helper is a permutation of the tile space for every rank and rank count (tested).
All arguments are integers (scalars or blocks); ``GROUP_M``/``DIRECTION`` are constexprs.
"""

import triton
import triton.language as tl

__all__ = ["grouped_tile", "rank_rotated_tile", "own_last_tile"]


@triton.jit
def grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of ``tile`` in grouped order (``GROUP_M`` rows of tiles a group)."""
    tiles_per_group = GROUP_M * tiles_n
    group = tile // tiles_per_group
    first_m = group * GROUP_M
    group_rows = tl.maximum(tl.minimum(tiles_m - first_m, GROUP_M), 1)  # >= 1 past the end
    local = tile % tiles_per_group
    pid_m = first_m + local % group_rows
    pid_n = local // group_rows
    return pid_m, pid_n


@triton.jit
def rank_rotated_tile(tile, tiles_per_shard_m, tiles_n, rank, world, GROUP_M: tl.constexpr,
                      DIRECTION: tl.constexpr = 1):
    """AllGather+GEMM order: own shard's tiles first, then the shards around the ring.

    Returns:
      ``(pid_m, pid_n, shard)``: the global tile and the rank whose rows it reads.
    """
    shard_tiles = tiles_per_shard_m * tiles_n
    step = tile // shard_tiles
    shard = (rank + DIRECTION * step + world * world) % world
    local_m, pid_n = grouped_tile(tile % shard_tiles, tiles_per_shard_m, tiles_n, GROUP_M)
    return shard * tiles_per_shard_m + local_m, pid_n, shard


@triton.jit
def own_last_tile(tile, tiles_per_segment_m, tiles_n, rank, world, GROUP_M: tl.constexpr):
    """GEMM+ReduceScatter order: segments of rank+1, rank+2, ..., the own segment last.

    Returns:
      ``(pid_m, pid_n, segment)``: the global tile and the rank that owns its rows.
    """
    segment_tiles = tiles_per_segment_m * tiles_n
    step = tile // segment_tiles
    segment = (rank + 1 + step) % world
    local_m, pid_n = grouped_tile(tile % segment_tiles, tiles_per_segment_m, tiles_n, GROUP_M)
    return segment * tiles_per_segment_m + local_m, pid_n, segment
