"""Runs the ranks of a distributed kernel concurrently on one GPU.

Each rank is a PE of the ``cuda`` SHMEM backend with its heap on the same GPU, and gets
its own copy of the kernel module (its ``jtd_ctx`` points at its own rank context) and
its own stream; the ranks' launches are enqueued behind a gate that opens once all are
enqueued (so they start together, not one host launch apart), overlap on the GPU and
exchange data and flags through its memory exactly as they would across GPUs. This tests
the CUDA memory ordering of distributed kernels (release/acquire signals, waits, double
buffering across calls) where only one GPU is available.

The ranks' programs must all be resident at once (``world * num_programs`` no more than
the GPU's multiprocessors), or their spin waits cannot make progress; the waits'
watchdog then ends the launch instead of hanging. A GPU gives its streams a few
hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default): past 8 ranks, streams
share queues, so one rank's kernel can queue behind another's; raise the variable before
CUDA starts. The gate is a word of host-mapped memory the host opens with a store, so no
stream's work queues behind the waits it ends. The harness polls for the ranks' work
rather than blocking on it: work still queued after :func:`finish_seconds` (which no wait
can explain) is reported as an error naming the ranks and the start gate's state.

SHMEM must hold ``world`` PEs on the GPU: ``run_ranks`` initialises it so (after
``shmem.finalize()`` if it was initialised otherwise, which drops JAX's launch plans;
they are made again on the next call).

Example::

    outs = one_gpu.run_ranks(push_exchange_kernel, world=4,
                             inputs=lambda call, rank: [x[call, rank]],
                             outputs=[((n,), np.float32)],
                             workspaces=[((2, 4, n), np.float32), ((2, 4, 1), np.int32)],
                             grid=(1,), kwargs=dict(n=n, SEND_CHUNKS=False, REDUCE="sum",
                                                    BLOCK=1024), calls=10)
    # outs[call][rank][output] are NumPy arrays
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_triton_dist import shmem
from jax_triton_dist.language import device_abi
from jax_triton_dist.language.device_abi import ParamKind
from jax_triton_dist.runtime import (
    call_site,
    cuda_dispatch,
    cuda_driver,
    launch_log,
    timeline_capture,
    tuning,
)
from jax_triton_dist.shmem import heap, lifetime, settings

__all__ = ["run_ranks", "time_ranks", "StuckError"]

_ids = itertools.count(-1, -1)  # negative: never clash with traced call sites


def _ensure_world(world: int, device: int) -> None:
    """SHMEM's ``cuda`` backend with PEs ``0 .. world - 1`` on GPU ``device``."""
    if heap.running_backend() is not None:
        if (heap.running_backend() == "cuda" and shmem.n_pes() >= world
                and all(shmem.device_of(pe) == device for pe in range(world))):
            return
        shmem.finalize()
    shmem.init(n_pes=world, backend="cuda", devices=[device] * world)


def _site(kernel, world, inputs, outputs, workspaces, grid, kwargs, symmetric,
          options) -> call_site.CallSite:
    def spec(shape, dtype):
        return call_site.ArraySpec(tuple(shape), np.dtype(dtype))

    tuner = kernel if isinstance(kernel, tuning.Autotuned) else None
    variants = tuning.variants_of(
        tuner.candidates(kwargs) if tuner else None, kwargs, options,
        lambda meta: tuple(grid(meta) if callable(grid) else grid))
    per_variant = [[spec(*w) for w in (workspaces(v.kwargs) if callable(workspaces)
                                       else workspaces)] for v in variants]
    params = [("array", i) for i in range(len(inputs))]
    params += [("output", i) for i in range(len(outputs))]
    params += [("workspace", i) for i in range(len(per_variant[0]))]
    kernel = tuner.kernel if tuner else kernel
    return call_site.CallSite(
        kernel=kernel, label=kernel.fn.__name__, variants=variants,
        team_axes=call_site.TeamAxes(("x",), (world,), (0,)), params=params,
        inputs=[spec(a.shape, a.dtype) for a in inputs], symmetric=frozenset(symmetric),
        outputs=[spec(*o) for o in outputs],
        workspaces=[max(c, key=lambda s: s.nbytes) for c in zip(*per_variant, strict=True)],
        tuner=tuner, call_id=next(_ids), timeline=timeline_capture.capacity())


def _choose(site: call_site.CallSite, team: call_site.TeamState, device: int,
            args: list[list[int]], rets: list[list[int]]) -> tuning.Variant:
    """The variant every rank runs. An autotuned kernel's ranks are timed together from
    this thread: each variant is loaded for every rank, every rank's timed launches are
    enqueued on its stream, then all are waited for (``tuning.select_for_team``)."""
    world = len(team.pes)
    if len(site.variants) > 1:
        def measure_team(index: int) -> list[float | None]:
            trials: list[cuda_dispatch.Trial | None] = []
            for rank, (region, ctx) in enumerate(team.region):
                try:
                    trials.append(cuda_dispatch.Trial(site, team, rank, device, region, ctx,
                                                      args[rank], rets[rank], index))
                except Exception as error:  # every rank's launches need every rank's
                    _skip(site, index, rank, error)
                    trials.append(None)
            if any(t is None for t in trials):
                for trial in trials:
                    if trial is not None:
                        trial.close()
                return [None] * world
            times: list[float | None] = []
            try:
                for trial in trials:
                    trial.start()
                for rank, trial in enumerate(trials):
                    try:
                        times.append(trial.finish())
                    except Exception as error:
                        _skip(site, index, rank, error)
                        times.append(None)
            except Exception as error:  # an enqueue failed: the rest cannot be waited for
                _skip(site, index, len(times), error)
                for trial in trials:
                    if getattr(trial, "stream", None) is not None:
                        cuda_driver.driver().stream_synchronize(device, trial.stream)
                times = [None] * world
            finally:
                for trial in trials:
                    trial.close()
            return times

        def read_team() -> list[list[np.ndarray]]:
            return [cuda_dispatch.read_outputs(device, rets[rank], site.outputs)
                    for rank in range(world)]

        index = tuning.select_for_team(
            site.tuner, site.variants, site.label, world,
            site.tuning_key(cuda_dispatch.device_kind(device)), "gpu", measure_team,
            read_team)
        for rank in range(world):
            team.choice[rank] = index
    return site.variant(team, 0)


def _skip(site: call_site.CallSite, index: int, rank: int, error: Exception) -> None:
    launch_log.emit(f"jtd autotune kernel={site.label} rank={rank} "
                    f"config={index + 1}/{len(site.variants)} failed "
                    f"({site.variants[index].config}): {type(error).__name__}: {error}")


class StuckError(RuntimeError):
    """The ranks' work did not finish (:func:`finish_seconds`): the GPU is stuck, and
    nothing more should run on it in this process."""


class _Gate:
    """A start gate of GPU ``device``: a 32-bit word in host-mapped memory that launch
    streams wait on (``cuStreamWaitValue32``, until it reaches a release number) and
    that the host opens with a plain store. No stream of its own: a stream that wrote it
    could share a hardware queue with a waiting rank's stream (a GPU has a few such
    queues, ``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default, for any number of streams) and
    then queue behind the wait it should end. One per device, kept for the process; its
    release numbers only grow."""

    _gates: dict[int, _Gate] = {}

    def __init__(self, device: int):
        self.host, self.device_address = cuda_driver.driver().host_alloc_mapped(device, 4)
        self._word = ctypes.c_uint32.from_address(self.host)  # only the host writes it

    @classmethod
    def of(cls, device: int) -> _Gate:
        if device not in cls._gates:
            cls._gates[device] = cls(device)
        return cls._gates[device]

    def next_release(self) -> int:
        """The number the next opening writes (streams enqueued now wait for it)."""
        return self._word.value + 1

    def open(self, release: int) -> None:
        """Lets every stream waiting for ``release`` (or less) go."""
        self._word.value = max(self._word.value, release)

    def value(self) -> int:
        """The word as the host sees it."""
        return self._word.value


class _Job:
    """The ranks of one kernel on one GPU: SHMEM, the team's region, a stream and buffers
    per rank, the chosen variant loaded once per rank; :meth:`close` releases them."""

    def __init__(self, caller, kernel, world, inputs, outputs, workspaces, grid, kwargs,
                 device, symmetric, options):
        self.caller = f"one_gpu.{caller}"  # what errors name
        if cuda_dispatch.launcher() is None or not cuda_driver.available():
            raise RuntimeError(
                f"{self.caller} needs the CUDA launcher and a GPU "
                f"({cuda_driver.unavailable_reason() or 'no CUDA launcher built'})")
        self.drv = drv = cuda_driver.driver()
        self.world, self.device, self.inputs = world, device, inputs
        self.stuck = False  # a rank's work did not finish (finish): nothing may be freed
        _ensure_world(world, device)
        first = [np.ascontiguousarray(a) for a in inputs(0, 0)]
        self.site = site = _site(kernel, world, first, outputs, workspaces, grid, kwargs,
                                 symmetric, options)
        self.team = call_site.TeamState(pes=list(range(world)),
                                        generation=lifetime.generation())
        self.contexts = cuda_dispatch.regions(site, self.team)
        self.team.region = self.contexts
        site.teams[()] = self.team
        self.streams = [drv.stream_create(device) for _ in range(world)]
        self.gate = _Gate.of(device)  # every rank's stream waits on it (launch)
        self.releases = 0  # the value the last launch opened the gate to
        self.in_bufs = [[drv.alloc(device, max(a.nbytes, 1)) for a in first]
                        for _ in range(world)]
        self.out_bufs = [[drv.alloc(device, max(site.outputs[i].nbytes, 1))
                          for i in range(len(outputs))] for _ in range(world)]
        self.loaded = []
        try:
            self.write_inputs(0)
            variant = _choose(site, self.team, device, [[0] + b for b in self.in_bufs],
                              self.out_bufs)
            self.loaded = [cuda_dispatch.Loaded(site, variant, device, region, ctx, world)
                           for region, ctx in self.contexts]
        except BaseException:
            self.close()
            raise
        self.epoch = self.team.epochs.get(0, 0)  # the tuner's launches (same on every rank)

    def write_inputs(self, call: int) -> None:
        for rank in range(self.world):
            for buf, array in zip(self.in_bufs[rank], self.inputs(call, rank), strict=True):
                self.drv.write(self.device, buf, np.ascontiguousarray(array).tobytes())

    def next_epoch(self) -> None:
        """Writes the next epoch into every rank's context (before its launches)."""
        self.epoch += 1
        for rank in range(self.world):
            self.drv.write(self.device, self.contexts[rank][1] + device_abi.EPOCH_OFFSET,
                           struct.pack("<i", self.epoch))

    def launch(self, call: int, ends: list[int] | None = None,
               start: int | None = None) -> None:
        """Every rank's launch of the current epoch, enqueued in a rotating order (a
        different rank first each call) behind a gate that opens once all are enqueued, so
        the ranks start together, as ranks launched by processes of their own can, rather
        than one host launch apart; ``start``: an event recorded as the gate opens;
        ``ends``: an event per rank recorded after its launch."""
        drv = self.drv
        self.releases = self.gate.next_release()
        try:  # (the waits inside: streams already held must be let go if a later one fails)
            for stream in self.streams:
                drv.stream_wait_value(self.device, stream, self.gate.device_address,
                                      self.releases)
            if start is not None:
                drv.event_record(self.device, start, self.streams[0])
            self._enqueue(call, ends)
        finally:  # open the gate even if an enqueue failed (the streams would wait forever)
            self.gate.open(self.releases)

    def _enqueue(self, call: int, ends: list[int] | None) -> None:
        epoch, drv = self.epoch, self.drv
        for rank in [(call + i) % self.world for i in range(self.world)]:
            loaded, values = self.loaded[rank], []
            for kind, index, value, alt, size in loaded.params:
                if kind == ParamKind.OPERAND:
                    values.append(self.in_bufs[rank][index - 1])
                elif kind == ParamKind.STAGED:  # as the FFI handler stages it: on the
                    # launch's stream, before the kernel (a blocking copy would hold the
                    # host, and so every later rank's launch, until the copy ends)
                    slot = device_abi.staging_slot(epoch, value, alt)
                    drv.copy_async(self.device, slot, self.in_bufs[rank][index - 1], size,
                                   self.streams[rank])
                    values.append(slot)
                elif kind == ParamKind.RESULT:
                    values.append(self.out_bufs[rank][index])
                else:
                    values.append(value)
            drv.launch(self.device, loaded.function, loaded.grid, loaded.block,
                       loaded.kernel.metadata.shared, values, self.streams[rank],
                       scratch=loaded.scratch)
            if ends is not None:
                drv.event_record(self.device, ends[rank], self.streams[rank])

    def finish(self, call: int) -> None:
        """Waits for every rank; raises a failure a wait recorded, or (a rank's work not
        done after :func:`finish_seconds`: the GPU is stuck) an error saying so."""
        seconds = finish_seconds()
        stuck = wait_streams(self.drv, self.device, self.streams, seconds)
        if stuck:
            self.stuck = True
            raise StuckError(stuck_message(self.caller, call, stuck, seconds,
                                           self.gate.value(), self.releases))
        failure = cuda_dispatch.take_failure(self.device, self.site.call_id, self.site.label)
        if failure:
            raise RuntimeError(f"{self.caller}, call {call}: {failure}")

    def results(self) -> list[list[np.ndarray]]:
        return [cuda_dispatch.read_outputs(self.device, self.out_bufs[rank], self.site.outputs)
                for rank in range(self.world)]

    def close(self) -> None:
        drv, device = self.drv, self.device
        if self.stuck:  # work still queued would use what is freed: leave all of it
            launch_log.emit(f"{self.caller}: the GPU's work did not finish; its streams, "
                            "buffers and modules are left as they are")
            return
        for stream in self.streams:
            drv.stream_synchronize(device, stream)
            drv.stream_destroy(device, stream)
        for buf in itertools.chain(*self.in_bufs, *self.out_bufs):
            drv.free(device, buf)
        for item in self.loaded:
            item.close()
        if self.site.timeline:  # inside jtd.timeline.record: keep the events
            timeline_capture.harvest(self.site)
        heap.release(self.contexts[0][0] - heap.heap_base(0))


# Past the waits' own limit (JTD_WAIT_TIMEOUT, after which a wait gives up and ends its
# launch), how long a rank's work may still take before the harness calls the GPU stuck.
FINISH_GRACE_S = 30.0


def finish_seconds() -> float:
    """Seconds :meth:`_Job.finish` waits for the ranks' work: twice the waits' limit
    (``JTD_WAIT_TIMEOUT``) plus :data:`FINISH_GRACE_S`. Work still queued then cannot end
    by itself (a wait would have given up): the start gate never opened, or the GPU is
    deadlocked in a way no wait sees."""
    return 2 * settings.wait_timeout() + FINISH_GRACE_S


def wait_streams(drv, device: int, streams: Sequence[int], seconds: float,
                 clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], None] = time.sleep) -> list[int]:
    """Polls ``streams`` until their work has completed or ``seconds`` have passed (it
    never blocks in the driver, so a stuck GPU cannot hang the caller); returns the
    indices of those whose work has not completed (none: all done)."""
    deadline = clock() + seconds
    pending = list(range(len(streams)))
    delay = 1e-5
    while True:
        pending = [i for i in pending if not drv.stream_query(device, streams[i])]
        if not pending or clock() >= deadline:
            return pending
        pause(delay)
        delay = min(2 * delay, 1e-3)


def stuck_message(caller: str, call: int, ranks: Sequence[int], seconds: float, gate: int,
                  releases: int) -> str:
    """What :meth:`_Job.finish` raises when ranks' work did not finish: which ranks, how
    long, and the start gate's state (``gate``: its word; ``releases``: the number the
    last launch's streams wait for)."""
    if gate >= releases:
        state = f"is open ({gate}, awaited {releases}): the launches themselves are stuck"
    else:
        state = f"is still closed ({gate}, awaited {releases}): the host never opened it"
    return (f"{caller}, call {call}: rank(s) {list(ranks)} did not finish within "
            f"{seconds:.0f} s, though every wait gives up after {settings.wait_timeout():.0f} s "
            f"({settings.TIMEOUT_ENV}); the start gate {state}. The GPU's queued work cannot "
            "be cancelled: this job's streams and buffers are left as they are; restart the "
            "process")


def _options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    return {k: int(v) for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
            if v is not None}


def run_ranks(kernel: Any, world: int, inputs: Callable[[int, int], Sequence[np.ndarray]],
              outputs: Sequence[tuple[tuple[int, ...], Any]],
              workspaces: Sequence[tuple[tuple[int, ...], Any]] | Callable,
              grid: Sequence[int] | Callable, kwargs: dict[str, Any], calls: int = 1,
              device: int = 0, symmetric: Sequence[int] = (), num_warps: int | None = None,
              num_stages: int | None = None) -> list:
    """Runs ``calls`` consecutive calls of ``kernel`` on ``world`` ranks of GPU ``device``.

    Args:
      kernel: a ``@triton.jit`` distributed kernel, or one wrapped by
        ``jax_triton_dist.autotune.autotune`` (the ranks then choose a config together
        before the first call, timing each on the first call's inputs).
      world: number of ranks.
      inputs: ``inputs(call, rank)`` returns that rank's input arrays for that call.
      outputs: ``(shape, dtype)`` of each per-rank result.
      workspaces: ``(shape, dtype)`` of each per-rank symmetric workspace (or a function of
        the keyword arguments, a config's included, returning them).
      grid: programs per rank (or a function of the keyword arguments).
      kwargs: the kernel's keyword arguments (constexprs, scalars).
      calls: consecutive calls; workspaces persist and epochs advance as under JAX.
      device: the GPU.
      symmetric: indices of inputs staged into the symmetric heap before each launch
        (``triton_call``'s ``symmetric=``), alternating between two slots by call parity.
      num_warps, num_stages: compile options (defaults 4 and 3; an autotune config's own
        take precedence).

    Returns:
      ``results[call][rank][output]`` as NumPy arrays.

    Inside ``jtd.timeline.record`` the launches are timed (every rank's programs, waits and
    notifies on the GPU's clock), which shows how the ranks' work interleaved on the GPU.
    """
    job = _Job("run_ranks", kernel, world, inputs, outputs, workspaces, grid, kwargs, device,
               symmetric, _options(num_warps, num_stages))
    try:
        results = []
        for call in range(calls):
            if call:
                job.write_inputs(call)
            job.next_epoch()
            job.launch(call)
            job.finish(call)
            results.append(job.results())
        return results
    finally:
        job.close()


def time_ranks(kernel: Any, world: int, inputs: Callable[[int, int], Sequence[np.ndarray]],
               outputs: Sequence[tuple[tuple[int, ...], Any]],
               workspaces: Sequence[tuple[tuple[int, ...], Any]] | Callable,
               grid: Sequence[int] | Callable, kwargs: dict[str, Any], calls: int = 10,
               warmup: int = 2, device: int = 0, symmetric: Sequence[int] = (),
               num_warps: int | None = None, num_stages: int | None = None) -> list[float]:
    """Seconds of each of ``calls`` timed calls of :func:`run_ranks`' job (after
    ``warmup`` untimed ones), on the first call's inputs: from the moment the ranks are
    released together (``_Job.launch``'s gate) to the last rank's end (their makespan).
    Arguments as :func:`run_ranks`."""
    job = _Job("time_ranks", kernel, world, inputs, outputs, workspaces, grid, kwargs,
               device, symmetric, _options(num_warps, num_stages))
    drv = job.drv
    start = drv.event_create(device)
    ends = [drv.event_create(device) for _ in range(world)]
    try:
        for call in range(warmup):
            job.next_epoch()
            job.launch(call)
            job.finish(call)
        seconds = []
        for call in range(calls):
            job.next_epoch()
            job.launch(call, ends, start)
            job.finish(call)
            seconds.append(max(drv.event_elapsed_ms(device, start, end) for end in ends) / 1e3)
        return seconds
    finally:
        for event in (start, *ends):
            drv.event_destroy(device, event)
        job.close()
