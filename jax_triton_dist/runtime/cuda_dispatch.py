"""CUDA backend: plans the launches of a call site on one GPU.

The C++ handler (xla_ffi/cuda_launch.cc) calls :func:`plan` on the first call of a
(call site, device). Planning reads the device's mesh coordinates once, joins the team,
allocates the team's symmetric region in the SHMEM heaps (``cuda``: PE ``i`` is GPU ``i``,
every heap reachable from every GPU; ``nvshmem``: one PE per process) with each rank's
context (``device_abi``) at its end, compiles the kernel for the device (once per call
site), loads it, points its context global at the rank's context, and registers the
launch plan. Later calls launch from C++ without Python. ``shmem.finalize`` drops the
plans (after the GPUs finish their work), so the next call plans again in the new heaps.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from typing import Any

import numpy as np

from jax_triton_dist import dtypes, shmem
from jax_triton_dist.language import device_abi
from jax_triton_dist.language.device_abi import ParamKind
from jax_triton_dist.runtime import (
    call_site,
    cuda_compile,
    cuda_driver,
    ir_dump,
    launch_log,
    python_ast,
    site_uses,
    timeline_capture,
    tuning,
)
from jax_triton_dist.shmem import heap, lifetime, nvshmem_bootstrap, rendezvous
from jax_triton_dist.shmem.settings import aligned

try:  # built only where the CUDA headers were found
    from jax_triton_dist import _cuda
except ImportError:  # pragma: no cover - depends on the build machine
    _cuda = None

__all__ = ["plan", "log_launch", "bind_context", "EXIT_GRACE_S", "ensure_shmem", "regions",
           "compile_site", "kernel_params", "Loaded", "Trial", "device_kind", "launcher",
           "error_record", "take_failure", "check_errors"]

_compile_lock = threading.Lock()
_compiled: dict[tuple[int, int], Any] = {}  # (call id, variant index) -> compiled
_planned: dict[tuple[int, int], Any] = {}  # (call id, device) -> the Loaded its plan launches
_init_lock = threading.Lock()
_records: dict[int, tuple[int, int]] = {}  # device -> (host, device) address of its record
EXIT_GRACE_S = 5.0
"""Seconds running plans get to finish at interpreter exit (``ffi_targets`` registers the
launcher's close with the target)."""


def launcher():
    """The ``_cuda`` extension (the FFI handler and its plans), or None in a build without
    the CUDA headers."""
    return _cuda


def _drop_plans() -> None:
    """Before SHMEM releases the heaps: let the GPUs finish, then forget every plan (their
    modules and scratch stay: a handler may still hold a retired plan)."""
    if _cuda is not None and cuda_driver.available():
        for device in _cuda.clear_plans():
            cuda_driver.driver().device_synchronize(device)
    with _compile_lock:
        _planned.clear()


lifetime.on_finalize(_drop_plans)


def _release(call_id: int, site: call_site.CallSite) -> None:
    """A released call site: its devices finish their work, its modules are unloaded."""
    with _compile_lock:
        for key in [k for k in _compiled if k[0] == call_id]:
            del _compiled[key]
    if _cuda is None or not cuda_driver.available():
        return
    drv = cuda_driver.driver()
    for device, _ in _cuda.drop_plans(call_id):
        drv.device_synchronize(device)  # no launch of it still in flight
        with _compile_lock:
            loaded = _planned.pop((call_id, device), None)
        if loaded is not None:
            loaded.close()


call_site.on_release(_release)


def error_record(device: int) -> tuple[int, int]:
    """``(host, device)`` address of GPU ``device``'s error record (host-mapped memory,
    ``device_abi.RECORD``; made on first use, kept for the process)."""
    with _init_lock:
        if device not in _records:
            _records[device] = cuda_driver.driver().host_alloc_mapped(
                device, device_abi.RECORD.size)
        return _records[device]


def take_failure(device: int, site: int | None = None, label: str | None = None) -> str:
    """The failure recorded on GPU ``device`` (of call site ``site``; None: any), emptying
    the record; "" when there is none. ``label`` names the kernel (default: the registered
    call site's)."""
    if device not in _records:
        return ""
    host = _records[device][0]
    raw = ctypes.string_at(host, device_abi.RECORD.size)
    fields = dict(zip((f for f, _ in device_abi.RECORD_FIELDS), device_abi.RECORD.unpack(raw),
                      strict=True))
    if fields["status"] != device_abi.RecordStatus.WRITTEN:
        return ""
    if label is None:
        found = call_site.find(fields["site"])
        label = found.label if found is not None else f"site {fields['site']}"
    return _cuda.take_failure(host, device, 0 if site is None else site, site is None, label)


def check_errors() -> None:
    """Raises the first failure a GPU recorded without trapping (a wait that timed out),
    for every device of this process; the records are emptied.

    Raises:
      RuntimeError: a device recorded one (the message names the GPU, rank, kernel, call,
        flag, expected and seen value).
    """
    failures = [f for f in (take_failure(device) for device in sorted(_records)) if f]
    if failures:
        raise RuntimeError("jax_triton_dist (CUDA): " + "; ".join(failures))


def ensure_shmem(device: int) -> int:
    """Starts SHMEM for the GPU runtime unless it runs, on the backend
    :func:`shmem.init` would choose: ``cuda`` over every local GPU (PE ``i`` = GPU ``i``),
    or ``nvshmem`` when each process of a multi-process job has one GPU. Returns the PE of
    GPU ``device``."""
    with _init_lock:
        if heap.running_backend() is None:
            if lifetime.default_backend() == "nvshmem":
                shmem.init(backend="nvshmem")
            else:
                count = cuda_driver.driver().device_count()
                shmem.init(n_pes=count, backend="cuda", devices=list(range(count)))
    backend = heap.running_backend()
    if backend == "nvshmem":
        pe = heap.process_pe()
        if shmem.device_of(pe) != device:
            raise shmem.ShmemError(
                f"GPU {device} runs a distributed kernel, but this process's NVSHMEM PE {pe} "
                f"is on GPU {shmem.device_of(pe)}")
        return pe
    if backend != "cuda":
        raise shmem.ShmemError(
            f"SHMEM runs the {backend!r} backend, but GPU {device} runs a distributed kernel, "
            "which needs 'cuda' or 'nvshmem': finalize SHMEM before switching platforms")
    if device >= shmem.n_pes() or shmem.device_of(device) != device:
        where = (f"PE {device} is on GPU {shmem.device_of(device)}" if device < shmem.n_pes()
                 else f"there are only {shmem.n_pes()} PEs")
        raise shmem.ShmemError(
            f"GPU {device} runs a distributed kernel as PE {device}, but {where}: initialise "
            "SHMEM with devices=range(number of GPUs), or let the runtime initialise it")
    return device


def regions(site: call_site.CallSite, team: call_site.TeamState) -> list[tuple[int, int]]:
    """Allocates the team's region in the SHMEM heaps, with each member's context after
    the workspaces (written by the member's process); returns ``(region, ctx)`` per rank.

    A team across processes (``team.name`` set) checks that every process reserved the
    same offset and leaves only when every member's region is zeroed and its context
    written, so no rank writes into a peer's region before the peer initialised it.
    """
    total = site.region_layout.total
    offset = call_site.allocate_region(
        site, team, extra=aligned(device_abi.context_size(site.num_ranks)))
    heaps = [heap.heap_base(pe) for pe in team.pes]
    local = call_site.local_pes(team)
    me = team.pes.index(local[0]) if team.name else None
    if team.name:
        offsets = rendezvous.process_gather(f"{team.name}/region", site.num_ranks, me, offset)
        if len(set(offsets)) != 1:
            heap.release(offset)
            raise shmem.ShmemError(
                f"kernel {site.label}: the team's processes reserved different heap offsets "
                f"for its workspaces ({offsets}): every process must run the same kernels in "
                "the same order")
        unreachable = [pe for pe, base in zip(team.pes, heaps, strict=True) if base == 0]
        if unreachable:
            heap.release(offset)
            raise NotImplementedError(
                f"kernel {site.label}: PE(s) {unreachable} of its team are not reachable by "
                f"load/store from PE {local[0]} (another node: no nvshmem_ptr mapping); "
                "kernels across nodes need NVSHMEM device calls, which are not supported yet")
    ctx_offset = offset + aligned(total)
    timeout_ns = int(shmem.wait_timeout() * 1e9)
    layout = site.region_layout
    result = []
    for rank, (pe, base) in enumerate(zip(team.pes, heaps, strict=True)):
        if pe in local:
            ctx = np.frombuffer(device_abi.pack_context(
                rank, site.num_ranks, base + offset + layout.barrier, timeout_ns, heaps,
                team.pes, error_record=error_record(shmem.device_of(pe))[1],
                abort_word=base + offset + layout.abort, site=site.call_id), np.uint8)
            heap.copy(pe, base + ctx_offset, ctx.ctypes.data, ctx.nbytes)
        result.append((base + offset, base + ctx_offset))
    if team.name:
        rendezvous.process_gather(f"{team.name}/ready", site.num_ranks, me, 1)
    return result


def _positional(site: call_site.CallSite) -> list[tuple[str, Any]]:
    kinds = {"array": lambda i: ("pointer", site.inputs[i].dtype),
             "output": lambda i: ("pointer", site.outputs[i].dtype),
             "workspace": lambda i: ("pointer", site.workspaces[i].dtype),
             "scalar": lambda v: ("scalar", v)}
    return [kinds[kind](value) for kind, value in site.params]


def compile_site(site: call_site.CallSite, variant: tuning.Variant):
    """Triton signature and compiled kernel of a call site's variant (compiled once)."""
    key = (site.call_id, site.variants.index(variant))
    with _compile_lock, python_ast.LOCK:  # Triton parses the kernel's source
        if key not in _compiled:
            start = time.perf_counter()
            positional = _positional(site)
            signature, constexprs = cuda_compile.signature_of(site.kernel, positional,
                                                              variant.kwargs)
            attrs = cuda_compile.divisibility(signature, positional, variant.kwargs)
            timeline = ((site.region_layout.timeline, site.timeline) if site.timeline
                        else None)
            kernel = cuda_compile.compile_kernel(
                site.kernel, signature, constexprs, attrs=attrs,
                num_warps=variant.options.get("num_warps", 4),
                num_stages=variant.options.get("num_stages", 3), num_ranks=site.num_ranks,
                nvshmem_device_lib=_nvshmem_device_lib(), timeline=timeline)
            _compiled[key] = (signature, kernel)
            launch_log.compiled(site, time.perf_counter() - start, "cuda sm_90")
        return _compiled[key]


def _nvshmem_device_lib() -> str | None:
    """NVSHMEM's device bitcode when kernels run on the nvshmem backend (so that they may
    make ``dl.nvshmem`` calls), else None."""
    if heap.running_backend() != "nvshmem":
        return None
    return nvshmem_bootstrap.device_library_path()


def _value(type_name: str, value: Any) -> tuple[int, int, int, int, int]:
    raw = struct.pack(dtypes.scalar_format(type_name), value)
    return (ParamKind.VALUE, 0, int.from_bytes(raw.ljust(8, b"\0"), "little"), 0, len(raw))


def kernel_params(site: call_site.CallSite, variant: tuning.Variant, signature: dict[str, str],
                  region: int) -> list[tuple[int, int, int, int, int]]:
    """``(kind, index, value, alt, size)`` per kernel parameter (``ParamKind``): an
    operand, a result, a value, or an operand staged into the symmetric slot ``value``
    (odd epochs: ``alt``) and ``size`` bytes long."""
    layout = site.region_layout
    workspace_offsets, staging = layout.workspaces, layout.staging
    positional = dict(zip(signature, site.params, strict=False))
    params = []
    for name, type_name in signature.items():
        if type_name == "constexpr":
            continue
        kind, value = positional.get(name, ("keyword", variant.kwargs.get(name)))
        # One rank: no peer reads a staged copy (symm_at can only name this rank, which
        # maps any pointer to itself), so the operand is used in place.
        if kind == "array" and value in staging and site.num_ranks > 1:
            even, odd = staging[value]
            params.append((ParamKind.STAGED, value + 1, region + even, region + odd,
                           site.inputs[value].nbytes))
        elif kind == "array":  # operand 0 holds the coordinates
            params.append((ParamKind.OPERAND, value + 1, 0, 0, 8))
        elif kind == "output":
            params.append((ParamKind.RESULT, value, 0, 0, 8))
        elif kind == "workspace":
            params.append((ParamKind.VALUE, 0, region + workspace_offsets[value], 0, 8))
        else:
            params.append(_value(type_name, value))
    return params


def bind_context(device: int, module: int, kernel: Any, ctx: int) -> None:
    """Points the loaded module's context global at ``ctx`` (kernels that use no
    distributed primitive have no such global)."""
    if f" {device_abi.CTX_SYMBOL};" not in kernel.asm["ptx"]:
        return
    drv = cuda_driver.driver()
    address, _ = drv.module_global(device, module, device_abi.CTX_SYMBOL)
    drv.write(device, address, struct.pack("<Q", ctx))


def _check_team_fits(site: call_site.CallSite) -> None:
    import jax

    local = jax.local_device_count()
    if jax.process_count() > 1 and site.num_ranks > local > 1:
        raise NotImplementedError(
            f"kernel {site.label}: its team has {site.num_ranks} ranks but this process drives "
            f"{local} GPUs: a team spans processes only with one GPU per process (the "
            "nvshmem backend); lay the kernel's mesh axis out within each process, or start "
            "one process per GPU")


class Loaded:
    """A variant compiled and loaded on one device (a module of its own), its rank context
    bound; what a launch of it needs. ``sharing``: ranks of the team on this device (a
    co-resident variant's programs of all of them must fit at once)."""

    def __init__(self, site: call_site.CallSite, variant: tuning.Variant, device: int,
                 region: int, ctx: int, sharing: int = 1):
        drv = cuda_driver.driver()
        self.signature, self.kernel = compile_site(site, variant)
        self.module, self.function = drv.load_function(
            device, self.kernel.asm["cubin"], self.kernel.metadata.name,
            self.kernel.metadata.shared)
        if variant.co_resident:
            fits = drv.resident_programs(device, self.function,
                                         32 * self.kernel.metadata.num_warps,
                                         self.kernel.metadata.shared)
            if variant.programs * sharing > fits:
                drv.module_unload(device, self.module)
                raise ValueError(
                    f"kernel {site.label}: its programs wait on each other (co_resident), but "
                    f"{variant.programs} programs x {sharing} rank(s) on GPU {device} do not "
                    f"fit on it at once (it holds {fits} of them): use a grid of at most "
                    f"{fits // sharing} programs")
        bind_context(device, self.module, self.kernel, ctx)
        if cuda_compile.uses_nvshmem(self.kernel):
            heap.init_nvshmem_module(self.module)
        self.device = device
        self.grid = list(variant.grid) + [1] * (3 - len(variant.grid))
        self.block = 32 * self.kernel.metadata.num_warps
        self.params = kernel_params(site, variant, self.signature, region)
        # Triton's global scratch (TMA descriptors made on the device): per program.
        per_program = getattr(self.kernel.metadata, "global_scratch_size", 0) or 0
        self.scratch = drv.alloc(device, per_program * variant.programs) if per_program else 0

    def close(self) -> None:
        """Unloads the module and frees the scratch (no launch of them may be in flight)."""
        drv = cuda_driver.driver()
        drv.module_unload(self.device, self.module)
        if self.scratch:
            drv.free(self.device, self.scratch)


class Trial(tuning.Trial):
    """The autotuner's timing of one variant by one rank on ``device``, on the call's
    buffers (``args[0]``: the coordinates): the median of the tuner's timed launches
    (CUDA events, a stream of its own). The rank's epochs (``team.epochs[rank]``) advance
    by the launches it makes, whether the variant runs or fails."""

    def __init__(self, site: call_site.CallSite, team: call_site.TeamState, rank: int,
                 device: int, region: int, ctx: int, args: list[int], rets: list[int],
                 index: int):
        self.site, self.device, self.ctx, self.args, self.rets = site, device, ctx, args, rets
        tuner = site.tuner
        self.first = team.epochs.get(rank, 0) + 1
        team.epochs[rank] = self.first + tuner.warmup + tuner.rep - 1
        self.stream = None
        self.loaded = Loaded(site, site.variants[index], device, region, ctx,
                             _sharing(team, device))

    def run(self) -> float:
        self.start()
        return self.finish()

    def start(self) -> None:
        """Enqueues the timed launches (returns at once: the ranks one thread drives start
        one after another, then finish)."""
        drv, loaded, tuner = cuda_driver.driver(), self.loaded, self.site.tuner
        self.stream = drv.stream_create(self.device)
        self.handle = _cuda.time_launches(
            self.device, loaded.function, loaded.grid, loaded.block,
            loaded.kernel.metadata.shared, loaded.params, self.ctx + device_abi.EPOCH_OFFSET,
            self.first, self.args, self.rets, tuner.warmup, tuner.rep, self.stream,
            loaded.scratch)

    def finish(self) -> float:
        """Waits for the launches; seconds per launch."""
        drv = cuda_driver.driver()
        try:
            ms = _cuda.timed_results(self.handle)
        finally:
            drv.stream_synchronize(self.device, self.stream)
            drv.stream_destroy(self.device, self.stream)
        failure = take_failure(self.device, self.site.call_id, self.site.label)
        if failure:
            raise RuntimeError(failure)
        return float(np.median(ms)) / 1e3

    def outputs(self) -> list[np.ndarray]:
        """This rank's outputs as the timed launches left them (after :meth:`finish`)."""
        return read_outputs(self.device, self.rets, self.site.outputs)

    def close(self) -> None:
        self.loaded.close()


def read_outputs(device: int, addresses: list[int], specs) -> list[np.ndarray]:
    """Host copies of the results at ``addresses`` on GPU ``device``, one per spec (shape,
    dtype) of ``specs`` (a call site's outputs)."""
    drv = cuda_driver.driver()
    return [np.frombuffer(drv.read(device, address, spec.nbytes), spec.dtype)
            .reshape(spec.shape) for address, spec in zip(addresses, specs, strict=True)]


def _sharing(team: call_site.TeamState, device: int) -> int:
    """Ranks of ``team`` on GPU ``device`` (several when PEs share a GPU)."""
    if heap.running_backend() == "nvshmem":
        return 1  # one PE per process; PEs sharing a GPU are other processes' business
    return sum(1 for pe in team.pes if lifetime.device_of(pe) == device)


def device_kind(device: int) -> str:
    """JAX's ``device_kind`` of local GPU ``device`` (what the autotuner's cache keys on)."""
    import jax

    kinds = {d.id: d.device_kind for d in jax.local_devices(backend="gpu")}
    return kinds.get(device, next(iter(kinds.values()), "gpu"))


def _plan(call_id: int, device: int, args: list[int], rets: list[int]) -> None:
    site = call_site.lookup(call_id)
    _check_team_fits(site)
    pe = ensure_shmem(device)
    drv = cuda_driver.driver()
    if not site.teams:
        site_uses.drain()  # regions of executables that are gone make room first
    raw = drv.read(device, args[0], 4 * len(site.mesh_axes))
    coords = tuple(int(c) for c in np.frombuffer(raw, np.int32))
    if heap.process_pe() >= 0:  # nvshmem: this process holds one rank of each team
        rank, team = site.join_processes(coords, pe, f"site{call_id}",
                                         rendezvous.process_gather, regions)
    else:
        rank, team = site.join(coords, device, shmem.wait_timeout(), regions)
    region, ctx = team.region[rank]
    variant = site.choose(team, rank, "gpu", device_kind(device) if site.tuner else "gpu",
                          lambda index: Trial(site, team, rank, device, region, ctx, args,
                                              rets, index))
    loaded = Loaded(site, variant, device, region, ctx, _sharing(team, device))
    ir_dump.dump(site, variant, device, loaded.kernel, loaded.signature, "cuda")
    launch_log.plan(site, variant, device, rank, team, heap.running_backend())
    if site.timeline:
        timeline_capture.planned_on_gpu(site)
    with _compile_lock:
        _planned[(call_id, device)] = loaded
    _cuda.set_plan(call_id, device, loaded.module, loaded.function, loaded.grid, loaded.block,
                   loaded.kernel.metadata.shared, loaded.params, ctx + device_abi.EPOCH_OFFSET,
                   error_record(device)[0], site.label,
                   rank if launch_log.enabled("launch") else -1, team.epochs.get(rank, 0),
                   loaded.scratch)


def log_launch(call_id: int, device: int, rank: int, epoch: int) -> None:
    """A launch of a plan registered with logging on (``JTD_LOG=launch``); called by the
    launcher after it enqueued the kernel."""
    site = call_site.find(call_id)
    if site is not None:
        team = next((t for t in site.teams.values() if rank < len(t.pes)
                     and t.pes[rank] is not None
                     and lifetime.device_of(t.pes[rank]) == device), None)
        launch_log.launch(site.label, call_id, device, rank, site.num_ranks,
                          tuple(team.pes) if team else (), epoch,
                          site.variant(team, rank).grid if team else ())


def plan(call_id: int, device: int, args: list[int], rets: list[int]) -> str | None:
    """Plans (call site, device) at its first call, whose buffer addresses are ``args``
    (``args[0]``: the coordinates) and ``rets``; returns None, or the message of the
    failure."""
    try:
        _plan(call_id, device, args, rets)
    except Exception as error:  # reported to XLA, which raises it in the caller
        return f"GPU {device}: {type(error).__name__}: {error}"
    return None
