"""GPU tier: the compiled kernels through real JAX on NVIDIA GPUs (skipped without one).

With one GPU these run at world size 1 (every rank-to-rank path is the self path); the
multi-GPU tiers come with a multi-GPU machine.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
import jax_triton_dist.language as dl
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not _gpus(), reason="needs an NVIDIA GPU")


def gpu_mesh():
    return Mesh(np.array(_gpus()), ("x",))


def run(fn, x):
    mesh = gpu_mesh()
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return f(jax.device_put(x, NamedSharding(mesh, P("x"))))


def random(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.int32:
        return jnp.asarray(rng.integers(-100, 100, shape).astype(np.int32))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


OPS = {
    "all_gather": (lambda v: jtd.all_gather(v, "x", tiled=True),
                   lambda v: jax.lax.all_gather(v, "x", tiled=True)),
    "reduce_scatter": (lambda v: jtd.reduce_scatter(v, "x", tiled=True),
                       lambda v: jax.lax.psum_scatter(v, "x", tiled=True)),
    "all_reduce_one_shot": (lambda v: jtd.all_reduce(v, "x", method="one_shot"),
                            lambda v: jax.lax.psum(v, "x")),
    "all_reduce_two_shot": (lambda v: jtd.all_reduce(v, "x", method="two_shot"),
                            lambda v: jax.lax.psum(v, "x")),
    "all_reduce_max": (lambda v: jtd.all_reduce(v, "x", op="max"),
                       lambda v: jax.lax.pmax(v, "x")),
    "all_to_all": (lambda v: jtd.all_to_all(v, "x", 0, 1, tiled=True),
                   lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=True)),
}


@requires_gpu
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32])
def test_op_matches_jax_lax_on_gpu(name, dtype):
    ours_fn, ref_fn = OPS[name]
    world = len(_gpus())
    x = random((world * 64, 1000 + 37), dtype, seed=hash(name) % 1000)
    ours, ref = run(ours_fn, x), run(ref_fn, x)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-3, atol=1e-2)


@requires_gpu
def test_kernel_path_runs_on_gpu():
    x = random((len(_gpus()) * 8, 128), jnp.float32, seed=0)
    mesh = gpu_mesh()
    f = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    hlo = f.lower(jax.device_put(x, NamedSharding(mesh, P("x")))).compile().as_text()
    assert "jtd_triton" in hlo and "all-reduce" not in hlo


@requires_gpu
def test_ring_exchange_and_repeated_calls_on_gpu():
    world = len(_gpus())
    n = 5000

    def shift(v):
        return jtd.triton_call(
            ring_shift_kernel, v, n=n, out_shape=jax.ShapeDtypeStruct((n,), v.dtype),
            workspace=[jtd.Workspace((2, n), v.dtype), jtd.Workspace((2,), jnp.int32)],
            grid=(1,), axis_name="x", BLOCK=1024)

    mesh = gpu_mesh()
    f = jax.jit(jax.shard_map(shift, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for seed in range(100):  # epochs advance on the device; flags are never reset
        x = random((world * n,), jnp.float32, seed=seed)
        y = f(jax.device_put(x, NamedSharding(mesh, P("x"))))
        np.testing.assert_array_equal(np.asarray(y), np.roll(np.asarray(x), n))


@triton.jit
def epoch_kernel(out_ptr):
    tl.store(out_ptr, dl.epoch() * 1000 + dl.rank() * 10 + dl.num_ranks())


@requires_gpu
def test_rank_context_on_gpu():
    world = len(_gpus())

    def probe(v):
        return jtd.triton_call(epoch_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                               grid=(1,), axis_name="x")

    mesh = gpu_mesh()
    f = jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.zeros(world), NamedSharding(mesh, P("x")))
    for call in range(1, 4):
        got = np.asarray(f(x))
        np.testing.assert_array_equal(got, [call * 1000 + r * 10 + world for r in range(world)])


@requires_gpu
@pytest.mark.parametrize("m,n,k", [(8192, 1376, 4096), (128, 1376, 4096), (1000, 333, 77)])
def test_gemm_tiles_match_jnp_dot_on_gpu(m, n, k):
    """Every config of the GEMM space: persistent, tensor-descriptor, flattened, TMA-store,
    split-K and stream-K ones (twice: split-K and stream-K counts carry over)."""
    from jax_triton_dist import tiles
    from jax_triton_dist.bench import gemm

    rng = np.random.default_rng(m)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    mesh = Mesh(np.array(_gpus()[:1]), ("x",))
    ref = np.asarray(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST))
    for config in tiles.gemm_tile_configs(m, n, k):
        f = jax.jit(jax.shard_map(lambda x, y, c=config: gemm.matmul(x, y, c), mesh=mesh,
                                  in_specs=(P(), P()), out_specs=P(), check_vma=False))
        for _ in range(2):
            ours = np.asarray(f(a, b), np.float32)
            assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-2, gemm.describe(config)


@requires_gpu
def test_kernel_beyond_shared_memory_is_a_clear_error():
    """A config whose buffers exceed the GPU's shared memory per program (256x256x128 bf16
    blocks, 4 stages: 512 KiB) fails at load with the bytes it needs and the bytes the GPU
    allows; one that fits (128x256x64, 3 stages: 144 KiB, above the 48 KiB default) runs."""
    from jax_triton_dist.bench import gemm

    mesh = Mesh(np.array(_gpus()[:1]), ("x",))
    a = jnp.ones((512, 512), jnp.bfloat16)
    for config, fits in [({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 4},
                          False),
                         ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 3},
                          True)]:
        config = dict(config, GROUP_M=8, num_warps=8, PERSISTENT=False, USE_TMA=False)
        f = jax.jit(jax.shard_map(lambda x, y, c=config: gemm.matmul(x, y, c), mesh=mesh,
                                  in_specs=(P(), P()), out_specs=P(), check_vma=False))
        if fits:
            np.testing.assert_allclose(np.asarray(f(a, a), np.float32), 512.0)
        else:
            with pytest.raises(Exception, match=r"matmul_kernel needs \d+ bytes of shared "
                                                r"memory per program; GPU 0 allows \d+"):
                np.asarray(f(a, a))


@triton.jit
def pull_gather_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Every rank pulls every peer's staged ``x`` after a barrier."""
    dl.barrier_all()
    for peer in range(0, dl.num_ranks()):
        dl.getmem(out_ptr + peer * n, x_ptr, n, peer, BLOCK)
    dl.barrier_all()


@requires_gpu
def test_symmetric_argument_staging_on_gpu():
    world, n = len(_gpus()), 3000

    def gather(v):
        return jtd.triton_call(pull_gather_kernel, v, n=n,
                               out_shape=jax.ShapeDtypeStruct((world * n,), v.dtype),
                               symmetric=[0], grid=(1,), axis_name="x", BLOCK=1024)

    mesh = gpu_mesh()
    f = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for seed in range(5):  # both staging slots, twice
        x = random((world * n,), jnp.float32, seed=seed)
        out = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("x")))))
        np.testing.assert_array_equal(out.reshape(world, world * n)[0], np.asarray(x))


@requires_gpu
@pytest.mark.parametrize("m,k,n", [(16, 4096, 1376), (128, 1376, 4096), (7, 100, 300)])
def test_matmul_all_reduce_on_gpu(m, k, n):
    world = len(_gpus())
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((m, world * k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((world * k, n)) / np.sqrt(world * k), jnp.bfloat16)
    mesh = gpu_mesh()
    specs = (P(None, "x"), P("x", None))
    f = jax.jit(jax.shard_map(lambda a, b: jtd.matmul_all_reduce(a, b, "x"), mesh=mesh,
                              in_specs=specs, out_specs=P("x")))
    out = np.asarray(f(jax.device_put(x, NamedSharding(mesh, specs[0])),
                       jax.device_put(w, NamedSharding(mesh, specs[1]))), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST))
    for r in range(world):
        part = out[r * m:(r + 1) * m]
        assert np.linalg.norm(part - ref) / np.linalg.norm(ref) < 1e-2


@requires_gpu
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("m,k,n", [(1024, 4096, 1376), (100, 72, 300)])
def test_fused_tp_ops_on_gpu(op, m, k, n):
    world = len(_gpus())
    rng = np.random.default_rng(m + k)
    x = jnp.asarray(rng.standard_normal((world * m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    mesh = gpu_mesh()
    # all_gather_matmul: rows of x split, w whole on every rank; matmul_reduce_scatter: K split.
    specs = {"all_gather_matmul": (P("x", None), P()),
             "matmul_reduce_scatter": (P(None, "x"), P("x", None))}[op]
    fn = getattr(jtd, op)
    f = jax.jit(jax.shard_map(lambda a, b: fn(a, b, "x"), mesh=mesh, in_specs=specs,
                              out_specs=P("x")))
    out = np.asarray(f(jax.device_put(x, NamedSharding(mesh, specs[0])),
                       jax.device_put(w, NamedSharding(mesh, specs[1]))), np.float32)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                             precision=jax.lax.Precision.HIGHEST))
    if op == "all_gather_matmul":
        ref = np.concatenate([ref] * world)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


@requires_gpu
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("skew", [False, True])
def test_moe_dispatch_and_combine_on_gpu(k, skew):
    from test_moe import model, routing, run_layer

    ranks, t, num_experts = len(_gpus()), 40, 4 * len(_gpus())
    for capacity in (None, 7):  # default capacity fits everything; 7 drops under skew
        tokens, ids, weights = routing(ranks, t, k, num_experts, skew, seed=k + 2 * skew)
        inputs, out, dropped, _ = run_layer(ranks, tokens, ids, weights, num_experts,
                                            capacity=capacity, platform="gpu")
        cap = ranks * t * k if capacity is None else capacity
        want_inputs, want_out, want_dropped = model(ranks, tokens, ids, weights, num_experts,
                                                    cap)
        np.testing.assert_array_equal(inputs, want_inputs)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(dropped, want_dropped)


@requires_gpu
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("activation", [None, "gelu_tanh", "silu"])
def test_fused_layouts_batch_dims_and_epilogues_compiled(op, layout, activation):
    """The compiled nk-weight, batched (BATCHED constexpr) and epilogue paths at world size 1
    against XLA in float32."""
    mesh = gpu_mesh()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 256, 512)), jnp.bfloat16)  # [batch, seq, d]
    w = jnp.asarray(rng.standard_normal((512, 384)) / 16, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(384), jnp.bfloat16)
    kwarg = {"gather_axis": 1} if op == "all_gather_matmul" else {"scatter_dimension": 1}
    stored = w if layout == "kn" else w.T

    def ours(a, c, d):
        return getattr(jtd, op)(a, c, "x", w_layout=layout, bias=d, activation=activation,
                                **kwarg)

    act = {None: lambda v: v, "gelu_tanh": jax.nn.gelu, "silu": jax.nn.silu}[activation]
    f = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(),
                              check_vma=False))
    got = np.asarray(f(x, stored, b), np.float32)
    want = np.asarray(act(jnp.einsum("bsd,dn->bsn", x.astype(jnp.float32),
                                     w.astype(jnp.float32)) + b.astype(jnp.float32)))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
