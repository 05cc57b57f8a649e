"""The collectives, fused ops and MoE dispatch/combine across processes (nvshmem backend,
one rank per process), checked on each process's shards against NumPy references of the
whole computation."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from job import start

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_moe import model, routing  # noqa: E402  (the NumPy model of MoE routing)

import jax_triton_dist as jtd
from jax_triton_dist import shmem

me, n = start()
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 5
mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
rng = np.random.default_rng(3)  # the same draws in every process


def global_array(host, spec):
    """``host`` (the whole array, known to every process) sharded by ``spec``."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def check(name, out, expected, spec, rtol, atol):
    out_sharding = NamedSharding(mesh, spec)
    indices = out_sharding.addressable_devices_indices_map(expected.shape)
    for shard in out.addressable_shards:
        got = np.asarray(shard.data.astype(jnp.float32))
        want = expected[indices[shard.device]]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{name} PE {me}")
    print(f"PE {me}: {name} ok", flush=True)


def run(name, fn, args, in_specs, out_spec, expected, rtol=1e-5, atol=1e-5):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                              check_vma=False))
    arrays = [global_array(a, s) for a, s in zip(args, in_specs, strict=True)]
    for _ in range(calls):  # back-to-back calls reuse workspaces by epoch
        out = f(*arrays)
    check(name, out, expected, out_spec, rtol, atol)


rows = 8 * n
x = rng.standard_normal((n * rows, 64)).astype(np.float32)  # rank r holds rows r*rows:...
run("all_gather", lambda a: jtd.all_gather(a, "x", tiled=True), [x], (P("x"),), P("x"),
    np.concatenate([x] * n))
run("reduce_scatter", lambda a: jtd.reduce_scatter(a, "x", tiled=True), [x], (P("x"),),
    P("x"), x.reshape(n, n, rows // n, 64).sum(0).reshape(n * rows // n, 64))
for method in ("one_shot", "two_shot"):
    run(f"all_reduce {method}", lambda a, m=method: jtd.all_reduce(a, "x", method=m), [x],
        (P("x"),), P("x"), np.tile(x.reshape(n, rows, 64).sum(0), (n, 1)), rtol=1e-4,
        atol=1e-4)
run("all_to_all", lambda a: jtd.all_to_all(a, "x", 0, 0, tiled=True), [x], (P("x"),),
    P("x"), x.reshape(n, n, rows // n, 64).transpose(1, 0, 2, 3).reshape(n * rows, 64))

# Fused ops, bf16 inputs, float32 references.
m, k, nn = 64, 128, 96
bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
xa = bf(rng.standard_normal((n * m, k)))
wa = bf(rng.standard_normal((k, n * nn)) / np.sqrt(k))
to_bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
run("all_gather_matmul", lambda a, b: jtd.all_gather_matmul(to_bf(a), to_bf(b), "x"),
    [xa, wa], (P("x"), P(None, "x")), P(None, "x"), xa @ wa, rtol=2e-2, atol=2e-2)
xr = bf(rng.standard_normal((n * m, n * k)))
wr = bf(rng.standard_normal((n * k, nn)) / np.sqrt(n * k))
run("matmul_reduce_scatter", lambda a, b: jtd.matmul_reduce_scatter(to_bf(a), to_bf(b), "x"),
    [xr, wr], (P(None, "x"), P("x")), P("x"), xr @ wr, rtol=2e-2, atol=2e-2)
run("matmul_all_reduce", lambda a, b: jtd.matmul_all_reduce(to_bf(a), to_bf(b), "x"),
    [xr, wr], (P(None, "x"), P("x")), P("x"), np.tile(xr @ wr, (n, 1)), rtol=2e-2, atol=2e-2)

# MoE: dispatch -> expert e scales its rows by (e + 1) -> combine; a skewed router and a
# capacity small enough to drop rows.
t, topk, experts = 12, 2, 2 * n
local = experts // n
for capacity in (n * t * topk, 5):
    tokens, ids, weights = routing(n, t, topk, experts, skew=True, seed=capacity)

    def moe(x, e, w, capacity=capacity):
        rows, route = jtd.moe_dispatch(x, e, "x", num_experts=experts, capacity=capacity)
        scale = (jax.lax.axis_index("x") * local + jnp.arange(local) + 1).astype(x.dtype)
        return rows, jtd.moe_combine(rows * scale[:, None, None], route, w, "x"), \
            route.dropped[None]

    f = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=(P("x"),) * 3,
                              check_vma=False))
    outs = f(*[global_array(a, P("x")) for a in (tokens, ids, weights)])
    wants = model(n, tokens, ids, weights, experts, capacity)
    for name, out, want in zip(("moe rows", "moe combine", "moe dropped"), outs, wants,
                               strict=True):
        check(f"{name} (capacity {capacity})", out, np.asarray(want, np.float32), P("x"),
              1e-5, 1e-5)

assert shmem.backend() == "nvshmem", shmem.backend()
print(f"PE {me} of {n}: ok", flush=True)
