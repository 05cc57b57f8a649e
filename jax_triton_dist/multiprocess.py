"""Local multi-process JAX jobs: one process per GPU (the ``nvshmem`` SHMEM backend).

From the shell::

    python -m jax_triton_dist.multiprocess --processes 8 train.py [script args ...]

starts ``train.py`` 8 times, process ``i`` on GPU ``i`` (``CUDA_VISIBLE_DEVICES``), with
the job's coordinates in ``JTD_COORDINATOR``, ``JTD_PROCESS_ID`` and
``JTD_NUM_PROCESSES``; each line of output is prefixed with ``[i]``. The script joins the
job with::

    from jax_triton_dist import multiprocess
    multiprocess.initialize()    # jax.distributed.initialize from those variables

``--share-gpu`` puts every process on the first GPU: NVSHMEM accepts several PEs on one
GPU, so a one-GPU machine runs the multi-process mode for testing (the processes'
kernels time-slice the GPU). If a process fails, the others are stopped.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

COORDINATOR_ENV = "JTD_COORDINATOR"
PROCESS_ID_ENV = "JTD_PROCESS_ID"
NUM_PROCESSES_ENV = "JTD_NUM_PROCESSES"

__all__ = ["initialize", "run", "main", "COORDINATOR_ENV", "PROCESS_ID_ENV",
           "NUM_PROCESSES_ENV"]


def initialize(timeout_s: int = 300) -> tuple[int, int]:
    """Joins the job started by :func:`run`: ``jax.distributed.initialize`` from
    ``JTD_COORDINATOR``, ``JTD_PROCESS_ID`` and ``JTD_NUM_PROCESSES``.

    Returns:
      ``(process index, process count)``.
    """
    import jax

    missing = [v for v in (COORDINATOR_ENV, PROCESS_ID_ENV, NUM_PROCESSES_ENV)
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"multiprocess.initialize: {', '.join(missing)} not set: start "
                           "this script with python -m jax_triton_dist.multiprocess")
    jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR_ENV],
                               num_processes=int(os.environ[NUM_PROCESSES_ENV]),
                               process_id=int(os.environ[PROCESS_ID_ENV]),
                               initialization_timeout=timeout_s)
    return jax.process_index(), jax.process_count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _gpus(processes: int, share_gpu: bool) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    pool = visible.split(",") if visible else [str(i) for i in range(processes)]
    if share_gpu:
        return [pool[0]] * processes
    if len(pool) < processes:
        raise ValueError(f"multiprocess: {processes} processes but CUDA_VISIBLE_DEVICES={visible} "
                         "names fewer GPUs (one per process; --share-gpu to share one)")
    return pool[:processes]


def run(command: Sequence[str], processes: int, *, share_gpu: bool = False,
        timeout: float | None = None, capture: bool = False,
        env: dict[str, str] | None = None) -> tuple[list[int], list[str]]:
    """Runs ``command`` (a Python script and its arguments) as ``processes`` processes of
    one JAX job on this machine.

    Args:
      command: the script and its arguments (run with this Python).
      processes: number of processes (= NVSHMEM PEs).
      share_gpu: every process on the first GPU (testing on one GPU).
      timeout: seconds before every process is killed (None: no limit).
      capture: return the outputs instead of printing them with ``[i]`` prefixes.
      env: extra environment variables for every process.

    Returns:
      ``(return codes, outputs)``; outputs are empty strings unless ``capture``. A process
      killed for the timeout, or because another failed, reports return code -9.
    """
    if processes < 1:
        raise ValueError(f"multiprocess: processes must be >= 1, got {processes}")
    port = _free_port()
    base = dict(os.environ, **(env or {}))
    base.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # no NVLink multicast
    base.setdefault("PYTHONUNBUFFERED", "1")
    if share_gpu:
        base.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several JAX clients
    procs = []
    for index, gpu in enumerate(_gpus(processes, share_gpu)):
        proc_env = dict(base, CUDA_VISIBLE_DEVICES=gpu, **{
            COORDINATOR_ENV: f"localhost:{port}", PROCESS_ID_ENV: str(index),
            NUM_PROCESSES_ENV: str(processes)})
        procs.append(subprocess.Popen([sys.executable, *command], env=proc_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [[] for _ in procs]

    def pump(index: int) -> None:
        for line in procs[index].stdout:
            if capture:
                outputs[index].append(line)
            else:
                print(f"[{index}] {line}", end="", flush=True)

    pumps = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(processes)]
    for thread in pumps:
        thread.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes):
            break
        failed = any(code not in (None, 0) for code in codes)
        late = deadline is not None and time.monotonic() > deadline
        if failed or late:
            time.sleep(0 if late else 5)  # let the others report their side first
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    for thread in pumps:
        thread.join()
    return [p.returncode for p in procs], ["".join(o) for o in outputs]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_triton_dist.multiprocess",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", "-n", type=int, required=True,
                        help="number of processes (one per GPU)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="put every process on the first GPU (testing on one GPU)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds, then stop all")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script [args ...]")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no script given")
    codes, _ = run(args.command, args.processes, share_gpu=args.share_gpu,
                   timeout=args.timeout)
    for index, code in enumerate(codes):
        if code != 0:
            print(f"multiprocess: process {index} exited with {code}", file=sys.stderr)
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
