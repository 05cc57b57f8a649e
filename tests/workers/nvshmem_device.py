"""dl.nvshmem device calls across processes: each rank puts its block to the next rank
with nvshmemx_putmem_signal_nbi_block; the receiver waits for the signal with dl.wait.
Run with 2 processes (the double buffering below is safe for a ring of two)."""

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from job import start

import jax_triton_dist as jtd
import jax_triton_dist.language as dl

me, n = start()


@triton.jit
def nvshmem_ring_kernel(x_ptr, out_ptr, buf_ptr, sig_ptr, size, BLOCK: tl.constexpr):
    rank, world, epoch = dl.rank(), dl.num_ranks(), dl.epoch()
    slot = epoch % 2
    dl.nvshmem.putmem_signal_nbi_block(buf_ptr + slot * size, x_ptr, size, sig_ptr + slot,
                                       epoch, "set", (rank + 1) % world)
    dl.nvshmem.quiet()
    token = dl.wait(sig_ptr + slot, 1, "sys", "acquire", epoch)
    received = dl.consume_token(buf_ptr + slot * size, token)
    for start_ in range(0, size, BLOCK):
        offs = start_ + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(received + offs, mask=offs < size), mask=offs < size)


def ring(x):
    return jtd.triton_call(
        nvshmem_ring_kernel, x, size=x.size, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        workspace=[jtd.Workspace((2, x.size), x.dtype), jtd.Workspace((2,), jnp.uint64)],
        grid=(1,), axis_name="x", BLOCK=1024)


mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
host = np.random.default_rng(5).standard_normal((n * 3000,)).astype(np.float32)
x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda i: host[i])
f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                          check_vma=False))
for _ in range(5):
    out = f(x)
expected = np.roll(host.reshape(n, 3000), 1, axis=0).reshape(-1)  # rank r gets rank r-1's
for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
print(f"PE {me} of {n}: ok", flush=True)
