"""Attention across ranks on the GPU (skipped without one): the ops under JAX at world
size 1 (head_dim 64 and 128, bf16, gradients), and the kernels at 2 and 8 ranks sharing
the GPU (``one_gpu``), against float64/float32 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_support import have_gpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
from jax_triton_dist import one_gpu, tiles
from jax_triton_dist.kernels.attention import (
    flash_decode_kernel,
    sequence_parallel_attention_kernel,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs a GPU")]
CALLS = 3


def reference(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    k, v = (np.repeat(x.astype(np.float64), group, axis=2) for x in (k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        scores = np.where(np.arange(s)[None, :] <= np.arange(s)[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_world_size_one_under_jax(d, causal):
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    rng = np.random.default_rng(d)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 4, d)) if i == 0 else
                           rng.standard_normal((2, 256, 2, d)), jnp.bfloat16) for i in range(3))
    spec = P(None, "sp")
    f = jax.jit(jax.shard_map(lambda a, b, c: jtd.sequence_parallel_attention(
        a, b, c, "sp", causal=causal), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    want = reference(*(np.asarray(x, np.float32) for x in (q, k, v)), causal)
    got = np.asarray(f(q, k, v), np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    grads = jax.grad(lambda a, b, c: jnp.sum(f(a, b, c).astype(jnp.float32)),
                     argnums=(0, 1, 2))(q, k, v)

    def lax_loss(a, b, c):
        group = a.shape[2] // b.shape[2]
        out = jax.nn.dot_product_attention(a.astype(jnp.float32),
                                           jnp.repeat(b.astype(jnp.float32), group, 2),
                                           jnp.repeat(c.astype(jnp.float32), group, 2),
                                           is_causal=causal)
        return jnp.sum(out)

    wants = jax.grad(lax_loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, wants, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 3e-2


@pytest.mark.parametrize("d", [64, 128])
def test_every_tuned_forward_config_on_the_gpu(monkeypatch, d):
    """Each config of the forward's space alone (the autotuner skips a config that fails,
    which would hide a broken one): blocks, warps, stages, tensor descriptors; causal, a
    ragged tail for the 128-row blocks (320 rows), bf16."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    rng = np.random.default_rng(d + 1)
    q = jnp.asarray(rng.standard_normal((1, 320, 4, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 320, 2, d)), jnp.bfloat16) for _ in range(2))
    want = reference(*(np.asarray(x, np.float32) for x in (q, k, v)), True)
    space = tiles.attention_configs(320, d, forward=True)
    assert any(c["USE_TMA"] for c in space)
    ran, too_big = [], []
    for config in space:
        monkeypatch.setattr(tiles, "attention_configs",
                            lambda *a, c=config, **kw: [c])
        f = jax.jit(jax.shard_map(lambda a, b, c: jtd.sequence_parallel_attention(
            a, b, c, "sp", causal=True), mesh=mesh, in_specs=(P(None, "sp"),) * 3,
            out_specs=P(None, "sp")))
        try:
            got = np.asarray(f(q, k, v), np.float32)
        except Exception as error:  # a config beyond the SM's shared memory: tuning skips it
            if "shared memory" not in str(error).lower() and "resource" not in str(error):
                raise
            too_big.append(config)
            continue
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, config
        ran.append(config)
    assert len(ran) >= len(space) // 2 and any(c["USE_TMA"] for c in ran), (ran, too_big)


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_parallel_kernel_on_ranks_sharing_the_gpu(world, causal):
    b, s, h, kvh, d = 1, 64, 2, 1, 64
    rng = np.random.default_rng(world)
    q = rng.standard_normal((world, b, s, h, d)).astype(np.float32)
    k = rng.standard_normal((world, b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((world, b, s, kvh, d)).astype(np.float32)
    blocks = tiles.attention_blocks(s)
    out = one_gpu.run_ranks(
        sequence_parallel_attention_kernel, world, lambda c, r: [q[r], k[r], v[r]],
        [((b, s, h, d), np.float32), ((b, s, h), np.float32)], [((2, world), np.int32)],
        grid=(b * h * (s // blocks["BLOCK_M"]),),
        kwargs=dict(B=b, S=s, H=h, KVH=kvh, scale=d ** -0.5, HEAD_DIM=d, CAUSAL=causal,
                    ZIGZAG=False, **blocks), calls=CALLS, symmetric=[1, 2])
    whole = [np.concatenate(list(x), axis=1) for x in (q, k, v)]  # [b, world * s, ...]
    want = reference(*whole, causal)
    for call in range(CALLS):
        for r in range(world):
            got = out[call][r][0]
            part = want[:, r * s:(r + 1) * s]
            assert np.linalg.norm(got - part) / np.linalg.norm(part) < 5e-3  # tf32 dots


@pytest.mark.parametrize("world", [2, 8])
def test_flash_decode_kernel_on_ranks_sharing_the_gpu(world):
    b, s, h, kvh, d = 3, 32, 4, 2, 64
    rng = np.random.default_rng(world + 1)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k = rng.standard_normal((world, b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((world, b, s, kvh, d)).astype(np.float32)
    lengths = np.array([world * s, s + 3, 0], np.int32)
    out = one_gpu.run_ranks(
        flash_decode_kernel, world, lambda c, r: [q, k[r], v[r], lengths],
        [((b, h, d), np.float32)],
        [((2, world, b, h, d), np.float32), ((2, world, b, h), np.float32),
         ((2, world, b * kvh), np.int32)], grid=(b * kvh,),
        kwargs=dict(B=b, S=s, H=h, KVH=kvh, scale=d ** -0.5, HEAD_DIM=d, GROUP=16,
                    BLOCK_N=tiles.attention_blocks(s)["BLOCK_N"]), calls=CALLS)
    kk, vv = (np.repeat(np.concatenate(list(x), axis=1).astype(np.float64), h // kvh, axis=2)
              for x in (k, v))
    scores = np.einsum("bhd,bshd->bhs", q.astype(np.float64), kk) / np.sqrt(d)
    scores = np.where(np.arange(world * s)[None, None, :] < lengths[:, None, None], scores,
                      -np.inf)
    for row in range(2):
        p = np.exp(scores[row] - scores[row].max(-1, keepdims=True))
        want = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), vv[row])
        for call in range(CALLS):
            for r in range(world):
                got = out[call][r][0][row]
                assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    for r in range(world):
        np.testing.assert_array_equal(out[-1][r][0][2], 0.0)
