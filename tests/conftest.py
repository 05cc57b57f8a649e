"""Test configuration: bounded waits; JAX clients that allocate GPU memory on demand (XLA
preallocates 75% of a GPU per process, and the GPU tier runs scripts, the doctor and the
stress runner in processes of their own beside this one). The plugin
``jax_triton_dist.testing`` (loaded through its entry point; ``jtd_cpu_devices = 8`` in
pyproject.toml) simulates 8 CPU devices before JAX starts and provides the ``straggler``
fixture."""

import os

os.environ.setdefault("JTD_WAIT_TIMEOUT", "60")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
