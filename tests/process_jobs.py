"""Runs a worker script as N processes of one JAX distributed job, all on one GPU.

NVSHMEM accepts several PEs (processes) on one GPU, so the one-process-per-GPU mode (the
``nvshmem`` backend) runs here as it would on N GPUs, only time-sliced: waits and
signals cross real process boundaries. Workers live in ``tests/workers`` and join the job
with ``jax_triton_dist.multiprocess.initialize()``.
"""

from __future__ import annotations

import os

from jax_triton_dist import multiprocess

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def run_processes(worker: str, n: int, *args: str, timeout: float = 300,
                  env: dict[str, str] | None = None) -> list[str]:
    """Runs ``tests/workers/<worker>`` in ``n`` processes sharing one GPU (``env``: extra
    variables); returns their outputs. Raises AssertionError with every process's output
    tail if one fails."""
    env = {"XLA_FLAGS": "", **(env or {})}  # not the CPU suite's simulated devices
    codes, outputs = multiprocess.run([os.path.join(WORKERS, worker), *args], n, share_gpu=True,
                                timeout=timeout, capture=True, env=env)
    if any(codes):
        raise AssertionError("\n".join(f"--- process {i} (rc {code}) ---\n{out[-4000:]}"
                                       for i, (code, out) in enumerate(zip(codes, outputs,
                                                                           strict=True))))
    return outputs
