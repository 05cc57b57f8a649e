"""Stress ops with a planted bug, for tests/test_stress.py: a ring shift whose kernel moves
one element too few when ``BUG`` is set (the last element of every rank's result stays
zero), and the same op without the bug."""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
import jax_triton_dist.language as dl
from jax_triton_dist.stress import Case, StressOp, register
from jax_triton_dist.stress.ops import random_array


@triton.jit
def shift_kernel(x_ptr, out_ptr, buf_ptr, flag_ptr, n, BLOCK: tl.constexpr, BUG: tl.constexpr):
    rank, world = dl.rank(), dl.num_ranks()
    peer = (rank + 1) % world
    slot = dl.epoch() % 2
    count = n - 1 if BUG else n  # the planted off-by-one
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(dl.symm_at(buf_ptr + slot * n, peer) + offs, tl.load(x_ptr + offs, mask=mask),
                 mask=mask)
    dl.notify(flag_ptr + slot, peer, signal=dl.epoch())
    token = dl.wait(flag_ptr + slot, 1, value=dl.epoch(), cmp="ge")
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        got = tl.load(dl.consume_token(buf_ptr + slot * n, token) + offs, mask=mask)
        tl.store(out_ptr + offs, got, mask=mask)


def _draw(bug):
    def draw(rng, n, dtype, scale):
        size = int(rng.choice([8, 33, 100])) * scale

        def body(v):
            return jtd.triton_call(
                shift_kernel, v, n=size, out_shape=jax.ShapeDtypeStruct((size,), v.dtype),
                workspace=[jtd.Workspace((2, size), v.dtype), jtd.Workspace((2,), jnp.int32)],
                grid=(1,), axis_name="x", BLOCK=32, BUG=bug)

        def reference(v):
            return jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)])

        return Case(f"[{size}]", body, reference, [random_array(rng, (n * size,), dtype)],
                    P("x"), P("x"), "movement")
    return draw


register(StressOp("planted_shift", ("float32",), _draw(True), min_ranks=2))
register(StressOp("correct_shift", ("float32",), _draw(False), min_ranks=2))
