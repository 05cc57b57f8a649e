"""Fused GEMM + communication ops vs jnp.dot in float32 composed with jax.lax collectives."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist.runtime import cpu_dispatch


def mesh_1d(ranks):
    return Mesh(np.array(jax.devices("cpu")[:ranks]), ("x",))


def inputs(ranks, m, k_local, n, dtype, seed):
    """Global x [M, ranks * K_local] and w [ranks * K_local, N]: K is split over ranks."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, ranks * k_local)), dtype)
    w = jnp.asarray(rng.standard_normal((ranks * k_local, n)) / np.sqrt(ranks * k_local), dtype)
    return x, w


def reference(x, w):
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)


def run_mar(mesh, axis, x, w):
    specs = (P(None, axis), P(axis, None))  # K split over the axis
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, axis), mesh=mesh,
                              in_specs=specs, out_specs=P(axis)))
    out = f(jax.device_put(x, NamedSharding(mesh, specs[0])),
            jax.device_put(w, NamedSharding(mesh, specs[1])))
    ranks = mesh.shape[axis]
    return np.asarray(out, np.float32).reshape((ranks,) + (x.shape[0], w.shape[1]))


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_all_reduce(ranks, dtype):
    x, w = inputs(ranks, m=5, k_local=24, n=40, dtype=dtype, seed=ranks)
    out = run_mar(mesh_1d(ranks), "x", x, w)
    ref = np.asarray(reference(x, w))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for r in range(ranks):  # every rank holds the whole sum
        assert np.linalg.norm(out[r] - ref) / np.linalg.norm(ref) < tol
    if dtype == jnp.float32:
        assert all(np.array_equal(out[0], out[r]) for r in range(ranks))  # rank-order sums


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_matmul_all_reduce_on_2x4_mesh(axis):
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "tp"))
    ranks = mesh.shape[axis]
    x, w = inputs(ranks, m=70, k_local=17, n=33, dtype=jnp.float32, seed=3)
    out = run_mar(mesh, axis, x, w)
    for r in range(ranks):
        np.testing.assert_allclose(out[r], np.asarray(reference(x, w)), rtol=1e-4, atol=1e-4)


def test_matmul_all_reduce_gradients_match_lax():
    ranks = 4
    mesh = mesh_1d(ranks)
    x, w = inputs(ranks, m=6, k_local=16, n=20, dtype=jnp.float32, seed=9)
    specs = (P(None, "x"), P("x", None))
    weights = jnp.asarray(np.random.default_rng(10).standard_normal((ranks * 6, 20)), jnp.float32)

    def loss(fn):
        f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x"))
        return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * weights), argnums=(0, 1)))

    ours = loss(lambda a, b: jtd.matmul_all_reduce(a, b, "x"))(x, w)
    ref = loss(lambda a, b: jax.lax.psum(jnp.dot(a, b), "x"))(x, w)
    for got, want in zip(ours, ref, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_matmul_all_reduce_200_back_to_back_calls():
    ranks, steps = 4, 200
    mesh = mesh_1d(ranks)
    rng = np.random.default_rng(20)
    xs = jnp.asarray(rng.standard_normal((steps, 3, ranks * 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((ranks * 8, 16)), jnp.float32)

    def body(xs, w):
        return jax.lax.scan(lambda c, x: (c, jtd.matmul_all_reduce(x, w, "x")), 0, xs)[1]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "x"), P("x", None)),
                              out_specs=P(None, "x")))
    out = np.asarray(f(xs, w)).reshape(steps, ranks, 3, 16)
    ref = np.asarray(jnp.einsum("smk,kn->smn", xs, w, precision=jax.lax.Precision.HIGHEST))
    for r in range(ranks):
        np.testing.assert_allclose(out[:, r], ref, rtol=1e-4, atol=1e-4)


def test_matmul_all_reduce_with_a_straggler(monkeypatch):
    mesh = mesh_1d(4)
    slow_pe = mesh.devices[3].id
    original = cpu_dispatch._run

    def delayed(call_id, device_ordinal, arg_ptrs, ret_ptrs):
        if device_ordinal == slow_pe:
            time.sleep(0.05)
        return original(call_id, device_ordinal, arg_ptrs, ret_ptrs)

    monkeypatch.setattr(cpu_dispatch, "_run", delayed)
    for seed in range(3):
        x, w = inputs(4, m=9, k_local=8, n=24, dtype=jnp.float32, seed=seed)
        out = run_mar(mesh, "x", x, w)
        for r in range(4):
            np.testing.assert_allclose(out[r], np.asarray(reference(x, w)), rtol=1e-4, atol=1e-4)


def test_fused_kernel_is_what_runs():
    mesh = mesh_1d(4)
    x, w = inputs(4, m=4, k_local=16, n=16, dtype=jnp.float32, seed=0)
    specs = (P(None, "x"), P("x", None))
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, "x"), mesh=mesh,
                              in_specs=specs, out_specs=P("x")))
    hlo = f.lower(jax.device_put(x, NamedSharding(mesh, specs[0])),
                  jax.device_put(w, NamedSharding(mesh, specs[1]))).compile().as_text()
    assert "jtd_triton" in hlo
    assert "all-reduce" not in hlo and " dot(" not in hlo


def test_matmul_all_reduce_errors():
    mesh = mesh_1d(2)
    specs = (P(None, "x"), P("x", None))

    def trace(x, w):
        f = jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, "x"), mesh=mesh,
                          in_specs=specs, out_specs=P("x"))
        return jax.jit(f).lower(x, w)

    with pytest.raises(ValueError, match=r"x.shape\[1\] must equal w.shape\[0\]"):
        trace(jnp.ones((4, 8)), jnp.ones((6, 4)))
    with pytest.raises(TypeError, match="one dtype, got float32 and bfloat16"):
        trace(jnp.ones((4, 8)), jnp.ones((8, 4), jnp.bfloat16))
    with pytest.raises(TypeError, match="unsupported dtype int32"):
        trace(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 4), jnp.int32))
    with pytest.raises(ValueError, match="must be 2-D"):
        trace(jnp.ones((4, 8, 2)), jnp.ones((8, 4)))
