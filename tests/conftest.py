"""Test configuration: 8 simulated CPU devices, bounded waits."""

import os

# Must happen before JAX initialises its CPU backend.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JTD_WAIT_TIMEOUT", "60")


import time  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def straggler(monkeypatch):
    """``straggler(pe, seconds)``: CPU device ``pe`` starts every kernel ``seconds`` late."""

    def install(pe: int, seconds: float) -> None:
        from jax_triton_dist.runtime import cpu_dispatch

        original = cpu_dispatch._run

        def delayed(call_id, device_ordinal, arg_ptrs, ret_ptrs):
            if device_ordinal == pe:
                time.sleep(seconds)
            return original(call_id, device_ordinal, arg_ptrs, ret_ptrs)

        monkeypatch.setattr(cpu_dispatch, "_run", delayed)

    return install


@pytest.fixture
def no_world():
    """No SHMEM running before or after the test."""
    from jax_triton_dist import shmem

    if shmem.init_status() == shmem.InitStatus.INITIALIZED:
        shmem.finalize()
    yield
    if shmem.init_status() == shmem.InitStatus.INITIALIZED:
        shmem.finalize()
