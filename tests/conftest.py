"""Test configuration: bounded waits. The plugin ``jax_triton_dist.testing`` (loaded through
its entry point; ``jtd_cpu_devices = 8`` in pyproject.toml) simulates 8 CPU devices before
JAX starts and provides the ``straggler`` fixture."""

import os

os.environ.setdefault("JTD_WAIT_TIMEOUT", "60")


import pytest  # noqa: E402


@pytest.fixture
def no_world():
    """No SHMEM running before or after the test."""
    from jax_triton_dist import shmem

    if shmem.init_status() == shmem.InitStatus.INITIALIZED:
        shmem.finalize()
    yield
    if shmem.init_status() == shmem.InitStatus.INITIALIZED:
        shmem.finalize()
