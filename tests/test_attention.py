"""Attention across ranks (``jtd.sequence_parallel_attention``, ``jtd.flash_decode``) on
simulated CPU devices, against ``jax.nn.dot_product_attention`` / a dense softmax over the
whole sequence in float32, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist import tiles
from jax_triton_dist.attention import flash_decode_p, unzigzag, zigzag

XLA_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                   "collective-permute")


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def qkv(b, s, h, kvh, d, dtype, seed):
    rng = np.random.default_rng(seed)
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)  # noqa: E731
    return make(b, s, h, d), make(b, s, kvh, d), make(b, s, kvh, d)


def reference(q, k, v, causal):
    """Attention over the whole sequence in float32 (GQA by repeating key heads)."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    return jax.nn.dot_product_attention(q.astype(jnp.float32), k, v, is_causal=causal)


def sp(mesh, axis, **options):
    spec = P(None, axis)
    return jax.jit(jax.shard_map(
        lambda q, k, v: jtd.sequence_parallel_attention(q, k, v, axis, **options),
        mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))


def close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    assert np.max(np.abs(got - want)) <= tol * max(1.0, np.max(np.abs(want))), \
        np.max(np.abs(got - want))


@pytest.mark.parametrize("ranks", [1, 2, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_reference(ranks, causal):
    q, k, v = qkv(2, 6 * ranks, 4, 2, 16, jnp.float32, seed=ranks)
    out = sp(mesh_of((ranks,), ("sp",)), "sp", causal=causal)(q, k, v)
    close(out, reference(q, k, v, causal), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
    q, k, v = qkv(1, 32, 2, 1, 32, dtype, seed=3)
    out = sp(mesh_of((4,), ("sp",)), "sp", causal=True)(q, k, v)
    assert out.dtype == dtype
    close(out, reference(q, k, v, True), dtype)


@pytest.mark.parametrize("axis", ["dp", "sp"])
def test_one_axis_of_a_2x4_mesh(axis):
    mesh = mesh_of((2, 4), ("dp", "sp"))
    ranks = mesh.shape[axis]
    other = "sp" if axis == "dp" else "dp"
    q, k, v = qkv(mesh.shape[other], 5 * ranks, 2, 2, 16, jnp.float32, seed=7)
    # The batch is split over the other axis: each of its rows is one team.
    spec = P(other, axis)
    f = jax.jit(jax.shard_map(
        lambda a, b, c: jtd.sequence_parallel_attention(a, b, c, axis, causal=True),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    close(f(q, k, v), reference(q, k, v, True), jnp.float32)


@pytest.mark.parametrize("ranks", [2, 4])
def test_zigzag_layout(ranks):
    q, k, v = qkv(1, 8 * ranks, 2, 1, 16, jnp.float32, seed=11)
    f = sp(mesh_of((ranks,), ("sp",)), "sp", causal=True, layout="zigzag")
    out = unzigzag(f(*(zigzag(x, ranks) for x in (q, k, v))), ranks)
    close(out, reference(q, k, v, True), jnp.float32)
    np.testing.assert_array_equal(np.asarray(unzigzag(zigzag(q, ranks), ranks)), np.asarray(q))


@pytest.mark.parametrize("causal, layout, kvh", [(False, "contiguous", 2), (True, "contiguous", 1),
                                                 (True, "zigzag", 2)])
def test_gradients_match_the_reference(causal, layout, kvh):
    ranks = 4
    q, k, v = qkv(2, 4 * ranks, 2, kvh, 16, jnp.float32, seed=13)
    check_gradients(q, k, v, ranks, causal, layout, seed=14)


def in_layout(f, ranks, layout):
    """``f`` (sharded attention) on a global sequence in natural order: reordered for the
    zigzag layout and back."""
    if layout != "zigzag":
        return f
    return lambda a, b, c: unzigzag(f(*(zigzag(x, ranks) for x in (a, b, c))), ranks)


def check_gradients(q, k, v, ranks, causal, layout, seed):
    """Gradients of a random weighting of the output vs the float32 reference's."""
    f = in_layout(sp(mesh_of((ranks,), ("sp",)), "sp", causal=causal, layout=layout), ranks,
                  layout)
    weights = jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape), jnp.float32)
    ours = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, b, c) * weights),
                            argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda a, b, c: jnp.sum(reference(a, b, c, causal) * weights),
                    argnums=(0, 1, 2))(q, k, v)
    for got, ref in zip(ours, want, strict=True):
        close(got, ref, jnp.float32)


# (BLOCK_M, BLOCK_N, USE_TMA, SPLIT_MASKED) with the (causal, layout) each runs.
BLOCK_CONFIGS = [((16, 16, False, True), False, "contiguous"),
                 ((16, 16, True, True), True, "contiguous"),
                 ((32, 16, True, True), True, "zigzag"),
                 ((16, 32, False, True), True, "zigzag"),
                 pytest.param((16, 16, False, False), True, "contiguous", marks=pytest.mark.slow),
                 pytest.param((32, 16, False, False), False, "zigzag", marks=pytest.mark.slow)]


@pytest.mark.parametrize("config, causal, layout", BLOCK_CONFIGS,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_every_block_config_and_tensor_descriptors(monkeypatch, config, causal, layout):
    """The attention kernels with one config: small blocks (so local sequences of a few
    blocks run both the unmasked and the masked key loops, or the one masked loop Ascend
    uses), through pointers or (the forward kernel) tensor descriptors."""
    bm, bn, use_tma, split = config

    def configs(seq, head_dim, target="cuda", forward=False):
        extra = {"USE_TMA": use_tma, "SPLIT_MASKED": split} if forward else {}
        return [{"BLOCK_M": bm, "BLOCK_N": bn, **extra, "num_warps": 4, "num_stages": 2}]

    monkeypatch.setattr(tiles, "attention_configs", configs)
    ranks = 2
    # 40 rows a rank: whole blocks and a ragged tail; zigzag chunks of 20 rows straddle
    # query blocks.
    q, k, v = qkv(1, 40 * ranks, 2, 1, 16, jnp.float32, seed=23)
    f = in_layout(sp(mesh_of((ranks,), ("sp",)), "sp", causal=causal, layout=layout), ranks,
                  layout)
    close(f(q, k, v), reference(q, k, v, causal), jnp.float32)
    check_gradients(q, k, v, ranks, causal, layout, seed=24)


def test_the_hlo_holds_our_calls_and_no_xla_collective():
    q, k, v = qkv(1, 16, 2, 2, 16, jnp.float32, seed=1)
    f = sp(mesh_of((4,), ("sp",)), "sp", causal=True)
    text = f.lower(q, k, v).as_text()
    assert text.count("jtd_triton") == 1 and not any(c in text for c in XLA_COLLECTIVES)
    grad = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, b, c)), argnums=(0, 1, 2)))
    text = grad.lower(q, k, v).as_text()
    # forward, 2 all-gathers, rowsum(dO * O), 2 backward kernels, 2 reduce-scatters
    assert text.count("jtd_triton") == 8 and not any(c in text for c in XLA_COLLECTIVES)


@pytest.mark.parametrize("steps", [12, pytest.param(100, marks=pytest.mark.slow)])
def test_back_to_back_calls_in_a_scan(steps):
    ranks = 4
    mesh = mesh_of((ranks,), ("sp",))
    q, k, v = qkv(1, 2 * ranks, 1, 1, 16, jnp.float32, seed=17)
    spec = P(None, "sp")

    def run(a, b, c):
        def body(carry, _):
            return jtd.sequence_parallel_attention(carry, b, c, "sp", causal=True), None

        return jax.lax.scan(body, a, None, length=steps)[0]

    f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    want = q
    for _ in range(steps):
        want = reference(want, k, v, True)
    close(f(q, k, v), want, jnp.float32)


def test_a_straggling_rank(straggler):
    straggler(2, 0.2)
    q, k, v = qkv(1, 16, 2, 1, 16, jnp.float32, seed=19)
    close(sp(mesh_of((4,), ("sp",)), "sp", causal=True)(q, k, v), reference(q, k, v, True),
          jnp.float32)


def test_bad_input_is_refused_clearly():
    mesh = mesh_of((2,), ("sp",))
    q, k, v = qkv(1, 8, 4, 2, 16, jnp.float32, seed=0)
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        sp(mesh, "sp")(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)))
    with pytest.raises(ValueError, match="head_dim must be a power of two of at least 16"):
        sp(mesh, "sp")(*(x[..., :12] for x in (q, k, v)))
    with pytest.raises(ValueError, match="must be \\[batch, seq, heads, head_dim\\]"):
        sp(mesh, "sp")(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="one dtype"):
        sp(mesh, "sp")(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match="expected float32, bfloat16 or float16"):
        sp(mesh, "sp")(*(x.astype(jnp.int32) for x in (q, k, v)))
    with pytest.raises(ValueError, match="k and v must have one shape"):
        sp(mesh, "sp")(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="k and v must be \\[batch=1, seq=4, kv_heads"):
        sp(mesh, "sp")(q, jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 16, 2, 16)))
    with pytest.raises(ValueError, match="layout must be one of"):
        sp(mesh, "sp", layout="striped")(q, k, v)
    with pytest.raises(ValueError, match="needs an even local sequence"):
        sp(mesh, "sp", layout="zigzag")(*(x[:, :6] for x in (q, k, v)))
    with pytest.raises(NameError):  # an axis the shard_map does not have
        jax.jit(jax.shard_map(lambda a, b, c: jtd.sequence_parallel_attention(a, b, c, "tp"),
                              mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                              out_specs=P(None, "sp")))(q, k, v)


# ---------------------------------------------------------------------------
# flash_decode
# ---------------------------------------------------------------------------


def decode_reference(q, k, v, lengths):
    group = q.shape[1] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    scores = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), k) / np.sqrt(q.shape[-1])
    valid = jnp.arange(k.shape[1])[None, None, :] < lengths[:, None, None]
    p = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    return jnp.where(lengths[:, None, None] > 0,
                     jnp.einsum("bhs,bshd->bhd", jnp.nan_to_num(p), v), 0.0)


def decode(mesh, axis):
    return jax.jit(jax.shard_map(
        lambda q, k, v, n: jtd.flash_decode(q, k, v, axis, kv_lengths=n), mesh=mesh,
        in_specs=(P(), P(None, axis), P(None, axis), P()), out_specs=P(axis)))


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flash_decode_with_variable_lengths(ranks, dtype):
    b, h, kvh, d, s_local = 4, 4, 2, 16, 8
    rng = np.random.default_rng(ranks)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((b, ranks * s_local, kvh, d)), jnp.float32).astype(dtype)
    v = jnp.asarray(rng.standard_normal((b, ranks * s_local, kvh, d)), jnp.float32).astype(dtype)
    # full, partial (some ranks hold nothing valid), one row, and an empty row
    lengths = jnp.asarray([ranks * s_local, s_local // 2 + 1, 1, 0], jnp.int32)
    out = decode(mesh_of((ranks,), ("kv",)), "kv")(q, k, v, lengths)
    want = decode_reference(q, k, v, lengths)
    for r in range(ranks):  # every rank holds the whole result
        close(out[r * b:(r + 1) * b], want, dtype)
    np.testing.assert_array_equal(np.asarray(out[:b][3], np.float32), 0.0)


@pytest.mark.parametrize("mesh_shape, axis", [((4,), "kv"), ((2, 2), "kv")])
def test_flash_decode_result_is_typed_as_the_same_on_every_rank(mesh_shape, axis):
    """Like psum's, the result is invariant over the cache's axis: out_specs may leave the
    axis out (checked by shard_map), on a 1-D mesh and on one axis of a 2-D mesh."""
    names = ("kv",) if len(mesh_shape) == 1 else ("dp", "kv")
    mesh = mesh_of(mesh_shape, names)
    ranks = mesh.shape[axis]
    b, h, kvh, d, s_local = 2, 4, 1, 16, 8
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, ranks * s_local, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, ranks * s_local, kvh, d)), jnp.float32)
    lengths = jnp.asarray([ranks * s_local - 3, 5], jnp.int32)
    f = jax.jit(jax.shard_map(
        lambda a, c, e, n: jtd.flash_decode(a, c, e, axis, kv_lengths=n), mesh=mesh,
        in_specs=(P(), P(None, axis), P(None, axis), P()), out_specs=P()))
    assert jax.typeof(f(q, k, v, lengths)).shape == (b, h, d)
    close(f(q, k, v, lengths), decode_reference(q, k, v, lengths), jnp.float32)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        flash_decode_p.bind(q, k, v, lengths, axes=(axis,), size=ranks, scale=0.25)


def test_flash_decode_default_lengths_and_bad_input():
    mesh = mesh_of((2,), ("kv",))
    q = jnp.ones((1, 2, 16))
    k = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 1, 16)), jnp.float32)
    f = jax.jit(jax.shard_map(lambda a, b, c: jtd.flash_decode(a, b, c, "kv"), mesh=mesh,
                              in_specs=(P(), P(None, "kv"), P(None, "kv")), out_specs=P("kv")))
    close(f(q, k, k)[:1], decode_reference(q, k, k, jnp.asarray([8])), jnp.float32)
    with pytest.raises(ValueError, match="q must be \\[batch, heads, head_dim\\]"):
        jax.jit(jax.shard_map(lambda a, b, c: jtd.flash_decode(a, b, c, "kv"), mesh=mesh,
                              in_specs=(P(), P(None, "kv"), P(None, "kv")),
                              out_specs=P("kv")))(q[0], k, k)
