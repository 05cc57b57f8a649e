"""Lifetimes and faults on the CPU backend: call sites released with their executables,
clean exits with work in flight, bad input caught at trace time, address checks of
interpreted kernels, and a failing rank that stops its peers at once."""

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

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
from jax_triton_dist.kernels.ring_exchange import ring_shift_kernel


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:n]), ("x",))


def _put(x, mesh):
    return jax.device_put(x, NamedSharding(mesh, P("x")))


def _run_script(source: str, *args: str, devices: int = 4, env: dict | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``source`` in a fresh interpreter with ``devices`` CPU devices."""
    full_env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                    JAX_PLATFORMS="cpu", **(env or {}))
    # A file (Triton's kernels need one), run outside the source tree, so that the installed
    # package (with its extensions) loads.
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "script.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(source))
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=folder)


# ---------------------------------------------------------------------------
# Call sites live as long as their executables
# ---------------------------------------------------------------------------

RETRACE_LOOP = """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_triton_dist as jtd

    mesh = jax.make_mesh((2,), ("x",))
    iterations, base = int(sys.argv[1]), int(sys.argv[2])
    live = []
    for i in range(iterations):
        n = 2 * (base + 64 * i)  # a new length, so a new trace, each time
        x = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x", method="one_shot"),
                                  mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        assert float(np.asarray(f(x))[0]) == 2.0
        live.append(jtd.heap_usage().heap.in_use_bytes)  # this site's region is held
        del f
        jax.clear_caches()
        for _ in range(1000):  # XLA lets go of the executable's state a moment later
            usage = jtd.heap_usage()
            if usage.regions == 0:
                break
            time.sleep(0.01)
        assert usage.heap.in_use_bytes == 0 and usage.regions == 0, (i, usage)
    print("max in use", max(live), "final", jtd.heap_usage())
"""


@pytest.mark.parametrize("retraces, heap", [(40, "8M"),
                                             pytest.param(300, "32M", marks=pytest.mark.slow)])
def test_retraces_fit_a_small_heap(retraces, heap):
    # Each site's region is about 260 KiB: 40 of them would need 10 MiB if none were
    # freed, 300 76 MiB.
    done = _run_script(RETRACE_LOOP, str(retraces), "16384", devices=2,
                       env={shmem.HEAP_SIZE_ENV: heap}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    in_use = int(done.stdout.split("max in use ")[1].split()[0])
    assert 0 < in_use < 1 << 20, done.stdout


def _usage_once(settled, seconds: float = 10.0):
    """``jtd.heap_usage()`` once ``settled(usage)`` holds: XLA destroys an executable's
    per-device state when its last asynchronous user lets go, which may be a moment after
    ``jax.clear_caches()`` returns."""
    deadline = time.monotonic() + seconds
    while True:
        usage = jtd.heap_usage()
        if settled(usage) or time.monotonic() > deadline:
            return usage
        time.sleep(0.01)


def _all_reduce_fn(mesh):
    return jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x", method="one_shot"),
                                 mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def test_clear_caches_frees_regions_and_a_live_executable_keeps_its_own():
    mesh = _mesh(2)
    x = _put(jnp.arange(2 * 1000, dtype=jnp.float32), mesh)
    expected = np.tile(np.arange(1000, dtype=np.float32) + np.arange(1000, 2000), 2)
    jax.clear_caches()
    before = jtd.heap_usage()
    before_bytes = before.heap.in_use_bytes if before.heap else 0

    compiled = _all_reduce_fn(mesh).lower(x).compile()  # an executable we keep
    np.testing.assert_array_equal(np.asarray(compiled(x)), expected)
    transient = _all_reduce_fn(mesh)
    np.testing.assert_array_equal(np.asarray(transient(x)), expected)
    held = jtd.heap_usage()
    assert held.regions == before.regions + 2
    del transient
    jax.clear_caches()
    after = _usage_once(lambda u: u.regions <= before.regions + 1)
    assert after.regions == before.regions + 1  # the kept executable's region stays
    assert after.heap.in_use_bytes < held.heap.in_use_bytes
    np.testing.assert_array_equal(np.asarray(compiled(x)), expected)  # and still works
    del compiled
    after = _usage_once(lambda u: u.regions == before.regions)
    assert after.regions == before.regions
    assert after.heap.in_use_bytes == before_bytes


def test_heap_usage_reports_shmem_allocations():
    usage = jtd.heap_usage()
    assert "call sites" in str(usage)
    if usage.heap is not None:
        assert usage.heap.heap_bytes >= usage.heap.in_use_bytes >= 0
        assert usage.heap.largest_free_block <= usage.heap.heap_bytes - usage.heap.in_use_bytes


# ---------------------------------------------------------------------------
# Exits with work in flight return their own status
# ---------------------------------------------------------------------------

EXIT_SCRIPT = """
    import sys
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_triton_dist as jtd

    mode, op, start = sys.argv[1], sys.argv[2], sys.argv[3]

    def before(v):  # "late": the reduction starts a few seconds after the dispatch
        if start == "now":
            return v
        m = jnp.full((1000, 1000), 1e-3) * v[0]
        for _ in range(4):
            m = jnp.tanh(m @ m)
        return v + m[0, 0]

    mesh = jax.make_mesh((4,), ("x",))
    x = jax.device_put(jnp.arange(4 * 1024.0), NamedSharding(mesh, P("x")))
    reduce = (lambda v: jtd.all_reduce(before(v), "x")) if op == "jtd" else (
        lambda v: jax.lax.psum(before(v), "x"))
    f = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    y = f(x)  # dispatched; nobody waits for it
    if mode == "raise":
        raise RuntimeError("the user's error after the dispatch")
    if mode == "exit3":
        sys.exit(3)
    if mode == "interrupt":
        raise KeyboardInterrupt
"""


@pytest.mark.parametrize("mode", ["last", "raise", *(pytest.param(m, marks=pytest.mark.slow)
                                                       for m in ("exit3", "interrupt"))])
def test_exits_with_an_op_in_flight_return_their_own_status(mode):
    reference = _run_script(EXIT_SCRIPT, mode, "lax", "now")
    # Three runs at a time: the abort this guards against was a race. The last reaches
    # the custom call only while Python exits (the dispatch finds the exit begun).
    starts = ["now", "now", "late"]
    start = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda when: _run_script(EXIT_SCRIPT, mode, "jtd", when), starts))
    assert time.monotonic() - start < 120  # no exit waits out a 60 s timeout
    for when, done in zip(starts, runs, strict=True):
        assert done.returncode == reference.returncode, (when, done.stderr[-3000:])
        for fatal in ("terminate called", "Fatal Python error", "Segmentation fault"):
            assert fatal not in done.stderr, (when, done.stderr[-3000:])
        if mode == "raise":
            assert "the user's error after the dispatch" in done.stderr


# ---------------------------------------------------------------------------
# Bad input fails at trace time, where the caller sees it
# ---------------------------------------------------------------------------


@triton.jit
def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _copy(v, **kwargs):
    return jtd.triton_call(copy_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(
        v.shape, v.dtype), grid=(1,), axis_name="x", **kwargs)


def _trace(fn, n=2):
    mesh = _mesh(n)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).lower(
        _put(jnp.ones(8 * n, jnp.float32), mesh))


def test_a_missing_constexpr_is_a_type_error_at_trace_time():
    with pytest.raises(TypeError, match=r"kernel copy_kernel: no value for parameter\(s\) "
                                        r"BLOCK \(pass them as keyword arguments"):
        _trace(lambda v: _copy(v))


@pytest.mark.parametrize(("var", "value", "message"), [
    (shmem.HEAP_SIZE_ENV, "0", "heap_size must be positive, got 0"),
    (shmem.HEAP_SIZE_ENV, "lots", "JTD_SHMEM_HEAP_SIZE='lots' is not a size"),
    (shmem.BACKEND_ENV, "tpu", r"JTD_SHMEM_BACKEND='tpu' is not a SHMEM backend \(expected "
                               r"one of host, cuda, nvshmem\)"),
    (shmem.TIMEOUT_ENV, "-1", "JTD_WAIT_TIMEOUT must be positive"),
    ("JTD_CPU_BOUNDS_CHECK", "yes", r"JTD_CPU_BOUNDS_CHECK='yes': expected 0 \(off\) or 1"),
])
def test_bad_settings_fail_at_trace_time(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        _trace(lambda v: _copy(v, BLOCK=8))


BAD_INPUT_AT_EXIT = """
    import sys
    import jax, jax.numpy as jnp, triton, triton.language as tl
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_triton_dist as jtd

    @triton.jit
    def copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    mesh = jax.make_mesh((4,), ("x",))
    x = jax.device_put(jnp.ones(4 * 8), NamedSharding(mesh, P("x")))
    ok = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                               out_specs=P("x")))
    y = ok(x)  # work in flight when the error below ends the script
    kwargs = {} if sys.argv[1] == "no-block" else {"BLOCK": 8}
    bad = jax.jit(jax.shard_map(lambda v: jtd.triton_call(
        copy_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=1,
        axis_name="x", **kwargs), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    bad(x)
"""


@pytest.mark.parametrize(("case", "env", "message"), [
    ("no-block", {}, "no value for parameter(s) BLOCK"),
    ("heap", {shmem.HEAP_SIZE_ENV: "0"}, "heap_size must be positive"),
])
def test_bad_input_ends_a_script_cleanly(case, env, message):
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: _run_script(BAD_INPUT_AT_EXIT, case, env=env), range(4)))
    for done in runs:
        assert done.returncode == 1, done.stderr[-3000:]
        assert message in done.stderr
        assert "Fatal Python error" not in done.stderr and "terminate" not in done.stderr


# ---------------------------------------------------------------------------
# Address checks of interpreted kernels
# ---------------------------------------------------------------------------


@triton.jit
def loose_mask_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Copies ``n`` elements but stores ``BLOCK``: the mask is one element too loose."""
    offs = tl.arange(0, BLOCK)
    values = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, values, mask=offs <= n)


def test_an_out_of_bounds_store_names_rank_kernel_line_address_and_buffer():
    def bad(v):
        return jtd.triton_call(loose_mask_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(
            v.shape, v.dtype), grid=1, axis_name="x", BLOCK=16)

    mesh = _mesh(2)
    f = jax.jit(jax.shard_map(bad, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(Exception) as error:
        jax.block_until_ready(f(_put(jnp.ones(16, jnp.float32), mesh)))
    message = str(error.value)
    assert "rank 0 of 2" in message or "rank 1 of 2" in message, message
    assert "kernel loose_mask_kernel: out-of-bounds store of fp32 at 0x" in message
    assert "0 bytes past the end of result 0 `out_ptr`" in message
    assert "tl.store(out_ptr + offs, values, mask=offs <= n)" in message  # the source line


@triton.jit
def far_load_kernel(x_ptr, out_ptr, OFFSET: tl.constexpr):
    tl.store(out_ptr, tl.load(x_ptr + OFFSET))


def test_an_out_of_bounds_load_before_a_buffer_is_caught():
    def bad(v):
        return jtd.triton_call(far_load_kernel, v, out_shape=jax.ShapeDtypeStruct(
            (1,), v.dtype), grid=1, axis_name="x", OFFSET=-4)

    mesh = _mesh(2)
    f = jax.jit(jax.shard_map(bad, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(Exception, match=r"out-of-bounds load of fp32 at 0x[0-9a-f]+ \(1 of 1 "
                                        r"addresses .*16 bytes before operand 0 `x_ptr`"):
        jax.block_until_ready(f(_put(jnp.ones(16, jnp.float32), mesh)))


def test_address_checks_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("JTD_CPU_BOUNDS_CHECK", "0")
    mesh = _mesh(2)
    f = jax.jit(jax.shard_map(lambda v: jtd.triton_call(
        far_load_kernel, v, out_shape=jax.ShapeDtypeStruct((1,), v.dtype), grid=1,
        axis_name="x", OFFSET=1), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    out = np.asarray(f(_put(jnp.arange(16, dtype=jnp.float32), mesh)))  # in bounds anyway
    np.testing.assert_array_equal(out, [1.0, 9.0])


def test_kernels_of_the_ops_pass_the_address_checks():
    mesh = _mesh(4)
    x = _put(jnp.arange(4 * 300, dtype=jnp.float32), mesh)
    ring = jax.jit(jax.shard_map(lambda v: jtd.triton_call(
        ring_shift_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        workspace=[jtd.Workspace((2, v.size), v.dtype), jtd.Workspace((2,), jnp.int32)],
        grid=(1,), axis_name="x", BLOCK=128), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    out = np.asarray(ring(x)).reshape(4, 300)
    np.testing.assert_array_equal(out, np.roll(np.arange(1200.0).reshape(4, 300), 1, axis=0))


# ---------------------------------------------------------------------------
# A failing rank stops its peers at once
# ---------------------------------------------------------------------------


@triton.jit
def one_rank_fails_kernel(x_ptr, out_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    """Rank 1 stores out of bounds before it signals; rank 0 waits for its signal."""
    me = dl.rank()
    epoch = dl.epoch()
    offs = tl.arange(0, BLOCK)
    if me == 1:
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n + 1)
        dl.notify(flag_ptr, 0, epoch, "set", "sys")
    else:
        dl.wait(flag_ptr, 1, "sys", "acquire", epoch)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_a_failing_rank_stops_the_others_waiting_at_once(monkeypatch):
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "60")
    mesh = _mesh(2)
    f = jax.jit(jax.shard_map(lambda v: jtd.triton_call(
        one_rank_fails_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        workspace=[jtd.Workspace((1,), jnp.int32)], grid=1, axis_name="x", BLOCK=32),
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    start = time.monotonic()
    with pytest.raises(Exception, match=r"out-of-bounds store .* result 0 `out_ptr`"):
        jax.block_until_ready(f(_put(jnp.ones(32, jnp.float32), mesh)))
    assert time.monotonic() - start < 20  # not rank 0's 60 s timeout


@triton.jit
def fails_on_negative_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A copy; rank 1 also stores one element past ``out`` when its ``x[0]`` is negative."""
    offs = tl.arange(0, BLOCK)
    over = tl.where((dl.rank() == 1) & (tl.load(x_ptr) < 0), 1, 0)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n + over)


@triton.jit
def handshake_kernel(x_ptr, out_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    """Rank 1 signals rank 0, which waits for it; both copy."""
    epoch = dl.epoch()
    if dl.rank() == 1:
        dl.notify(flag_ptr, 0, epoch, "set", "sys")
    else:
        dl.wait(flag_ptr, 1, "sys", "acquire", epoch)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_a_rank_failing_in_one_call_stops_the_later_calls_of_the_execution(monkeypatch):
    # Rank 1 fails in the first call, where nobody waits for it; rank 0 goes on to the second
    # call and would wait there for rank 1 (at the team's first run, or at dl.wait once the
    # team exists) until the timeout. It stops at once, with rank 1's failure; and the next
    # execution runs, though rank 1 skipped a launch of the second call that rank 0 made.
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "60")
    mesh = _mesh(2)

    def body(v):
        shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
        u = jtd.triton_call(fails_on_negative_kernel, v, n=v.size, out_shape=shape, grid=1,
                            axis_name="x", BLOCK=64)
        return jtd.triton_call(handshake_kernel, u, n=v.size, out_shape=shape,
                               workspace=[jtd.Workspace((1,), jnp.int32)], grid=1,
                               axis_name="x", BLOCK=32)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    good = _put(jnp.arange(1.0, 65.0), mesh)
    bad = _put(-jnp.arange(1.0, 65.0), mesh)
    for first_run in (True, False, False):  # the joins of a first run; the waits of later ones
        start = time.monotonic()
        with pytest.raises(Exception, match=r"out-of-bounds store") as caught:
            jax.block_until_ready(f(bad))
        assert time.monotonic() - start < 20, first_run  # not rank 0's 60 s timeout
        assert "meanwhile" not in str(caught.value)  # nobody timed out
        np.testing.assert_array_equal(f(good), jnp.arange(1.0, 65.0))  # later runs unharmed


@triton.jit
def scaled_copy_kernel(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, SCALE * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_ranks_sent_to_different_calls_time_out_saying_where_each_rank_is(monkeypatch):
    # A lax.cond whose predicate differs between ranks: rank 1 runs one kernel, the others
    # another, and each waits for the first run of its team in vain.
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "2")
    mesh = _mesh(4)

    def call(v, scale):
        return jtd.triton_call(scaled_copy_kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(
            v.shape, v.dtype), grid=1, axis_name="x", SCALE=scale, BLOCK=8)

    f = jax.jit(jax.shard_map(
        lambda v: jax.lax.cond(jax.lax.axis_index("x") == 1, lambda u: call(u, 2.0),
                               lambda u: call(u, 3.0), v),
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    start = time.monotonic()
    with pytest.raises(Exception) as caught:
        jax.block_until_ready(f(_put(jnp.ones(32, jnp.float32), mesh)))
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert re.search(r"kernel scaled_copy_kernel: rank \d \(PE \d\) waited 2\.0 s for the first "
                     r"run of its team .*; ranks \[.*\] never arrived", message), message
    # ... and where the others were meanwhile: in their call, or just out of it.
    assert re.search(r"meanwhile PE \d (runs kernel scaled_copy_kernel \(call \d+\) for "
                     r"\d+\.\d s|runs no kernel \(the last it ran: kernel scaled_copy_kernel "
                     r"\(call \d+\), (failed|ended) \d+\.\d s ago)", message), message


def _fresh_autotuned_copy():
    """An autotuned copy kernel made now: its source is neither hashed nor rewritten yet."""

    @triton.jit
    def fresh_copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    return jtd.autotune.autotune([jtd.autotune.Config({"BLOCK": 8}),
                                  jtd.autotune.Config({"BLOCK": 16})], enabled=False)(
        fresh_copy_kernel)


def test_device_threads_parse_python_source_one_at_a_time(monkeypatch):
    # CPython 3.11's ast module fails ("AST constructor recursion depth mismatch") when two
    # threads parse at once; a kernel's first run parses its source on every rank's thread
    # (the interpreter's rewrite, an autotuned site's source hash): under one lock.
    import ast
    import threading

    from jax_triton_dist.runtime import python_ast

    parses = []
    original = ast.parse

    def parse(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            parses.append(python_ast.LOCK._is_owned())
        return original(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", parse)
    kernel, mesh = _fresh_autotuned_copy(), _mesh(4)
    f = jax.jit(jax.shard_map(lambda v: jtd.triton_call(
        kernel, v, n=v.size, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=1,
        axis_name="x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jnp.arange(32, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(_put(x, mesh))), np.asarray(x))
    assert parses and all(parses), parses  # the source was parsed on device threads, locked
