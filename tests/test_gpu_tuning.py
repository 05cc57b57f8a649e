"""The autotuner and the persistent fused kernels on the GPU (skipped without one): ops
tuned at world size 1 under JAX, the ranks of one GPU tuning together, persistent kernels
at 2-8 ranks sharing the GPU, co-residency checked, the benchmarks' timers."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_support import have_gpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist import one_gpu
from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel
from jax_triton_dist.kernels.gemm_collectives import (
    all_gather_matmul_kernel,
    matmul_reduce_scatter_kernel,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a GPU")]
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
CALLS = 5


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JTD_AUTOTUNE", "gpu")
    monkeypatch.setenv("JTD_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))


def test_fused_op_tunes_on_the_gpu_and_matches_jnp_dot():
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 384)) / 16, jnp.bfloat16)
    f = jax.jit(jax.shard_map(lambda a, b: jtd.all_gather_matmul(a, b, "x"), mesh=mesh,
                              in_specs=(P(), P()), out_specs=P(), check_vma=False))
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P()))  # noqa: E731
    out = f(put(x), put(w))
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    assert float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)) < 1e-2
    entries = jtd.autotune.cache_entries()
    assert len(entries) == 1
    (entry,) = entries.values()
    assert entry["kernel"] == "all_gather_matmul_kernel" and len(entry["times_us"]) > 1
    assert entry["call"]["device"] == jax.devices()[0].device_kind


def _wrong_but_fastest():
    import tuned_shift

    configs = [jtd.autotune.Config({"BLOCK": 256}),
               jtd.autotune.Config({"BLOCK": 128, "WRONG": True}),
               jtd.autotune.Config({"BLOCK": 64})]
    return tuned_shift, tuned_shift.make(
        lambda config, rank, seconds: 1e-6 if config.kwargs.get("WRONG") else seconds,
        configs=configs, check=True)


def test_check_skips_a_wrong_config_on_the_gpu_under_jax():
    tuned_shift, kernel = _wrong_but_fastest()
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    f = jax.jit(jax.shard_map(lambda v: tuned_shift.shift(kernel, v, "x"), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    x = jnp.arange(tuned_shift.N, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))  # a ring of one
    assert {rec.index for rec in kernel.records} != {1}
    assert kernel.records[0].times[1] is None and kernel.records[0].times[0] is not None


def _shift_sharing_the_gpu(kernel, world: int, calls: int, seed: int) -> None:
    """Runs the tuned ring shift on ``world`` ranks of one GPU; checks the last call."""
    import tuned_shift

    n = tuned_shift.N
    x = np.random.default_rng(seed).standard_normal((world, n)).astype(np.float32)
    out = one_gpu.run_ranks(kernel, world, lambda c, r: [x[r]], [((n,), np.float32)],
                            lambda meta: [((n,), np.float32),
                                          ((-(-n // meta["BLOCK"]),), np.int32)],
                            lambda meta: (-(-n // meta["BLOCK"]),), {"n": n}, calls=calls)
    for r in range(world):
        np.testing.assert_array_equal(out[-1][r][0], x[(r - 1) % world])


def test_check_skips_a_wrong_config_for_ranks_sharing_the_gpu():
    _, kernel = _wrong_but_fastest()
    _shift_sharing_the_gpu(kernel, 2, calls=2, seed=2)
    assert {rec.index for rec in kernel.records} != {1}
    assert kernel.records[0].times[1] is None


def test_ranks_sharing_the_gpu_tune_together():
    import tuned_shift

    kernel = tuned_shift.make()  # real event timings, no timer
    _shift_sharing_the_gpu(kernel, 4, calls=3, seed=1)
    assert len({rec.index for rec in kernel.records}) == 1
    assert {rec.source for rec in kernel.records} == {"tuned"}
    assert all(t is not None and t > 0 for t in kernel.records[0].times)


def _persistent(kwargs, programs, stream_k=False, tiles=1):
    """64x64x64 tiles on ``programs`` programs: kwargs, grid and the stream-K workspaces
    (``stream_k``: the shares' slots and ``tiles`` counts; else unused ones)."""
    kwargs = dict(kwargs, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, PERSISTENT=True,
                  STREAM_K=stream_k)
    if stream_k:
        return kwargs, (programs,), [((programs, 2, 64, 64), np.float32), ((tiles,), np.int32)]
    return kwargs, (programs,), [((1,), np.float32), ((1,), np.int32)]


STREAM_K = pytest.mark.parametrize("stream_k", [False, True], ids=["tiles", "stream-k"])


@STREAM_K
@pytest.mark.parametrize("world", [2, 8])
def test_persistent_all_gather_matmul(world, stream_k):
    m, k, n = 128, 128, 192
    rng = np.random.default_rng(world)
    xs = rng.standard_normal((CALLS, world, m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) / 12
    kwargs, grid, sk = _persistent({"m": m, "N": n, "K": k, "R": m, "stride_wk": n,
                                    "stride_wn": 1}, 132 // world, stream_k, world * 2 * 3)
    out = one_gpu.run_ranks(all_gather_matmul_kernel, world, lambda c, r: [xs[c, r], w, w[0]],
                            [((world * m, n), np.float32)], [((2, world), np.int32), *sk], grid,
                            kwargs, calls=CALLS, symmetric=[0])
    for c in range(CALLS):
        want = xs[c].reshape(world * m, k).astype(np.float64) @ w.astype(np.float64)
        for r in range(world):
            assert np.linalg.norm(out[c][r][0] - want) / np.linalg.norm(want) < 5e-3


@STREAM_K
@pytest.mark.parametrize("world", [2, 8])
def test_persistent_matmul_reduce_scatter(world, stream_k):
    seg, k, n = 128, 128, 128
    rng = np.random.default_rng(world + 1)
    xs = rng.standard_normal((CALLS, world, world * seg, k)).astype(np.float32)
    w = rng.standard_normal((world, k, n)).astype(np.float32) / 12
    per_segment = (seg // 64) * (n // 64)
    kwargs, grid, sk = _persistent({"seg": seg, "N": n, "K": k, "R": seg, "stride_wk": n,
                                    "stride_wn": 1}, 132 // world, stream_k, world * per_segment)
    out = one_gpu.run_ranks(
        matmul_reduce_scatter_kernel, world, lambda c, r: [xs[c, r], w[r], w[r, 0]],
        [((seg, n), np.float32)],
        [((2, world, seg, n), np.float32), ((2, world, per_segment), np.int32), *sk], grid,
        kwargs, calls=CALLS)
    for c in range(CALLS):
        full = np.einsum("rmk,rkn->mn", xs[c].astype(np.float64), w.astype(np.float64))
        for r in range(world):
            want = full[r * seg:(r + 1) * seg]
            assert np.linalg.norm(out[c][r][0] - want) / np.linalg.norm(want) < 5e-3


@STREAM_K
@pytest.mark.parametrize("world", [2, 8])
def test_persistent_matmul_all_reduce(world, stream_k):
    m, k, n = 64, 256, 256
    rng = np.random.default_rng(world + 2)
    xs = rng.standard_normal((CALLS, world, m, k)).astype(np.float32)
    w = rng.standard_normal((world, k, n)).astype(np.float32) / 16
    tiles = (m // 64) * (n // 64)
    kwargs, grid, sk = _persistent({"M": m, "N": n, "K": k, "stride_am": k, "stride_ak": 1,
                                    "stride_bk": n, "stride_bn": 1}, 3, stream_k, tiles)
    out = one_gpu.run_ranks(
        matmul_all_reduce_kernel, world, lambda c, r: [xs[c, r], w[r]], [((m, n), np.float32)],
        [((2, world, m, n), np.float32), ((2, 2, world, tiles), np.int32), *sk], grid, kwargs,
        calls=CALLS)
    for c in range(CALLS):
        ref = np.einsum("rmk,rkn->mn", xs[c].astype(np.float64), w.astype(np.float64))
        for r in range(world):
            assert np.linalg.norm(out[c][r][0] - ref) / np.linalg.norm(ref) < 5e-3


def test_a_persistent_grid_that_does_not_fit_is_refused():
    m, k, n = 64, 64, 64
    x = np.ones((m, k), np.float32)
    kwargs, grid, sk = _persistent({"M": m, "N": n, "K": k, "stride_am": k, "stride_ak": 1,
                                    "stride_bk": n, "stride_bn": 1}, 100_000)
    with pytest.raises(ValueError, match="co_resident.*do not fit on it at once"):
        one_gpu.run_ranks(jtd.autotune.autotune([jtd.autotune.Config({}, co_resident=True)],
                                                enabled=False)(matmul_all_reduce_kernel), 2,
                          lambda c, r: [x, x], [((m, n), np.float32)],
                          [((2, 2, m, n), np.float32), ((2, 2, 2, 1), np.int32), *sk], grid,
                          kwargs)


def test_time_ranks_and_kernel_seconds_measure_device_time():
    from jax_triton_dist.bench import device_time
    from jax_triton_dist.kernels.gemm import matmul_kernel

    m = n = k = 1024
    a = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    seconds = one_gpu.time_ranks(
        matmul_kernel, 2, lambda c, r: [a, a], [((m, n), np.float32)], [], (64,),
        {"M": m, "N": n, "K": k, "stride_am": k, "stride_ak": 1, "stride_bk": n,
         "stride_bn": 1, "stride_cm": n, "stride_cn": 1, "BLOCK_M": 128, "BLOCK_N": 128,
         "BLOCK_K": 32, "GROUP_M": 8, "PERSISTENT": True}, calls=3)
    assert len(seconds) == 3 and all(0 < s < 1 for s in seconds)
    dot = jax.jit(jnp.dot)
    x = jnp.ones((2048, 2048), jnp.bfloat16)
    timed = device_time.kernel_seconds(dot, x, x, calls=5)
    assert timed.source == "profiler" and timed.kernels, timed
    assert 0 < timed.seconds < 0.01
