"""An expert-parallel MoE layer: router -> moe_dispatch -> per-expert GEMM -> moe_combine.

    python examples/moe_layer.py        # 8 simulated CPU devices, or the GPUs if present

Each rank holds T tokens and E/n experts (a [D, D] weight each). The router picks the
top-k experts per token; dispatch sends each (token, choice) to the expert's rank, the
experts run one batched GEMM over their rows, combine brings the results back weighted
by the router's probabilities. Checked against the dense computation in float32, with a
deliberately skewed router (most tokens prefer expert 0); then the router and the experts
train for a few SGD steps (gradients through combine and dispatch) next to the dense
reference trained the same way.
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

TOKENS_PER_RANK, D_MODEL, EXPERTS_PER_RANK, TOP_K = 16, 32, 2, 2


def moe_layer(x, router, experts, num_experts):
    """Per rank: x [T, D], router [D, E], experts [E/n, D, D] -> [T, D]."""
    logits = x @ router
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
    rows, routing = jtd.moe_dispatch(x, ids, "ep", num_experts=num_experts)
    outputs = jnp.einsum("ecd,edf->ecf", rows, experts)  # every local expert, all its rows
    return jtd.moe_combine(outputs, routing, weights, "ep"), routing.dropped[None]


def dense_reference(x, router, experts):
    """Every token through its top-k experts, unsharded, float32."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(x @ router, axis=-1), TOP_K)
    per_expert = jnp.einsum("td,edf->tef", x, experts, precision=jax.lax.Precision.HIGHEST)
    chosen = jnp.take_along_axis(per_expert, ids[:, :, None], axis=1)
    return jnp.sum(weights[:, :, None] * chosen, axis=1)


def main():
    devices = jax.devices()
    n = len(devices)
    num_experts = n * EXPERTS_PER_RANK
    mesh = Mesh(np.array(devices), ("ep",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n * TOKENS_PER_RANK, D_MODEL)), jnp.float32)
    router = rng.standard_normal((D_MODEL, num_experts)).astype(np.float32)
    router[:, 0] += 2.0 * np.sign(np.asarray(x).mean(0))  # skew: expert 0 is popular
    router = jnp.asarray(router)
    experts = jnp.asarray(rng.standard_normal((num_experts, D_MODEL, D_MODEL)) / np.sqrt(D_MODEL),
                          jnp.float32)
    layer = jax.jit(jax.shard_map(
        lambda a, b, c: moe_layer(a, b, c, num_experts), mesh=mesh,
        in_specs=(P("ep"), P(), P("ep")), out_specs=(P("ep"), P("ep"))))
    out, dropped = layer(jax.device_put(x, NamedSharding(mesh, P("ep"))),
                         jax.device_put(router, NamedSharding(mesh, P())),
                         jax.device_put(experts, NamedSharding(mesh, P("ep"))))
    ref = dense_reference(x, router, experts)
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    _, ids = jax.lax.top_k(x @ router, TOP_K)
    share = float(jnp.mean(jnp.any(ids == 0, axis=1)))
    print(f"MoE on {n} {devices[0].platform} device(s): {num_experts} experts, top-{TOP_K}, "
          f"{n * TOKENS_PER_RANK} tokens; {share:.0%} of tokens chose expert 0")
    print(f"output vs dense reference: relative error {err:.1e}; dropped: "
          f"{int(np.asarray(dropped).sum())}")
    tol = 1e-4 if devices[0].platform == "cpu" else 1e-2  # TF32 GEMMs on GPUs
    assert err < tol and int(np.asarray(dropped).sum()) == 0
    train(mesh, x, router, experts, num_experts, tol)


def train(mesh, x, router, experts, num_experts, tol, steps=5, lr=0.05):
    """SGD on the router and the experts against a fixed target, sharded and dense."""
    target = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)

    def sharded_loss(params, x, target):
        def per_rank(router, experts, x, target):
            out, _ = moe_layer(x, router, experts, num_experts)
            return jax.lax.psum(jnp.sum((out - target) ** 2), "ep")
        return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P("ep"), P("ep"), P("ep")),
                             out_specs=P())(*params, x, target) / x.size

    def dense_loss(params, x, target):
        return jnp.sum((dense_reference(x, *params) - target) ** 2) / x.size

    def sgd(loss):
        @jax.jit
        def step(params):
            value, grads = jax.value_and_grad(loss)(params, x, target)
            return value, jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return step

    ours, ref = (router, experts), (router, experts)
    step_ours, step_ref = sgd(sharded_loss), sgd(dense_loss)
    for i in range(steps):
        loss_ours, ours = step_ours(ours)
        loss_ref, ref = step_ref(ref)
        print(f"step {i + 1}: loss {float(loss_ours):.6f} (dense reference {float(loss_ref):.6f})")
    err = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
              for a, b in zip(ours, ref, strict=True))
    print(f"router and experts after {steps} SGD steps vs dense reference: relative error "
          f"{err:.1e}")
    assert err < 10 * tol


if __name__ == "__main__":
    main()
