"""jtd.fuse: plain jax.lax shard_map code gets the fused kernels (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd

XLA_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def _mesh(n=4):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _rand(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _close(a, b, tol=2e-5):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= tol * max(1.0, float(np.max(np.abs(b)))), \
        np.max(np.abs(a - b))


def _hlo_counts(f, *args):
    text = f.lower(*args).as_text()
    return text.count("jtd_triton"), {c: text.count(c) for c in XLA_COLLECTIVES}


# ---------------------------------------------------------------------------
# Models written in plain jax.lax
# ---------------------------------------------------------------------------


def mlp(x, w1, w2):
    h = jax.nn.gelu(jax.lax.all_gather(x, "x", tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "x", tiled=True)


MLP_SPECS = dict(in_specs=(P("x"), P(None, "x"), P("x", None)), out_specs=P("x"))


def _mlp_inputs(seed=0, dtype=jnp.float32, n=4):
    rng = np.random.default_rng(seed)
    return (_rand(rng, 8 * n, 16, dtype=dtype), _rand(rng, 16, 8 * n, dtype=dtype),
            _rand(rng, 8 * n, 16, dtype=dtype))


@pytest.mark.parametrize("form", ["body", "outer"])
def test_tp_mlp_fused_same_outputs_and_gradients(form):
    mesh = _mesh()
    args = _mlp_inputs()
    plain = jax.shard_map(mlp, mesh=mesh, **MLP_SPECS)
    if form == "body":
        fused_fn = jtd.fuse(mlp)
        fused = jax.shard_map(fused_fn, mesh=mesh, **MLP_SPECS)
    else:
        fused_fn = fused = jtd.fuse(jax.jit(plain))
    _close(jax.jit(fused)(*args), jax.jit(plain)(*args))
    report = fused_fn.last_report
    assert [op for op, _ in report.rewrites] == ["all_gather_matmul with gelu_tanh",
                                                 "matmul_reduce_scatter"]
    assert all("test_fuse.py" in where and "(mlp)" in where for _, where in report.rewrites)
    assert report.near_misses == []

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))

    value, grads = jax.jit(jax.value_and_grad(loss(fused), argnums=(0, 1, 2)))(*args)
    value_ref, grads_ref = jax.jit(jax.value_and_grad(loss(plain), argnums=(0, 1, 2)))(*args)
    _close(value, value_ref)
    for g, r in zip(grads, grads_ref, strict=True):
        _close(g, r)
    calls, xla = _hlo_counts(jax.jit(fused), *args)
    assert calls == 2 and not any(xla.values()), xla


def test_bfloat16_mlp():
    mesh = _mesh()
    args = _mlp_inputs(1, jnp.bfloat16)
    plain = jax.jit(jax.shard_map(mlp, mesh=mesh, **MLP_SPECS))
    fused = jax.jit(jax.shard_map(jtd.fuse(mlp), mesh=mesh, **MLP_SPECS))
    out = fused(*args)
    assert out.dtype == jnp.bfloat16
    _close(out, plain(*args), tol=3e-2)


def attention_block(x, wqkv, wo, *, heads_local=2, head_dim=4):
    """Sequence-sharded rows gathered into a fused QKV projection, local heads, and a
    row-parallel output projection summed over the ranks."""
    qkv = jax.lax.all_gather(x, "x", tiled=True) @ wqkv
    s = qkv.shape[0]
    q, k, v = jnp.split(qkv.reshape(s, 3, heads_local, head_dim), 3, axis=1)
    q, k, v = (t[:, 0] for t in (q, k, v))
    scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(head_dim)
    o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(s, -1)
    return jax.lax.psum(o @ wo, "x")


def test_attention_projection_block():
    mesh, n = _mesh(), 4
    rng = np.random.default_rng(2)
    d = 16
    x = _rand(rng, 4 * n, d)
    wqkv = _rand(rng, n, d, 3 * 8).transpose(1, 0, 2).reshape(d, n * 24)  # per rank [d, 24]
    wo = _rand(rng, n * 8, d)
    specs = dict(in_specs=(P("x"), P(None, "x"), P("x", None)), out_specs=P())
    plain = jax.jit(jax.shard_map(attention_block, mesh=mesh, **specs))
    fused_fn = jtd.fuse(attention_block)
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, **specs))
    _close(fused(x, wqkv, wo), plain(x, wqkv, wo), tol=1e-4)
    assert [op for op, _ in fused_fn.last_report.rewrites] == ["all_gather_matmul",
                                                                "matmul_all_reduce"]
    calls, xla = _hlo_counts(fused, x, wqkv, wo)
    assert calls >= 2 and not any(xla.values())
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(fused_fn, mesh=mesh, **specs)(*a)
                                            ** 2), argnums=(0, 1, 2)))(x, wqkv, wo)
    r = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(attention_block, mesh=mesh,
                                                          **specs)(*a) ** 2),
                         argnums=(0, 1, 2)))(x, wqkv, wo)
    for a, b in zip(g, r, strict=True):
        _close(a, b, tol=1e-4)


def test_scan_of_four_layers():
    mesh, n = _mesh(), 4
    rng = np.random.default_rng(3)
    x = _rand(rng, 4 * n, 16)
    w1s, w2s = _rand(rng, 4, 16, 8 * n), _rand(rng, 4, 8 * n, 16)

    def stack(x, w1s, w2s):
        def layer(h, ws):
            return mlp(h, *ws) + h, None
        return jax.lax.scan(layer, x, (w1s, w2s))[0]

    specs = dict(in_specs=(P("x"), P(None, None, "x"), P(None, "x", None)), out_specs=P("x"))
    plain = jax.jit(jax.shard_map(stack, mesh=mesh, **specs))
    fused_fn = jtd.fuse(stack)
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, **specs))
    _close(fused(x, w1s, w2s), plain(x, w1s, w2s), tol=1e-4)
    assert len(fused_fn.last_report.rewrites) == 2  # in the scan body, traced once
    calls, xla = _hlo_counts(fused, x, w1s, w2s)
    assert calls == 2 and not any(xla.values())
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(fused_fn, mesh=mesh, **specs)(*a)),
                         argnums=(1, 2)))(x, w1s, w2s)
    r = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(stack, mesh=mesh, **specs)(*a)),
                         argnums=(1, 2)))(x, w1s, w2s)
    for a, b in zip(g, r, strict=True):
        _close(a, b, tol=1e-4)


def test_inside_jit_cond_checkpoint_and_custom_vjp():
    mesh = _mesh()
    args = _mlp_inputs(4)

    @jax.custom_vjp
    def custom(x, w1, w2):
        return mlp(x, w1, w2)

    custom.defvjp(lambda *a: (custom(*a), a),
                  lambda res, ct: jax.vjp(mlp, *res)[1](ct))

    def body(x, w1, w2):
        a = jax.jit(mlp)(x, w1, w2)
        # the same branch on every rank (collectives in rank-divergent branches pair up
        # by accident or not at all, in XLA's collectives as in ours)
        b = jax.lax.cond(jax.lax.psum(jnp.sum(x), "x") > 0, mlp, lambda *v: mlp(*v) * 2,
                         x, w1, w2)
        c = jax.checkpoint(mlp)(x, w1, w2)
        d = custom(x, w1, w2)
        return a + b + c + d

    plain = jax.jit(jax.shard_map(body, mesh=mesh, **MLP_SPECS))
    fused_fn = jtd.fuse(body)
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, **MLP_SPECS))
    _close(fused(*args), plain(*args), tol=1e-4)
    # jit 2 + cond (2 branches) 4 + checkpoint 2 + custom_vjp 2
    assert len(fused_fn.last_report.rewrites) == 10
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(fused_fn, mesh=mesh,
                                                          **MLP_SPECS)(*a))))(*args)
    r = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(body, mesh=mesh,
                                                          **MLP_SPECS)(*a))))(*args)
    _close(g, r, tol=1e-4)


# ---------------------------------------------------------------------------
# Near misses: each kind is left as it was, with the reason
# ---------------------------------------------------------------------------


def _near_miss(body, in_specs, out_specs, *args):
    mesh = _mesh()
    fused_fn = jtd.fuse(body)
    plain = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    np.testing.assert_array_equal(fused(*args), plain(*args))  # untouched: bit-equal
    report = fused_fn.last_report
    assert report.rewrites == []
    (miss,) = report.near_misses
    return miss.reason


RNG = np.random.default_rng(9)
X, W = _rand(RNG, 16, 8), _rand(RNG, 8, 8)
AG_SPECS = ((P("x"), P()), P("x"))


def _gathered(x, **kwargs):
    return jax.lax.all_gather(x, "x", tiled=True, **kwargs)


@pytest.mark.parametrize("body, reason", [
    (lambda x, w: _gathered(x, axis=1) @ jnp.tile(w, (4, 1)), "all_gather(tiled=True, axis=1)"),
    (lambda x, w: jax.lax.all_gather(x, "x", tiled=False).reshape(-1, 8).T.T @ w, None),
    (lambda x, w: (lambda g: g @ w + jnp.sum(g))(_gathered(x)),
     "the gathered operand is also used elsewhere"),
    (lambda x, w: jax.lax.dot_general(w, _gathered(x), (((1,), (1,)), ((), ()))),
     "the collective's operand is the dot's right operand"),
    (lambda x, w: jax.lax.dot_general(_gathered(x), jnp.ones((16, 8)),
                                      (((0,), (0,)), ((), ()))),
     "contracting dimensions (0,) x (0,)"),
    (lambda x, w: jnp.dot(_gathered(x)[:, :8].T, jnp.ones((16, 8))),
     None),
    (lambda x, w: jnp.dot(_gathered(x), w, precision=jax.lax.Precision.HIGHEST), "precision"),
    (lambda x, w: jnp.dot(_gathered(x.astype(jnp.bfloat16)), w.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32),
     "preferred_element_type float32 differs"),
    (lambda x, w: jnp.dot(_gathered(x.astype(jnp.int32)), w.astype(jnp.int32)).astype(
        jnp.float32), "dtype int32"),
    (lambda x, w: jnp.einsum("mk,knj->mnj", _gathered(x), w.reshape(8, 4, 2)).reshape(-1, 8),
     "operands of rank 2 and 3"),
], ids=["gather_axis_1", "untiled_not_adjacent", "reused", "right_operand", "contracting",
         "sliced",
        "precision", "preferred_type", "int32", "weight_rank3"])
def test_all_gather_near_misses(body, reason):
    if reason is None:  # the gather does not feed the dot directly: nothing to report
        fused_fn = jtd.fuse(body)
        jax.jit(jax.shard_map(fused_fn, mesh=_mesh(), in_specs=AG_SPECS[0],
                              out_specs=AG_SPECS[1]))(X, W)
        assert fused_fn.last_report.rewrites == [] and fused_fn.last_report.near_misses == []
        return
    assert reason in _near_miss(body, *AG_SPECS, X, W)


def test_scatter_and_sum_near_misses():
    x, w = _rand(RNG, 16, 32), _rand(RNG, 32, 16)
    specs = ((P(None, "x"), P("x", None)), P(None, "x"))
    reason = _near_miss(lambda x, w: jax.lax.psum_scatter(x @ w, "x", scatter_dimension=1,
                                                          tiled=True), *specs, x, w)
    assert "scatter_dimension=1" in reason
    reason = _near_miss(lambda x, w: (lambda p: jax.lax.psum(p, "x") + p)(x @ w),
                        (P(None, "x"), P("x", None)), P("x"), x, w)
    assert "the product is also used elsewhere" in reason


def test_report_logs_rewrites_and_near_misses(caplog):
    import logging

    def body(x, w):
        g = jax.lax.all_gather(x, "x", tiled=True)
        return g @ w + jnp.sum(g)

    with caplog.at_level(logging.WARNING, logger="absl"):
        jax.jit(jax.shard_map(jtd.fuse(body, report=True), mesh=_mesh(),
                              in_specs=AG_SPECS[0], out_specs=AG_SPECS[1]))(X, W)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "jtd.fuse: 0 rewrite(s), 1 near miss(es)" in text
    assert "left all_gather_matmul at" in text and "also used elsewhere" in text


# ---------------------------------------------------------------------------
# collectives=True
# ---------------------------------------------------------------------------


def test_collectives_are_replaced():
    mesh = _mesh()
    rng = np.random.default_rng(5)
    x = _rand(rng, 16, 8)

    def body(x):
        a = jax.lax.psum(x, "x")
        b = jax.lax.pmax(x, "x") + jax.lax.pmin(x, "x")
        c = jax.lax.all_gather(x, "x")  # untiled: a new axis
        d = jax.lax.psum_scatter(jnp.tile(x, (4, 1)), "x", tiled=True)
        e = jax.lax.all_to_all(x, "x", 0, 0, tiled=True)
        f = jax.lax.all_to_all(x.reshape(4, 1, 8), "x", 0, 1)
        return a, b, c, d, e, f

    specs = dict(in_specs=P("x"), out_specs=(P(), P(), P("x"), P("x"), P("x"), P("x")))
    plain = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
    fused_fn = jtd.fuse(body, collectives=True)
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, **specs))
    for a, b in zip(fused(x), plain(x), strict=True):
        _close(a, b)
    assert len(fused_fn.last_report.rewrites) == 7
    calls, xla = _hlo_counts(fused, x)
    assert calls >= 7 and not any(xla.values()), xla


def test_vmap_over_the_fused_function():
    mesh = _mesh()
    x, w1, w2 = _mlp_inputs(6)
    xs = jnp.stack([x, 2 * x, -x])
    plain = jax.vmap(jax.shard_map(mlp, mesh=mesh, **MLP_SPECS), in_axes=(0, None, None))
    fused = jax.vmap(jax.shard_map(jtd.fuse(mlp), mesh=mesh, **MLP_SPECS),
                     in_axes=(0, None, None))
    _close(jax.jit(fused)(xs, w1, w2), jax.jit(plain)(xs, w1, w2), tol=1e-4)
    calls, xla = _hlo_counts(jax.jit(fused), xs, w1, w2)
    assert calls >= 2 and xla["all-gather"] == 0 and xla["reduce-scatter"] == 0


def test_non_array_arguments_stay_static():
    mesh = _mesh()
    x, w1, w2 = _mlp_inputs(7)

    def scaled(x, w1, w2, factor, *, gelu=True):
        h = jax.lax.all_gather(x, "x", tiled=True) @ w1
        h = jax.nn.gelu(h) if gelu else h
        return jax.lax.psum_scatter(h @ w2, "x", tiled=True) * factor

    for gelu in (True, False):
        f = jax.jit(jax.shard_map(lambda *a, g=gelu: jtd.fuse(scaled)(*a, 3, gelu=g),
                                  mesh=mesh, **MLP_SPECS))
        r = jax.jit(jax.shard_map(lambda *a, g=gelu: scaled(*a, 3, gelu=g), mesh=mesh,
                                  **MLP_SPECS))
        _close(f(x, w1, w2), r(x, w1, w2), tol=1e-4)


def test_a_dot_between_two_collectives_fuses_one_side():
    mesh = _mesh()
    rng = np.random.default_rng(8)
    x, w = _rand(rng, 16, 8), _rand(rng, 8, 16)

    def body(x, w):
        return jax.lax.psum_scatter(jax.lax.all_gather(x, "x", tiled=True) @ w, "x",
                                    tiled=True)

    fused_fn = jtd.fuse(body)
    specs = dict(in_specs=(P("x"), P()), out_specs=P("x"))
    _close(jax.jit(jax.shard_map(fused_fn, mesh=mesh, **specs))(x, w),
           jax.jit(jax.shard_map(body, mesh=mesh, **specs))(x, w), tol=1e-4)
    report = fused_fn.last_report
    assert [op for op, _ in report.rewrites] == ["all_gather_matmul"]
    (miss,) = report.near_misses
    assert miss.op == "matmul_reduce_scatter" and "already part of another fused op" in \
        miss.reason


def test_sequence_parallel_mlp_on_batch_seq_model_arrays():
    """[batch, seq, d_model] activations, the sequence sharded: gathered along it into the
    first GEMM, scattered along it out of the second; weights in [N, K] layout."""
    mesh, n = _mesh(), 4
    rng = np.random.default_rng(12)
    x = _rand(rng, 2, 4 * n, 16)
    w1t = _rand(rng, 8 * n, 16)  # [d_ff, d_model]: x @ w1t.T
    w2 = _rand(rng, 8 * n, 16)

    def block(x, w1t, w2):
        h = jax.nn.relu(jnp.einsum("bsd,fd->bsf", jax.lax.all_gather(x, "x", axis=1,
                                                                      tiled=True), w1t))
        return jax.lax.psum_scatter(h @ w2, "x", scatter_dimension=1, tiled=True)

    specs = dict(in_specs=(P(None, "x"), P("x"), P("x")), out_specs=P(None, "x"))
    plain = jax.jit(jax.shard_map(block, mesh=mesh, **specs))
    fused_fn = jtd.fuse(block)
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, **specs))
    _close(fused(x, w1t, w2), plain(x, w1t, w2), tol=1e-4)
    assert [op for op, _ in fused_fn.last_report.rewrites] == ["all_gather_matmul with relu",
                                                                "matmul_reduce_scatter"]
    calls, xla = _hlo_counts(fused, x, w1t, w2)
    assert calls == 2 and not any(xla.values())
    loss = lambda f: (lambda *a: jnp.sum(f(*a) ** 2))  # noqa: E731
    g = jax.jit(jax.grad(loss(jax.shard_map(fused_fn, mesh=mesh, **specs)), argnums=(0, 1, 2)))
    r = jax.jit(jax.grad(loss(jax.shard_map(block, mesh=mesh, **specs)), argnums=(0, 1, 2)))
    for a, b in zip(g(x, w1t, w2), r(x, w1t, w2), strict=True):
        _close(a, b, tol=1e-4)


def test_scan_operand_counts_without_the_parameters():
    """Newer jax drops num_consts / num_carry from scan equations; they are derived."""
    from jax_triton_dist.fuse.evaluate import _scan_counts

    c = jnp.ones((3,))

    def f(init, xs):
        return jax.lax.scan(lambda h, x: (h * c + x.sum(), (h, x * 2)), init, xs)

    closed = jax.make_jaxpr(f)(jnp.ones((3,)), jnp.ones((5, 3, 2)))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    if "num_consts" in eqn.params:  # jax 0.10: the parameters say it
        assert (eqn.params["num_consts"], eqn.params["num_carry"]) == (1, 1)
    stripped = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry")}
    assert _scan_counts(eqn.replace(params=stripped)) == (1, 1)


ACTIVATION_CASES = {
    "bias+relu": (lambda h, b: jax.nn.relu(h + b), "bias+relu"),
    "silu": (lambda h, b: jax.nn.silu(h), "silu"),
    "bias+gelu": (lambda h, b: jax.nn.gelu(h + b, approximate=False), "bias+gelu"),
    "bias": (lambda h, b: h + b, "bias"),
    "bias_reused": (lambda h, b: jax.nn.relu(h + b) + jnp.sum(b), "bias+relu"),
    "pre_activation_reused": (lambda h, b: jax.nn.silu(h) + h, None),
    "bias_not_a_vector": (lambda h, b: h + b[0], None),
}


@pytest.mark.parametrize("case", list(ACTIVATION_CASES))
def test_a_following_bias_and_activation_fold_into_the_epilogue(case):
    mesh = _mesh()
    act, folded = ACTIVATION_CASES[case]
    rng = np.random.default_rng(14)
    x, w, b = _rand(rng, 16, 16), _rand(rng, 16, 32), _rand(rng, 32)

    def body(x, w, b):
        return act(jax.lax.all_gather(x, "x", tiled=True) @ w, b)

    specs = dict(in_specs=(P("x"), P(None, "x"), P("x")), out_specs=P(None, "x"))
    fused_fn = jtd.fuse(body)
    fused = jax.jit(jax.shard_map(fused_fn, mesh=mesh, **specs))
    plain = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
    _close(fused(x, w, b), plain(x, w, b), tol=1e-5)
    (rewrite,) = [op for op, _ in fused_fn.last_report.rewrites]
    assert rewrite == "all_gather_matmul" + (f" with {folded}" if folded else "")
    if folded and "gelu" in folded:
        assert "erf" not in fused.lower(x, w, b).as_text()  # the epilogue is in the kernel
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(fused_fn, mesh=mesh, **specs)(*a)
                                            ** 2), argnums=(0, 1, 2)))(x, w, b)
    r = jax.jit(jax.grad(lambda *a: jnp.sum(jax.shard_map(body, mesh=mesh, **specs)(*a)
                                            ** 2), argnums=(0, 1, 2)))(x, w, b)
    for a, c in zip(g, r, strict=True):
        _close(a, c, tol=1e-4)
