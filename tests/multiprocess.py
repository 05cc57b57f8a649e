"""Runs a worker script as N processes of one JAX distributed job, all on one GPU.

NVSHMEM accepts several PEs (processes) on one GPU, so the one-process-per-GPU mode (the
``nvshmem`` backend) runs here as it would on N GPUs, only time-sliced: waits and
signals cross real process boundaries. Workers live in ``tests/workers``; each gets the
coordinator port, its process index and the process count as arguments.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(worker: str, n: int, *args: str, timeout: float = 300) -> list[str]:
    """Runs ``tests/workers/<worker>`` in ``n`` processes; returns their outputs.

    Raises AssertionError with every process's output tail if one fails or times out.
    """
    port = _free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NVLS="1",
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
               PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the CPU test suite's simulated devices
    procs = [subprocess.Popen([sys.executable, os.path.join(WORKERS, worker), str(port),
                               str(i), str(n), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    outputs, failed = [], []
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out += f"\n[process {i} killed after {timeout} s]"
        outputs.append(out)
        if proc.returncode != 0:
            failed.append(i)
    if failed:
        raise AssertionError("\n".join(
            f"--- process {i} (rc {procs[i].returncode}) ---\n{outputs[i][-4000:]}"
            for i in range(n)))
    return outputs
