"""The GEMM tile kernel vs jnp.dot in float32 (CPU); it compiles to wgmma for sm_90."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_triton_dist.bench import gemm
from jax_triton_dist.kernels.gemm import matmul_kernel, matmul_stream_k_kernel
from jax_triton_dist.runtime import cuda_compile


@pytest.mark.parametrize("m,n,k", [(64, 48, 48), (130, 70, 33), (1, 16, 200)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_matches_jnp_dot(m, n, k, dtype):
    rng = np.random.default_rng(m + n + k)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    b = jnp.asarray(rng.standard_normal((k, n)), dtype)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    ref = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    tile = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4,
            "num_stages": 3}
    configs = [dict(tile, PERSISTENT=False), dict(tile, PERSISTENT=True), dict(tile, SPLIT_K=3)]
    if k % 16 == 0 and n % 16 == 0:  # tensor descriptors need 16-byte aligned rows
        configs += [dict(tile, PERSISTENT=p, USE_TMA=True) for p in (False, True)]
        configs += [dict(tile, PERSISTENT=True, USE_TMA=True, FLATTEN=True)]
        configs += [dict(tile, PERSISTENT=True, USE_TMA=True, FLATTEN=f, TMA_STORE=True,
                         SUBTILE=sub) for f in (False, True) for sub in (False, True)]
        configs += [dict(tile, PERSISTENT=p, USE_TMA=True, WARP_SPECIALIZE=True, TMA_STORE=True)
                    for p in (False, True)]
    for config in configs:
        f = jax.jit(jax.shard_map(lambda x, y, c=config: gemm.matmul(x, y, c), mesh=mesh,
                                  in_specs=(P(), P()), out_specs=P(), check_vma=False))
        for _ in range(3):  # split-K: the sums and counts carry over between calls
            ours = np.asarray(f(a, b), np.float32)
            assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < tol, config
            a, b = a * 0.5, b * 2.0


@pytest.mark.parametrize("m,n,k,programs", [(96, 80, 208, 5), (130, 64, 96, 4),
                                             (32, 32, 160, 3), (64, 64, 32, 16),
                                             pytest.param(96, 96, 512, 11,
                                                          marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [jnp.float32,
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_stream_k_matches_jnp_dot(m, n, k, programs, dtype):
    """Stream-K (descriptors, and pointers as on Ascend): runs of K blocks that split tiles
    between programs (a tile split over two and three programs, runs that end on a tile's
    edge, programs with empty runs when there are fewer K blocks than programs), then
    whole tiles; three calls, so the tiles' counts must be back at zero after each. And
    the in-step split (heads of their own, tails in runs that meet up to five tiles at
    96x96x512 on 11 programs; no heads when there are fewer K blocks than programs)."""
    rng = np.random.default_rng(m * n + k)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    b = jnp.asarray(rng.standard_normal((k, n)), dtype)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    tile = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4,
            "num_stages": 3, "PERSISTENT": True, "USE_TMA": True, "STREAM_K": True}
    for form in ({}, {"FLATTEN": True, "TMA_STORE": True}, {"USE_TMA": False},
                 {"IN_STEP": True}, {"IN_STEP": True, "USE_TMA": False}):
        config = dict(tile, **form)
        f = jax.jit(jax.shard_map(
            lambda x, y, c=config: gemm.matmul(x, y, c, programs=programs), mesh=mesh,
            in_specs=(P(), P()), out_specs=P(), check_vma=False))
        for _ in range(3):
            ref = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
            ours = np.asarray(f(a, b), np.float32)
            assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < tol, form
            a, b = a * 0.5, b * 2.0 + 1.0


def test_stream_k_slots_count_the_tiles_a_run_meets():
    from jax_triton_dist import tiles

    assert tiles.stream_k_slots(132, 352, 64) == 2
    # 88 split tiles: heads of 42 blocks, tails of 22 in runs of 44 (two tails each)
    assert tiles.stream_k_slots(132, 352, 64, in_step=True) == 2
    # 120 split tiles: heads of 58, tails of 6 in runs of 60 (ten whole tails)
    assert tiles.stream_k_slots(132, 384, 64, in_step=True) == 10
    # 9 tiles of 32 blocks on 11 programs: heads of 26, tails of 6 in runs of 27 (five)
    assert tiles.stream_k_slots(11, 9, 32, in_step=True) == 5
    # fewer split blocks than programs: no heads, runs of one block
    assert tiles.stream_k_slots(16, 1, 2, in_step=True) == 1


def test_stream_k_configs_where_tiles_leave_a_partial_wave():
    from jax_triton_dist import tiles

    configs = tiles.stream_k_configs(8192, 8192, 8192)
    assert configs and all(c["STREAM_K"] and c["PERSISTENT"] for c in configs)
    assert {c["USE_TMA"] for c in configs} == {False, True}
    assert all(c.get("FLATTEN", False) == c.get("TMA_STORE", False) for c in configs)
    assert not any(c.get("SUBTILE") for c in configs)  # the stream-K kernel stores whole tiles
    assert all(tiles.gemm_shared_bytes(c) <= 227 * 1024 for c in configs)
    # 132 tiles of 64x64 fill one wave exactly: no stream-K form of that config
    assert not any(c["BLOCK_M"] == 64 and c["BLOCK_N"] == 64
                   for c in tiles.stream_k_configs(64 * 12, 64 * 11, 4096))
    assert tiles.stream_k_configs(8192, 8192, 8192, target="ascend") == []
    unaligned = tiles.stream_k_configs(130, 70, 33)  # rows not 16-byte aligned: pointers
    assert unaligned and not any(c["USE_TMA"] for c in unaligned)
    assert tiles.gemm_tile_configs(128, 1376, 4096) == (
        tiles.gemm_configs(128, 1376, 4096, tma=True, tile_kernel=True)
        + tiles.split_k_configs(128, 1376, 4096) + tiles.stream_k_configs(128, 1376, 4096))


@pytest.mark.parametrize("flatten, in_step", [(False, False), (True, False), (False, True)],
                         ids=["tiles", "flattened-tma-store", "in-step"])
def test_stream_k_compiles_for_sm90(flatten, in_step):
    positional = ([("pointer", np.dtype(jnp.bfloat16))] * 3
                  + [("pointer", np.dtype(np.float32)), ("pointer", np.dtype(np.int32))])
    kwargs = {"M": 8192, "N": 8192, "K": 8192, "stride_am": 8192, "stride_ak": 1,
              "stride_bk": 8192, "stride_bn": 1, "stride_cm": 8192, "stride_cn": 1,
              "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
              "FLATTEN": flatten, "TMA_STORE": flatten, "IN_STEP": in_step, "SLOTS": 3}
    signature, constexprs = cuda_compile.signature_of(matmul_stream_k_kernel, positional, kwargs)
    attrs = cuda_compile.divisibility(signature, positional, kwargs)
    ptx = cuda_compile.compile_kernel(matmul_stream_k_kernel, signature, constexprs,
                                      attrs=attrs, num_warps=8, num_stages=3).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx  # the tiles' counts


def test_bf16_matmul_uses_wgmma_on_sm90():
    positional = [("pointer", np.dtype(jnp.bfloat16))] * 3
    kwargs = {"M": 8192, "N": 8192, "K": 8192, "stride_am": 8192, "stride_ak": 1,
              "stride_bk": 8192, "stride_bn": 1, "stride_cm": 8192, "stride_cn": 1,
              "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}
    signature, constexprs = cuda_compile.signature_of(matmul_kernel, positional, kwargs)
    attrs = cuda_compile.divisibility(signature, positional, kwargs)
    compiled = cuda_compile.compile_kernel(matmul_kernel, signature, constexprs, attrs=attrs,
                                           num_warps=8, num_stages=3)
    assert "wgmma.mma_async" in compiled.asm["ptx"]


@pytest.mark.parametrize("tma_store", [False, True], ids=["stores", "tma-store"])
def test_flattened_persistent_tma_tile_compiles_for_sm90(tma_store):
    """The FLATTEN form: descriptors made once, one pipelined loop, bulk tensor copies
    (``TMA_STORE``: out of shared memory into C as well)."""
    positional = [("pointer", np.dtype(jnp.bfloat16))] * 3
    kwargs = {"M": 8192, "N": 4096, "K": 1376, "stride_am": 1376, "stride_ak": 1,
              "stride_bk": 4096, "stride_bn": 1, "stride_cm": 4096, "stride_cn": 1,
              "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": True,
              "USE_TMA": True, "FLATTEN": True, "TMA_STORE": tma_store}
    signature, constexprs = cuda_compile.signature_of(matmul_kernel, positional, kwargs)
    attrs = cuda_compile.divisibility(signature, positional, kwargs)
    ptx = cuda_compile.compile_kernel(matmul_kernel, signature, constexprs, attrs=attrs,
                                      num_warps=8, num_stages=3).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert ptx.count("tensormap") >= (3 if tma_store else 2)  # descriptors, made once
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == tma_store


@pytest.mark.parametrize("flatten", [False, True], ids=["tiles", "flattened"])
def test_subtiled_store_fits_four_stages_on_sm90(flatten):
    """``SUBTILE``: the output tile leaves in two halves through a ``[128, 128]`` descriptor,
    so 128x256x64 with 4 stages fits an SM's 227 KiB (the whole tile's staging buffer
    would not), as ``tiles.gemm_shared_bytes`` counts it (a few barriers aside)."""
    from jax_triton_dist import tiles

    positional = [("pointer", np.dtype(jnp.bfloat16))] * 3
    kwargs = {"M": 8192, "N": 1376, "K": 4096, "stride_am": 4096, "stride_ak": 1,
              "stride_bk": 1376, "stride_bn": 1, "stride_cm": 1376, "stride_cn": 1,
              "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": True,
              "USE_TMA": True, "FLATTEN": flatten, "TMA_STORE": True, "SUBTILE": True}
    signature, constexprs = cuda_compile.signature_of(matmul_kernel, positional, kwargs)
    attrs = cuda_compile.divisibility(signature, positional, kwargs)
    compiled = cuda_compile.compile_kernel(matmul_kernel, signature, constexprs, attrs=attrs,
                                           num_warps=8, num_stages=4)
    counted = tiles.gemm_shared_bytes(dict(kwargs, num_stages=4))
    assert counted <= compiled.metadata.shared <= min(counted + 1024, 227 * 1024)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    # two bulk tensor stores per tile (the halves), one more copy where the loop is peeled
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared") >= 2


def _ws_tile(persistent: bool, tma_store: bool):
    positional = [("pointer", np.dtype(jnp.bfloat16))] * 3
    kwargs = {"M": 8192, "N": 1376, "K": 4096, "stride_am": 4096, "stride_ak": 1,
              "stride_bk": 1376, "stride_bn": 1, "stride_cm": 1376, "stride_cn": 1,
              "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
              "PERSISTENT": persistent, "USE_TMA": True, "TMA_STORE": tma_store,
              "WARP_SPECIALIZE": True}
    signature, constexprs = cuda_compile.signature_of(matmul_kernel, positional, kwargs)
    return signature, constexprs, cuda_compile.divisibility(signature, positional, kwargs)


@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
def test_warp_specialized_tile_compiles_for_sm90(persistent):
    """``WARP_SPECIALIZE`` with ``num_warps=4``: Triton partitions the K loop (a producer
    warp group and two consumer groups: 12 warps, registers moved between them); with 8
    warps it leaves the loop as it is, which is why the WS configs are compiled with 4."""
    signature, constexprs, attrs = _ws_tile(persistent, True)
    for warps, specialized in ((4, True), (8, False)):
        compiled = cuda_compile.compile_kernel(matmul_kernel, signature, constexprs,
                                               attrs=attrs, num_warps=warps, num_stages=3)
        assert ("ttg.warp_specialize" in compiled.asm["ttgir"]) == specialized
        assert ("setmaxnreg" in compiled.asm["ptx"]) == specialized
        assert compiled.metadata.num_warps == (12 if specialized else warps)
        assert "wgmma.mma_async" in compiled.asm["ptx"]


def test_warp_specialized_tile_without_tma_store_is_refused():
    signature, constexprs, attrs = _ws_tile(True, False)
    with pytest.raises(Exception, match="WARP_SPECIALIZE needs TMA_STORE"):
        cuda_compile.compile_kernel(matmul_kernel, signature, constexprs, attrs=attrs,
                                    num_warps=4, num_stages=3)


def test_gemm_benchmark_rows():
    rows = gemm.run([(40, 24, 16)], iters=1, dtype="float32", platform="cpu")
    assert rows[0]["shape"] == "40x24x16" and rows[0]["rel_err"] < 1e-5
    assert rows[0]["best_us"] > 0 and rows[0]["xla_us"] > 0
    # cuBLAS through PyTorch only where PyTorch has a GPU (never on the CPU platform)
    assert np.isnan(rows[0]["cublas_us"]) and np.isnan(rows[0]["cublas_ratio"])
    assert gemm.cublas_seconds(8, 8, 8, "float32", 1) is None  # no PyTorch GPU here


def test_tma_configs_only_where_rows_are_aligned():
    from jax_triton_dist import tiles

    plain = tiles.gemm_configs(8192, 1376, 4096)
    both = tiles.gemm_configs(8192, 1376, 4096, tma=True)
    assert not any(c["USE_TMA"] for c in plain)
    assert both == plain + [dict(c, USE_TMA=True) for c in plain]
    tile = tiles.gemm_configs(8192, 1376, 4096, tma=True, tile_kernel=True)
    persistent = [c for c in both if c["USE_TMA"] and c["PERSISTENT"]]
    assert persistent and tile[:len(both)] == both
    # (TMA_STORE, FLATTEN, SUBTILE) after both
    forms = [(False, True, False), (True, False, False), (True, True, False),
             (True, False, True), (True, True, True)]
    fits = lambda c: tiles.gemm_shared_bytes(c) <= 227 * 1024  # noqa: E731
    shaped = [form for s, f, sub in forms for c in persistent
              if fits(form := dict(c, FLATTEN=f, **({"TMA_STORE": True} if s else {}),
                                   **({"SUBTILE": True} if sub else {})))]
    assert tile[len(both):len(both) + len(shaped)] == shaped
    # then the warp-specialized forms of the 8-warp descriptor configs, compiled with 4
    wide = [c for c in both if c["USE_TMA"] and c["num_warps"] == 8]
    assert wide and tile[len(both) + len(shaped):] == [
        form for c in wide
        if fits(form := dict(c, num_warps=4, WARP_SPECIALIZE=True, TMA_STORE=True))]
    # 128x256x64 with 4 stages fits (192 KiB) but not with the output's staging buffer,
    # only with half of it
    deep = [c for c in persistent if c["BLOCK_N"] == 256 and c["num_stages"] == 4]
    assert deep and all(dict(c, TMA_STORE=True, FLATTEN=f) not in tile
                        and dict(c, TMA_STORE=True, FLATTEN=f, SUBTILE=True) in tile
                        for c in deep for f in (False, True))
    assert all(fits(c) for c in tile)
    assert tiles.gemm_configs(130, 70, 33, tma=True) == tiles.gemm_configs(130, 70, 33)
    assert tiles.gemm_configs(64, 64, 64, target="ascend", tma=True) == tiles.gemm_configs(
        64, 64, 64, target="ascend")


def test_split_k_configs_only_for_decode_shapes():
    from jax_triton_dist import tiles

    assert tiles.split_k_configs(8192, 8192, 8192) == []
    decode = tiles.split_k_configs(128, 1376, 4096)
    assert [c["SPLIT_K"] for c in decode] == [2, 3, 4]
    assert all(c["BLOCK_M"] == 64 and c["BLOCK_K"] == 128 for c in decode)
    assert tiles.split_k_configs(128, 1376, 4096, target="ascend") == []
