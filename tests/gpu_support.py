"""Whether this machine can run the GPU tier (tests import it; no pytest fixtures here)."""

from jax_triton_dist import _shmem


def have_gpu() -> bool:
    """A CUDA build whose launcher finds a usable NVIDIA driver and GPU."""
    try:
        from jax_triton_dist import _cuda
    except ImportError:  # built without the CUDA headers
        return False
    return _cuda.available() and _shmem.has_cuda()
