"""A ring shift with a config space (the autotuner's tests): every rank sends its block to
rank + 1. Run as a script, it shifts once on 4 CPU devices and prints how each rank chose
(the cross-process cache test)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

import jax_triton_dist as jtd
import jax_triton_dist.language as dl

BLOCKS = (64, 128, 256)
N = 1000


def make(timer=None, configs=None, **options):
    """A fresh autotuned ring-shift kernel (its own records)."""
    configs = configs or [jtd.autotune.Config({"BLOCK": b}) for b in BLOCKS]

    options = {"warmup": 0, "rep": 1, **options}

    @jtd.autotune.autotune(configs, key=["n"], timer=timer, **options)
    @triton.jit
    def tuned_shift_kernel(x_ptr, out_ptr, buf_ptr, flags_ptr, n, BLOCK: tl.constexpr,
                           FAIL: tl.constexpr = False, WRONG: tl.constexpr = False):
        tl.static_assert(not FAIL, "this config is meant to fail")
        pid = tl.program_id(0)
        me = dl.rank()
        peer = (me + 1) % dl.num_ranks()  # my successor on the ring
        epoch = dl.epoch()
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dl.symm_at(buf_ptr, peer) + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        dl.notify(flags_ptr + pid, peer, epoch, "set", "sys")
        token = dl.wait(flags_ptr + pid, 1, "sys", "acquire", epoch)
        buf_ptr = dl.consume_token(buf_ptr, token)
        got = tl.load(buf_ptr + offs, mask=mask)
        if WRONG:  # a config that runs but computes the wrong thing (``check``'s tests):
            got = -got - 1.0  # wrong beyond any tolerance whatever the input's scale
        tl.store(out_ptr + offs, got, mask=mask)

    return tuned_shift_kernel


def shift(kernel, x, axis_name, n=N):
    """One call of ``kernel`` on this rank's ``x`` (``n`` float32 values)."""
    return jtd.triton_call(
        kernel, x, n=n, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        workspace=lambda meta: [jtd.Workspace((n,), x.dtype),
                                jtd.Workspace((triton.cdiv(n, meta["BLOCK"]),), jnp.int32)],
        grid=lambda meta: (triton.cdiv(n, meta["BLOCK"]),), axis_name=axis_name)


if __name__ == "__main__":
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    kernel = make(timer=lambda config, rank, seconds: float(config.kwargs["BLOCK"]))
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    f = jax.jit(jax.shard_map(lambda v: shift(kernel, v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    x = jnp.arange(4 * N, dtype=jnp.float32)
    ok = np.array_equal(np.asarray(f(x)), np.roll(np.asarray(x).reshape(4, N), 1, 0).ravel())
    print("correct" if ok else "WRONG", sorted((r.rank, r.index, r.source)
                                               for r in kernel.records))
    sys.exit(0 if ok else 1)
