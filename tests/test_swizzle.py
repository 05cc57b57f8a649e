"""Swizzle helpers: permutations of the tile space in the documented order."""

import numpy as np
import pytest
import triton
import triton.language as tl

from jax_triton_dist import swizzle
from jax_triton_dist.runtime import cuda_compile, interpreter


@triton.jit
def order_kernel(out_ptr, tiles_m, tiles_n, rank, world, MODE: tl.constexpr,
                 GROUP_M: tl.constexpr, DIRECTION: tl.constexpr, BLOCK: tl.constexpr):
    """Writes (pid_m, pid_n, shard) of every tile, BLOCK tiles at a time."""
    for start in range(0, tiles_m * tiles_n, BLOCK):
        tile = start + tl.arange(0, BLOCK)
        mask = tile < tiles_m * tiles_n
        if MODE == "grouped":
            pid_m, pid_n = swizzle.grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
            shard = tile * 0
        elif MODE == "rotated":
            pid_m, pid_n, shard = swizzle.rank_rotated_tile(tile, tiles_m // world, tiles_n,
                                                            rank, world, GROUP_M, DIRECTION)
        else:
            pid_m, pid_n, shard = swizzle.own_last_tile(tile, tiles_m // world, tiles_n, rank,
                                                        world, GROUP_M)
        tl.store(out_ptr + 3 * tile, pid_m, mask=mask)
        tl.store(out_ptr + 3 * tile + 1, pid_n, mask=mask)
        tl.store(out_ptr + 3 * tile + 2, shard, mask=mask)


def order(mode, tiles_m, tiles_n, rank=0, world=1, group=4, direction=1):
    out = np.full((tiles_m * tiles_n, 3), -1, np.int32)
    interpreter.launch(order_kernel, (1,), [interpreter.Pointer(out.ctypes.data, "int32"),
                                            tiles_m, tiles_n, rank, world],
                       {"MODE": mode, "GROUP_M": group, "DIRECTION": direction, "BLOCK": 64})
    return out


def assert_permutation(out, tiles_m, tiles_n):
    pairs = {(int(m), int(n)) for m, n, _ in out}
    assert len(pairs) == tiles_m * tiles_n
    assert pairs == {(m, n) for m in range(tiles_m) for n in range(tiles_n)}


@pytest.mark.parametrize("tiles_m,tiles_n,group", [(1, 1, 4), (7, 5, 4), (16, 3, 8), (9, 9, 1)])
def test_grouped_tile_is_a_permutation(tiles_m, tiles_n, group):
    out = order("grouped", tiles_m, tiles_n, group=group)
    assert_permutation(out, tiles_m, tiles_n)
    # The first group's tiles come first, column by column.
    first = out[: min(group, tiles_m) * tiles_n]
    assert set(first[:, 0]) == set(range(min(group, tiles_m)))


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("direction", [1, -1])
def test_rank_rotated_tile_starts_at_own_shard_and_walks_the_ring(world, direction):
    per_shard, tiles_n = 3, 4
    for rank in range(world):
        out = order("rotated", per_shard * world, tiles_n, rank, world, group=2,
                    direction=direction)
        assert_permutation(out, per_shard * world, tiles_n)
        shards = out[:, 2].reshape(world, per_shard * tiles_n)
        expected = [(rank + direction * k) % world for k in range(world)]
        assert [int(s[0]) for s in shards] == expected
        assert (shards == shards[:, :1]).all()
        assert (out[:, 0] // per_shard == out[:, 2]).all()  # a tile lies in its shard


@pytest.mark.parametrize("world", range(1, 9))
def test_own_last_tile_ends_with_own_segment(world):
    per_segment, tiles_n = 2, 5
    for rank in range(world):
        out = order("own_last", per_segment * world, tiles_n, rank, world, group=4)
        assert_permutation(out, per_segment * world, tiles_n)
        segments = out[:, 2].reshape(world, per_segment * tiles_n)[:, 0]
        assert [int(s) for s in segments] == [(rank + 1 + k) % world for k in range(world)]
        assert int(segments[-1]) == rank
        assert (out[:, 0] // per_segment == out[:, 2]).all()


def test_swizzle_compiles_for_sm90():
    signature, constexprs = cuda_compile.signature_of(
        order_kernel, [("pointer", np.int32), ("scalar", 8), ("scalar", 4), ("scalar", 1),
                       ("scalar", 4)],
        {"MODE": "rotated", "GROUP_M": 4, "DIRECTION": 1, "BLOCK": 64})
    assert cuda_compile.compile_kernel(order_kernel, signature, constexprs).asm["cubin"]
