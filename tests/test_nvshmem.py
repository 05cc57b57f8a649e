"""The ``nvshmem`` SHMEM backend (one process per GPU).

Everywhere: backend selection and the errors of a misconfigured start. On a GPU: NVSHMEM
started with one PE through the unique-id path, then the host API on its heap — in a
subprocess, because NVSHMEM runs once per process; and jobs of 2 and 4 processes
(``jax.distributed``, all on one GPU: NVSHMEM allows it) running the host API and every
collective and fused op with one rank per process.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
from gpu_support import have_gpu
from jax.sharding import PartitionSpec as P
from process_jobs import run_processes

import jax_triton_dist as jtd
import jax_triton_dist.language as dl
from jax_triton_dist import shmem
from jax_triton_dist.shmem import lifetime, nvshmem_bootstrap

needs_nvshmem_gpu = pytest.mark.skipif(
    not have_gpu() or "nvshmem" not in shmem.available_backends(),
    reason="needs a GPU and a build with the nvshmem backend")


def test_default_backend_is_nvshmem_for_one_gpu_per_process(monkeypatch):
    monkeypatch.delenv(shmem.BACKEND_ENV, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 1)
    assert lifetime.default_backend() == "nvshmem"
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 8)  # 4 hosts x 8 GPUs
    assert lifetime.default_backend() == "cuda"
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert lifetime.default_backend() == "cuda"
    monkeypatch.setenv(shmem.BACKEND_ENV, "nvshmem")
    assert lifetime.default_backend() == "nvshmem"


def test_nvshmem_start_errors_are_specific(no_world):
    if "nvshmem" not in shmem.available_backends():
        with pytest.raises(shmem.ShmemError, match="no 'nvshmem' backend .*NVSHMEM's headers"):
            shmem.init(backend="nvshmem")
    elif jax.default_backend() == "cpu":
        with pytest.raises(shmem.ShmemError, match="one PE per process on one GPU"):
            shmem.init(backend="nvshmem")
    with pytest.raises(ValueError, match="devices= is for the cuda backend"):
        shmem.init(backend="nvshmem", devices=[0])
    assert shmem.init_status() == shmem.InitStatus.NOT_INITIALIZED


def test_nvshmem_symmetric_size_must_hold_the_heap(monkeypatch):
    monkeypatch.setenv(nvshmem_bootstrap.SYMMETRIC_SIZE_ENV, "1G")
    with pytest.raises(shmem.ShmemError, match="NVSHMEM_SYMMETRIC_SIZE=1G leaves no room"):
        nvshmem_bootstrap.prepare_heap(1 << 30)
    monkeypatch.delenv(nvshmem_bootstrap.SYMMETRIC_SIZE_ENV)
    nvshmem_bootstrap.prepare_heap(1 << 30)
    assert int(os.environ[nvshmem_bootstrap.SYMMETRIC_SIZE_ENV]) > 1 << 30


def test_nvshmem_library_from_environment(monkeypatch):
    monkeypatch.setenv(nvshmem_bootstrap.LIBRARY_ENV, "/opt/nvshmem/lib/libnvshmem_host.so.3")
    assert nvshmem_bootstrap.library_path() == "/opt/nvshmem/lib/libnvshmem_host.so.3"


def test_nvshmem_device_bitcode_next_to_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv(nvshmem_bootstrap.LIBRARY_ENV, str(tmp_path / "libnvshmem_host.so.3"))
    assert nvshmem_bootstrap.device_library_path() is None
    (tmp_path / "libnvshmem_device.bc").write_bytes(b"")  # NVSHMEM <= 3.4: one bitcode
    assert nvshmem_bootstrap.device_library_path() == str(tmp_path / "libnvshmem_device.bc")
    (tmp_path / "libnvshmem_device_sm_90.bc").write_bytes(b"")  # >= 3.5: per architecture
    assert nvshmem_bootstrap.device_library_path(90) == str(
        tmp_path / "libnvshmem_device_sm_90.bc")


ONE_PE = textwrap.dedent("""
    import numpy as np
    from jax_triton_dist import shmem
    from jax_triton_dist.shmem import nvshmem_bootstrap

    shmem.init(backend="nvshmem", heap_size=64 << 20)
    assert shmem.backend() == "nvshmem", shmem.backend()
    assert (shmem.n_pes(), shmem.my_pe(), shmem.device_of(0)) == (1, 0, 0)
    rng = np.random.default_rng(7)
    data = rng.standard_normal(1 << 16).astype(np.float32)
    a = shmem.malloc(data.nbytes)
    b = shmem.malloc(data.nbytes)
    sig = shmem.calloc(1, 8)
    assert shmem.ptr(a, 0) == a
    shmem.putmem(a, data.ctypes.data, data.nbytes, 0)
    shmem.putmem_signal_nbi(b, a, data.nbytes, sig, 5, shmem.SignalOp.SET, 0)
    assert shmem.signal_wait_until(sig, shmem.Cmp.EQ, 5, timeout=10) == 5
    back = np.empty_like(data)
    shmem.getmem(back.ctypes.data, b, data.nbytes, 0)
    assert np.array_equal(back, data)
    shmem.signal_op(sig, 3, shmem.SignalOp.ADD, 0)
    assert shmem.signal_fetch(sig) == 8
    try:
        shmem.signal_wait_until(sig, shmem.Cmp.EQ, 9, timeout=0.5)
        raise AssertionError("wait_until did not time out")
    except shmem.ShmemTimeoutError as error:
        assert "saw 8" in str(error), error
    shmem.barrier_all()
    shmem.free(b)
    shmem.free(a)
    shmem.free(sig)
    version = nvshmem_bootstrap.library_version()
    shmem.finalize()
    print("NVSHMEM", version, "one PE through the unique-id path: ok")
""")


@pytest.mark.gpu
@needs_nvshmem_gpu
def test_nvshmem_one_pe_through_unique_id():
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NVLS="1",
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    result = subprocess.run([sys.executable, "-c", ONE_PE], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "one PE through the unique-id path: ok" in result.stdout
    print(result.stdout.strip().splitlines()[-1])


def test_cross_process_rendezvous_on_cpu():
    # The key-value-store all-gather behind the nvshmem backend's collectives and the
    # runtime's teams, in a 2-process CPU job.
    for out in run_processes("kv_rendezvous.py", 2, env={"JAX_PLATFORMS": "cpu"}, timeout=120):
        assert "of 2: ok" in out, out[-2000:]


def test_kernel_teams_across_processes_need_one_gpu_per_process(monkeypatch):
    from types import SimpleNamespace

    from jax_triton_dist.runtime import cuda_dispatch

    site = SimpleNamespace(label="all_gather_kernel", num_ranks=16)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 8)
    with pytest.raises(NotImplementedError, match="team has 16 ranks but this process drives 8"):
        cuda_dispatch._check_team_fits(site)
    site.num_ranks = 8  # TP inside a node
    cuda_dispatch._check_team_fits(site)
    monkeypatch.setattr(jax, "process_count", lambda: 16)
    monkeypatch.setattr(jax, "local_device_count", lambda *a: 1)  # one GPU per process
    site.num_ranks = 16
    cuda_dispatch._check_team_fits(site)


@pytest.mark.gpu
@needs_nvshmem_gpu
@pytest.mark.parametrize("processes", [2, 4])
def test_host_api_across_processes(processes):
    for out in run_processes("shmem_pes.py", processes):
        assert f"of {processes}: ok" in out, out[-2000:]


@pytest.mark.gpu
@needs_nvshmem_gpu
@pytest.mark.parametrize("processes", [2, 4])
def test_kernels_across_processes(processes):
    for out in run_processes("kernels.py", processes, "5", timeout=600):
        assert f"of {processes}: ok" in out, out[-2000:]


@pytest.mark.gpu
@needs_nvshmem_gpu
def test_nvshmem_device_calls_across_processes():
    for out in run_processes("nvshmem_device.py", 2):
        assert "of 2: ok" in out, out[-2000:]


@triton.jit
def put_kernel(x_ptr, buf_ptr, n):
    dl.nvshmem.putmem_nbi_block(buf_ptr, x_ptr, n, 0)


def test_nvshmem_device_calls_need_the_nvshmem_backend():
    from jax_triton_dist.runtime import cuda_compile

    f32 = ("pointer", np.dtype(np.float32))
    sig, cx = cuda_compile.signature_of(put_kernel, [f32, f32], {"n": 64})
    with pytest.raises(Exception, match="compiles only for the nvshmem SHMEM backend"):
        cuda_compile.compile_kernel(put_kernel, sig, cx)


@triton.jit
def quiet_kernel(x_ptr, out_ptr):
    dl.nvshmem.quiet()


def test_nvshmem_device_calls_fail_clearly_in_the_interpreter():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
    f = jax.jit(jax.shard_map(
        lambda x: jtd.triton_call(quiet_kernel, x, out_shape=jax.ShapeDtypeStruct(x.shape,
                                  x.dtype), grid=(1,), axis_name="x"),
        mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    with pytest.raises(Exception, match="dl.nvshmem calls are NVSHMEM device functions"):
        f(jax.device_put(jnp.ones(4), jax.NamedSharding(mesh, P("x")))).block_until_ready()
