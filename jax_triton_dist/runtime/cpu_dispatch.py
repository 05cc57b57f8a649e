"""CPU backend: runs one rank of a call site in Triton's interpreter.

``dispatch`` is what the C++ FFI handler (xla_ffi/cpu_dispatch.cc) calls on the
XLA thread of each CPU device.
"""

from __future__ import annotations

import inspect
import threading
import traceback

import numpy as np
from triton.runtime.errors import InterpreterError

from jax_triton_dist import shmem
from jax_triton_dist.language import context
from jax_triton_dist.language.device_abi import staging_slot
from jax_triton_dist.runtime import call_site, interpreter
from jax_triton_dist.shmem import heap

__all__ = ["dispatch"]

_init_lock = threading.Lock()


def _ensure_shmem(device_ordinal: int) -> None:
    with _init_lock:
        if heap.running_backend() is None:
            shmem.init(backend="host")
    if heap.running_backend() != "host":
        raise shmem.ShmemError(
            f"SHMEM runs the {heap.running_backend()!r} backend, but a CPU device runs a "
            "distributed kernel (it needs 'host'): finalize SHMEM before switching platforms"
        )
    if device_ordinal >= shmem.n_pes():
        raise shmem.ShmemError(
            f"SHMEM was initialised with {shmem.n_pes()} PEs, but CPU device {device_ordinal} "
            "runs a distributed kernel; initialise with n_pes >= the number of CPU devices "
            "(or let the runtime initialise SHMEM)"
        )


def _kernel_args(site: call_site.CallSite, pe: int, epoch: int, region: int,
                 arg_ptrs: list[int], ret_ptrs: list[int]) -> list:
    base = heap.heap_base(pe) + region
    _, workspace_offsets, staging, _ = site.region_layout
    args = []
    for kind, value in site.params:
        if kind == "scalar":
            args.append(value)
        elif kind == "output":
            args.append(interpreter.Pointer(ret_ptrs[value], site.outputs[value].dtype))
        elif kind == "workspace":
            spec = site.workspaces[value]
            args.append(interpreter.Pointer(base + workspace_offsets[value], spec.dtype))
        else:  # operand; operand 0 holds the mesh coordinates
            spec = site.inputs[value]
            address = arg_ptrs[value + 1]
            if value in staging:
                slot = base + staging_slot(epoch, *staging[value])
                heap.copy(pe, slot, address, spec.nbytes)
                address = slot
            args.append(interpreter.Pointer(address, spec.dtype))
    return args


def _run(call_id: int, device_ordinal: int, arg_ptrs: list[int], ret_ptrs: list[int]) -> None:
    site = call_site.lookup(call_id)
    _ensure_shmem(device_ordinal)
    coords = shmem.as_array(arg_ptrs[0], (len(site.mesh_axes),), np.int32)
    timeout = shmem.wait_timeout()
    rank, team = site.join(tuple(int(c) for c in coords), device_ordinal, timeout,
                           call_site.allocate_region)
    epoch = team.epochs.get(device_ordinal, 0) + 1
    team.epochs[device_ordinal] = epoch
    ctx = context.RankContext(
        rank=rank,
        num_ranks=site.num_ranks,
        pe=device_ordinal,
        team_pes=tuple(team.pes),
        heap_bases=np.array([heap.heap_base(p) for p in team.pes], dtype=np.uint64),
        heap_size=heap.heap_size(),
        epoch=epoch,
        barrier_area=heap.heap_base(device_ordinal) + team.region,
        timeout=timeout,
        label=site.label,
    )
    args = _kernel_args(site, device_ordinal, epoch, team.region, arg_ptrs, ret_ptrs)
    with shmem.as_pe(device_ordinal), context.active(ctx):
        interpreter.launch(site.kernel, site.grid, args, site.kwargs)


def _kernel_frame(site: call_site.CallSite, error: BaseException) -> str:
    """`` (at file:line: source)`` of the deepest frame in the kernel's file, or ``""``."""
    try:
        kernel_file = inspect.getsourcefile(site.kernel.fn)
    except (TypeError, AttributeError):
        return ""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == kernel_file]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()})"


def dispatch(call_id: int, device_ordinal: int, arg_ptrs: list[int],
             ret_ptrs: list[int]) -> str | None:
    """Runs one rank; returns None, or the message of the failure."""
    try:
        _run(call_id, device_ordinal, arg_ptrs, ret_ptrs)
    except Exception as error:  # reported to XLA, which raises it in the caller
        cause = error
        while isinstance(cause, InterpreterError) and cause.__cause__ is not None:
            cause = cause.__cause__
        site = call_site.find(call_id)
        where = _kernel_frame(site, error) if site is not None else ""
        return (f"jax_triton_dist (CPU device {device_ordinal}): {type(cause).__name__}: "
                f"{cause}{where}")
    return None
