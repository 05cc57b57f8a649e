"""Compiled (CUDA) lowering of the distributed primitives.

The rank context comes from the device library that ``device_abi`` generates, linked into
every kernel through Triton's ``extern_libs``; the runtime points the module global
``device_abi.CTX_SYMBOL`` of each loaded copy of a kernel at that rank's context. Waits
spin on acquire loads with a ``%globaltimer`` watchdog: a wait that times out writes the
rank, the flag, the expected and the seen value into the GPU's host-mapped error record
and ends its launch (every rank of the team stops waiting), so a lost signal fails the
call instead of hanging it, and the CUDA context survives.

Used only by ``primitives.py`` (the builtins' compiled branch); not public API.
"""

from __future__ import annotations

import contextlib
import os
import threading

import triton
import triton.language as tl
from triton.language import core

from jax_triton_dist.language import device_abi
from jax_triton_dist.language import timeline as _timeline
from jax_triton_dist.language.compare import fails

LIB_NAME = "libjtd_device"

_SCOPE_PTX = {"cta": "cta", "gpu": "gpu", "sys": "sys"}


NVSHMEM_LIB_NAME = "libjtd_nvshmem"
NVSHMEM_LIB_PATH = os.path.join(os.path.dirname(__file__), "libjtd_nvshmem.ll")


def extern_libs(nvshmem_device_lib: str | None = None) -> dict[str, str]:
    """The ``extern_libs`` option every compiled distributed kernel needs; with NVSHMEM's
    device bitcode (``libnvshmem_device.bc``), also the NVSHMEM wrappers and the bitcode
    (in that order: Triton links each library only for what is still undefined)."""
    libs = {LIB_NAME: device_abi.library_path()}
    if nvshmem_device_lib:
        libs[NVSHMEM_LIB_NAME] = NVSHMEM_LIB_PATH
        libs["libnvshmem_device"] = nvshmem_device_lib
    return libs


def _ctx_call(symbol: str, ret: tl.dtype, args: list, arg_types: tuple, _semantic):
    return core.extern_elementwise(LIB_NAME, device_abi.library_path(), args,
                                   {arg_types: (symbol, ret)},
                                   is_pure=True, _semantic=_semantic)


class NeedsNvshmem(Exception):  # noqa: N818 - a signal to the compiler, not an error
    """Raised while compiling a kernel that makes ``dl.nvshmem`` calls without NVSHMEM's
    device bitcode, when the bitcode is available: compile again with it."""


# How the kernel being compiled (in this thread) lowers the primitives; see `compiling`.
_SETTINGS = {"num_ranks": None, "nvshmem": "absent", "timeline": None}
_settings = threading.local()


def _setting(name: str):
    return getattr(_settings, name, _SETTINGS[name])


@contextlib.contextmanager
def compiling(*, num_ranks: int | None = None, nvshmem: str = "absent",
              timeline: tuple[int, int] | None = None):
    """Lowering of the kernel compiled inside the block.

    Args:
      num_ranks: the launch's rank count, when the compiler knows it (the runtime compiles
        once per call site, and a call site's team has a fixed size): ``dl.num_ranks()``
        becomes a constant, so loops over ranks have constant bounds, and with one rank
        ``dl.rank()`` is the constant 0 and every exchange folds away. None: both are read
        from the rank context at run time.
      nvshmem: how ``dl.nvshmem`` calls compile: ``"linked"`` (NVSHMEM's device bitcode is
        linked), ``"available"`` (it can be: raise :class:`NeedsNvshmem`), or ``"absent"``
        (an error: not the nvshmem backend).
      timeline: ``(offset, capacity)``: the launch is timed; its timeline area is ``offset``
        bytes after the barrier area, ``capacity`` events per program
        (``language/timeline.py``). None: no timeline code is compiled.
    """
    previous = {name: _setting(name) for name in _SETTINGS}
    _settings.num_ranks, _settings.nvshmem = num_ranks, nvshmem
    _settings.timeline = timeline
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(_settings, name, value)


def _itemsize(ptr) -> int:
    """Bytes per element of pointer ``ptr``'s type (1 for booleans)."""
    return max(1, ptr.dtype.element_ty.primitive_bitwidth // 8)


# NVSHMEM's signal operations (nvshmemx_signal_op_t).
_NVSHMEM_SIGNAL_OPS = {"set": 9, "add": 10}


def _nvshmem_call(symbol: str, args: list, types: tuple, _semantic):
    state = _setting("nvshmem")
    if state == "available":
        raise NeedsNvshmem(symbol)
    if state != "linked":
        raise NotImplementedError(
            f"dl.nvshmem: {symbol.removeprefix('jtd_nvshmem_')} is an NVSHMEM device call: it "
            "compiles only for the nvshmem SHMEM backend (one process per GPU, "
            "jax.distributed); with other backends use dl.putmem / dl.getmem / dl.signal_op")
    return core.extern_elementwise(NVSHMEM_LIB_NAME, NVSHMEM_LIB_PATH, args,
                                   {types: (symbol, tl.int32)}, is_pure=False,
                                   _semantic=_semantic)


def _address(ptr, what: str, _semantic):
    if not isinstance(ptr, tl.tensor) or not ptr.dtype.is_ptr() or ptr.type.is_block():
        raise TypeError(f"dl.nvshmem: {what} must be a scalar pointer, got {ptr!r}")
    return core.cast(ptr, tl.int64, bitcast=True, _semantic=_semantic)


def _nbytes(ptr, nelems, _semantic):
    itemsize = _itemsize(ptr)
    count = core.cast(_semantic.to_tensor(nelems), tl.int64, _semantic=_semantic)
    return _semantic.mul(count, _semantic.to_tensor(itemsize), True)


def _pe_of(rank_, _semantic):
    """The NVSHMEM PE of team rank ``rank_`` (from the rank context)."""
    rank_ = core.cast(_semantic.to_tensor(rank_), tl.int32, _semantic=_semantic)
    return _ctx_call("jtd_pe", tl.int32, [rank_], (tl.int32,), _semantic)


def nvshmem_put(dest, source, nelems, peer, sig_addr, signal, sig_op, _semantic):
    i64, i32 = tl.int64, tl.int32
    args = [_address(dest, "dest", _semantic), _address(source, "source", _semantic),
            _nbytes(dest, nelems, _semantic)]
    pe = _pe_of(peer, _semantic)
    if sig_addr is None:
        return _nvshmem_call("jtd_nvshmem_putmem_nbi_block", args + [pe], (i64, i64, i64, i32),
                             _semantic)
    value = core.cast(_semantic.to_tensor(signal), i64, _semantic=_semantic)
    op = _semantic.to_tensor(_NVSHMEM_SIGNAL_OPS[sig_op])
    return _nvshmem_call("jtd_nvshmem_putmem_signal_nbi_block",
                         args + [_address(sig_addr, "sig_addr", _semantic), value, op, pe],
                         (i64, i64, i64, i64, i64, i32, i32), _semantic)


def nvshmem_get(dest, source, nelems, peer, _semantic):
    args = [_address(dest, "dest", _semantic), _address(source, "source", _semantic),
            _nbytes(dest, nelems, _semantic), _pe_of(peer, _semantic)]
    return _nvshmem_call("jtd_nvshmem_getmem_block", args, (tl.int64, tl.int64, tl.int64,
                                                               tl.int32), _semantic)


def nvshmem_signal_op(sig_addr, signal, sig_op, peer, _semantic):
    value = core.cast(_semantic.to_tensor(signal), tl.int64, _semantic=_semantic)
    args = [_address(sig_addr, "sig_addr", _semantic), value,
            _semantic.to_tensor(_NVSHMEM_SIGNAL_OPS[sig_op]), _pe_of(peer, _semantic)]
    return _nvshmem_call("jtd_nvshmem_signal_op", args, (tl.int64, tl.int64, tl.int32,
                                                           tl.int32), _semantic)


def nvshmem_simple(symbol: str, _semantic):
    return _nvshmem_call(f"jtd_nvshmem_{symbol}", [], (), _semantic)


def rank(_semantic):
    if _setting("num_ranks") == 1:
        return _semantic.to_tensor(0)
    return _ctx_call("jtd_rank", tl.int32, [], (), _semantic)


def num_ranks(_semantic):
    n = _setting("num_ranks")
    if n is not None:
        return _semantic.to_tensor(int(n))
    return _ctx_call("jtd_num_ranks", tl.int32, [], (), _semantic)


def epoch(_semantic):
    return _ctx_call("jtd_epoch", tl.int32, [], (), _semantic)


def barrier_area(_semantic):
    area = _ctx_call("jtd_barrier_area", tl.int64, [], (), _semantic)
    return core.cast(area, tl.pointer_type(tl.uint64), _semantic=_semantic)


def heap_base(peer, _semantic):
    peer = core.cast(_semantic.to_tensor(peer), tl.int32, _semantic=_semantic)
    return _ctx_call("jtd_heap_base", tl.int64, [peer], (tl.int32,), _semantic)


# Heap bases are aligned to far more than 16 bytes (CUDA VMM granularity, NVSHMEM heaps),
# so moving a pointer between heaps keeps its alignment. ``symm_at`` moves it with pointer
# arithmetic by a whole number of 16-byte units (``(delta >> 4) << 4`` is ``delta``), which
# Triton's alignment analysis can follow: loads through ``symm_at`` stay vectorised and
# asynchronous (cp.async) like local ones. (Integer casts, or a ``multiple_of`` hint on the
# scalar distance, lose that knowledge.)
_HEAP_ALIGNMENT_LOG2 = 4


def symm_at(ptr, peer, _semantic):
    delta = _semantic.sub(heap_base(peer, _semantic), heap_base(rank(_semantic), _semantic),
                          True)
    itemsize = _itemsize(ptr)
    if itemsize & (itemsize - 1) or itemsize > 1 << _HEAP_ALIGNMENT_LOG2:
        raise TypeError(f"dl.symm_at: unsupported element type {ptr.dtype.element_ty}")
    units = _semantic.ashr(delta, _semantic.to_tensor(_HEAP_ALIGNMENT_LOG2))
    elements = _semantic.shl(
        units, _semantic.to_tensor(_HEAP_ALIGNMENT_LOG2 - (itemsize.bit_length() - 1)))
    return _semantic.add(ptr, elements, True)


def notify(ptr, peer, signal, sig_op: str, scope: str, _semantic, _generator=None):
    if _setting("timeline") is not None:
        record(_timeline.Kind.NOTIFY, peer, _semantic, _generator)
    remote = symm_at(ptr, peer, _semantic)
    value = core.cast(_semantic.to_tensor(signal), remote.dtype.element_ty, _semantic=_semantic)
    update = core.atomic_xchg if sig_op == "set" else core.atomic_add
    # The update is issued by one thread; its release covers the other threads' writes
    # only once a CTA barrier has ordered them before it (bar.sync, then the release).
    _semantic.debug_barrier()
    update(remote, value, sem="release", scope=_SCOPE_PTX[scope], _semantic=_semantic)


def fence(scope: str, _semantic):
    core.inline_asm_elementwise(f"fence.acq_rel.{_SCOPE_PTX[scope]}; mov.u32 $0, 0;", "=r", [],
                                dtype=tl.int32, is_pure=False, pack=1, _semantic=_semantic)


def extern_call(lib_name, lib_path, symbol, args, ret_dtype, is_pure, _semantic):
    types = tuple(_semantic.to_tensor(a).dtype for a in args)
    return core.extern_elementwise(lib_name, lib_path, list(args), {types: (symbol, ret_dtype)},
                                   is_pure=is_pure, _semantic=_semantic)


# ---------------------------------------------------------------------------
# wait: a spin loop with a watchdog, written in Triton
# ---------------------------------------------------------------------------


@core.extern
def _globaltimer(_semantic=None):
    return core.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                       is_pure=False, pack=1, _semantic=_semantic)


@core.extern
def _timeout_ns(_semantic=None):
    return _ctx_call("jtd_timeout_ns", tl.int64, [], (), _semantic)


@core.extern
def _context_address(field, _semantic=None):
    """An address held in the rank context (``error_record``, ``abort_word``) as int64."""
    field = field.value if isinstance(field, tl.constexpr) else field
    return _ctx_call(f"jtd_{field}", tl.int64, [], (), _semantic)


@core.extern
def _site(_semantic=None):
    return _ctx_call("jtd_site", tl.int64, [], (), _semantic)


@core.extern
def _rank(_semantic=None):
    return rank(_semantic)


@core.extern
def _num_ranks(_semantic=None):
    return num_ranks(_semantic)


@core.extern
def _epoch(_semantic=None):
    return epoch(_semantic)


@core.extern
def _on_rank(ptr, peer, _semantic=None):
    return symm_at(ptr, peer, _semantic)


# The error record's fields, as element indices of 32- and 64-bit views (device_abi.RECORD).
_REC_RANK = tl.constexpr(device_abi.record_offset("rank") // 4)
_REC_NUM_RANKS = tl.constexpr(device_abi.record_offset("num_ranks") // 4)
_REC_FLAG = tl.constexpr(device_abi.record_offset("flag_index") // 4)
_REC_EPOCH = tl.constexpr(device_abi.record_offset("epoch") // 4)
_REC_SITE = tl.constexpr(device_abi.record_offset("site") // 8)
_REC_ADDRESS = tl.constexpr(device_abi.record_offset("address") // 8)
_REC_EXPECTED = tl.constexpr(device_abi.record_offset("expected") // 8)
_REC_SEEN = tl.constexpr(device_abi.record_offset("seen") // 8)
_WRITING = tl.constexpr(int(device_abi.RecordStatus.WRITING))
_WRITTEN = tl.constexpr(int(device_abi.RecordStatus.WRITTEN))


@triton.jit
def _announce_timeout(index, flag, target, seen, epoch):
    """Writes the timed-out wait into the GPU's error record (the first wait to time out
    does), then raises every team rank's abort word to ``epoch``: their waits of this call
    end too, and the launch finishes."""
    record = _context_address("error_record")
    if record != 0:
        words = record.to(tl.pointer_type(tl.int32))
        if tl.atomic_cas(words, 0, _WRITING, sem="acq_rel", scope="sys") == 0:
            tl.store(words + _REC_RANK, _rank())
            tl.store(words + _REC_NUM_RANKS, _num_ranks())
            tl.store(words + _REC_FLAG, index)
            tl.store(words + _REC_EPOCH, epoch)
            longs = record.to(tl.pointer_type(tl.int64))
            tl.store(longs + _REC_SITE, _site())
            tl.store(longs + _REC_ADDRESS, flag.to(tl.int64, bitcast=True))
            tl.store(longs + _REC_EXPECTED, target.to(tl.int64))
            tl.store(longs + _REC_SEEN, seen.to(tl.int64))
            tl.atomic_xchg(words, _WRITTEN, sem="release", scope="sys")
    abort = _context_address("abort_word").to(tl.pointer_type(tl.int64))
    for peer in range(0, _num_ranks()):
        tl.atomic_max(_on_rank(abort, peer), epoch.to(tl.int64), sem="release", scope="sys")


@triton.jit
def wait_loop(flag_ptr, n, value, CMP: tl.constexpr, SEM: tl.constexpr, SCOPE: tl.constexpr):
    """Spins until each of ``n`` consecutive flags from ``flag_ptr`` satisfies ``CMP value``,
    or this call is abandoned: the wait times out (it records why and aborts the team) or
    this rank's abort word reaches the call's epoch (a peer's wait timed out)."""
    timeout = _timeout_ns()
    target = tl.cast(value, flag_ptr.dtype.element_ty)
    epoch = _epoch()
    abort = _context_address("abort_word").to(tl.pointer_type(tl.int64))
    for i in range(0, n):
        start = _globaltimer()
        seen = tl.atomic_add(flag_ptr + i, 0, sem=SEM, scope=SCOPE)
        stop = 0
        while fails(seen, target, CMP) & (stop == 0):
            if tl.load(abort, volatile=True) >= epoch:
                stop = 1
            elif _globaltimer() - start > timeout:
                _announce_timeout(i, flag_ptr + i, target, seen, epoch)
                stop = 1
            seen = tl.atomic_add(flag_ptr + i, 0, sem=SEM, scope=SCOPE)
    tl.debug_barrier()
    return 0


def wait(flag_ptrs, n, value, cmp: str, semantic: str, scope: str, _semantic, _generator):
    if flag_ptrs.type.is_block():
        raise ValueError("dl.wait: compiled kernels take a scalar pointer to the first of n "
                         "consecutive flags (a block of flag pointers is CPU-only)")
    sem = "acquire" if semantic in ("acquire", "acq_rel") else "relaxed"
    args = [flag_ptrs, n, value, tl.constexpr(cmp), tl.constexpr(sem),
            tl.constexpr(_SCOPE_PTX[scope])]
    timed = _setting("timeline") is not None
    if timed:
        record(_timeline.Kind.WAIT_START, 0, _semantic, _generator)
    token = _generator.call_JitFunction(wait_loop, args, {})
    if timed:
        record(_timeline.Kind.WAIT_END, 0, _semantic, _generator)
    return token


# ---------------------------------------------------------------------------
# The timeline of a timed launch (language/timeline.py)
# ---------------------------------------------------------------------------


@core.extern
def _timeline_capacity(_semantic=None):
    return _semantic.to_tensor(_setting("timeline")[1])


@core.extern
def _timeline_area(_semantic=None):
    """Address of this program's block of the timeline area, as int64."""
    offset, capacity = _setting("timeline")
    area = _ctx_call("jtd_barrier_area", tl.int64, [], (), _semantic)
    program = _semantic.program_id(0)
    for axis in (1, 2):
        size = _semantic.num_programs(axis - 1) if axis == 1 else _semantic.mul(
            _semantic.num_programs(0), _semantic.num_programs(1), True)
        program = _semantic.add(program, _semantic.mul(_semantic.program_id(axis), size, True),
                                True)
    program = core.cast(program, tl.int64, _semantic=_semantic)
    block = _semantic.mul(program, _semantic.to_tensor(_timeline.program_stride(capacity)),
                          True)
    return _semantic.add(_semantic.add(area, _semantic.to_tensor(offset), True), block, True)


@triton.jit
def record_event(kind, arg):
    """Appends ``(time, kind, epoch, arg)`` to this program's timeline block (a relaxed
    counter picks the slot; events past the capacity are only counted)."""
    block = _timeline_area()
    index = tl.atomic_add(block.to(tl.pointer_type(tl.int64)), 1, sem="relaxed", scope="gpu")
    if index < _timeline_capacity():
        event = (block + 8 + index.to(tl.int64) * 32).to(tl.pointer_type(tl.int64))
        tl.store(event, _globaltimer())
        tl.store(event + 1, tl.cast(kind, tl.int64))
        tl.store(event + 2, _epoch().to(tl.int64))
        tl.store(event + 3, tl.cast(arg, tl.int64))


def record(kind: int, arg, _semantic, _generator) -> None:
    """Emits :func:`record_event` (the kernel is timed)."""
    args = [_semantic.to_tensor(int(kind)), _semantic.to_tensor(arg)]
    _generator.call_JitFunction(record_event, args, {})


def timed() -> bool:
    """Whether the kernel being compiled is timed."""
    return _setting("timeline") is not None
