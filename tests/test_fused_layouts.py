"""The fused ops with the weight stored [N, K] (w_layout="nk"): values, both derivative
modes, vmap over the weight, and the transposes' own layouts (no transposed copy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd

OPS = {
    # op: (x spec, w spec for [K, N], out spec, reference on [K, N] weights)
    "all_gather_matmul": (P("x"), P(None, "x"), P(None, "x"),
                          lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w),
    "matmul_reduce_scatter": (P(None, "x"), P("x", None), P("x"),
                              lambda x, w: jax.lax.psum_scatter(x @ w, "x", tiled=True)),
    "matmul_all_reduce": (P(None, "x"), P("x", None), P(),
                          lambda x, w: jax.lax.psum(x @ w, "x")),
}


def _flip(spec):
    return P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))


def _case(op, ranks, dtype, seed):
    rng = np.random.default_rng(seed)
    x_spec, w_spec, out_spec, ref = OPS[op]
    m, k, n = 8 * ranks, 16 * ranks, 8 * ranks
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / 4, jnp.float32).astype(dtype)
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("x",))
    ours = jax.shard_map(lambda a, b: getattr(jtd, op)(a, b, "x", w_layout="nk"), mesh=mesh,
                         in_specs=(x_spec, _flip(w_spec)), out_specs=out_spec)
    lax = jax.shard_map(ref, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    return x, w, ours, lax


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("ranks, dtype", [(1, jnp.float32), (2, jnp.bfloat16),
                                          (4, jnp.float32), (8, jnp.float16)])
def test_nk_layout_matches_lax(op, ranks, dtype):
    x, w, ours, lax = _case(op, ranks, dtype, seed=ranks)
    got = jax.jit(ours)(x, w.T)
    want = jax.jit(lax)(x.astype(jnp.float32), w.astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("op", list(OPS))
def test_nk_layout_gradients_both_modes(op):
    x, w, ours, lax = _case(op, 4, jnp.float32, seed=11)
    wt = w.T

    def loss(f):
        return lambda a, b: jnp.sum(jnp.sin(f(a, b)))

    gx, gw = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, wt)
    rx, rw = jax.jit(jax.grad(loss(lax), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, rw.T, rtol=1e-4, atol=1e-4)
    _, tangent = jax.jit(lambda a, b: jax.jvp(ours, (a, b), (a, b)))(x, wt)
    _, want = jax.jit(lambda a, b: jax.jvp(lax, (a, b), (a, b)))(x, w)
    np.testing.assert_allclose(tangent, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_backward_makes_no_transposed_weight_copy(op, layout):
    """The x cotangent of one op is the other op reading the same weight the other way
    round: the backward holds no transpose, in either layout."""
    x, w, _, _ = _case(op, 4, jnp.float32, seed=3)
    x_spec, w_spec, out_spec, _ = OPS[op]
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    ours = jax.shard_map(lambda a, b: getattr(jtd, op)(a, b, "x", w_layout=layout),
                         mesh=mesh, in_specs=(x_spec, w_spec if layout == "kn"
                                              else _flip(w_spec)), out_specs=out_spec)
    grad_x = jax.jit(jax.grad(lambda a, b: jnp.sum(ours(a, b) ** 2), argnums=0))
    text = grad_x.lower(x, w if layout == "kn" else w.T).as_text()
    assert text.count("jtd_triton") >= 2 and "transpose" not in text


@pytest.mark.parametrize("op", list(OPS))
def test_vmap_over_an_nk_weight(op):
    x, w, ours, lax = _case(op, 2, jnp.float32, seed=5)
    ws = jnp.stack([w, 2 * w, -w])
    got = jax.jit(jax.vmap(ours, in_axes=(None, 0)))(x, jnp.swapaxes(ws, 1, 2))
    want = jax.jit(jax.vmap(lax, in_axes=(None, 0)))(x, ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_layout_errors():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))

    def run(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                     check_vma=False))(x, w)

    with pytest.raises(ValueError, match="w_layout must be one of"):
        run(lambda a, b: jtd.all_gather_matmul(a, b, "x", w_layout="mk"))
    with pytest.raises(ValueError, match=r"\('nk' layout\): x.shape\[1\] must equal "
                                         r"w.shape\[1\]"):
        run(lambda a, b: jtd.all_gather_matmul(a, b, "x", w_layout="nk"))
