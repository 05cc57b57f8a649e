"""Start of every worker: join the job that jax_triton_dist.multiprocess started."""

import jax

from jax_triton_dist import multiprocess


def start() -> tuple[int, int]:
    """``(process index, process count)`` after joining the job (one GPU per process)."""
    index, count = multiprocess.initialize(timeout_s=120)
    assert len(jax.local_devices()) == 1, jax.local_devices()
    return index, count
