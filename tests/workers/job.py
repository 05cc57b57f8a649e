"""Start of every worker: join the JAX distributed job from the command line."""

import sys

import jax


def start() -> tuple[int, int]:
    """``(process index, process count)`` after ``jax.distributed.initialize``."""
    port, index, count = (int(a) for a in sys.argv[1:4])
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=count,
                               process_id=index, initialization_timeout=120)
    assert jax.process_count() == count and len(jax.local_devices()) == 1
    return index, count
