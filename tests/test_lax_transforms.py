"""Every collective and fused op under JAX's transformations, against ``jax.lax`` under the
same transformation: vmap inside and over ``shard_map``, forward and reverse derivatives
(``check_grads`` in both modes, second order), eager ``shard_map``, every element type; and
the compiled program still runs the project's kernels, with no XLA collective, after vmap
and jvp.
"""

import itertools

import jax
import jax.numpy as jnp
import jax.test_util
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from lax_harness import assert_kernel_path, assert_same, both

import jax_triton_dist as jtd

# (mesh shape, mesh axes, the op's axis name): one axis, one axis of two, a tuple of two.
MESHES = {
    "x4": ((4,), ("x",), "x"),
    "tp_of_2x4": ((2, 4), ("dp", "tp"), "tp"),
    "dp_tp_of_2x4": ((2, 4), ("dp", "tp"), ("dp", "tp")),
}

# name -> (op(lax, v, axes), exact, linear)
OPS = {
    "psum": (lambda lax, v, a: lax.psum(v, a), False, True),
    "pmean": (lambda lax, v, a: lax.pmean(v, a), False, True),
    "pmax": (lambda lax, v, a: lax.pmax(v, a), True, False),
    "pmin": (lambda lax, v, a: lax.pmin(v, a), True, False),
    "all_gather": (lambda lax, v, a: lax.all_gather(v, a, axis=1), True, True),
    "all_gather_tiled": (lambda lax, v, a: lax.all_gather(v, a, axis=1, tiled=True), True, True),
    "psum_scatter": (lambda lax, v, a: lax.psum_scatter(v, a, scatter_dimension=0), False, True),
    "psum_scatter_tiled": (lambda lax, v, a: lax.psum_scatter(v, a, scatter_dimension=1,
                                                              tiled=True), False, True),
    "all_to_all": (lambda lax, v, a: lax.all_to_all(v, a, 0, 1), True, True),
    "all_to_all_tiled": (lambda lax, v, a: lax.all_to_all(v, a, 1, 0, tiled=True), True, True),
}


def cases(names, *axes, fast):
    """Every combination of ``axes`` (lists of parameter values, named by the comma-separated
    ``names``), those not in ``fast`` marked slow (``pytest -m slow`` runs them: the default
    run keeps a representative part of each family)."""
    combos = itertools.product(*axes)
    return pytest.mark.parametrize(names, [
        pytest.param(*c, marks=() if c in fast else pytest.mark.slow) for c in combos])


def setup(mesh_name, per_device_rows=None, seed=0, dtype=np.float32, batch=()):
    shape, names, axes = MESHES[mesh_name]
    mesh = Mesh(np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape), names)
    team = int(np.prod([dict(zip(names, shape, strict=True))[a] for a in jax.tree.leaves(axes)]))
    rows = per_device_rows or team  # untiled scatter / all_to_all need team-sized dims
    spec = P(*((None,) * len(batch)), names)
    x = np.random.default_rng(seed).standard_normal(
        batch + (rows * int(np.prod(shape)), 2 * team)).astype(dtype)
    return mesh, axes, spec, jax.device_put(x, NamedSharding(mesh, spec))


def shard_mapped(mesh, spec, body, check_vma=True):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=check_vma))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("op", sorted(OPS))
def test_vmap_inside_shard_map(op, mesh_name):
    fn, exact, _ = OPS[op]
    mesh, axes, spec, x = setup(mesh_name, seed=1, batch=(3,))
    spec = P(None, mesh.axis_names)

    def program(lax):
        return shard_mapped(mesh, spec, jax.vmap(lambda v: fn(lax, v, axes)))(x)
    # out_specs must hold the batch first, so each result keeps the batch at 0
    assert_same(*both(program), exact=exact)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("in_axis", [0, 2])
def test_vmap_over_shard_map(op, mesh_name, in_axis):
    fn, exact, _ = OPS[op]
    mesh, axes, spec, x = setup(mesh_name, seed=2)
    xs = jnp.stack([x, 2 * x, -x], axis=in_axis)

    def program(lax):
        return jax.vmap(shard_mapped(mesh, spec, lambda v: fn(lax, v, axes)),
                        in_axes=in_axis)(xs)
    assert_same(*both(program), exact=exact, per_shard=False)


@cases("op, mesh_name", sorted(op for op in OPS if OPS[op][2]), sorted(MESHES),
       fast={*((op, "x4") for op in OPS), ("psum", "dp_tp_of_2x4"),
             ("all_to_all", "dp_tp_of_2x4"), ("psum_scatter_tiled", "tp_of_2x4")})
def test_jvp_and_linearize(op, mesh_name):
    fn, exact, _ = OPS[op]
    mesh, axes, spec, x = setup(mesh_name, seed=3)
    _, _, _, t = setup(mesh_name, seed=4)

    def program(lax):
        f = shard_mapped(mesh, spec, lambda v: fn(lax, v, axes))
        y, linear = jax.linearize(f, x)
        return jax.jvp(f, (x,), (t,)), linear(t), y
    assert_same(*both(program), exact=exact)


@cases("op, mesh_name", sorted(op for op in OPS if OPS[op][2]), ["x4", "dp_tp_of_2x4"],
       fast={("psum", "x4"), ("all_gather_tiled", "x4"), ("all_to_all_tiled", "x4")})
def test_check_grads_both_modes_second_order(op, mesh_name):
    fn, _, _ = OPS[op]
    mesh, axes, spec, x = setup(mesh_name, seed=5)
    f = shard_mapped(mesh, spec, lambda v: jnp.sin(fn(jtd.lax, v, axes)))
    jax.test_util.check_grads(f, (x,), order=2, modes=["fwd", "rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("op", sorted(op for op in OPS if OPS[op][2]))
def test_reverse_mode_matches_jax_lax(op):
    fn, _, _ = OPS[op]
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=6)

    def program(lax):
        f = shard_mapped(mesh, spec, lambda v: fn(lax, v, axes))
        return jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(f(v)) * jnp.cos(f(v)))))(x)
    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_max_and_min_are_not_differentiable(op):
    fn, _, _ = OPS[op]
    mesh, axes, spec, x = setup("x4", seed=7)
    f = shard_mapped(mesh, spec, lambda v: fn(jtd.lax, v, axes))
    with pytest.raises(NotImplementedError, match=f"op='{op[1:]}'.*not differentiable"):
        jax.jvp(f, (x,), (x,))
    with pytest.raises(NotImplementedError, match="not differentiable"):
        jax.grad(lambda v: jnp.sum(f(v)))(x)


@pytest.mark.parametrize("op", sorted(OPS))
def test_eager_shard_map(op):
    fn, exact, _ = OPS[op]
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=8)

    def program(lax):
        return jax.shard_map(lambda v: fn(lax, v, axes), mesh=mesh, in_specs=spec,
                             out_specs=spec)(x)
    assert_same(*both(program), exact=exact)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("check_vma", [True, False])
def test_results_are_typed_like_jax_lax(op, check_vma):
    fn, _, _ = OPS[op]
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=9)
    types = {}

    def body(lax):
        def f(v):
            out = fn(lax, v, axes)
            types[lax.__name__] = jax.typeof(out)
            return out
        return f
    for lax in (jax.lax, jtd.lax):
        shard_mapped(mesh, spec, body(lax), check_vma=check_vma).trace(x)
    assert types["jax.lax"] == types["jax_triton_dist.lax"]


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_path_after_vmap_and_jvp(op):
    fn, _, linear = OPS[op]
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=10)
    f = shard_mapped(mesh, spec, lambda v: fn(jtd.lax, v, axes))
    xs = jnp.stack([x, x])
    assert_kernel_path(jax.jit(jax.vmap(f)).lower(xs).compile().as_text())
    if linear:
        jvp = jax.jit(lambda v, t: jax.jvp(f, (v,), (t,)))
        assert_kernel_path(jvp.lower(x, x).compile().as_text())


def test_sum_returned_invariant_with_check_vma():
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=11)

    def program(lax):
        return jax.jit(jax.shard_map(lambda v: lax.psum(v, axes), mesh=mesh, in_specs=spec,
                                     out_specs=P()))(x)
    assert_same(*both(program), exact=False)


# ---------------------------------------------------------------------------
# Element types
# ---------------------------------------------------------------------------

MOVED = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.float16,
         ml_dtypes.bfloat16, np.float32, np.complex64, ml_dtypes.float8_e4m3fn,
         ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz,
         ml_dtypes.float8_e4m3b11fnuz]
WIDE = [np.int64, np.uint64, np.float64, np.complex128]  # with jax_enable_x64


def typed(x, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return x > 0
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.round(x * 40), info.min, info.max).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return (x + 1j * x[::-1]).astype(dtype)
    return x.astype(dtype)


def _dtype_case(op, dtype):
    fn, exact, _ = OPS[op]
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=12)
    value = jax.device_put(typed(np.asarray(x), dtype), NamedSharding(mesh, spec))
    if op in ("psum_scatter", "psum_scatter_tiled") and np.dtype(dtype) == np.bool_:
        with pytest.raises(TypeError, match="bool"):
            shard_mapped(mesh, spec, lambda v: fn(jtd.lax, v, axes))(value)
        return

    def program(lax):
        return shard_mapped(mesh, spec, lambda v: fn(lax, v, axes))(value)
    ref, ours = both(program)
    assert_same(ref, ours, exact=exact or not jnp.issubdtype(np.dtype(dtype), jnp.inexact))


# The default run moves every op in these; the rest of MOVED with -m slow.
_COMMON = {np.bool_, np.int8, np.uint8, np.int32, np.float16, ml_dtypes.bfloat16, np.float32,
           np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [d if d in _COMMON else pytest.param(d, marks=pytest.mark.slow)
                                   for d in MOVED], ids=lambda d: np.dtype(d).name)
def test_every_dtype(op, dtype):
    if np.dtype(dtype).kind == "c" and op in ("pmax", "pmin"):
        with pytest.raises(TypeError, match="not defined on complex"):
            _dtype_case(op, dtype)
        return
    _dtype_case(op, dtype)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: np.dtype(d).name)
def test_every_64_bit_dtype(op, dtype):
    if np.dtype(dtype).kind == "c" and op in ("pmax", "pmin"):
        pytest.skip("max/min of complex numbers: refused (test_every_dtype)")
    with jax.enable_x64(True):
        _dtype_case(op, dtype)


def test_data_movement_is_bit_exact_for_nan_payloads_and_signed_zeros():
    mesh, axes, spec, x = setup("x4", seed=13)
    bits = np.asarray(x).view(np.uint32).copy()
    bits[0, :4] = [0x7FC00001, 0x7F800123, 0xFFC0BEEF, 0x80000000]  # NaN payloads, -0.0
    value = jax.device_put(bits.view(np.float32), NamedSharding(mesh, spec))
    for op in ("all_gather", "all_to_all_tiled"):
        fn = OPS[op][0]
        got = np.asarray(shard_mapped(mesh, spec, lambda v, fn=fn: fn(jtd.lax, v, axes))(value))
        want = np.asarray(shard_mapped(mesh, spec, lambda v, fn=fn: fn(jax.lax, v, axes))(value))
        assert got.tobytes() == want.tobytes()


def test_integer_sums_wrap_like_xla():
    mesh, axes, spec, _ = setup("x4")
    value = jax.device_put(np.full((4 * 4, 8), 100, np.int8), NamedSharding(mesh, spec))
    ref, ours = both(lambda lax: shard_mapped(mesh, spec, lambda v: lax.psum(v, axes))(value))
    assert_same(ref, ours)
    assert int(np.asarray(ours)[0, 0]) == np.int8(np.int32(400).astype(np.int8))


# ---------------------------------------------------------------------------
# Fused ops
# ---------------------------------------------------------------------------

FUSED = {
    # name -> (ours(x, w, axes), reference(x, w, axes), x spec, w spec, out spec, x/w shapes)
    "all_gather_matmul": (
        lambda x, w, a: jtd.all_gather_matmul(x, w, a),
        lambda x, w, a: jax.lax.all_gather(x, a, tiled=True) @ w,
        lambda n: P(n), lambda n: P(None, n), lambda n: P(None, n)),
    "matmul_reduce_scatter": (
        lambda x, w, a: jtd.matmul_reduce_scatter(x, w, a),
        lambda x, w, a: jax.lax.psum_scatter(x @ w, a, tiled=True),
        lambda n: P(None, n), lambda n: P(n), lambda n: P(n)),
    "matmul_all_reduce": (
        lambda x, w, a: jtd.matmul_all_reduce(x, w, a),
        lambda x, w, a: jax.lax.psum(x @ w, a),
        lambda n: P(None, n), lambda n: P(n), lambda n: P()),
}


def fused_setup(name, mesh_name, seed):
    shape, names, axes = MESHES[mesh_name]
    mesh = Mesh(np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape), names)
    ours, reference, x_spec, w_spec, out_spec = FUSED[name]
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2 * n, 2 * n)).astype(np.float32)
    w = rng.standard_normal((2 * n, 2 * n)).astype(np.float32)
    return mesh, axes, ours, reference, x_spec(axes), w_spec(axes), out_spec(axes), x, w


def _fused_fn(mesh, fn, axes, x_spec, w_spec, out_spec):
    return jax.jit(jax.shard_map(lambda x, w: fn(x, w, axes), mesh=mesh,
                                 in_specs=(x_spec, w_spec), out_specs=out_spec))


@cases("name, mesh_name", sorted(FUSED), ["x4", "tp_of_2x4", "dp_tp_of_2x4"],
       fast={*((name, "x4") for name in FUSED), ("all_gather_matmul", "dp_tp_of_2x4")})
def test_fused_values_and_jvp(name, mesh_name):
    mesh, axes, ours, reference, xs, ws, outs, x, w = fused_setup(name, mesh_name, 20)
    f, g = (_fused_fn(mesh, fn, axes, xs, ws, outs) for fn in (ours, reference))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(g(x, w)), rtol=1e-4, atol=1e-4)
    (_, ty), (_, rty) = jax.jvp(f, (x, w), (w, x)), jax.jvp(g, (x, w), (w, x))
    np.testing.assert_allclose(np.asarray(ty), np.asarray(rty), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name, mesh_name, order", [
    ("all_gather_matmul", "x4", 1),
    # second order on one axis; first order on two (second order there: ~1 min per op)
    *(pytest.param(name, mesh, 2 if mesh == "x4" else 1, marks=pytest.mark.slow)
      for name in sorted(FUSED) for mesh in ("x4", "dp_tp_of_2x4"))])
def test_fused_check_grads_both_modes_second_order(name, mesh_name, order):
    mesh, axes, ours, _, xs, ws, outs, x, w = fused_setup(name, mesh_name, 22)
    jax.test_util.check_grads(_fused_fn(mesh, ours, axes, xs, ws, outs), (x, w), order=order,
                              modes=["fwd", "rev"], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("batched", ["x", "w", "both"])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_vmap(name, batched):
    mesh, axes, ours, reference, xs, ws, outs, x, w = fused_setup(name, "dp_tp_of_2x4", 21)
    in_axes = {"x": (0, None), "w": (None, 0), "both": (0, 0)}[batched]
    args = (np.stack([x, -x]) if in_axes[0] == 0 else x,
            np.stack([w, 2 * w]) if in_axes[1] == 0 else w)
    got, want = (jax.vmap(_fused_fn(mesh, fn, axes, xs, ws, outs), in_axes=in_axes)(*args)
                 for fn in (ours, reference))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
    if batched != "both":  # one kernel call for the batch
        text = jax.jit(jax.vmap(_fused_fn(mesh, ours, axes, xs, ws, outs), in_axes=in_axes)
                       ).lower(*args).compile().as_text()
        assert_kernel_path(text)


# ---------------------------------------------------------------------------
# Partially-manual shard_map: mesh axes left to the compiler
# ---------------------------------------------------------------------------


def _partial(mesh, body, n_in=1):
    """A shard_map manual over "tp" only, its operands sharded over both axes."""
    sharding = NamedSharding(mesh, P("dp", "tp"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"),) * n_in,
                                 out_specs=P("tp"), axis_names=frozenset({"tp"})),
                   in_shardings=(sharding,) * n_in)


@pytest.mark.parametrize("op", sorted(OPS))
def test_partially_manual_shard_map(op):
    mesh = setup("tp_of_2x4")[0]
    x = np.random.default_rng(30).standard_normal((4, 16)).astype(np.float32)  # [4, 4] a shard
    fn, exact, linear = OPS[op]
    ref, ours = both(lambda lax: _partial(mesh, lambda v: fn(lax, v, "tp"))(x))
    assert_same(ref, ours, exact=exact, per_shard=False)
    text = _partial(mesh, lambda v: fn(jtd.lax, v, "tp")).lower(x).compile().as_text()
    assert "jtd_triton" in text
    if linear:
        def loss(lax):
            return jax.grad(lambda v: jnp.sum(_partial(mesh, lambda u: fn(lax, u, "tp"))(v)
                                              ** 2))(x)
        assert_same(*both(loss), exact=False, per_shard=False)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_in_partially_manual_shard_map(name):
    mesh, _, ours, reference, *_ = fused_setup(name, "tp_of_2x4", 31)
    _, _, _, _, xs, ws, _, x, w = fused_setup(name, "x4", 31)  # shapes divisible by 4
    got, want = (jax.jit(jax.shard_map(lambda a, b, fn=fn: fn(a, b, "tp"), mesh=mesh,
                                       in_specs=(FUSED[name][2]("tp"), FUSED[name][3]("tp")),
                                       out_specs=P(), axis_names=frozenset({"tp"}),
                                       check_vma=False))(x, w)
                 for fn in (ours, reference))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_naming_a_compiler_axis_is_an_unbound_axis():
    mesh = setup("tp_of_2x4")[0]
    x = np.ones((4, 16), np.float32)
    with pytest.raises(NameError, match="'dp' is not a manual axis"):
        _partial(mesh, lambda v: jtd.lax.psum(v, "dp"))(x)


# ---------------------------------------------------------------------------
# axis_index_groups of different sizes (reductions only, as in jax.lax)
# ---------------------------------------------------------------------------

UNEVEN = {"x4": [[0, 2, 3], [1]], "dp_tp_of_2x4": [[5], [0, 1, 2], [3, 4, 6, 7]]}


@pytest.mark.parametrize("mesh_name", sorted(UNEVEN))
@pytest.mark.parametrize("op", ["psum", "pmax", "pmin"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_uneven_groups(op, mesh_name, dtype):
    if op == "psum" and dtype == np.bool_:
        dtype = np.int8
    mesh, axes, spec, x = setup(mesh_name, seed=33)
    x = jax.device_put((np.asarray(x) * 3).astype(dtype), x.sharding)
    groups = UNEVEN[mesh_name]

    def program(lax):
        return shard_mapped(mesh, spec, lambda v: getattr(lax, op)(
            (v, 2), axes, axis_index_groups=groups)[0] + getattr(lax, op)(
            v[:1] * 0 + 1, axes, axis_index_groups=groups))(x)
    assert_same(*both(program), exact=op != "psum" or dtype == np.int32)


@pytest.mark.parametrize("order", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_uneven_groups_derivatives(order):
    mesh, axes, spec, x = setup("dp_tp_of_2x4", seed=34)
    groups = UNEVEN["dp_tp_of_2x4"]

    def f(lax):
        return shard_mapped(mesh, spec, lambda v: jnp.sin(lax.psum(v, axes,
                                                                   axis_index_groups=groups)))
    jax.test_util.check_grads(f(jtd.lax), (x,), order=order, modes=["fwd", "rev"], atol=1e-2,
                              rtol=1e-2)
    grads = both(lambda lax: jax.grad(lambda v: jnp.sum(f(lax)(v) ** 2))(x))
    assert_same(*grads, exact=False)


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter", "all_to_all"])
def test_uneven_groups_are_refused_where_they_have_no_meaning(op):
    mesh, axes, spec, x = setup("x4", seed=35)
    call = {"all_gather": lambda v: jtd.lax.all_gather(v, axes, axis_index_groups=[[0], [1, 2, 3]]),
            "psum_scatter": lambda v: jtd.lax.psum_scatter(v, axes, tiled=True,
                                                           axis_index_groups=[[0], [1, 2, 3]]),
            "all_to_all": lambda v: jtd.lax.all_to_all(v, axes, 0, 0, tiled=True,
                                                       axis_index_groups=[[0], [1, 2, 3]])}[op]
    with pytest.raises(ValueError, match="must all be the same size"):
        shard_mapped(mesh, spec, call, check_vma=False)(x)
