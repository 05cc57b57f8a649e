"""A sequence-parallel causal attention layer (context parallelism) trained for a few steps
next to the unsharded reference.

    python examples/long_context_attention.py   # 8 simulated CPU devices, or the GPUs

The sequence of x [batch, seq, d_model] is sharded over the mesh axis "sp" in the zigzag
layout (rank r holds chunks r and 2n-1-r of 2n, so causal work is balanced). Each rank
projects its rows to queries, keys and values (grouped-query: fewer key/value heads),
``jtd.sequence_parallel_attention`` attends over the whole sequence in one distributed
kernel, and an output projection follows. The same layer, unsharded, uses
``jax.nn.dot_product_attention``; both are trained with SGD on the same data and their
losses and weights are compared at every step.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_triton_dist as jtd  # noqa: E402
from jax_triton_dist.attention import unzigzag, zigzag  # noqa: E402

BATCH, SEQ_PER_RANK, D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 1, 8, 32, 4, 2, 16
STEPS, LEARNING_RATE = 3, 0.5


def init(rng):
    scale = D_MODEL ** -0.5
    return {"wq": rng.standard_normal((D_MODEL, HEADS * HEAD_DIM)) * scale,
            "wk": rng.standard_normal((D_MODEL, KV_HEADS * HEAD_DIM)) * scale,
            "wv": rng.standard_normal((D_MODEL, KV_HEADS * HEAD_DIM)) * scale,
            "wo": rng.standard_normal((HEADS * HEAD_DIM, D_MODEL)) * scale}


def project(x, params):
    b, s, _ = x.shape
    q = (x @ params["wq"]).reshape(b, s, HEADS, HEAD_DIM)
    k = (x @ params["wk"]).reshape(b, s, KV_HEADS, HEAD_DIM)
    v = (x @ params["wv"]).reshape(b, s, KV_HEADS, HEAD_DIM)
    return q, k, v


def sharded_layer(x, params):
    """Per rank: x [batch, seq_local, d_model] -> same."""
    q, k, v = project(x, params)
    out = jtd.sequence_parallel_attention(q, k, v, "sp", causal=True, layout="zigzag")
    return out.reshape(x.shape[0], x.shape[1], -1) @ params["wo"]


def reference_layer(x, params):
    q, k, v = project(x, params)
    group = HEADS // KV_HEADS
    out = jax.nn.dot_product_attention(q, jnp.repeat(k, group, axis=2),
                                       jnp.repeat(v, group, axis=2), is_causal=True)
    return out.reshape(x.shape[0], x.shape[1], -1) @ params["wo"]


def main():
    devices = jax.devices()
    ranks = len(devices)
    mesh = Mesh(np.array(devices), ("sp",))
    rng = np.random.default_rng(0)
    seq = ranks * SEQ_PER_RANK
    x = jnp.asarray(rng.standard_normal((BATCH, seq, D_MODEL)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((BATCH, seq, D_MODEL)), jnp.float32)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in init(rng).items()}
    reference_params = dict(params)

    seq_spec = P(None, "sp")
    layer = jax.shard_map(sharded_layer, mesh=mesh, in_specs=(seq_spec, P()),
                          out_specs=seq_spec)
    put = lambda a: jax.device_put(zigzag(a, ranks), NamedSharding(mesh, seq_spec))  # noqa: E731
    x_sharded, target_sharded = put(x), put(target)

    def loss(params, x, target):
        return jnp.mean((layer(x, params) - target) ** 2)

    def reference_loss(params):
        return jnp.mean((reference_layer(x, params) - target) ** 2)

    out = unzigzag(jax.jit(layer)(x_sharded, params), ranks)
    error = float(jnp.linalg.norm(out - reference_layer(x, params))
                  / jnp.linalg.norm(reference_layer(x, params)))
    print(f"{ranks} ranks, sequence {seq} ({SEQ_PER_RANK} per rank, zigzag), {HEADS} heads "
          f"({KV_HEADS} kv), head_dim {HEAD_DIM}: forward relative error {error:.2e}")
    assert error < 1e-4, error

    step = jax.jit(jax.value_and_grad(loss))
    reference_step = jax.jit(jax.value_and_grad(reference_loss))
    for i in range(STEPS):
        value, grads = step(params, x_sharded, target_sharded)
        reference_value, reference_grads = reference_step(reference_params)
        params = {k: params[k] - LEARNING_RATE * grads[k] for k in params}
        reference_params = {k: reference_params[k] - LEARNING_RATE * reference_grads[k]
                            for k in params}
        drift = max(float(jnp.max(jnp.abs(params[k] - reference_params[k]))) for k in params)
        print(f"step {i}: loss {float(value):.6f} (reference {float(reference_value):.6f}), "
              f"largest weight difference {drift:.1e}")
        assert abs(float(value) - float(reference_value)) < 1e-4 * abs(float(reference_value))
        assert drift < 1e-4, drift
    print("trained like the unsharded reference: relative error of the forward pass "
          f"{error:.2e}")


if __name__ == "__main__":
    main()
