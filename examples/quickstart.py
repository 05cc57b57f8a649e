"""Quickstart: write a distributed Triton kernel and run it inside jax.shard_map.

Runs on 8 simulated CPU devices (Triton's interpreter, one rank per device) unless
JAX_PLATFORMS says otherwise:

    python examples/quickstart.py

The kernel below is a ring all-gather written with the ``dl`` primitives: every rank
forwards blocks to its successor and raises a flag there; each rank waits for the flag
of each step before forwarding the block it just received. The result is checked
against ``jax.lax.all_gather``; then the library's ``jtd.all_reduce`` is checked
against ``jax.lax.psum``.
"""

import os
import time

# 8 simulated CPU ranks show the communication on any machine; run with
# JAX_PLATFORMS=cuda to use the GPUs instead (the same kernel compiles for them).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_triton_dist as jtd  # noqa: E402
import jax_triton_dist.language as dl  # noqa: E402


@triton.jit
def ring_all_gather_kernel(
    x_ptr,  # [n] this rank's block
    out_ptr,  # [num_ranks, n] all blocks, in rank order
    buf_ptr,  # symmetric workspace [2, num_ranks, n]: receive slots by epoch parity
    flag_ptr,  # symmetric workspace [2, num_ranks] int32: "block arrived in epoch e"
    n,
    BLOCK: tl.constexpr,
):
    me = dl.rank()
    world = dl.num_ranks()
    epoch = dl.epoch()
    slots = buf_ptr + (epoch % 2) * world * n
    flags = flag_ptr + (epoch % 2) * world
    succ = (me + 1) % world
    for step in range(0, world):
        # The block travelling in this step started at rank (me - step).
        src = (me - step + world) % world
        if step == 0:
            block = x_ptr
        else:
            token = dl.wait(flags + src, 1, "sys", "acquire", epoch)
            block = dl.consume_token(slots + src * n, token)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            values = tl.load(block + offs, mask=mask)
            tl.store(out_ptr + src * n + offs, values, mask=mask)
            if step < world - 1:
                tl.store(dl.symm_at(slots + src * n + offs, succ), values, mask=mask)
        if step < world - 1:
            dl.notify(flags + src, succ, epoch, "set", "sys")


def ring_all_gather(x, axis_name):
    world = jax.lax.psum(1, axis_name)
    n = x.size
    return jtd.triton_call(
        ring_all_gather_kernel, x, n=n,
        out_shape=jax.ShapeDtypeStruct((world, n), x.dtype),
        workspace=[jtd.Workspace((2, world, n), x.dtype), jtd.Workspace((2, world), jnp.int32)],
        grid=(1,), axis_name=axis_name, BLOCK=256,
    )


def main():
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    world = len(devices)
    where = "Triton's interpreter" if devices[0].platform == "cpu" else "compiled Triton"
    print(f"{world} devices ({devices[0].platform}); kernels run in {where}")

    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.standard_normal(world * 1000).astype(np.float32)),
                       NamedSharding(mesh, P("x")))

    def both(v):
        gathered = ring_all_gather(v, "x").reshape(-1)
        reference = jax.lax.all_gather(v, "x", tiled=True)
        return gathered, reference, jtd.all_reduce(v, "x"), jax.lax.psum(v, "x")

    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    start = time.perf_counter()
    gathered, gathered_ref, summed, summed_ref = jax.block_until_ready(f(x))
    elapsed = time.perf_counter() - start
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(gathered_ref))
    np.testing.assert_allclose(np.asarray(summed), np.asarray(summed_ref), rtol=1e-5, atol=1e-5)
    print(f"ring all-gather == jax.lax.all_gather        ({world} ranks x 1000 float32)")
    print(f"jtd.all_reduce == jax.lax.psum (max |diff| "
          f"{np.abs(np.asarray(summed) - np.asarray(summed_ref)).max():.2e})")
    print(f"first call (trace + compile + run): {elapsed:.2f} s")
    hlo = f.lower(x).as_text()
    print(f"custom calls in the HLO: {hlo.count('jtd_triton')}")


if __name__ == "__main__":
    main()
