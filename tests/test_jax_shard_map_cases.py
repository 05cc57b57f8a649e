"""JAX's own shard_map collective tests (``tests/shard_map_test.py`` at jax 0.10.2), each run
with ``jax.lax`` and with ``jax_triton_dist.lax`` and compared per device shard.

Each test names the JAX test it ports. Inputs are random where the original's values do
not matter. Not ported: tests of ``ppermute``, ``pbroadcast`` and ``axis_index`` alone (no
counterpart here) and of the ``reduced`` / ``unreduced`` types (the ops do not take them).
"""

from functools import partial

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # as jax's test does
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from lax_harness import assert_same, both

import jax_triton_dist as jtd


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices("cpu")[:int(np.prod(shape))]).reshape(shape), names)


def rand(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-50, 50, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def inputs(spec, seed=0, dtype=np.float32):
    """jax's create_inputs: an [8, 8] array on a (2, 2, 2) ('x', 'y', 'z') mesh."""
    mesh = mesh_of((2, 2, 2), ("x", "y", "z"))
    return mesh, jax.device_put(rand((8, 8), dtype, seed), NamedSharding(mesh, spec))


def test_all_gather():  # test_all_gather
    mesh, a = inputs(P("z", ("x", "y")))

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P("z", ("x", "y")),),
                 out_specs=P("z", ("x", "y")))
        def fwd(a):
            return (lax.all_gather(a, "z", axis=0, tiled=True),
                    lax.all_gather(a, ("x", "y"), axis=-1, tiled=True))
        return fwd(a)

    ref, ours = both(program)
    assert_same(ref, ours)
    assert ours[0].addressable_data(0).shape == (8, 2)
    assert ours[1].addressable_data(0).shape == (4, 8)


def test_all_gather_invariant_basic():  # test_all_gather_invariant_basic
    mesh = mesh_of((4,), ("x",))
    arr = jnp.asarray(rand((8,), seed=1))

    def program(lax):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=P("x"), out_specs=P())
        def f(a):
            out = lax.all_gather(a, "x", tiled=True, to="invarying")
            assert jax.typeof(out).mat.varying == set()
            return out

        grad = jax.jit(jax.grad(lambda v: f(v).sum()))(arr)
        assert grad.sharding == NamedSharding(mesh, P("x"))
        return f(arr), grad, f

    (ref, ref_grad, _), (ours, our_grad, f) = both(program)
    assert_same((ref, ref_grad), (ours, our_grad))
    jax.test_util.check_grads(f, (arr,), order=2, modes=["fwd", "rev"])


def test_all_gather_invariant_complex():  # test_all_gather_invariant_complex
    mesh, a = inputs(P("z", ("x", "y")), seed=2)

    def program(lax):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P("z", ("x", "y")),),
                       out_specs=(P(None, ("x", "y")), P("z")))
        def f(a):
            c = lax.all_gather(a, "z", axis=0, tiled=True, to="invarying")
            assert jax.typeof(c).mat.varying == {"x", "y"}
            d = lax.all_gather(a, ("x", "y"), axis=-1, tiled=True, to="invarying")
            assert jax.typeof(d).mat.varying == {"z"}
            return c, d

        def g(x):
            return f(x)[0].sum()
        return f(a), jax.jit(jax.grad(g))(a), jax.grad(g)(a)

    ref, ours = both(program)
    assert_same(ref, ours)
    assert ours[1].sharding == NamedSharding(mesh, P("z", ("x", "y")))


def test_all_gather_with_axis_index_groups():  # test_all_gather_with_axis_index_groups
    mesh, a = inputs(P("x", ("y", "z")), seed=3)

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P("x", ("y", "z")),),
                 out_specs=P("x", ("y", "z")))
        def fwd(a):
            return lax.all_gather(a, ("y", "z"), axis_index_groups=((0, 1), (2, 3)), axis=-1,
                                  tiled=True)
        return fwd(a)

    assert_same(*both(program))


def test_matmul_reduce_scatter():  # test_matmul_reduce_scatter
    mesh = mesh_of((2, 2, 2), ("x", "y", "z"))
    a = jax.device_put(rand((8, 8), seed=4), NamedSharding(mesh, P("z", "y")))
    b = jax.device_put(rand((8, 8), seed=5), NamedSharding(mesh, P("y", None)))

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P("z", "y"), P("y", None)),
                 out_specs=P(("z", "y"), None))
        def fwd(a, b):
            c = jnp.matmul(a, b)
            return (lax.psum_scatter(c, "y", scatter_dimension=0, tiled=True),
                    lax.psum_scatter(c, ("z", "y"), scatter_dimension=0, tiled=True))
        return fwd(a, b)

    ref, ours = both(program)
    assert_same(ref, ours, exact=False)
    np.testing.assert_allclose(np.asarray(ours[0]), np.asarray(a) @ np.asarray(b), rtol=1e-4,
                               atol=1e-4)


def test_reduce_scatter_with_axis_index_groups():  # test_reduce_scatter_with_axis_index_groups
    mesh, a = inputs(P(None, ("x", "y", "z")), seed=6)
    groups = ((0, 2, 4, 6), (1, 3, 5, 7))

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(None, ("x", "y", "z")),),
                 out_specs=P(None, ("x", "y", "z")))
        def fwd(a):
            return lax.psum_scatter(a, ("x", "y", "z"), scatter_dimension=0,
                                    axis_index_groups=groups, tiled=True)
        return fwd(a)

    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("axis_name,mesh_axes", [("x", {"x": 8}),
                                                 (("x", "y"), {"x": 4, "y": 2})])
def test_all_to_all(axis_name, mesh_axes):  # test_all_to_all
    mesh = mesh_of(tuple(mesh_axes.values()), tuple(mesh_axes))
    a = jax.device_put(jnp.arange(8 * 8).reshape((8, 8)), NamedSharding(mesh, P(axis_name, None)))

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(axis_name, None),),
                 out_specs=P(None, axis_name))
        def fwd(a):
            return lax.all_to_all(a, axis_name, split_axis=1, concat_axis=1, tiled=True)
        return fwd(a)

    ref, ours = both(program)
    assert_same(ref, ours)
    assert (ours == jnp.reshape(a.T, (1, 64))).all()


def test_all_to_all_with_axis_index_groups():  # test_all_to_all_with_axis_index_groups
    mesh = mesh_of((4,), ("x",))
    a = jax.device_put(rand((4, 4), np.int32, seed=7), NamedSharding(mesh, P("x", None)))

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P("x", None),), out_specs=P(None, "x"))
        def fwd(a):
            return lax.all_to_all(a, "x", split_axis=1, concat_axis=0,
                                  axis_index_groups=((0, 1), (2, 3)), tiled=True)
        return fwd(a)

    assert_same(*both(program))


def test_all_to_all_grad():  # test_all_to_all_grad
    mesh = mesh_of((4,), ("x",))
    a = jax.device_put(rand((8, 8), seed=8), NamedSharding(mesh, P("x", None)))

    def program(lax):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P("x", None),), out_specs=P(None, "x"))
        def fwd(x):
            return lax.all_to_all(x, "x", split_axis=1, concat_axis=0, tiled=True)

        @jax.jit
        @partial(jax.grad, has_aux=True)
        def loss_and_grad(x):
            loss = (fwd(x) * jnp.arange(8.0)).sum() * 2
            return loss, loss
        return fwd(a), loss_and_grad(a), fwd

    ref, ours = both(program)
    assert_same(ref[:2], ours[:2], exact=False)
    jax.test_util.check_grads(ours[2], (a,), order=2, modes=["fwd", "rev"])


@pytest.mark.parametrize("use_jit", [False, True])
def test_replication_checker(use_jit):  # test_replication_checker_eager, _jit
    mesh = mesh_of((2, 2), ("x", "y"))
    x = rand((8, 8), seed=9)

    def program(lax):
        g = jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=P("x", "y"),
                          out_specs=P(None, "y"))
        return (jax.jit(g) if use_jit else g)(x)

    assert_same(*both(program), exact=False)


def test_eager_control_flow():  # test_eager_control_flow
    mesh = mesh_of((2, 2), ("x", "y"))
    x = jnp.asarray(rand((2, 2), seed=10))

    def program(lax):
        def f(v):
            return v if lax.psum(v, ("x", "y")) < 0 else -v
        return jax.shard_map(f, mesh=mesh, in_specs=(P("x", "y"),), out_specs=P("x", "y"))(x)

    assert_same(*both(program))


def test_axis_index_eager():  # test_axis_index_eager
    mesh = mesh_of((4,), ("x",))

    def program(lax):
        @partial(jax.shard_map, mesh=mesh, in_specs=(), out_specs=P())
        def foo():
            val = lax.psum(jax.lax.axis_index("x"), "x")
            return 1.0 if val > 0 else -1.0
        return foo()

    ref, ours = both(program)
    assert_same(ref, ours)
    assert ours == 1.0


def test_optimize_remat():  # test_optimize_remat
    mesh = mesh_of((4,), ("x",))
    x = jnp.asarray(rand((4,), seed=11))

    def program(lax):
        @jax.custom_vjp
        def f(x):
            return jnp.tan(x)

        def f_fwd(x):
            return lax.psum(x, "x"), (x,)

        def f_bwd(res, g):
            return (jnp.cos(res[0]) * g,)

        f.defvjp(f_fwd, f_bwd, optimize_remat=True)

        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=P(), out_specs=P())
        def temp(x):
            return jax.remat(f)(x) ** 2
        return jax.grad(lambda v: temp(v).sum())(x)

    assert_same(*both(program), exact=False)


def test_collectives_not_saved():  # test_collectives_not_saved
    mesh = mesh_of((4,), ("x",))
    for lax in (jax.lax, jtd.lax):
        @jax.remat
        @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        def f(x, lax=lax):
            return lax.all_gather(x, "x") * lax.all_gather(x, "x")

        assert len(saved_residuals(f, jnp.ones(4))) == 1


def test_psum_transpose_non_zero_cts():  # test_psum_transpose_non_zero_cts
    mesh = mesh_of((8,), ("x",))
    x1 = jnp.asarray(rand((16,), seed=12))

    def program(lax):
        @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P()))
        def f1(x_block):
            return x_block, lax.psum(x_block, axis_name="x")

        def f2(x_block):
            return f1(x_block)[0].sum()
        return f1(x1), jax.jit(jax.grad(f2))(x1), jax.grad(f2)(x1)

    assert_same(*both(program), exact=False)


def _inner_primitives(jaxpr):
    """The primitive names inside the one shard_map equation of ``jaxpr``."""
    eqn, = jaxpr.jaxpr.eqns
    return [str(e.primitive) for e in eqn.params["jaxpr"].eqns]


def test_fanin_psum_transposes_to_fanout():  # test_fanin_psum_transposes_to_fanout
    mesh = mesh_of((4,), ("x",))
    f = jax.shard_map(lambda v: jtd.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    jaxpr = jax.make_jaxpr(jax.vjp(f, jnp.arange(4.0))[1])(jnp.array([1.0]))
    # jax.lax: [pvary]; ours: the same cast, whose own transpose is our sum.
    assert _inner_primitives(jaxpr) == ["jtd_vary"]


def test_psum_with_implicit_fanout_self_transposes():
    # test_psum_with_implicit_fanout_self_transposes
    mesh = mesh_of((4,), ("x",))
    f = jax.shard_map(lambda v: jtd.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                      out_specs=P("x"))
    jaxpr = jax.make_jaxpr(jax.vjp(f, jnp.arange(4.0))[1])(jnp.arange(4.0))
    # jax.lax: [psum_invariant, pvary]. The first sum is shard_map's own (the transpose of
    # returning an invariant value with out_specs=P("x")), the cast is our sum's transpose.
    assert _inner_primitives(jaxpr) == ["psum_invariant", "jtd_vary"]


def test_rewrite_scan():  # test_rewrite_scan
    mesh = mesh_of((4,), ("x",))

    @partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def f(x):
        def g(x, _):
            return jax.lax.pcast(jtd.lax.psum(x, "x"), "x", to="varying"), None
        return jax.lax.scan(g, x, None, length=2)[0]

    eqn, = jax.make_jaxpr(f)(jnp.arange(4.0)).jaxpr.eqns
    scan, = eqn.params["jaxpr"].eqns
    assert [e.primitive.name for e in scan.params["jaxpr"].eqns] == ["jtd_all_reduce", "pvary"]
    np.testing.assert_allclose(np.asarray(jax.jit(f)(jnp.arange(4.0))), np.full(4, 24.0))


def test_transpose_float0():  # test_transpose_float0
    mesh = mesh_of((4,), ("x",))
    s = NamedSharding(mesh, P(None, "x"))

    def program(lax):
        @jax.custom_vjp
        def f(x, _):
            return x

        def f_fwd(x, y):
            return x, jnp.zeros(shape=y.shape, dtype=np.int32)

        def f_rev(tmp, g):
            return (g, tmp)
        f.defvjp(f_fwd, f_rev)

        @jax.custom_vjp
        def g(x, y):
            return x, y

        def g_fwd(x, y):
            return jax.vjp(lambda x, y: (x, y), x, y)

        def g_bwd(vjp_fn, result):
            return vjp_fn(result)
        g.defvjp(g_fwd, g_bwd)

        @partial(jax.shard_map, mesh=mesh, in_specs=(P("x"), P()), out_specs=P())
        def f_shmapped(x, y):
            return lax.psum(f(x, y).sum(), axis_name=("x"))

        @partial(jax.shard_map, mesh=mesh, check_vma=False, in_specs=P("x"),
                 out_specs=(P("x"), P()))
        def f_shmapped2(x, y):
            return g(x, y)

        def f_wrapper(x, y):
            x, y = jax.lax.map(lambda xs: f_shmapped2(xs[0], xs[1]), (x, y))
            return jax.lax.map(lambda xs: f_shmapped(xs[0], xs[1]), (x, y)).sum()

        @partial(jax.jit, in_shardings=s, out_shardings=NamedSharding(mesh, P()))
        def example(x, y):
            return jax.grad(f_wrapper, allow_int=True, argnums=(0, 1))(x, y)

        return example(np.zeros((8, 16), np.float32), np.zeros((8, 16), np.int32))

    ref, ours = both(program)
    assert ours[1].dtype == jax.dtypes.float0
    assert_same(ref[0], ours[0])


@pytest.mark.parametrize("use_jit", [True, False])
def test_check_rep_failure_inside_rule(use_jit):  # test_check_rep_failure_inside_rule
    mesh = mesh_of((4,), ("i",))

    def program(lax):
        def loss(w, x):
            @jax.shard_map(mesh=mesh, in_specs=P("i"), out_specs=P())
            def f(x):
                return lax.psum(((w * x) ** 2).sum(), "i")
            return f(x)
        return jax.grad(jax.jit(loss) if use_jit else loss)(3.0, jnp.arange(8.0))

    assert_same(*both(program), exact=False)


def test_conv_general_dilated():  # test_conv_general_dilated
    mesh = mesh_of((4,), ("i",))
    dot = partial(jax.lax.conv_general_dilated, window_strides=(), padding="VALID",
                  dimension_numbers=("NC", "IO", "NC"))
    a, b = rand((16, 32), seed=13), rand((32, 8), seed=14)

    def program(lax):
        return jax.shard_map(lambda x, y: lax.psum(dot(x, y), "i"), mesh=mesh,
                             in_specs=(P(None, "i"), P("i", None)), out_specs=P(None, None))(a, b)

    assert_same(*both(program), exact=False)


def test_repeated_psum_allowed():  # test_repeated_psum_allowed
    mesh = mesh_of((4,), ("i",))

    def program(lax):
        return jax.shard_map(lambda x: lax.psum(lax.psum(x, "i"), "i"), mesh=mesh,
                             in_specs=P("i"), out_specs=P())(jnp.asarray(rand((4,), seed=15)))

    assert_same(*both(program), exact=False)


def test_psum_not_under_shmap_error():  # test_psum_not_under_shmap_error
    with pytest.raises(NameError, match="must be called inside jax.shard_map"):
        jax.jit(lambda v: jtd.lax.psum(v, "x"))(jnp.arange(8.0))
    mesh = mesh_of((2,), ("x",))
    jax.shard_map(jax.jit(lambda v: jtd.lax.psum(v, "x")), mesh=mesh, in_specs=P("x"),
                  out_specs=P())(jnp.arange(8.0))


@pytest.mark.parametrize("use_jit", [True, False])
@pytest.mark.parametrize("reduce_along", [("y",), ("x",), ("x", "y")])
def test_get_check_rep(use_jit, reduce_along):  # test_get_check_rep
    mesh = mesh_of((2, 2), ("x", "y"))
    out_spec = P(*(n for n in ("x", "y") if n not in reduce_along))
    x = rand((8, 8), seed=16)

    def program(lax):
        @partial(jax.shard_map, mesh=mesh, in_specs=P("x", "y"), out_specs=out_spec)
        def g(v):
            result = lax.psum(v, axis_name=reduce_along)
            assert jax.typeof(result).mat.varying == jax.typeof(v).mat.varying - set(reduce_along)
            return result
        return (jax.jit(g) if use_jit else g)(x)

    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("name", ["pmin", "pmax"])
def test_pmin_pmax(name):  # test_pmin, test_pmax
    mesh = mesh_of((4,), ("i",))
    x = jnp.asarray(rand((8,), seed=17))

    def program(lax):
        return jax.shard_map(lambda v: getattr(lax, name)(v, "i"), mesh=mesh, in_specs=P("i"),
                             out_specs=P())(x)

    assert_same(*both(program))


def test_pmax_vma_in_types():  # test_pmax_vma_in_types
    mesh = mesh_of((4,), ("i",))
    x = jnp.arange(8.0, dtype=np.float32)
    f = jax.jit(jax.shard_map(lambda v: jtd.lax.pmax(v, "i"), mesh=mesh, in_specs=P(),
                              out_specs=P()))
    assert "jtd_vary[axes=('i',)" in str(f.trace(x).jaxpr)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))


def test_all_gather_with_vma_in_types():  # test_all_gather_with_vma_in_types
    mesh = mesh_of((2,), ("x",))
    x = np.arange(8.0)

    def program(lax):
        def f(v):
            assert jax.typeof(v).mat.varying == frozenset()
            out = lax.all_gather(v, "x")
            assert jax.typeof(out).mat.varying == frozenset({"x"})
            return out
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("x")))(x)

    assert_same(*both(program))


@pytest.mark.parametrize("use_jit", [False, True])
def test_smap_nested_psum(use_jit):  # test_smap_nested_psum
    mesh = mesh_of((2, 2), ("x", "y"))

    def program(lax):
        @jax.smap(axis_name="x", in_axes=0, out_axes=0)
        def f(x):
            x = jnp.sin(x)

            @jax.smap(axis_name="y", in_axes=0, out_axes=None)
            def g(x):
                assert jax.typeof(x).mat.varying == {"x", "y"}
                x = lax.psum(x, "y")
                assert jax.typeof(x).mat.varying == {"x"}
                return x

            x = g(x)
            assert jax.typeof(x).mat.varying == {"x"}
            return x

        with jax.set_mesh(mesh):
            return (jax.jit(f) if use_jit else f)(jnp.arange(4.0))

    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("use_jit", [False, True])
def test_vmap_shmap_psum(use_jit):  # test_vmap_shmap_psum (with an explicit mesh)
    """vmap over an explicit mesh axis makes the shard_map manual over "y" only; ours runs
    manual over "x" as well, its operands replicated over "x" (compiler_axes.py), so the
    values agree and the result is replicated over "x" where jax.lax's is sharded."""
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu")[:4])

    def program(lax):
        with jax.set_mesh(mesh):
            arr = jax.device_put(jnp.asarray(rand((2, 8), np.int32, seed=18)), P("x", "y"))
            f = jax.shard_map(lambda v: lax.psum(v, axis_name="y"), in_specs=P("y"),
                              out_specs=P(None))
            return (jax.jit(jax.vmap(f)) if use_jit else jax.vmap(f))(arr)

    ref, ours = both(program)
    assert ref.sharding == NamedSharding(mesh, P("x", None))
    assert ours.sharding.is_fully_replicated
    assert_same(ref, ours, per_shard=False)
