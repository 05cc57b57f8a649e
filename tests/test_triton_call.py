"""Distributed kernels through ``triton_call`` inside ``jax.shard_map`` on CPU devices."""

import time

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
from jax_triton_dist import shmem
from jax_triton_dist.kernels.exchange import push_exchange_kernel
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel


def make_mesh(shape, names, order=None):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))])
    if order is not None:
        devices = devices[np.asarray(order)]
    return Mesh(devices.reshape(shape), names)


def sharded(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def random(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return jnp.asarray(rng.integers(-1000, 1000, shape).astype(dtype))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# ---------------------------------------------------------------------------
# Wrappers of the example kernels
# ---------------------------------------------------------------------------


def ring_shift(x, axis_name, block=256):
    n = x.size
    return jtd.triton_call(
        ring_shift_kernel, x.reshape(-1), n=n,
        out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
        workspace=[jtd.Workspace((2, n), x.dtype), jtd.Workspace((2,), jnp.int32)],
        grid=(1,), axis_name=axis_name, BLOCK=block,
    ).reshape(x.shape)


def one_shot_all_reduce(x, axis_name, block=256):
    n = x.size
    world = jax.lax.psum(1, axis_name)
    programs = triton.cdiv(n, block)
    return jtd.triton_call(
        push_exchange_kernel, x.reshape(-1), n=n,
        out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
        workspace=[jtd.Workspace((2, world, n), x.dtype),
                   jtd.Workspace((2, world, programs), jnp.int32)],
        grid=(programs,), axis_name=axis_name, SEND_CHUNKS=False, REDUCE="sum", BLOCK=block,
    ).reshape(x.shape)


def psum_reference(x, axis_name):
    return jax.lax.psum(x.astype(jnp.float32), axis_name)


# ---------------------------------------------------------------------------
# Ring exchange
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_ring_exchange(ranks, dtype):
    mesh = make_mesh((ranks,), ("x",))
    length = 300  # not a multiple of the block
    x = put(random((ranks * length,), dtype, seed=ranks), mesh, P("x"))
    y = sharded(lambda v: ring_shift(v, "x"), mesh, P("x"), P("x"))(x)
    expected = np.roll(np.asarray(x), length)
    np.testing.assert_array_equal(np.asarray(y), expected)


def test_ring_exchange_on_permuted_devices():
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    mesh = make_mesh((8,), ("x",), order=order)
    x = put(random((8 * 64,), jnp.float32, seed=11), mesh, P("x"))
    y = sharded(lambda v: ring_shift(v, "x"), mesh, P("x"), P("x"))(x)
    np.testing.assert_array_equal(np.asarray(y), np.roll(np.asarray(x), 64))


# ---------------------------------------------------------------------------
# One-shot all-reduce
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_one_shot_all_reduce_matches_psum(ranks, dtype):
    mesh = make_mesh((ranks,), ("x",))
    x = put(random((ranks, 3, 171), dtype, seed=ranks + 100), mesh, P("x"))
    ours = sharded(lambda v: one_shot_all_reduce(v, "x"), mesh, P("x"), P("x"))(x)
    ref = sharded(lambda v: psum_reference(v, "x"), mesh, P("x"), P("x"))(x)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref), rtol=tol, atol=tol)
    assert ours.dtype == dtype


@pytest.mark.parametrize("axis", ["dp", "tp"])
def test_one_shot_all_reduce_on_2x4_mesh(axis):
    mesh = make_mesh((2, 4), ("dp", "tp"))
    x = put(random((2 * 5, 4 * 77), jnp.float32, seed=3), mesh, P("dp", "tp"))
    spec = P("dp", "tp")
    ours = sharded(lambda v: one_shot_all_reduce(v, axis, block=128), mesh, spec, spec)(x)
    ref = sharded(lambda v: jax.lax.psum(v, axis), mesh, spec, spec)(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_100_back_to_back_calls_with_fresh_inputs():
    """Workspace and flags are reused: every step must equal its own reference."""
    mesh = make_mesh((4,), ("x",))
    steps = 100
    xs = put(random((steps, 4 * 40), jnp.float32, seed=5), mesh, P(None, "x"))

    def body(v):
        def step(carry, x):
            return carry, (one_shot_all_reduce(x, "x", block=64), ring_shift(x, "x", block=64))

        _, (summed, shifted) = jax.lax.scan(step, 0, v)
        return summed, shifted

    summed, shifted = sharded(body, mesh, P(None, "x"), (P(None, "x"), P(None, "x")))(xs)
    ref = sharded(lambda v: jax.lax.psum(v, "x"), mesh, P(None, "x"), P(None, "x"))(xs)
    np.testing.assert_allclose(np.asarray(summed), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(shifted), np.roll(np.asarray(xs), 40, axis=1))


def test_straggler_rank_still_gives_correct_results(straggler):
    """Rank 2 starts every call 50 ms late; the others must wait for it, not read stale data."""
    mesh = make_mesh((4,), ("x",))
    straggler(mesh.devices.reshape(-1)[2].id, 0.05)
    f = sharded(lambda v: one_shot_all_reduce(v, "x", block=64), mesh, P("x"), P("x"))
    ref = sharded(lambda v: jax.lax.psum(v, "x"), mesh, P("x"), P("x"))
    for seed in range(5):
        x = put(random((4 * 100,), jnp.float32, seed=seed), mesh, P("x"))
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)


def test_a_call_site_used_twice_in_one_program(straggler):
    """A traced function called twice gives two custom calls with one call site; XLA's CPU
    runtime may run independent ones in either order on each rank (and a straggler makes
    the orders differ): each custom call pairs with itself on every rank, none waits for
    the other."""
    mesh = make_mesh((4,), ("x",))
    straggler(mesh.devices.reshape(-1)[1].id, 0.02)
    summed = jax.jit(lambda v: one_shot_all_reduce(v, "x", block=64))  # traced once

    def body(a, b, c):
        return summed(a), summed(b), summed(c)  # independent of one another

    f = sharded(body, mesh, (P("x"),) * 3, (P("x"),) * 3)
    ref = sharded(lambda v: jax.lax.psum(v, "x"), mesh, P("x"), P("x"))
    hlo = f.lower(*(put(random((400,), jnp.float32, seed=s), mesh, P("x"))
                    for s in range(3))).compile().as_text()
    ids = [line.split("call_id = ")[1].split(" ")[0].rstrip(",}")
           for line in hlo.splitlines() if "jtd_triton" in line and "call_id = " in line]
    assert len(ids) == 3 and len(set(ids)) == 1  # one call site, three custom calls
    for seed in range(5):
        xs = [put(random((400,), jnp.float32, seed=10 * seed + i), mesh, P("x"))
              for i in range(3)]
        for got, x in zip(f(*xs), xs, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref(x)), rtol=1e-5,
                                       atol=1e-5)


def test_custom_call_is_in_the_lowered_hlo():
    mesh = make_mesh((4,), ("x",))
    x = put(random((4 * 8,), jnp.float32, seed=0), mesh, P("x"))
    text = sharded(lambda v: one_shot_all_reduce(v, "x"), mesh, P("x"), P("x")).lower(x).as_text()
    assert "jtd_triton" in text
    assert "all-reduce" not in text and "all_reduce" not in text


# ---------------------------------------------------------------------------
# Device SHMEM calls and symmetric arguments
# ---------------------------------------------------------------------------


@triton.jit
def pull_all_gather_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Every rank pulls every peer's staged ``x`` with ``dl.getmem`` after a barrier."""
    dl.barrier_all()
    for peer in range(0, dl.num_ranks()):
        dl.getmem(out_ptr + peer * n, x_ptr, n, peer, BLOCK)
    dl.barrier_all()


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_pull_all_gather_with_symmetric_argument_and_barriers(ranks):
    mesh = make_mesh((ranks,), ("x",))

    def gather(v):
        return jtd.triton_call(
            pull_all_gather_kernel, v, n=v.size,
            out_shape=jax.ShapeDtypeStruct((ranks * v.size,), v.dtype),
            symmetric=[0], grid=(1,), axis_name="x", BLOCK=64,
        )

    f = sharded(gather, mesh, P("x"), P("x"))
    for seed in range(3):  # consecutive calls alternate the staging slots
        x = put(random((ranks * 50,), jnp.float32, seed=seed), mesh, P("x"))
        out = np.asarray(f(x)).reshape(ranks, ranks * 50)
        for row in out:
            np.testing.assert_array_equal(row, np.asarray(x))


@triton.jit
def put_signal_kernel(x_ptr, out_ptr, buf_ptr, sig_ptr, n, BLOCK: tl.constexpr):
    """Sends ``x`` to the next rank with ``putmem_signal``; waits with ``signal_wait_until``."""
    me = dl.my_pe()
    epoch = dl.epoch()
    dl.putmem_signal(buf_ptr, x_ptr, n, sig_ptr, 1, "add", (me + 1) % dl.n_pes(), BLOCK)
    dl.signal_wait_until(sig_ptr, "ge", epoch)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(buf_ptr + offs, mask=offs < n), mask=offs < n)
    dl.barrier_all()  # nobody overwrites buf before its reader copied it


def test_putmem_signal_and_signal_wait_until():
    mesh = make_mesh((4,), ("x",))

    def send(v):
        return jtd.triton_call(
            put_signal_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
            workspace=[jtd.Workspace(v.shape, v.dtype), jtd.Workspace((1,), jnp.uint64)],
            grid=(1,), axis_name="x", BLOCK=32,
        )

    f = sharded(send, mesh, P("x"), P("x"))
    for seed in range(3):
        x = put(random((4 * 70,), jnp.float32, seed=seed), mesh, P("x"))
        np.testing.assert_array_equal(np.asarray(f(x)), np.roll(np.asarray(x), 70))


# ---------------------------------------------------------------------------
# Watchdog and errors
# ---------------------------------------------------------------------------


@triton.jit
def wait_forever_kernel(out_ptr, flag_ptr):
    """Waits for a flag that no rank ever sets."""
    token = dl.wait(flag_ptr, 1, "sys", "acquire", 1)
    tl.store(out_ptr, dl.consume_token(dl.rank(), token))


def test_wait_watchdog_names_rank_flag_and_values(monkeypatch):
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "1")
    mesh = make_mesh((2,), ("x",))

    def stuck(v):
        return jtd.triton_call(
            wait_forever_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
            workspace=[jtd.Workspace((4,), jnp.int32)], grid=(1,), axis_name="x",
        )

    f = sharded(stuck, mesh, P("x"), P("x"))
    start = time.monotonic()
    with pytest.raises(Exception, match=r"rank \d of 2 \(PE \d\), kernel wait_forever_kernel"
                                        r".*wait timed out after 1\.0 s on flag 0 of 1 "
                                        r"\(address 0x[0-9a-f]+\): expected value == 1, saw 0"):
        jax.block_until_ready(f(put(jnp.zeros(2), mesh, P("x"))))
    assert time.monotonic() - start < 30


def _trace(fn):
    mesh, spec = make_mesh((2,), ("x",)), P("x")
    x = put(jnp.ones(8, jnp.float32), mesh, spec)
    return sharded(fn, mesh, spec, spec)(x)


def _ring(v, **overrides):
    n = v.size
    kwargs = dict(
        n=n, out_shape=jax.ShapeDtypeStruct((n,), v.dtype),
        workspace=[jtd.Workspace((2, n), v.dtype), jtd.Workspace((2,), jnp.int32)],
        grid=(1,), axis_name="x", BLOCK=64,
    )
    kwargs.update(overrides)
    return jtd.triton_call(ring_shift_kernel, v, **kwargs)


def test_error_outside_shard_map():
    with pytest.raises(ValueError, match="must be called inside jax.shard_map"):
        _ring(jnp.ones(8))


def test_error_unknown_axis():
    with pytest.raises(ValueError, match="axis_name 'tp' is not a manual axis.*\\['x'\\]"):
        _trace(lambda v: _ring(v, axis_name="tp"))


def test_error_unsupported_dtype():
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        _trace(lambda v: _ring(v, out_shape=jax.ShapeDtypeStruct((8,), jnp.complex64)))
    with pytest.raises(TypeError, match="Workspace: unsupported dtype complex64"):
        jtd.Workspace((4,), jnp.complex64)


def test_error_too_many_arguments():
    with pytest.raises(TypeError, match="takes 6 parameters, but 7 positional"):
        _trace(lambda v: _ring(v, workspace=[jtd.Workspace((4,), jnp.int32)] * 5))


def test_error_unknown_keyword():
    with pytest.raises(TypeError, match=r"no parameters \['BLOCKSIZE'\]"):
        _trace(lambda v: jtd.triton_call(
            ring_shift_kernel, v, n=8, out_shape=jax.ShapeDtypeStruct((8,), v.dtype),
            workspace=[jtd.Workspace((2, 8), v.dtype), jtd.Workspace((2,), jnp.int32)],
            grid=(1,), axis_name="x", BLOCKSIZE=64))


def test_error_bad_grid_and_symmetric_index():
    with pytest.raises(ValueError, match="grid must be 1 to 3 positive ints"):
        _trace(lambda v: _ring(v, grid=(0,)))
    with pytest.raises(ValueError, match="symmetric index 3 is not an array argument"):
        _trace(lambda v: _ring(v, symmetric=[3]))


def test_error_not_a_kernel():
    with pytest.raises(TypeError, match="expected a @triton.jit kernel"):
        _trace(lambda v: jtd.triton_call(lambda x: x, v, out_shape=v, grid=1, axis_name="x"))


def test_error_non_array_argument():
    with pytest.raises(TypeError, match="argument 0 of ring_shift_kernel is a str"):
        _trace(lambda v: jtd.triton_call(ring_shift_kernel, "x", out_shape=v, grid=1,
                                         axis_name="x"))


@triton.jit
def symm_at_local_kernel(x_ptr, out_ptr):
    """Asks for a peer's copy of a non-symmetric (XLA) buffer."""
    tl.store(out_ptr, tl.load(dl.symm_at(x_ptr, 1)))


def test_error_symm_at_on_non_symmetric_buffer():
    def bad(v):
        return jtd.triton_call(symm_at_local_kernel, v,
                               out_shape=jax.ShapeDtypeStruct((1,), v.dtype), grid=1,
                               axis_name="x")

    with pytest.raises(Exception, match=r"dl\.symm_at: address 0x[0-9a-f]+ is not in this "
                                        r"rank's symmetric heap"):
        jax.block_until_ready(_trace(bad))


@triton.jit
def bad_peer_kernel(x_ptr, out_ptr):
    tl.store(out_ptr, tl.load(dl.symm_at(x_ptr, dl.num_ranks())))


def test_error_peer_out_of_range():
    def bad(v):
        return jtd.triton_call(bad_peer_kernel, v, out_shape=jax.ShapeDtypeStruct((1,), v.dtype),
                               symmetric=[0], grid=1, axis_name="x")

    with pytest.raises(Exception, match=r"rank \d of 2 .*dl\.symm_at: peer 2 is out of range "
                                        r"\[0, 2\)"):
        jax.block_until_ready(_trace(bad))


def test_primitives_outside_a_kernel_fail():
    with pytest.raises(RuntimeError, match="only run inside a kernel launched by"):
        dl.rank()
