"""JAX's own collective tests from ``tests/pmap_test.py`` and ``tests/multiprocess/``
(jax 0.10.2), each run with ``jax.lax`` and with ``jax_triton_dist.lax`` and compared per
device shard.

``jax.pmap`` is itself a ``shard_map`` (``check_vma=False``) at these versions, so the
pmap cases run as written; the multiprocess cases run in one process over the 8 CPU
devices. Each test names the JAX test it ports. Not ported: ``ppermute``, ``pshuffle``,
``pswapaxes`` and ``pbroadcast`` (no counterpart here), nested pmaps (skipped by JAX
itself at these versions), and tests of pmap's lowering API that only use ``pmean`` as
filler beyond one (``testLowerCompile``).
"""

import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
import jax.test_util
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from lax_harness import assert_same, both

import jax_triton_dist as jtd

N = 8  # the CPU devices of the test session


def rand(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def pmapped(body, **kwargs):
    """``program(lax)`` running ``jax.pmap(body(lax), axis_name="i")``."""
    def program_of(*args):
        return lambda lax: jax.pmap(body(lax), axis_name="i", **kwargs)(*args)
    return program_of


@pytest.mark.parametrize("name,reduce", [("psum", "sum"), ("pmean", "mean"), ("pmax", "max"),
                                         ("pmin", "min")])
def test_reductions(name, reduce):  # testBasic, testMean, testReduceMax, testReduceMin
    x = rand((N, 4), seed=1)
    program = pmapped(lambda lax: lambda v: v - getattr(lax, name)(v, "i"))(x)
    ref, ours = both(program)
    assert_same(ref, ours, exact=reduce in ("max", "min"))
    np.testing.assert_allclose(np.asarray(ours), x - getattr(np, reduce)(x, 0), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("case", ["plain", "bool", "negative_axis", "tiled",
                                  "tiled_negative_axis"])
def test_gather(case):  # testGather, testGatherBool, testGatherNegativeAxis, testGatherTiled,
    # testGatherTiledNegativeAxis
    x = rand((N, 4, 3) if case == "tiled_negative_axis" else (N, 4), seed=2)
    if case == "bool":
        x = x > 0
    kwargs = {"plain": {}, "bool": {}, "negative_axis": dict(axis=-1), "tiled": dict(tiled=True),
              "tiled_negative_axis": dict(tiled=True, axis=-1)}[case]
    assert_same(*both(pmapped(lambda lax: lambda v: lax.all_gather(v, "i", **kwargs))(x)))


@pytest.mark.parametrize("tiled", [False, True])
def test_reduce_scatter(tiled):  # testReduceScatter, testReduceScatterTiled
    x = rand((N, 4 * N if tiled else N), seed=3)
    program = pmapped(lambda lax: lambda v: lax.psum_scatter(v, "i", tiled=tiled))(x)
    assert_same(*both(program), exact=False)


def test_reduce_scatter_replica_groups_tiled():  # testReduceScatterReplicaGroupsTiled
    groups = [[i for i in range(N) if i % 2 == 0], [i for i in range(N) if i % 2]]
    x = rand((N, 4 * N), seed=4)
    program = pmapped(lambda lax: lambda v: lax.psum_scatter(v, "i", axis_index_groups=groups,
                                                            tiled=True))(x)
    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("name", ["pmax", "pmin", "psum", "pmean", "transpose"])
def test_trees(name):  # testTrees, testCollectivesWithTreesOfDifferentDtypes
    x = {"a": rand((N, N), np.int32, seed=5), "b": rand((N, N), np.float32, seed=6),
         "c": rand((N, N), np.int32, seed=7), "d": rand((N, N), np.float32, seed=8)}

    def body(lax):
        if name == "transpose":
            return lambda v: lax.all_to_all(v, "i", 0, 0)
        return lambda v: getattr(lax, name)(v, "i")
    assert_same(*both(pmapped(body)(x)), exact=name != "pmean")


def test_complex_psum():  # testComplexPsum
    x = rand((N, 4), np.complex64, seed=9)
    assert_same(*both(pmapped(lambda lax: lambda v: v - lax.psum(v, "i"))(x)), exact=False)


ALL_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32,
              np.float16, ml_dtypes.bfloat16, np.float32, np.complex64]


@pytest.mark.parametrize("split_axis,concat_axis", list(itertools.product(range(2), range(2))))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_to_all(split_axis, concat_axis, dtype):  # testAllToAll
    x = rand((N,) * 3, dtype, seed=10)
    program = pmapped(lambda lax: lambda v: lax.all_to_all(v, "i", split_axis, concat_axis))(x)
    assert_same(*both(program))


def test_partially_mapped():  # testPartiallyMapped
    x = np.array(3.0, np.float32)
    y = rand((N, 4), seed=11)
    program = pmapped(lambda lax: lambda a, b: a - lax.psum(b, "i"), in_axes=(None, 0))(x, y)
    assert_same(*both(program), exact=False)


def test_grad_of_psum():  # testGradOfPsum
    x = rand((N, 4), seed=12)
    jax.test_util.check_grads(jax.pmap(lambda v: jtd.lax.psum(v, "i"), axis_name="i"), (x,),
                              2, ["fwd", "rev"], 1e-2, 1e-2, eps=1.0)


def test_two_args_grad():  # testTwoArgsGrad
    x = rand((N, 4), seed=13)
    y = 4 + x

    def program(lax):
        f = jax.pmap(lambda a, b: lax.psum(5.0 * jnp.cos(a) * jnp.sin(b), "i"), "i")
        return jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1))(x, y)
    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("constant", [False, True])
def test_psum_replica_groups(constant):  # testPsumReplicaGroups, testPsumConstantReplicaGroups
    groups = np.arange(N).reshape(2, N // 2).tolist()
    x = rand((N, 4), seed=14)
    program = pmapped(lambda lax: lambda v: v - lax.psum(2.0 if constant else v, "i",
                                                         axis_index_groups=groups))(x)
    assert_same(*both(program), exact=False)


def test_psum_uneven_replica_groups():  # testPsumUnevenReplicaGroups
    groups = [[0, 1], list(range(2, N))]
    x = rand((N, 4), seed=15)
    program = pmapped(lambda lax: lambda v: v - lax.psum(v, "i", axis_index_groups=groups))(x)
    assert_same(*both(program), exact=False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gather_replica_groups(interleaved):  # testGatherReplicaGroups, ...Interleaved
    if interleaved:
        indexes = np.arange(N)
        groups = np.concatenate([indexes[::2], indexes[1::2]]).reshape(2, N // 2).tolist()
    else:
        groups = np.arange(N, dtype=np.int32).reshape((N // 2, 2)).T.tolist()
    x = rand((N, 4), seed=16)
    program = pmapped(lambda lax: lambda v: lax.all_gather(v, "i", axis_index_groups=groups))(x)
    assert_same(*both(program))


def test_all_to_all_replica_groups():  # testAllToAllReplicaGroups
    groups = np.arange(N, dtype=np.int32).reshape((N // 2, 2)).T.tolist()
    x = rand((N, N // 2), np.int32, seed=17)
    program = pmapped(lambda lax: lambda v: lax.all_to_all(v, "i", 0, 0,
                                                          axis_index_groups=groups))(x)
    assert_same(*both(program))


def test_grad_of_all_to_all_replica_groups():  # testGradOfAllToAllReplicaGroups
    groups = np.arange(N, dtype=np.int32).reshape((2, N // 2)).tolist()
    x = rand((N, N // 2, 1), seed=18)
    w = rand((N,), seed=19)

    def body(lax):
        def fn(x, w):
            def g(x):
                return jnp.sum(lax.all_to_all(x, "i", 0, 1, axis_index_groups=groups) * w)
            return jax.grad(g)(x)
        return fn
    assert_same(*both(pmapped(body)(x, w)), exact=False)


def test_jit_pmap_composition():  # testJitPmapComposition
    x = rand((N, 4), seed=20)

    def program(lax):
        def f(v):
            return v - lax.psum(v, "i")
        return jax.jit(jax.pmap(f, "i"))(x), jax.pmap(jax.jit(f), "i")(x)
    assert_same(*both(program), exact=False)


def test_psum_on_boolean_dtype():  # testPsumOnBooleanDtype
    x = jnp.array([True, False] * (N // 2))
    ref, ours = both(lambda lax: (jax.pmap(lambda v: lax.psum(v, "i"), "i")(x),
                                  jax.pmap(lambda v: lax.pmean(v, "i"), "i")(x)))
    assert_same(ref, ours)
    assert list(np.asarray(ours[0])) == [N // 2] * N


def test_psum_zero_cotangents():  # testPsumZeroCotangents
    def program(lax):
        def loss(params, meta_params):
            net, mpo = params
            return meta_params * mpo * net

        def inner(meta_params, params):
            grads = lax.psum(jax.grad(loss)(params, meta_params), axis_name="i")
            net_grads, _ = grads
            return params[1] * (params[0] + net_grads)

        def outer(params):
            return jax.grad(inner)(jnp.array(4.0), params)
        return jax.pmap(outer, axis_name="i")
    params = (jnp.full((N,), 2.0), jnp.full((N,), 3.0))
    ref, ours = both(lambda lax: program(lax)(params))
    assert_same(ref, ours, exact=False)
    # As in JAX's test, the derivatives on one device (with 8 ranks the float32 finite
    # differences of the second order miss jax.lax's own tolerance).
    one = (jnp.array([2.0]), jnp.array([3.0]))
    jax.test_util.check_grads(program(jtd.lax), (one,), 2, ["fwd", "rev"], 1e-3, 1e-3)


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.int8, np.uint8, np.float16,
                                   ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_pmap_dtype(dtype):  # testPmapDtype
    program = pmapped(lambda lax: lambda _: lax.psum(np.dtype(dtype).type(0), "i"))(
        jnp.arange(N))
    ref, ours = both(program)
    assert ours.dtype == np.dtype(dtype)
    assert_same(ref, ours)


@pytest.mark.parametrize("collective", ["psum", "pmean", "pmax", "pmin"])
def test_collectives_with_vmap(collective):  # testCollectivesWithVmap
    x = jnp.asarray(rand((2, 2, 16, 16), seed=21))

    def f(map1, map2, lax):
        @partial(map1, axis_name="i")
        @partial(map2, axis_name="j")
        def g(a, b):
            return a + getattr(lax, collective)(a.dot(b), ("i", "j"))
        return g

    ref = f(jax.vmap, jax.vmap, jax.lax)(x, x)
    for maps in ((jax.pmap, jax.vmap), (jax.vmap, jax.pmap), (jax.vmap, jax.vmap)):
        _, ours = both(lambda lax, maps=maps: f(*maps, lax)(x, x))
        assert_same(ref, ours, exact=False, per_shard=False)


@pytest.mark.slow
@pytest.mark.parametrize("split_axis,concat_axis,vmap_axis",
                         list(itertools.product(range(3), range(3), range(4))))
def test_all_to_all_in_vmap(split_axis, concat_axis, vmap_axis):  # testAllToAllInVmap
    shape = (N,) * 5
    x = jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)

    def program(lax):
        def f(v):
            return lax.all_to_all(v, "i", split_axis=split_axis, concat_axis=concat_axis)
        return jax.pmap(jax.vmap(f, in_axes=vmap_axis), axis_name="i")(x)
    assert_same(*both(program))


@pytest.mark.parametrize("split_axis,concat_axis", list(itertools.product(range(3), range(3))))
def test_all_to_all_vs_vmap(split_axis, concat_axis):  # testAllToAllVsVmap
    shape = (N,) * 4
    x = jnp.arange(math.prod(shape)).reshape(shape)

    def f(lax):
        return lambda v: lax.all_to_all(v, "i", split_axis=split_axis, concat_axis=concat_axis)
    ref = jax.pmap(f(jax.lax), axis_name="i")(x)
    assert_same(ref, jax.vmap(f(jtd.lax), axis_name="i")(x), per_shard=False)
    assert_same(ref, jax.pmap(f(jtd.lax), axis_name="i")(x))


@pytest.mark.parametrize("prim", ["all_gather", "psum_scatter"])
def test_with_vmap(prim):  # testWithVmap
    x = jnp.asarray(rand((2, 2, 2, 64), seed=22))

    def f(map1, map2, lax):
        return map1(map2(partial(getattr(lax, prim), axis_name="i")), axis_name="i")
    ref = f(jax.pmap, jax.vmap, jax.lax)(x)
    assert_same(ref, f(jax.vmap, jax.pmap, jtd.lax)(x), exact=False, per_shard=False)
    assert_same(ref, f(jax.pmap, jax.vmap, jtd.lax)(x), exact=False)


@pytest.mark.parametrize("prim,tiled", list(itertools.product(["all_gather", "psum_scatter"],
                                                              [False, True])))
def test_vs_vmap(prim, tiled):  # testVsVmap
    x = jnp.asarray(rand((4, 4, 8), seed=23))

    def f(lax):
        return partial(getattr(lax, prim), axis_name="i", tiled=tiled)
    ref = jax.vmap(f(jax.lax), axis_name="i")(x)
    assert_same(ref, jax.vmap(f(jtd.lax), axis_name="i")(x), exact=False)
    assert_same(ref, jax.pmap(f(jtd.lax), axis_name="i")(x), exact=False, per_shard=False)


def test_all_devices_jit_in_pmap_pmap_in_jit():  # testAllDevices, testJitInPmap, testPmapInJit
    x = rand((N, 1), seed=24)

    def program(lax):
        all_devices = jax.pmap(lambda v: v - lax.psum(v, "i"), axis_name="i",
                               devices=jax.devices())(x)
        jit_in = jax.pmap(lambda v: lax.psum(jax.jit(lambda y: y + 1)(v), "i"), axis_name="i")(x)
        in_jit = jax.jit(lambda v: jax.pmap(lambda y: lax.psum(y, "i"), axis_name="i")(v))(x)
        return all_devices, jit_in, in_jit
    assert_same(*both(program), exact=False)


def test_lower_compile():  # testLowerCompile
    x = rand((N, 4), seed=25)
    f = jax.pmap(lambda v: v - jtd.lax.pmean(v, "i"), axis_name="i")
    expected = f(x)
    compiled = f.lower(x).compile()
    assert_same(expected, compiled(x))
    assert "jtd_triton" in compiled.as_text()


# ---------------------------------------------------------------------------
# tests/multiprocess/: one process, 8 CPU devices as a (2, 4) or (8,) mesh
# ---------------------------------------------------------------------------

MP_DTYPES = [np.int32, np.float32, np.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", MP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_gather_shard_map(dtype):  # all_gather_test.test_all_gather_shard_map
    mesh = Mesh(np.array(jax.devices("cpu")).reshape(2, 4), ("x", "y"))
    x = jax.device_put(rand((2, 4), dtype, seed=26), NamedSharding(mesh, P("x", "y")))

    def program(lax):
        @partial(jax.shard_map, mesh=mesh, in_specs=P("x", "y"), out_specs=P(None, None),
                 check_vma=False)
        def f(v):
            return lax.all_gather(lax.all_gather(v, "x", axis=0, tiled=True), "y", axis=1,
                                  tiled=True)
        return f(x)
    assert_same(*both(program))


@pytest.mark.parametrize("dtype", MP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_to_all_shard_map(dtype):  # all_to_all_test.test_all_to_all_shard_map
    mesh = Mesh(np.array(jax.devices("cpu")), ("i",))
    x = jax.device_put(rand((N, N, 100), dtype, seed=27), NamedSharding(mesh, P("i", None, None)))

    def program(lax):
        @partial(jax.shard_map, mesh=mesh, in_specs=P("i", None, None),
                 out_specs=P("i", None, None))
        def f(v):
            return jnp.expand_dims(lax.all_to_all(jnp.squeeze(v, 0), "i", split_axis=0,
                                                  concat_axis=0), 0)
        return f(x)
    assert_same(*both(program))


@pytest.mark.parametrize("case", ["simple", "both_axes", "subset", "multiple_operands"])
@pytest.mark.parametrize("dtype", MP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_psum_shard_map(case, dtype):  # all_reduce_test.test_psum_simple, test_psum,
    # test_psum_subset_devices, test_psum_multiple_operands
    if case == "simple":
        mesh, spec, axes = Mesh(np.array(jax.devices("cpu")), ("x",)), P("x"), "x"
        shape = (N,)
    else:
        mesh = Mesh(np.array(jax.devices("cpu")).reshape(2, 4), ("x", "y"))
        spec = P("x") if case == "subset" else P("x", "y")
        axes = "x" if case == "subset" else ("x", "y")
        shape = (2, 4, 200) if case == "multiple_operands" else (2, 4)
    x = jax.device_put(rand(shape, dtype, seed=28), NamedSharding(mesh, spec))
    program = lambda lax: jax.shard_map(lambda v: lax.psum(v, axes), mesh=mesh, in_specs=spec,  # noqa: E731
                                        out_specs=spec)(x)
    assert_same(*both(program), exact=dtype == np.int32)


def test_psum_axis_index_groups_pmap():  # all_reduce_test.test_psum_axis_index_groups
    groups = [list(range(N))[0::2], list(range(N))[1::2]]
    xs = rand((N, 100), np.int32, seed=29)
    assert_same(*both(pmapped(lambda lax: lambda v: lax.psum(v, "i",
                                                             axis_index_groups=groups))(xs)))
