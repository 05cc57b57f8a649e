"""CPU backend: runs one rank of a call site in Triton's interpreter.

``dispatch`` is what the C++ FFI handler (xla_ffi/cpu_dispatch.cc) calls on the
XLA thread of each CPU device. Every load and store of the kernel is checked against
the launch's buffers (``language/bounds.py``). A rank that fails raises its team's
abort word to its epoch, so that its peers stop waiting for it at once; at interpreter
exit, dispatches are drained before Python finalises (``close_at_exit``, registered
with the FFI target, before any dispatch can start).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import inspect
import io
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
from triton.runtime.errors import InterpreterError

from jax_triton_dist import _ffi, shmem
from jax_triton_dist.language import bounds, context
from jax_triton_dist.language.device_abi import staging_slot
from jax_triton_dist.runtime import (
    call_site,
    debug_settings,
    failed_runs,
    interpreter,
    ir_dump,
    launch_log,
    rank_activity,
    site_uses,
    timeline_capture,
    tuning,
)
from jax_triton_dist.shmem import heap, host_atomics, settings

__all__ = ["dispatch", "close_at_exit", "EXIT_GRACE_S"]

EXIT_GRACE_S = 5.0
"""Seconds running dispatches get to finish at interpreter exit before their waits are
cancelled."""

_init_lock = threading.Lock()


def _ensure_shmem(device_ordinal: int) -> None:
    with _init_lock:
        if heap.running_backend() is None:
            env = settings.backend_from_env()
            if env not in (None, "host"):
                raise shmem.ShmemError(
                    f"{settings.BACKEND_ENV}={env!r}, but a CPU device runs a distributed "
                    "kernel, which needs the 'host' backend: unset the variable or set host")
            shmem.init(backend="host")
    if heap.running_backend() != "host":
        raise shmem.ShmemError(
            f"SHMEM runs the {heap.running_backend()!r} backend, but a CPU device runs a "
            "distributed kernel (it needs 'host'): finalize SHMEM before switching platforms")
    if device_ordinal >= shmem.n_pes():
        raise shmem.ShmemError(
            f"SHMEM was initialised with {shmem.n_pes()} PEs, but CPU device {device_ordinal} "
            "runs a distributed kernel; initialise with n_pes >= the number of CPU devices "
            "(or let the runtime initialise SHMEM)")


def close_at_exit() -> None:
    """Interpreter exit: lets running dispatches finish (or abandons their waits), turns
    away later ones, and waits for the computations around them, so that no device
    thread is in Python, or enters it, when it finalises.

    Registered (``atexit``) with the FFI target, before any dispatch can start: a
    program dispatched just before the exit may reach its custom call only while Python
    finalises, and its dispatch must find the door closed then (registered by the first
    dispatch, the hook came too late for such a program, whose thread then entered a
    finalising Python and aborted the process)."""
    interrupted = _exiting_on_keyboard_interrupt()
    if _ffi.close(EXIT_GRACE_S):
        host_atomics.cancel_waits("the interpreter is exiting")
        call_site.abandon_joins("the interpreter is exiting")
        _ffi.close(2 * shmem.wait_timeout())
    _finish_computations()
    if interrupted:
        _keep_keyboard_interrupt_status()


def _finish_computations() -> None:
    """Waits for the XLA computations still running: once a dispatch has finished, the
    rest of its program (after the custom call) still runs on XLA's threads, and a process
    that tears XLA down under it can abort ("terminate called without an active
    exception", seen at 1 exit in ~100 with a dispatched, never awaited op). Dispatches
    are done or cancelled by now, so every computation ends; its failure is not this
    exit's business. Only the CPU backend's: another platform's work is not this
    backend's to wait for (a GPU process that never ran a CPU kernel exits as before)."""
    import jax

    try:
        arrays = jax.live_arrays("cpu")
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
        return
    for array in arrays:
        with contextlib.suppress(Exception):
            array.block_until_ready()


def _exiting_on_keyboard_interrupt() -> bool:
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return isinstance(last, KeyboardInterrupt)


def _keep_keyboard_interrupt_status() -> None:
    """An uncaught KeyboardInterrupt makes Python exit by SIGINT (status 130), but any
    ``exec``/``eval`` run meanwhile (the interpreter's kernel code did, on device threads)
    clears the flag that says so. Raising it once more through ``PyRun_SimpleString`` sets
    the flag again (its traceback is not shown)."""
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        ctypes.pythonapi.PyRun_SimpleString(b"raise KeyboardInterrupt")
    finally:
        sys.stderr = stderr


def _kernel_args(site: call_site.CallSite, pe: int, epoch: int, region: int,
                 arg_ptrs: list[int], ret_ptrs: list[int]) -> tuple[list, list[bounds.Buffer]]:
    """The kernel's arguments, and the buffers of this rank they reach."""
    base = heap.heap_base(pe) + region
    layout = site.region_layout
    names = list(inspect.signature(site.kernel.fn).parameters)
    args, buffers = [], []
    for position, (kind, value) in enumerate(site.params):
        name = f"`{names[position]}`" if position < len(names) else f"argument {position}"
        if kind == "scalar":
            args.append(value)
            continue
        if kind == "output":
            spec, address = site.outputs[value], ret_ptrs[value]
            what = f"result {value} {name}"
        elif kind == "workspace":
            spec, address = site.workspaces[value], base + layout.workspaces[value]
            what = f"workspace {value} {name}"
        else:  # operand; operand 0 holds the mesh coordinates
            spec, address = site.inputs[value], arg_ptrs[value + 1]
            what = f"operand {value} {name}"
            if value in layout.staging:
                address = base + staging_slot(epoch, *layout.staging[value])
                heap.copy(pe, address, arg_ptrs[value + 1], spec.nbytes)
                what += " (its symmetric copy)"
        args.append(interpreter.Pointer(address, spec.dtype))
        buffers.append(bounds.Buffer(address, spec.nbytes, what))
    return args, buffers


def _team_buffers(site: call_site.CallSite, team: call_site.TeamState) -> list[bounds.Buffer]:
    """Each team rank's symmetric region (what symm_at reaches)."""
    return [bounds.Buffer(heap.heap_base(pe) + team.region, site.region_layout.total,
                          f"the symmetric region of rank {rank} (workspaces, staging)")
            for rank, pe in enumerate(team.pes)]


def _abort_team(site: call_site.CallSite, team: call_site.TeamState, rank: int, epoch: int,
                message: str) -> None:
    """Raises every team rank's abort word to ``epoch``: their waits of this call give up."""
    team.failures.setdefault(epoch, f"rank {rank} failed: {message}")
    for pe in team.pes:
        word = heap.heap_base(pe) + team.region + site.region_layout.abort
        if int(shmem.as_array(word, 1, np.int64)[0]) < epoch:
            host_atomics.signal_op(word, epoch, shmem.SignalOp.SET, 8)


def _dump_cuda_compile(site: call_site.CallSite, variant: tuning.Variant,
                       device_ordinal: int) -> None:
    """``JTD_DUMP_IR`` on CPU: the kernel compiled for CUDA (what a GPU would run)."""
    from jax_triton_dist.runtime import cuda_dispatch

    signature, kernel = cuda_dispatch.compile_site(site, variant)
    ir_dump.dump(site, variant, device_ordinal, kernel, signature,
                 "cuda (compiled on the CPU backend)")


def _run(call_id: int, device_ordinal: int, arg_ptrs: list[int], ret_ptrs: list[int],
         instance: int, run_id: int) -> None:
    site = call_site.lookup(call_id)
    what = f"kernel {site.label} (call {call_id})"
    with (rank_activity.running(device_ordinal, what),
          failed_runs.entered(run_id, f"PE {device_ordinal}, {what}") as run_word):
        _run_site(site, device_ordinal, arg_ptrs, ret_ptrs, instance, _Run(run_id, run_word))


@dataclasses.dataclass(frozen=True)
class _Run:
    """The execution a call belongs to (``runtime/failed_runs.py``)."""

    id: int
    abort_word: int

    def failure(self) -> str | None:
        return failed_runs.reason(self.id)


def _run_site(site: call_site.CallSite, device_ordinal: int, arg_ptrs: list[int],
              ret_ptrs: list[int], instance: int, run: _Run) -> None:
    _ensure_shmem(device_ordinal)
    coords = shmem.as_array(arg_ptrs[0], (len(site.mesh_axes),), np.int32)
    key = tuple(int(c) for c in coords)
    if not site.teams:
        site_uses.drain()  # regions of executables that are gone make room first
    # A call site used twice in a program (a traced function called twice) is two custom
    # calls, which XLA may run in either order on each rank: each has its teams.
    rank, team = site.join(key, device_ordinal, shmem.wait_timeout(), call_site.allocate_region,
                           instance=instance, stop=run.failure)
    # One run at a time per rank (runs of successive executions may overlap).
    with team.rank_lock(rank):
        _run_team(site, team, rank, device_ordinal, arg_ptrs, ret_ptrs, run)


def _run_team(site: call_site.CallSite, team: call_site.TeamState, rank: int,
              device_ordinal: int, arg_ptrs: list[int], ret_ptrs: list[int], run: _Run) -> None:

    def launch(variant: tuning.Variant) -> None:
        _launch(site, team, rank, device_ordinal, variant, arg_ptrs, ret_ptrs, run)

    first = device_ordinal not in team.epochs
    team.align_epoch(device_ordinal, run.id, site.cond)
    variant = site.choose(team, rank, "cpu", "cpu", lambda index: _Trial(
        site.tuner, team, device_ordinal, lambda: launch(site.variants[index]),
        lambda: [_read_output(spec, ret_ptrs[i]) for i, spec in enumerate(site.outputs)]))
    if first:
        launch_log.plan(site, variant, device_ordinal, rank, team, "host")
        if debug_settings.dump_ir_dir() is not None:
            _dump_cuda_compile(site, variant, device_ordinal)
    launch(variant)


class _Trial(tuning.Trial):
    """The autotuner's timing of one variant by one rank in the interpreter: the median
    of ``tuner.rep`` timed launches after ``tuner.warmup`` untimed ones. The rank's epochs
    advance by that count, whether the variant runs or fails."""

    def __init__(self, tuner: tuning.Autotuned, team: call_site.TeamState, device: int,
                 launch: Callable[[], None], read: Callable[[], list[np.ndarray]]):
        self.tuner, self.team, self.device, self.launch = tuner, team, device, launch
        self.read = read
        self.end = team.epochs.get(device, 0) + tuner.warmup + tuner.rep

    def outputs(self) -> list[np.ndarray]:
        return self.read()

    def run(self) -> float:
        try:
            for _ in range(self.tuner.warmup):
                self.launch()
            times = []
            for _ in range(self.tuner.rep):
                start = time.perf_counter()
                self.launch()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        finally:
            self.team.epochs[self.device] = self.end


def _read_output(spec, address: int) -> np.ndarray:
    """A copy of the output of ``spec`` (shape, dtype) at host ``address``."""
    raw = ctypes.string_at(address, spec.nbytes)
    return np.frombuffer(raw, spec.dtype).reshape(spec.shape).copy()


def _launch(site: call_site.CallSite, team: call_site.TeamState, rank: int,
            device_ordinal: int, variant: tuning.Variant, arg_ptrs: list[int],
            ret_ptrs: list[int], run: _Run) -> None:
    """One launch of ``variant`` by ``rank`` in the next epoch."""
    timeout = shmem.wait_timeout()
    epoch = team.epochs.get(device_ordinal, 0) + 1
    team.epochs[device_ordinal] = epoch
    base = heap.heap_base(device_ordinal) + team.region
    ctx = context.RankContext(
        rank=rank,
        num_ranks=site.num_ranks,
        pe=device_ordinal,
        team_pes=tuple(team.pes),
        heap_bases=np.array([heap.heap_base(p) for p in team.pes], dtype=np.uint64),
        heap_size=heap.heap_size(),
        epoch=epoch,
        barrier_area=base + site.region_layout.barrier,
        timeout=timeout,
        label=site.label,
        abort_word=base + site.region_layout.abort,
        run_abort_word=run.abort_word,
        timeline=[] if site.timeline else None,
    )
    launch_log.launch(site.label, site.call_id, device_ordinal, rank, site.num_ranks,
                      tuple(team.pes), epoch, variant.grid)
    try:
        args, buffers = _kernel_args(site, device_ordinal, epoch, team.region, arg_ptrs,
                                     ret_ptrs)
        limits = bounds.Bounds(buffers + _team_buffers(site, team), ctx.who()) if (
            bounds.enabled()) else None

        def scope() -> contextlib.ExitStack:  # the rank's thread-local state
            stack = contextlib.ExitStack()
            stack.enter_context(shmem.as_pe(device_ordinal))
            stack.enter_context(context.active(ctx))
            stack.enter_context(bounds.checking(limits))
            return stack

        def failed(error: BaseException) -> None:  # the rank's other programs stop waiting
            _abort_team(site, team, rank, epoch, f"{type(error).__name__}: {error}")

        with scope():
            try:
                interpreter.launch(site.kernel, variant.grid, args, variant.kwargs,
                                   concurrent=variant.co_resident, program_scope=scope,
                                   on_failure=failed)
            finally:
                if ctx.timeline is not None:
                    timeline_capture.add_events(site, device_ordinal, device_ordinal, rank,
                                                ctx.timeline)
    except shmem.ShmemAbortedError as error:
        cause = team.failures.get(epoch) or run.failure()
        raise shmem.ShmemAbortedError(f"{error}: {cause}" if cause else str(error)
                                      ).with_traceback(error.__traceback__) from None
    except Exception as error:
        _abort_team(site, team, rank, epoch, f"{type(error).__name__}: {error}")
        raise


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


def dispatch(call_id: int, device_ordinal: int, arg_ptrs: list[int], ret_ptrs: list[int],
             instance: int = 0, run_id: int = 0) -> str | None:
    """Runs one rank of custom call ``instance`` of the site (on a thread of its own: the
    FFI handler is asynchronous) in execution ``run_id`` (XLA's ``RunId``; 0: unknown);
    returns None, or the message of the failure (which stops the execution's other calls:
    ``runtime/failed_runs.py``)."""
    try:
        _run(call_id, device_ordinal, arg_ptrs, ret_ptrs, instance, run_id)
    except Exception as error:  # reported to XLA, which raises it in the caller
        cause = error
        while isinstance(cause, InterpreterError) and cause.__cause__ is not None:
            cause = cause.__cause__
        site = call_site.find(call_id)
        where = _kernel_frame(site, error) if site is not None else ""
        if isinstance(cause, shmem.ShmemTimeoutError):  # where the others are meanwhile
            others = [pe for pe in range(shmem.n_pes()) if pe != device_ordinal]
            where += f"; meanwhile {rank_activity.describe(others)}"
        message = f"{type(cause).__name__}: {cause}{where}"
        if not isinstance(cause, shmem.ShmemAbortedError):  # (an abort has its own cause)
            label = site.label if site is not None else "?"
            failed_runs.fail(run_id, device_ordinal, f"kernel {label} (call {call_id})",
                             message)
        return f"jax_triton_dist (CPU device {device_ordinal}): {message}"
    return None
