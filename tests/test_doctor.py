"""``python -m jax_triton_dist doctor``: its report and exit status on CPU."""

import os
import subprocess
import sys
import tempfile

from jax_triton_dist import doctor


def _doctor(**env):
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environment.update(env)
    # Outside the checkout: from its root, the source tree would shadow the installed package.
    return subprocess.run([sys.executable, "-m", "jax_triton_dist", "doctor"],
                          capture_output=True, text=True, timeout=300, env=environment,
                          cwd=tempfile.gettempdir())


def test_doctor_passes_on_this_machine():
    result = _doctor()
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for name in ("jax / jaxlib", "triton", "extension _shmem", "extension _ffi", "platform",
                 "SHMEM backend", "heap", "libcuda", "NVSHMEM host library",
                 "Ascend compiler", "all_reduce", "triton_call ring kernel"):
        assert name in out, name
    assert "set XLA_FLAGS=--xla_force_host_platform_device_count=4" in out
    assert "cpu: 4 device(s)" in out
    assert "all_reduce over 4 rank(s) matches jax.lax.psum" in out
    assert "[ok  ] SHMEM backend              host (JAX's default platform is the CPU)" in out
    assert "everything this platform needs works" in out


def test_doctor_fails_with_a_backend_the_platform_cannot_use():
    result = _doctor(JTD_SHMEM_BACKEND="cuda")
    assert result.returncode == 1
    assert "[FAIL] SHMEM backend" in result.stdout
    assert "unset JTD_SHMEM_BACKEND" in result.stdout
    assert "[skip] smoke tests" in result.stdout


def test_doctor_fails_on_a_bad_setting():
    result = _doctor(JTD_SHMEM_HEAP_SIZE="lots")
    assert result.returncode == 1
    assert "JTD_SHMEM_HEAP_SIZE='lots' is not a size" in result.stdout


def test_a_failing_smoke_test_fails_the_doctor(monkeypatch, capsys):
    def broken():
        raise RuntimeError("jax_triton_dist (CPU device 1): the ring lost a message")

    monkeypatch.setattr(doctor, "_ring_check", broken)
    assert doctor.main() == 1
    out = capsys.readouterr().out
    assert "[FAIL] triton_call ring kernel" in out
    assert "the ring lost a message" in out and "--verbose" in out
    assert "[ok  ] all_reduce" in out
