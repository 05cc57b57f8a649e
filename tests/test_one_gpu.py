"""Several ranks of each distributed kernel on one GPU: CUDA memory ordering under real
concurrency (skipped without a GPU)."""

import numpy as np
import pytest
import triton
import triton.language as tl
from gpu_support import have_gpu

import jax_triton_dist.language as dl
from jax_triton_dist import one_gpu
from jax_triton_dist.kernels.allreduce import two_shot_all_reduce_kernel
from jax_triton_dist.kernels.exchange import push_exchange_kernel
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a GPU")]

CALLS = 20


def data(shape, world, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((CALLS, world) + shape).astype(dtype)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_one_shot_all_reduce(world, reduce):
    n = 4000
    x = data((n,), world, seed=world)
    out = one_gpu.run_ranks(
        push_exchange_kernel, world, lambda c, r: [x[c, r]], [((n,), np.float32)],
        [((2, world, n), np.float32), ((2, world, 4), np.int32)], grid=(4,),
        kwargs={"n": n, "SEND_CHUNKS": False, "REDUCE": reduce, "BLOCK": 1024}, calls=CALLS)
    for c in range(CALLS):
        ref = x[c].sum(0) if reduce == "sum" else x[c].max(0)
        for r in range(world):
            np.testing.assert_allclose(out[c][r][0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_all_to_all_and_all_gather(world):
    n = 1500
    x = data((world, n), world, seed=7)
    a2a = one_gpu.run_ranks(
        push_exchange_kernel, world, lambda c, r: [x[c, r]], [((world, n), np.float32)],
        [((2, world, n), np.float32), ((2, world, 2), np.int32)], grid=(2,),
        kwargs={"n": n, "SEND_CHUNKS": True, "REDUCE": "none", "BLOCK": 1024}, calls=CALLS)
    gathered = one_gpu.run_ranks(
        push_exchange_kernel, world, lambda c, r: [x[c, r, 0]], [((world, n), np.float32)],
        [((2, world, n), np.float32), ((2, world, 2), np.int32)], grid=(2,),
        kwargs={"n": n, "SEND_CHUNKS": False, "REDUCE": "none", "BLOCK": 1024}, calls=CALLS)
    for c in range(CALLS):
        for r in range(world):
            np.testing.assert_array_equal(a2a[c][r][0], x[c, :, r])
            np.testing.assert_array_equal(gathered[c][r][0], x[c, :, 0])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_two_shot_all_reduce(world):
    n = 3001
    chunk = triton.cdiv(n, world)
    programs = triton.cdiv(chunk, 512)
    x = data((n,), world, seed=11)
    out = one_gpu.run_ranks(
        two_shot_all_reduce_kernel, world, lambda c, r: [x[c, r]], [((n,), np.float32)],
        [((2, world, chunk), np.float32), ((2, world, chunk), np.float32),
         ((2, 2, world, programs), np.int32)], grid=(programs,),
        kwargs={"n": n, "chunk": chunk, "REDUCE": "sum", "BLOCK": 512}, calls=CALLS)
    for c in range(CALLS):
        for r in range(world):
            np.testing.assert_allclose(out[c][r][0], x[c].sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 8])
def test_ring_exchange(world):
    n = 10000
    x = data((n,), world, seed=3)
    out = one_gpu.run_ranks(
        ring_shift_kernel, world, lambda c, r: [x[c, r]], [((n,), np.float32)],
        [((2, n), np.float32), ((2,), np.int32)], grid=(1,), kwargs={"n": n, "BLOCK": 1024},
        calls=CALLS)
    for c in range(CALLS):
        for r in range(world):
            np.testing.assert_array_equal(out[c][r][0], x[c, (r - 1) % world])


@triton.jit
def put_signal_barrier_kernel(x_ptr, out_ptr, buf_ptr, sig_ptr, n, BLOCK: tl.constexpr):
    me = dl.my_pe()
    dl.putmem_signal(buf_ptr, x_ptr, n, sig_ptr, 1, "add", (me + 1) % dl.n_pes(), BLOCK)
    dl.signal_wait_until(sig_ptr, "ge", dl.epoch())
    dl.getmem(out_ptr, buf_ptr, n, me, BLOCK)
    dl.barrier_all()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_putmem_signal_and_barrier(world):
    n = 2048
    x = data((n,), world, seed=5)
    out = one_gpu.run_ranks(
        put_signal_barrier_kernel, world, lambda c, r: [x[c, r]], [((n,), np.float32)],
        [((n,), np.float32), ((1,), np.uint64)], grid=(1,), kwargs={"n": n, "BLOCK": 512},
        calls=CALLS)
    for c in range(CALLS):
        for r in range(world):
            np.testing.assert_array_equal(out[c][r][0], x[c, (r - 1) % world])


# The fused kernels' stream-K workspaces, unused by their other forms
NO_STREAM_K = [((1,), np.float32), ((1,), np.int32)]

# The fused kernels' forms with different exchanges: one tile a program (a flag per tile
# and peer); persistent (3 programs over 4 tiles, or 2/3 of a grid's tiles: a program's
# tiles start at different positions in different segments), whose one-shot GEMM+AR and
# GEMM+RS raise one flag per program and peer; with tensor descriptors (GEMM+RS: its own
# tiles summed through the slots' descriptor, its loops flattened).
EXCHANGE_FORMS = ["per-tile", "persistent", "persistent-tma"]


@pytest.mark.parametrize("form", EXCHANGE_FORMS)
@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_matmul_all_reduce_kernel(world, two_shot, form):
    from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel

    m, k, n = 32, 256, 192
    rng = np.random.default_rng(world)
    xs = rng.standard_normal((CALLS, world, m, k)).astype(np.float32)
    w = rng.standard_normal((world, k, n)).astype(np.float32) / 16
    tiles = 2 * 2  # BLOCK_M=16 over m=32, BLOCK_N=128 over n=192
    form_kwargs = {"per-tile": {}, "persistent": {"PERSISTENT": True},
                   "persistent-tma": {"PERSISTENT": True, "USE_TMA": True}}[form]
    out = one_gpu.run_ranks(
        matmul_all_reduce_kernel, world, lambda c, r: [xs[c, r], w[r]], [((m, n), np.float32)],
        [((2, world, m, n), np.float32), ((2, 2, world, tiles), np.int32), *NO_STREAM_K],
        grid=(3 if form_kwargs else tiles,),
        kwargs={"M": m, "N": n, "K": k, "stride_am": k, "stride_ak": 1, "stride_bk": n,
                "stride_bn": 1, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                "TWO_SHOT": two_shot, **form_kwargs},
        calls=CALLS)
    for c in range(CALLS):
        ref = np.einsum("rmk,rkn->mn", xs[c].astype(np.float64), w.astype(np.float64))
        for r in range(world):  # tf32 tensor cores for float32 inputs
            assert np.linalg.norm(out[c][r][0] - ref) / np.linalg.norm(ref) < 5e-3
            np.testing.assert_array_equal(out[c][r][0], out[c][0][0])  # rank-order sums


@pytest.mark.parametrize("form", EXCHANGE_FORMS)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_matmul_reduce_scatter_kernel(world, form):
    from jax_triton_dist.kernels.gemm_collectives import matmul_reduce_scatter_kernel

    seg, k, n = 64, 128, 128
    rng = np.random.default_rng(world + 1)
    xs = rng.standard_normal((CALLS, world, world * seg, k)).astype(np.float32)
    w = rng.standard_normal((world, k, n)).astype(np.float32) / 12
    per_segment = 2  # BLOCK_M=32 over 64 rows, BLOCK_N=128 over 128 columns
    form_kwargs = {"per-tile": {}, "persistent": {"PERSISTENT": True},
                   "persistent-tma": {"PERSISTENT": True, "USE_TMA": True, "FLATTEN": True,
                                      "SUM_TMA": True}}[form]
    tiles = world * per_segment
    out = one_gpu.run_ranks(
        matmul_reduce_scatter_kernel, world, lambda c, r: [xs[c, r], w[r], w[r, 0]],
        [((seg, n), np.float32)],
        [((2, world, seg, n), np.float32), ((2, world, per_segment), np.int32),
         *NO_STREAM_K], grid=(tiles * 2 // 3 if form_kwargs else tiles,),
        kwargs={"seg": seg, "N": n, "K": k, "R": seg, "stride_wk": n, "stride_wn": 1,
                "BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, **form_kwargs},
        calls=CALLS)
    for c in range(CALLS):
        full = np.einsum("rmk,rkn->mn", xs[c].astype(np.float64), w.astype(np.float64))
        for r in range(world):
            want = full[r * seg:(r + 1) * seg]
            assert np.linalg.norm(out[c][r][0] - want) / np.linalg.norm(want) < 5e-3


# The tensor-descriptor store form with 40-row shards in 32-row tiles: each shard's last
# tile is clipped at the shard's end (a store past it would land in the next shard's rows).
AG_FORMS = {"pointers": (64, {}),
            "tma-store": (40, {"USE_TMA": True, "PERSISTENT": True, "TMA_STORE": True})}


@pytest.mark.parametrize("form", list(AG_FORMS))
@pytest.mark.parametrize("world", [2, 4, 8])
def test_all_gather_matmul_kernel_with_symmetric_staging(world, form):
    from jax_triton_dist.kernels.gemm_collectives import all_gather_matmul_kernel

    m, extra = AG_FORMS[form]
    k, n = 128, 128
    rng = np.random.default_rng(world + 2)
    xs = rng.standard_normal((CALLS, world, m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) / 12
    tiles = 2  # BLOCK_M=32 over the shard's rows, BLOCK_N=128 over 128 columns
    grid = max(1, world * tiles // 3) if extra.get("PERSISTENT") else world * tiles  # loops
    out = one_gpu.run_ranks(
        all_gather_matmul_kernel, world, lambda c, r: [xs[c, r], w, w[0]],
        [((world * m, n), np.float32)], [((2, world), np.int32), *NO_STREAM_K],
        grid=(grid,),
        kwargs={"m": m, "N": n, "K": k, "R": m, "stride_wk": n, "stride_wn": 1, "BLOCK_M": 32,
                "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, **extra},
        calls=CALLS, symmetric=[0])
    for c in range(CALLS):
        want = xs[c].reshape(world * m, k).astype(np.float64) @ w.astype(np.float64)
        for r in range(world):  # tf32 tensor cores for float32 inputs
            assert np.linalg.norm(out[c][r][0] - want) / np.linalg.norm(want) < 5e-3
