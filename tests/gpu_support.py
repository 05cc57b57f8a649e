"""Whether this machine can run the GPU tier (tests import it; no pytest fixtures here)."""

from jax_triton_dist import shmem
from jax_triton_dist.runtime import cuda_driver


def have_gpu() -> bool:
    """A CUDA build whose launcher finds a usable NVIDIA driver and GPU."""
    return cuda_driver.available() and "cuda" in shmem.available_backends()
