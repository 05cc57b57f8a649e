"""Fused GEMM + communication ops vs jnp.dot in float32 composed with jax.lax collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd


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


@pytest.mark.parametrize("ranks, dtype", [(2, jnp.float32), (3, jnp.bfloat16),
                                          pytest.param(4, jnp.float32, marks=pytest.mark.slow),
                                          pytest.param(8, jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
def test_matmul_all_reduce_two_shot(monkeypatch, ranks, dtype, persistent):
    """The two-shot exchange (each tile summed by its owner, ``tile % ranks``, and the sum
    pushed to the others) as the op's only config: small tiles, so that every rank owns
    some; every rank's result against the float32 product, and the same bits on every
    rank (the owner's rounded sum is what the others copy)."""
    from jax_triton_dist import tiles
    from jax_triton_dist.fused import launch

    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4,
              "num_stages": 3, "PERSISTENT": persistent, "USE_TMA": False}
    monkeypatch.setattr(tiles, "gemm_configs", lambda *a, **k: [config])
    monkeypatch.setattr(tiles, "fill_programs", lambda target="cuda": 5)
    monkeypatch.setattr(launch, "ALL_REDUCE_FORMS", ({"TWO_SHOT": True},))
    x, w = inputs(ranks, m=40, k_local=16, n=56, dtype=dtype, seed=ranks + 20)
    ref = np.asarray(reference(x, w))
    for _ in range(2):  # back to back: one call's sums must not satisfy the next's waits
        out = run_mar(mesh_1d(ranks), "x", x, w)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for r in range(ranks):
        assert np.linalg.norm(out[r] - ref) / np.linalg.norm(ref) < tol
        np.testing.assert_array_equal(out[r], out[0])


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


@pytest.mark.parametrize("steps", [12, pytest.param(200, marks=pytest.mark.slow)])
def test_matmul_all_reduce_back_to_back_calls(steps):
    ranks = 4
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


def test_matmul_all_reduce_with_a_straggler(straggler):
    mesh = mesh_1d(4)
    straggler(mesh.devices[3].id, 0.05)
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

    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal w.shape\[0\]"):
        trace(jnp.ones((4, 8)), jnp.ones((6, 4)))
    with pytest.raises(TypeError, match="one dtype, got float32 and bfloat16"):
        trace(jnp.ones((4, 8)), jnp.ones((8, 4), jnp.bfloat16))
    with pytest.raises(TypeError, match="unsupported dtype int32"):
        trace(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"x must be \[..., rows, K\] and w 2-D"):
        trace(jnp.ones((4, 8)), jnp.ones((8, 4, 1)))


# ---------------------------------------------------------------------------
# all_gather_matmul and matmul_reduce_scatter
# ---------------------------------------------------------------------------


def run_op(op, mesh, axis, x, w, x_spec, w_spec):
    f = jax.jit(jax.shard_map(lambda a, b: op(a, b, axis), mesh=mesh, in_specs=(x_spec, w_spec),
                              out_specs=P(axis)))
    return np.asarray(f(jax.device_put(x, NamedSharding(mesh, x_spec)),
                        jax.device_put(w, NamedSharding(mesh, w_spec))), np.float32)


def check_agmm(mesh, axis, m, k, n_local, dtype, seed):
    """x rows split over the axis; w columns split over it: out[r] = x @ w[:, cols of r]."""
    ranks = mesh.shape[axis]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((ranks * m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, ranks * n_local)) / np.sqrt(k), dtype)
    out = run_op(jtd.all_gather_matmul, mesh, axis, x, w, P(axis, None), P(None, axis))
    full = np.asarray(reference(x, w))  # [ranks*m, ranks*n_local]
    out = out.reshape(ranks, ranks * m, n_local)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for r in range(ranks):
        want = full[:, r * n_local:(r + 1) * n_local]
        assert np.linalg.norm(out[r] - want) / np.linalg.norm(want) < tol


def check_mmrs(mesh, axis, m, k_local, n, dtype, seed):
    """x columns (K) split over the axis; out[r] = rows r of x @ w (summed over K shards)."""
    ranks = mesh.shape[axis]
    x, w = inputs(ranks, m=ranks * m, k_local=k_local, n=n, dtype=dtype, seed=seed)
    out = run_op(jtd.matmul_reduce_scatter, mesh, axis, x, w, P(None, axis), P(axis, None))
    full = np.asarray(reference(x, w))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for r in range(ranks):
        want = full[r * m:(r + 1) * m]
        got = out[r * m:(r + 1) * m]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_gather_matmul(ranks, dtype):
    check_agmm(mesh_1d(ranks), "x", m=5, k=24, n_local=20, dtype=dtype, seed=ranks)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_reduce_scatter(ranks, dtype):
    check_mmrs(mesh_1d(ranks), "x", m=3, k_local=20, n=36, dtype=dtype, seed=ranks + 40)


def test_matmul_reduce_scatter_sums_own_tiles_through_the_slots_descriptor(monkeypatch):
    """GEMM+RS reads the peers' partials through a descriptor of the slots (``SUM_TMA``)
    only where there are peers and the slots' rows are 16-byte multiples; right results
    both ways."""
    from jax_triton_dist.fused import launch

    chosen = []
    real = launch.triton_call

    def spy(*args, **kwargs):
        chosen.append(kwargs["SUM_TMA"])
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "triton_call", spy)
    for ranks, n, dtype in ((1, 32, jnp.float32), (2, 32, jnp.bfloat16), (2, 36, jnp.float32),
                            (2, 36, jnp.bfloat16)):
        check_mmrs(mesh_1d(ranks), "x", m=4, k_local=16, n=n, dtype=dtype, seed=n + ranks)
    # 32 bf16 = 64 bytes, 36 float32 = 144 bytes: 16-byte rows; 36 bf16 = 72 bytes: not
    assert chosen == [False, True, True, False]


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_agmm_and_mmrs_on_2x4_mesh(axis):
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "tp"))
    check_agmm(mesh, axis, m=9, k=17, n_local=13, dtype=jnp.float32, seed=5)
    check_mmrs(mesh, axis, m=7, k_local=11, n=19, dtype=jnp.float32, seed=6)


def test_agmm_mmrs_gradients_match_lax():
    """A tensor-parallel MLP (AG+GEMM -> gelu -> GEMM+RS) vs the unfused jax.lax version."""
    ranks = 4
    mesh = mesh_1d(ranks)
    rng = np.random.default_rng(70)
    x = jnp.asarray(rng.standard_normal((ranks * 3, 16)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((16, ranks * 8)) / 4, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((ranks * 8, 16)) / 4, jnp.float32)
    weights = jnp.asarray(rng.standard_normal((ranks * 3, 16)), jnp.float32)
    specs = (P("x", None), P(None, "x"), P("x", None))

    def ours(x, w1, w2):
        h = jax.nn.gelu(jtd.all_gather_matmul(x, w1, "x"))
        return jtd.matmul_reduce_scatter(h, w2, "x")

    def lax_version(x, w1, w2):
        h = jax.nn.gelu(jnp.dot(jax.lax.all_gather(x, "x", tiled=True), w1))
        return jax.lax.psum_scatter(jnp.dot(h, w2), "x", tiled=True)

    def grads(fn):
        f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x"))
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * weights),
                                          argnums=(0, 1, 2)))(x, w1, w2)

    (value, got), (ref_value, want) = grads(ours), grads(lax_version)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_agmm_mmrs_back_to_back_with_a_straggler(straggler):
    mesh = mesh_1d(4)
    straggler(mesh.devices[2].id, 0.02)
    for seed in range(4):  # both staging slots, twice, with fresh inputs
        check_agmm(mesh, "x", m=4, k=16, n_local=8, dtype=jnp.float32, seed=100 + seed)
        check_mmrs(mesh, "x", m=2, k_local=8, n=24, dtype=jnp.float32, seed=200 + seed)


@pytest.mark.parametrize("steps", [12, pytest.param(200, marks=pytest.mark.slow)])
def test_agmm_mmrs_back_to_back_calls(steps):
    ranks = 2
    mesh = mesh_1d(ranks)
    rng = np.random.default_rng(30)
    xs = jnp.asarray(rng.standard_normal((steps, ranks * 2, 8)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((8, ranks * 8)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((ranks * 8, 8)), jnp.float32)

    def body(xs, w1, w2):
        def step(c, x):
            return c, jtd.matmul_reduce_scatter(jtd.all_gather_matmul(x, w1, "x"), w2, "x")
        return jax.lax.scan(step, 0, xs)[1]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P(None, "x"),
                                                         P("x", None)), out_specs=P(None, "x")))
    out = np.asarray(f(xs, w1, w2))
    ref = np.asarray(jnp.einsum("sme,ef,fn->smn", xs, w1, w2, precision="highest"))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_agmm_mmrs_kernels_are_what_runs():
    mesh = mesh_1d(4)
    x = jnp.ones((16, 8))
    f = jax.jit(jax.shard_map(
        lambda a, b: jtd.matmul_reduce_scatter(jtd.all_gather_matmul(a, b, "x"), b.T, "x"),
        mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P("x")))
    hlo = f.lower(x, jnp.ones((8, 16))).compile().as_text()
    assert hlo.count("jtd_triton") >= 2
    assert not any(op in hlo for op in ("all-gather", "reduce-scatter", "all-reduce", " dot("))


def test_agmm_mmrs_errors():
    mesh = mesh_1d(4)

    def trace(op, x, w, **kw):
        f = jax.shard_map(lambda a, b: op(a, b, "x", **kw), mesh=mesh,
                          in_specs=(P(), P()), out_specs=P("x"))
        return jax.jit(f).lower(x, w)

    with pytest.raises(ValueError, match="dimension 0 of x has 6 entries, which do not divide "
                                         "by the 4 ranks"):
        trace(jtd.matmul_reduce_scatter, jnp.ones((6, 8)), jnp.ones((8, 4)))
    with pytest.raises(ValueError, match="gather_axis=1 is x's last dimension, which the GEMM "
                                         "contracts"):
        trace(jtd.all_gather_matmul, jnp.ones((4, 8)), jnp.ones((8, 4)), gather_axis=1)
    with pytest.raises(ValueError, match="scatter_dimension=3 is not a dimension of a 3-D x"):
        trace(jtd.matmul_reduce_scatter, jnp.ones((2, 4, 8)), jnp.ones((8, 4)),
              scatter_dimension=3)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal w.shape\[0\]"):
        trace(jtd.all_gather_matmul, jnp.ones((4, 8)), jnp.ones((6, 4)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_exchange_workspaces_hold_both_epoch_halves(dtype):
    """GEMM+RS's and GEMM+AR's symmetric workspaces, as the kernels index them: slots of
    every rank's partial in the output's type, per-epoch flags per rank and tile
    (GEMM+AR: an area for the partials and one for the two-shot sums), twice."""
    from jax_triton_dist.fused import launch

    assert launch.reduce_scatter_exchange(4, 24, 40, 6, dtype) == [
        ((2, 4, 24, 40), jnp.dtype(dtype)), ((2, 4, 6), jnp.dtype(jnp.int32))]
    assert launch.all_reduce_exchange(3, 16, 56, 7, dtype) == [
        ((2, 3, 16, 56), jnp.dtype(dtype)), ((2, 2, 3, 7), jnp.dtype(jnp.int32))]


def test_a_config_that_sets_a_form_constexpr_is_refused(monkeypatch):
    """A GEMM config that sets what one of the kernel's forms sets (GEMM+AR's exchange)
    would be silently overridden by the form: refused, naming both."""
    from jax_triton_dist import tiles
    from jax_triton_dist.fused import launch
    from jax_triton_dist.kernels.gemm_allreduce import matmul_all_reduce_kernel

    monkeypatch.setattr(tiles, "gemm_configs", lambda *a, **k: [{"TWO_SHOT": True}])
    with pytest.raises(ValueError, match=r"matmul_all_reduce_kernel: GEMM configs set "
                                         r"\['TWO_SHOT'\].*forms"):
        launch._tuned(matmul_all_reduce_kernel, 8, 32, 16, 1, forms=launch.ALL_REDUCE_FORMS)


def test_tuning_spaces_hold_the_exchange_and_store_forms(monkeypatch):
    """What the ops hand the autotuner: GEMM+AR both exchanges at several ranks (the first
    is the choice on CPU and with tuning off: one-shot for small outputs, as all_reduce
    chooses), one-shot alone at one rank, with its loop of stores flattened and through a
    descriptor; AG+GEMM the TMA-store forms of its descriptor configs, unbatched only,
    and the flattened forms of its persistent descriptor configs."""
    from jax_triton_dist import autotune
    from jax_triton_dist.fused import launch

    spaces = []
    real = autotune.autotune

    def spy(configs, **kwargs):
        spaces.append([c.kwargs for c in configs])
        return real(configs, **kwargs)

    monkeypatch.setattr(autotune, "autotune", spy)
    for ranks in (1, 2):
        x, w = inputs(ranks, m=8, k_local=16, n=32, dtype=jnp.float32, seed=ranks)
        run_mar(mesh_1d(ranks), "x", x, w)
    one, two = spaces
    assert {c.get("TWO_SHOT") for c in one} == {False}
    assert {c.get("TWO_SHOT") for c in two} == {False, True} and not two[0]["TWO_SHOT"]
    # one rank: the one-shot configs, their descriptor-store forms and the flattened forms
    # of the persistent descriptor ones (a single loop of stores); more ranks: both
    # exchanges, none flattened or stored through a descriptor
    one_rank_forms = ("FLATTEN", "TMA_STORE", "SUBTILE")
    assert [c for c in two if not c["TWO_SHOT"]] == [
        c for c in one if not any(c.get(form) for form in one_rank_forms)]
    flattened = [c for c in one if c.get("FLATTEN")]
    assert flattened and all(c["USE_TMA"] and c["PERSISTENT"] for c in flattened)
    assert {c.get("SUBTILE", False) for c in one if c.get("TMA_STORE")} == {False, True}
    assert not any(c.get(form) for c in two for form in one_rank_forms)
    # the default (first) form follows all_reduce's one-shot limit
    limit = launch.ONE_SHOT_MAX_BYTES
    assert launch._all_reduce_forms(8, limit) == ({"TWO_SHOT": False}, {"TWO_SHOT": True})
    assert launch._all_reduce_forms(8, limit + 1) == ({"TWO_SHOT": True}, {"TWO_SHOT": False})
    assert launch._all_reduce_forms(1, limit + 1) == ({"TWO_SHOT": False},)

    spaces.clear()
    mesh = mesh_1d(2)
    for shape in ((32, 64), (2, 16, 64)):  # rows, or batch entries of rows
        x = jnp.ones(shape, jnp.float32)
        w = jnp.ones((64, 32), jnp.float32)
        spec = P(*[None] * (len(shape) - 2), "x")
        jax.jit(jax.shard_map(
            lambda a, b: jtd.all_gather_matmul(a, b, "x", gather_axis=a.ndim - 2),
            mesh=mesh, in_specs=(spec, P()), out_specs=spec))(x, w)
    flat, batched = spaces
    assert any(c.get("TMA_STORE") for c in flat)
    assert all(c["USE_TMA"] for c in flat if c.get("TMA_STORE"))
    # halves of the output tile, in the persistent forms, flattened or not
    subtiled = [c for c in flat if c.get("SUBTILE")]
    assert subtiled and all(c["TMA_STORE"] and c["PERSISTENT"] for c in subtiled)
    assert {c.get("FLATTEN", False) for c in subtiled} == {False, True}
    assert not any(c.get("TMA_STORE") or c.get("SUBTILE") for c in batched)
    for space in (flat, batched):
        flattened = [c for c in space if c.get("FLATTEN")]
        assert flattened and all(c["USE_TMA"] and c["PERSISTENT"] for c in flattened)
        assert {c.get("TMA_STORE", False) for c in flattened} == {space is flat, False}
