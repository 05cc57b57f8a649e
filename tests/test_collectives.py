"""Collectives vs jax.lax on random data: values, gradients, repetition, skew, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32]
RANKS = [1, 2, 4, 8]


def mesh_1d(ranks):
    return Mesh(np.array(jax.devices("cpu")[:ranks]), ("x",))


def mesh_2x4():
    return Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "tp"))


def run(fn, mesh, x, in_spec, out_spec):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
    return f(jax.device_put(x, NamedSharding(mesh, in_spec)))


def random(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return jnp.asarray(rng.integers(-100, 100, shape).astype(np.int32))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def assert_reduced_close(ours, ref, dtype):
    """``ref`` is computed in float32; ours rounds once to ``dtype``."""
    ours = np.asarray(ours.astype(jnp.float32))
    ref = np.asarray(ref, np.float32)
    if dtype == jnp.int32:
        np.testing.assert_array_equal(ours, ref)
        return
    tol = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}[dtype]
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))


# ---------------------------------------------------------------------------
# Values vs jax.lax, every rank count and dtype
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis,tiled", [(0, True), (1, True), (0, False), (2, False)])
def test_all_gather(ranks, dtype, axis, tiled):
    x = random((ranks * 3, 37), dtype, seed=ranks)
    mesh = mesh_1d(ranks)
    ours = run(lambda v: jtd.all_gather(v, "x", axis=axis, tiled=tiled), mesh, x, P("x"), P("x"))
    ref = run(lambda v: jax.lax.all_gather(v, "x", axis=axis, tiled=tiled), mesh, x, P("x"),
              P("x"))
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,tiled", [(0, True), (1, True), (0, False)])
def test_reduce_scatter_sum(ranks, dtype, dim, tiled):
    per_rank = {(0, True): (ranks * 5, 13), (1, True): (3, ranks * 7), (0, False): (ranks, 29)}
    shape = per_rank[(dim, tiled)]
    x = random((ranks * shape[0],) + shape[1:], dtype, seed=ranks + 10)
    mesh = mesh_1d(ranks)
    ours = run(lambda v: jtd.reduce_scatter(v, "x", scatter_dimension=dim, tiled=tiled), mesh,
               x, P("x"), P("x"))
    ref = run(lambda v: jax.lax.psum_scatter(v.astype(jnp.float32), "x",
                                             scatter_dimension=dim, tiled=tiled),
              mesh, x, P("x"), P("x"))
    assert ours.shape == ref.shape and ours.dtype == x.dtype
    assert_reduced_close(ours, ref, dtype)


@pytest.mark.parametrize("op,reference", [("max", jax.lax.pmax), ("min", jax.lax.pmin)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_reduce_scatter_max_min(op, reference, dtype):
    x = random((4 * 8, 11), dtype, seed=4)
    mesh = mesh_1d(4)
    ours = run(lambda v: jtd.reduce_scatter(v, "x", tiled=True, op=op), mesh, x, P("x"), P("x"))

    def ref_fn(v):
        full = reference(v, "x")
        return full.reshape(4, 2, 11)[jax.lax.axis_index("x")]

    ref = run(ref_fn, mesh, x, P("x"), P("x"))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["one_shot", "two_shot", "auto"])
def test_all_reduce_sum(ranks, dtype, method):
    x = random((ranks * 3, 45), dtype, seed=ranks + 20)  # 135 elements: not a multiple of ranks
    mesh = mesh_1d(ranks)
    ours = run(lambda v: jtd.all_reduce(v, "x", method=method), mesh, x, P("x"), P("x"))
    ref = run(lambda v: jax.lax.psum(v.astype(jnp.float32), "x"), mesh, x, P("x"), P("x"))
    assert ours.dtype == x.dtype
    assert_reduced_close(ours, ref, dtype)


@pytest.mark.parametrize("op,reference", [("max", jax.lax.pmax), ("min", jax.lax.pmin)])
@pytest.mark.parametrize("method", ["one_shot", "two_shot"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_all_reduce_max_min(op, reference, method, dtype):
    x = random((4 * 2, 33), dtype, seed=5)
    mesh = mesh_1d(4)
    ours = run(lambda v: jtd.all_reduce(v, "x", op=op, method=method), mesh, x, P("x"), P("x"))
    ref = run(lambda v: reference(v, "x"), mesh, x, P("x"), P("x"))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split,concat,tiled", [(0, 0, True), (0, 1, True), (1, 0, True),
                                                (0, 1, False), (0, 2, False)])
def test_all_to_all(ranks, dtype, split, concat, tiled):
    per_rank = (ranks * 2, ranks * 3, 5) if tiled else (ranks, 3, 5)
    x = random((ranks * per_rank[0],) + per_rank[1:], dtype, seed=ranks + 30)
    mesh = mesh_1d(ranks)
    ours = run(lambda v: jtd.all_to_all(v, "x", split, concat, tiled=tiled), mesh, x, P("x"),
               P("x"))
    ref = run(lambda v: jax.lax.all_to_all(v, "x", split, concat, tiled=tiled), mesh, x, P("x"),
              P("x"))
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


# ---------------------------------------------------------------------------
# A 2x4 mesh, on each axis
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_every_op_on_each_axis_of_a_2x4_mesh(axis):
    mesh = mesh_2x4()
    spec = P("dp", "tp")
    x = random((2 * 8, 4 * 6), jnp.float32, seed=40)
    pairs = [
        (lambda v: jtd.all_gather(v, axis, tiled=True),
         lambda v: jax.lax.all_gather(v, axis, tiled=True)),
        (lambda v: jtd.reduce_scatter(v, axis, tiled=True),
         lambda v: jax.lax.psum_scatter(v, axis, tiled=True)),
        (lambda v: jtd.all_reduce(v, axis, method="one_shot"), lambda v: jax.lax.psum(v, axis)),
        (lambda v: jtd.all_reduce(v, axis, method="two_shot"), lambda v: jax.lax.psum(v, axis)),
        (lambda v: jtd.all_to_all(v, axis, 0, 1, tiled=True),
         lambda v: jax.lax.all_to_all(v, axis, 0, 1, tiled=True)),
    ]
    for ours_fn, ref_fn in pairs:
        ours = run(ours_fn, mesh, x, spec, spec)
        ref = run(ref_fn, mesh, x, spec, spec)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Gradients vs the jax.lax versions
# ---------------------------------------------------------------------------

GRAD_CASES = {
    "all_gather": (lambda v: jtd.all_gather(v, "x", axis=1, tiled=True),
                   lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True)),
    "all_gather_stacked": (lambda v: jtd.all_gather(v, "x", axis=0),
                           lambda v: jax.lax.all_gather(v, "x", axis=0)),
    "reduce_scatter": (lambda v: jtd.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                       lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True)),
    "all_reduce_one_shot": (lambda v: jtd.all_reduce(v, "x", method="one_shot"),
                            lambda v: jax.lax.psum(v, "x")),
    "all_reduce_two_shot": (lambda v: jtd.all_reduce(v, "x", method="two_shot"),
                            lambda v: jax.lax.psum(v, "x")),
    "all_to_all": (lambda v: jtd.all_to_all(v, "x", 1, 0, tiled=True),
                   lambda v: jax.lax.all_to_all(v, "x", 1, 0, tiled=True)),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
@pytest.mark.parametrize("ranks", [2, 4])
def test_gradients_match_jax_lax(name, ranks):
    ours_fn, ref_fn = GRAD_CASES[name]
    mesh = mesh_1d(ranks)
    x = jax.device_put(random((ranks * 4, ranks * 6), jnp.float32, seed=50),
                       NamedSharding(mesh, P("x")))

    def loss(fn):
        f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))

        def scalar(v):
            out = f(v)
            weights = jnp.asarray(np.random.default_rng(51).standard_normal(out.shape),
                                  jnp.float32)
            return jnp.sum(out * weights)

        return jax.jit(jax.value_and_grad(scalar))

    value, grad = loss(ours_fn)(x)
    ref_value, ref_grad = loss(ref_fn)(x)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-5, atol=1e-5)


def test_max_reduction_is_not_differentiable():
    mesh = mesh_1d(2)
    x = jax.device_put(random((4, 3), jnp.float32, seed=0), NamedSharding(mesh, P("x")))
    f = jax.shard_map(lambda v: jtd.all_reduce(v, "x", op="max"), mesh=mesh, in_specs=P("x"),
                      out_specs=P("x"))
    with pytest.raises(NotImplementedError, match="op='max'.*not differentiable"):
        jax.grad(lambda v: jnp.sum(f(v)))(x)


# ---------------------------------------------------------------------------
# Control flow, repetition, skew
# ---------------------------------------------------------------------------


def test_inside_fori_loop():
    """A loop carry keeps its type: the sum's result is invariant over "x", as psum's is,
    so the carry starts invariant too (as it must with jax.lax)."""
    mesh = mesh_1d(4)
    x = random((4 * 2, 9), jnp.float32, seed=60)

    def loop(all_reduce):
        def body(v):
            start = all_reduce(v) / 4.0
            return jax.lax.fori_loop(0, 5, lambda i, acc: all_reduce(acc) / 4.0 + 1.0, start)
        return body

    ours = run(loop(lambda v: jtd.all_reduce(v, "x")), mesh, x, P("x"), P())
    ref = run(loop(lambda v: jax.lax.psum(v, "x")), mesh, x, P("x"), P())
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5)


@pytest.mark.parametrize("steps", [12, pytest.param(250, marks=pytest.mark.slow)])
def test_back_to_back_calls_in_one_scan(steps):
    """Reused workspaces and flags: every step must equal its own reference exactly."""
    ranks = 4
    mesh = mesh_1d(ranks)
    xs = random((steps, ranks * 4, 8), jnp.int32, seed=70)
    spec = P(None, "x")

    def ours(v):
        def step(carry, x):
            return carry, (jtd.all_reduce(x, "x", method="one_shot"),
                           jtd.all_reduce(x, "x", method="two_shot"),
                           jtd.all_gather(x, "x", tiled=True),
                           jtd.reduce_scatter(x, "x", tiled=True),
                           jtd.all_to_all(x, "x", 0, 0, tiled=True))
        return jax.lax.scan(step, 0, v)[1]

    def ref(v):
        def step(carry, x):
            return carry, (jax.lax.psum(x, "x"), jax.lax.psum(x, "x"),
                           jax.lax.all_gather(x, "x", tiled=True),
                           jax.lax.psum_scatter(x, "x", tiled=True),
                           jax.lax.all_to_all(x, "x", 0, 0, tiled=True))
        return jax.lax.scan(step, 0, v)[1]

    out_spec = (spec,) * 5
    for got, want in zip(run(ours, mesh, xs, spec, out_spec), run(ref, mesh, xs, spec, out_spec),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_straggler(straggler):
    mesh = mesh_1d(4)
    straggler(mesh.devices[1].id, 0.03)
    for seed in range(3):
        x = random((4 * 4, 10), jnp.float32, seed=80 + seed)
        for method in ("one_shot", "two_shot"):
            ours = run(lambda v, m=method: jtd.all_reduce(v, "x", method=m), mesh, x, P("x"),
                       P("x"))
            ref = run(lambda v: jax.lax.psum(v, "x"), mesh, x, P("x"), P("x"))
            np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)
        ours = run(lambda v: jtd.all_to_all(v, "x", 0, 1, tiled=True), mesh, x, P("x"), P("x"))
        ref = run(lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=True), mesh, x, P("x"),
                  P("x"))
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


# ---------------------------------------------------------------------------
# The kernel path runs (no hidden jax.lax fallback)
# ---------------------------------------------------------------------------

XLA_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                   "collective-permute")


@pytest.mark.parametrize("fn", [
    lambda v: jtd.all_gather(v, "x", tiled=True),
    lambda v: jtd.reduce_scatter(v, "x", tiled=True),
    lambda v: jtd.all_reduce(v, "x", method="one_shot"),
    lambda v: jtd.all_reduce(v, "x", method="two_shot"),
    lambda v: jtd.all_to_all(v, "x", 0, 1, tiled=True),
])
def test_kernel_path_in_compiled_hlo(fn):
    mesh = mesh_1d(4)
    x = jax.device_put(random((16, 4), jnp.float32, seed=0), NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    hlo = f.lower(x).compile().as_text()
    assert "jtd_triton" in hlo
    assert not any(op in hlo for op in XLA_COLLECTIVES)


def test_xla_method_is_the_jax_reference():
    mesh = mesh_1d(4)
    x = jax.device_put(random((16, 4), jnp.float32, seed=0), NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x", method="xla"), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    hlo = f.lower(x).compile().as_text()
    assert "all-reduce" in hlo and "jtd_triton" not in hlo


# ---------------------------------------------------------------------------
# Errors at trace time
# ---------------------------------------------------------------------------


def _trace(fn, ranks=4, shape=(8, 6), dtype=jnp.float32):
    mesh = mesh_1d(ranks)
    return run(fn, mesh, jnp.zeros((ranks * shape[0],) + shape[1:], dtype), P("x"), P("x"))


@pytest.mark.parametrize("fn", [
    lambda v: jtd.all_gather(v, "x"),
    lambda v: jtd.reduce_scatter(v, "x", tiled=True),
    lambda v: jtd.all_reduce(v, "x"),
    lambda v: jtd.all_to_all(v, "x", 0, 0, tiled=True),
])
def test_sub_byte_dtype(fn):
    with pytest.raises(TypeError, match="dtype int4 is narrower than a byte"):
        _trace(fn, dtype=jnp.int4)


def test_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="reduce_scatter: dimension 1 has size 6, which does "
                                         "not divide by the 4 ranks"):
        _trace(lambda v: jtd.reduce_scatter(v, "x", scatter_dimension=1, tiled=True))
    with pytest.raises(ValueError, match=r"reduce_scatter\(tiled=False\): dimension 0 has size "
                                         "8 but must equal the 4 ranks"):
        _trace(lambda v: jtd.reduce_scatter(v, "x"))
    with pytest.raises(ValueError, match="all_to_all: split_axis 1 has size 6, which does not "
                                         "divide by the 4 ranks"):
        _trace(lambda v: jtd.all_to_all(v, "x", 1, 0, tiled=True))
    with pytest.raises(ValueError, match=r"all_to_all\(tiled=False\): split_axis 0 has size 8"):
        _trace(lambda v: jtd.all_to_all(v, "x", 0, 0))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"op must be one of \['sum', 'max', 'min'\], got 'prod'"):
        _trace(lambda v: jtd.all_reduce(v, "x", op="prod"))
    with pytest.raises(ValueError, match="method must be one of"):
        _trace(lambda v: jtd.all_reduce(v, "x", method="ring"))
    with pytest.raises(ValueError, match="all_gather: axis=5 is out of range for 3 dimensions"):
        _trace(lambda v: jtd.all_gather(v, "x", axis=5))
    with pytest.raises(ValueError, match="axis_name 'y' is not a manual axis"):
        _trace(lambda v: jtd.all_reduce(v, "y"))


def test_outside_shard_map():
    with pytest.raises(ValueError, match="must be called inside jax.shard_map"):
        jtd.all_reduce(jnp.ones(4), "x")
