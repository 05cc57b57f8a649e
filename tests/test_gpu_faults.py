"""GPU tier: lifetimes and faults on NVIDIA GPUs — a wait that times out ends its launch
without a trap and is reported, the process keeps working; call sites are released with
their executables; exits with work in flight return their own status."""

import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from gpu_support import have_gpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_triton_dist as jtd
import jax_triton_dist.language as dl
from jax_triton_dist import one_gpu, shmem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not have_gpu(), reason="needs an NVIDIA GPU")]


def _mesh():
    return Mesh(np.array(jax.devices("gpu")[:1]), ("x",))


@triton.jit
def wait_forever_kernel(out_ptr, flags_ptr):
    """Waits for a flag nobody raises."""
    token = dl.wait(flags_ptr, 1, "sys", "acquire", 1)
    tl.store(dl.consume_token(out_ptr, token), 7)


def _stuck(v):
    return jtd.triton_call(wait_forever_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                           workspace=[jtd.Workspace((4,), jnp.int32)], grid=(1,),
                           axis_name="x")


def test_a_timed_out_wait_is_reported_and_the_process_keeps_working(monkeypatch):
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "2")
    mesh = _mesh()
    x = jax.device_put(jnp.zeros(1), NamedSharding(mesh, P("x")))
    stuck = jax.jit(jax.shard_map(_stuck, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    jax.block_until_ready(stuck(x))  # the launch ends: no trap, no lost context
    with pytest.raises(RuntimeError, match=r"GPU 0: rank 0 of 1, kernel wait_forever_kernel: "
                                           r"dl\.wait timed out in call 1 on flag 0 \(address "
                                           r"0x[0-9a-f]+\): expected 1, saw 0"):
        jtd.check_errors()
    jtd.check_errors()  # reported once

    jax.block_until_ready(stuck(x))  # times out again; its next call raises it
    with pytest.raises(Exception, match=r"dl\.wait timed out in call 2 on flag 0"):
        jax.block_until_ready(stuck(x))

    # The process, its CUDA context and the SHMEM heaps still work.
    y = jax.device_put(jnp.arange(4096, dtype=jnp.float32), NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda v: jtd.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(y)), np.arange(4096, dtype=np.float32))


def test_one_gpu_ranks_report_a_timed_out_wait(monkeypatch):
    monkeypatch.setenv(shmem.TIMEOUT_ENV, "2")
    with pytest.raises(RuntimeError, match=r"one_gpu\.run_ranks, call 0: GPU 0: rank \d of 2, "
                                           r"kernel wait_forever_kernel: dl\.wait timed out"):
        one_gpu.run_ranks(wait_forever_kernel, 2, inputs=lambda call, rank: [],
                          outputs=[((1,), np.int32)], workspaces=[((4,), np.int32)],
                          grid=(1,), kwargs={})


def _script(source: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "script.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(source))
        return subprocess.run([sys.executable, path, *args], capture_output=True, text=True,
                              timeout=600, cwd=folder, env=dict(os.environ, XLA_FLAGS="",
                                                                **(env or {})))


RETRACE_LOOP = """
    import time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_triton_dist as jtd

    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("x",))
    for i in range(40):
        n = (4 << 20) + 1024 * i  # 16 MiB of float32, a new length each time
        x = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(mesh, P("x")))
        f = jax.jit(jax.shard_map(lambda v: jtd.all_gather(v, "x", tiled=True), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        assert float(np.asarray(f(x))[-1]) == 1.0
        del f
        jax.clear_caches()
        for _ in range(1000):
            usage = jtd.heap_usage()
            if usage.regions == 0:
                break
            time.sleep(0.01)
        assert usage.regions == 0 and usage.heap.in_use_bytes == 0, (i, usage)
    print("ok", jtd.heap_usage())
"""


def test_retraces_release_their_gpu_regions():
    # 40 sites of about 64 MiB each would need 2.5 GiB of a 256 MiB heap if none were freed.
    done = _script(RETRACE_LOOP, env={shmem.HEAP_SIZE_ENV: "256M"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok" in done.stdout


EXIT_SCRIPT = """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_triton_dist as jtd

    mode, op = sys.argv[1], sys.argv[2]
    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("x",))
    x = jax.device_put(jnp.arange(1 << 20, dtype=jnp.float32), NamedSharding(mesh, P("x")))
    reduce = (lambda v: jtd.all_reduce(v, "x")) if op == "jtd" else (
        lambda v: jax.lax.psum(v, "x"))
    y = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
    if mode == "raise":
        raise RuntimeError("the user's error after the dispatch")
    if mode == "exit3":
        sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["last", "raise", "exit3"])
def test_gpu_exits_with_an_op_in_flight_return_their_own_status(mode):
    reference = _script(EXIT_SCRIPT, mode, "lax")
    done = _script(EXIT_SCRIPT, mode, "jtd")
    assert done.returncode == reference.returncode, done.stderr[-3000:]
    assert "terminate called" not in done.stderr and "Fatal" not in done.stderr
