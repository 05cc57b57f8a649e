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
    with pytest.raises(ValueError, match=r"\(.nk. layout\): x.shape\[-1\] must equal "
                                         r"w.shape\[1\]"):
        run(lambda a, b: jtd.all_gather_matmul(a, b, "x", w_layout="nk"))


# ---------------------------------------------------------------------------
# Leading batch dimensions: [batch, seq, d_model] gathered / scattered along the sequence
# ---------------------------------------------------------------------------

SEQ_CASES = [
    # (op, per-rank x shape, axis, x spec, out spec, reference)
    ("all_gather_matmul", (3, 4, 16), 1, P(None, "x"), P(None, None, "x"),
     lambda x, w: jax.lax.all_gather(x, "x", axis=1, tiled=True) @ w),
    ("all_gather_matmul", (2, 3, 4, 16), 2, P(None, None, "x"), P(None, None, None, "x"),
     lambda x, w: jax.lax.all_gather(x, "x", axis=2, tiled=True) @ w),
    ("all_gather_matmul", (8, 2, 16), 0, P("x"), P(None, None, "x"),
     lambda x, w: jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w),
    ("matmul_reduce_scatter", (3, 16, 16), 1, P(None, None, "x"), P(None, "x"),
     lambda x, w: jax.lax.psum_scatter(x @ w, "x", scatter_dimension=1, tiled=True)),
    ("matmul_reduce_scatter", (2, 8, 3, 16), 1, P(None, None, None, "x"), P(None, "x"),
     lambda x, w: jax.lax.psum_scatter(x @ w, "x", scatter_dimension=1, tiled=True)),
]


def _seq_case(op, shape, axis, x_spec, out_spec, ranks, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    k_local, n = shape[-1], 8
    if op == "all_gather_matmul":  # x: sharded along `axis`; w: columns over ranks
        x_global = list(shape)
        x_global[axis] *= ranks
        w_shape, w_spec = (k_local, n * ranks), P(None, "x")
    else:  # K split over the ranks
        x_global = list(shape[:-1]) + [k_local * ranks]
        w_shape, w_spec = (k_local * ranks, n), P("x", None)
    x = jnp.asarray(rng.standard_normal(x_global), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.standard_normal(w_shape) / 4, jnp.float32).astype(dtype)
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("x",))
    kwarg = "gather_axis" if op == "all_gather_matmul" else "scatter_dimension"
    return x, w, mesh, w_spec, kwarg


@pytest.mark.parametrize("case", SEQ_CASES, ids=[f"{c[0]}-{len(c[1])}d-axis{c[2]}"
                                                 for c in SEQ_CASES])
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_leading_batch_dimensions_match_lax(case, ranks):
    op, shape, axis, x_spec, out_spec, ref = case
    x, w, mesh, w_spec, kwarg = _seq_case(op, shape, axis, x_spec, out_spec, ranks, ranks)
    ours = jax.shard_map(lambda a, b: getattr(jtd, op)(a, b, "x", **{kwarg: axis}), mesh=mesh,
                         in_specs=(x_spec, w_spec), out_specs=out_spec)
    lax = jax.shard_map(ref, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    np.testing.assert_allclose(jax.jit(ours)(x, w), jax.jit(lax)(x, w), rtol=1e-5, atol=1e-5)
    # Both derivative modes, and the nk layout of the same weight.
    loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))  # noqa: E731
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, w)
    r = jax.jit(jax.grad(loss(lax), argnums=(0, 1)))(x, w)
    for a, b in zip(g, r, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    _, t = jax.jit(lambda a, b: jax.jvp(ours, (a, b), (a, b)))(x, w)
    _, tr = jax.jit(lambda a, b: jax.jvp(lax, (a, b), (a, b)))(x, w)
    np.testing.assert_allclose(t, tr, rtol=1e-4, atol=1e-4)
    nk = jax.shard_map(lambda a, b: getattr(jtd, op)(a, b, "x", w_layout="nk", **{kwarg: axis}),
                       mesh=mesh, in_specs=(x_spec, _flip(w_spec)), out_specs=out_spec)
    np.testing.assert_allclose(jax.jit(nk)(x, w.T), jax.jit(lax)(x, w), rtol=1e-5, atol=1e-5)


def test_leading_batch_dimensions_bfloat16_and_vmap():
    op, shape, axis, x_spec, out_spec, ref = SEQ_CASES[0]
    x, w, mesh, w_spec, kwarg = _seq_case(op, shape, axis, x_spec, out_spec, 4, 9,
                                          jnp.bfloat16)
    ours = jax.shard_map(lambda a, b: jtd.all_gather_matmul(a, b, "x", gather_axis=1),
                         mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    lax = jax.shard_map(ref, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    want = jax.jit(lax)(x.astype(jnp.float32), w.astype(jnp.float32))
    got = jax.jit(ours)(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=3e-2, atol=3e-2)
    xs = jnp.stack([x, -x]).astype(jnp.float32)
    got = jax.jit(jax.vmap(ours, in_axes=(0, None)))(xs, w.astype(jnp.float32))
    want = jax.jit(jax.vmap(lax, in_axes=(0, None)))(xs, w.astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    text = jax.jit(jax.vmap(ours, in_axes=(0, None))).lower(xs, w.astype(jnp.float32)).as_text()
    assert "transpose" not in text  # the vmapped batch is one more leading dimension


# ---------------------------------------------------------------------------
# Epilogues: bias and activation fused into the kernel
# ---------------------------------------------------------------------------

ACTS = {"relu": jax.nn.relu, "silu": jax.nn.silu,
        "gelu": lambda v: jax.nn.gelu(v, approximate=False),
        "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True), None: lambda v: v}


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("activation, with_bias", [
    *((activation, True) for activation in ["relu", "silu", "gelu", "gelu_tanh", None]),
    (None, False),  # each activation without a bias: with -m slow
    *(pytest.param(activation, False, marks=pytest.mark.slow)
      for activation in ["relu", "silu", "gelu", "gelu_tanh"])])
def test_epilogue_matches_lax_with_gradients(op, activation, with_bias):
    if activation is None and not with_bias:
        pytest.skip("no epilogue")
    x, w, _, _ = _case(op, 4, jnp.float32, seed=13)
    x_spec, w_spec, out_spec, ref = OPS[op]
    n = w.shape[1] if op == "matmul_reduce_scatter" else w.shape[1] // 4
    b = jnp.asarray(np.random.default_rng(1).standard_normal(n), jnp.float32)
    b_spec = P() if op == "matmul_reduce_scatter" else P("x")
    if op == "all_gather_matmul":
        b = jnp.tile(b, 4)
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def ours_fn(a, wt, bb):
        return getattr(jtd, op)(a, wt, "x", bias=bb if with_bias else None,
                                activation=activation)

    def lax_fn(a, wt, bb):
        out = ref(a, wt)
        return ACTS[activation](out + bb if with_bias else out)

    specs = dict(mesh=mesh, in_specs=(x_spec, w_spec, b_spec), out_specs=out_spec)
    ours, lax = jax.shard_map(ours_fn, **specs), jax.shard_map(lax_fn, **specs)
    np.testing.assert_allclose(jax.jit(ours)(x, w, b), jax.jit(lax)(x, w, b), rtol=1e-5,
                               atol=1e-5)
    text = jax.jit(ours).lower(x, w, b).as_text()
    assert text.count("jtd_triton") == 1 and "tanh" not in text and "erf" not in text
    loss = lambda f: (lambda *a: jnp.sum(jnp.cos(f(*a))))  # noqa: E731
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(x, w, b)
    r = jax.jit(jax.grad(loss(lax), argnums=(0, 1, 2)))(x, w, b)
    for a, c in zip(g, r, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)


def test_epilogue_bfloat16_batch_dims_and_vmap():
    op, shape, axis, x_spec, out_spec, ref = SEQ_CASES[0]
    x, w, mesh, w_spec, kwarg = _seq_case(op, shape, axis, x_spec, out_spec, 2, 4,
                                          jnp.bfloat16)
    b = jnp.linspace(-1, 1, w.shape[1]).astype(jnp.bfloat16)
    ours = jax.shard_map(lambda a, c, d: jtd.all_gather_matmul(
        a, c, "x", gather_axis=1, bias=d, activation="gelu_tanh"), mesh=mesh,
        in_specs=(x_spec, w_spec, P("x")), out_specs=out_spec)
    lax = jax.shard_map(lambda a, c, d: jax.nn.gelu(ref(a, c) + d), mesh=mesh,
                        in_specs=(x_spec, w_spec, P("x")), out_specs=out_spec)
    f32 = [v.astype(jnp.float32) for v in (x, w, b)]
    got = jax.jit(ours)(x, w, b)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), jax.jit(lax)(*f32), rtol=3e-2,
                               atol=3e-2)
    xs = jnp.stack([f32[0], -f32[0]])
    np.testing.assert_allclose(jax.jit(jax.vmap(ours, in_axes=(0, None, None)))(xs, *f32[1:]),
                               jax.jit(jax.vmap(lax, in_axes=(0, None, None)))(xs, *f32[1:]),
                               rtol=1e-5, atol=1e-5)


def test_epilogue_errors():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))

    def run(**kw):
        return jax.jit(jax.shard_map(lambda a, b: jtd.all_gather_matmul(a, b, "x", **kw),
                                     mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                     check_vma=False))(x, w)

    with pytest.raises(ValueError, match="activation must be one of"):
        run(activation="tanh")
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \(4,\), got \(3,\)"):
        run(bias=jnp.ones(3))
