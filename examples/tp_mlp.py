"""A tensor-parallel transformer MLP block on jax_triton_dist's fused ops, trained with SGD.

    python examples/tp_mlp.py            # 8 simulated CPU devices, or the GPUs if present

Sequence-parallel Megatron layout on a mesh axis "tp" of n ranks:

    x   [T/n, D]   this rank's tokens
    h = gelu(all_gather_matmul(x, w1))      [T, F/n]    (AG+GEMM, column-parallel)
    y = matmul_reduce_scatter(h, w2)        [T/n, D]    (GEMM+RS, row-parallel)

The output and the gradients are checked against the same block computed unsharded in
float32 with jnp.dot; then a few SGD steps run on both and must stay together.
"""

import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_triton_dist as jtd  # noqa: E402

TOKENS, D_MODEL, D_FF = 64, 32, 128
STEPS, LEARNING_RATE = 5, 0.5


def block(x, w1, w2):
    """Per-rank TP MLP: x [T/n, D], w1 [D, F/n], w2 [F/n, D] -> [T/n, D]."""
    h = jax.nn.gelu(jtd.all_gather_matmul(x, w1, "tp"))
    return jtd.matmul_reduce_scatter(h, w2, "tp")


def reference_block(x, w1, w2):
    """The same block, unsharded, in float32."""
    hi = jax.lax.Precision.HIGHEST
    return jnp.dot(jax.nn.gelu(jnp.dot(x, w1, precision=hi)), w2, precision=hi)


def loss_fn(apply, x, w1, w2, target):
    return jnp.mean((apply(x, w1, w2) - target) ** 2)


def relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("tp",))
    n = len(devices)
    print(f"TP MLP on {n} {devices[0].platform} device(s): tokens {TOKENS}, d_model {D_MODEL}, "
          f"d_ff {D_FF}")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((TOKENS, D_MODEL)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((TOKENS, D_MODEL)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((D_MODEL, D_FF)) / np.sqrt(D_MODEL), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((D_FF, D_MODEL)) / np.sqrt(D_FF), jnp.float32)

    specs = (P("tp", None), P(None, "tp"), P("tp", None))  # x rows, w1 columns, w2 rows
    sharded = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("tp", None))

    def put(*arrays):
        pairs = zip(arrays, specs, strict=True)
        return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in pairs]

    xs, w1s, w2s = put(x, w1, w2)
    targets = jax.device_put(target, NamedSharding(mesh, P("tp", None)))

    # ---- forward and gradients vs the unsharded float32 reference ----
    start = time.perf_counter()
    y = jax.jit(sharded)(xs, w1s, w2s)
    y_err = relative_error(y, reference_block(x, w1, w2))
    grad = jax.jit(jax.value_and_grad(lambda a, b, c, t: loss_fn(sharded, a, b, c, t),
                                      argnums=(1, 2)))
    ref_grad = jax.jit(jax.value_and_grad(lambda a, b, c, t: loss_fn(reference_block, a, b, c, t),
                                          argnums=(1, 2)))
    loss, (g1, g2) = grad(xs, w1s, w2s, targets)
    ref_loss, (r1, r2) = ref_grad(x, w1, w2, target)
    g_err = max(relative_error(g1, r1), relative_error(g2, r2))
    print(f"output vs reference: relative error {y_err:.1e}")
    print(f"loss {float(loss):.6f} vs {float(ref_loss):.6f}; gradients: relative error "
          f"{g_err:.1e}  ({time.perf_counter() - start:.1f} s incl. compilation)")
    # float32 GEMMs run on TF32 tensor cores on NVIDIA GPUs (as jnp.dot's default does).
    tol = 1e-4 if devices[0].platform == "cpu" else 1e-2
    assert y_err < tol and g_err < tol, "fused TP MLP disagrees with the reference"

    # ---- SGD on both; they must stay together ----
    for step in range(1, STEPS + 1):
        loss, (g1, g2) = grad(xs, w1s, w2s, targets)
        ref_loss, (r1, r2) = ref_grad(x, w1, w2, target)
        w1s, w2s = w1s - LEARNING_RATE * g1, w2s - LEARNING_RATE * g2
        w1, w2 = w1 - LEARNING_RATE * r1, w2 - LEARNING_RATE * r2
        print(f"step {step}: loss {float(loss):.6f} (reference {float(ref_loss):.6f})")
    drift = max(relative_error(w1s, w1), relative_error(w2s, w2))
    print(f"weights after {STEPS} SGD steps vs reference: relative error {drift:.1e}")
    assert drift < 10 * tol, "training diverged from the reference"
    hlo = jax.jit(sharded).lower(xs, w1s, w2s).compile().as_text()
    fused = hlo.count('custom_call_target="jtd_triton"')
    collectives = sum(hlo.count(c) for c in ("all-gather", "reduce-scatter"))
    print(f"forward HLO: {fused} fused custom calls, {collectives} XLA collectives")


if __name__ == "__main__":
    main()
