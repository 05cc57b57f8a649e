"""Distributed primitives of the kernel language: the backend-specific layer.

Each primitive is a Triton builtin with one implementation per backend family:

* interpreter (CPU backend): reads the launch's :class:`RankContext` and
  operates on host memory through the SHMEM extension;
* compiled for CUDA (Triton 3.6, builtins get ``_semantic``): emits Triton IR through
  ``compiled.py`` (the rank context comes from a small device library linked into the
  kernel);
* compiled for Ascend (triton-ascend, Triton 3.2, builtins get ``_builder``): emits
  Triton IR through ``ascend.py`` (rank, epoch and heap bases as trailing kernel
  arguments, or ACLSHMEM calls).

Everything else in ``jax_triton_dist.language`` is written in Triton on top of
these, so a kernel has one source for every backend. The module needs only Triton and
NumPy at import (the SHMEM extension is loaded when an interpreted kernel first waits
or signals), so the Ascend lowering can load kernels where the project is not built.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp

from jax_triton_dist.language import ascend as _ascend
from jax_triton_dist.language import bounds
from jax_triton_dist.language import compiled as _compiled
from jax_triton_dist.language import timeline as _timeline
from jax_triton_dist.language.context import current
from jax_triton_dist.shmem.signals import Cmp, SignalOp

__all__ = [
    "rank", "num_ranks", "epoch", "symm_at", "wait", "notify", "consume_token", "fence",
    "barrier_area", "extern_call", "register_interpreter_extern",
    "CMPS", "SIG_OPS", "SCOPES", "SEMANTICS",
]

CMPS = {cmp.name.lower(): cmp for cmp in Cmp}
"""``cmp`` of ``dl.wait``: ``"eq"``, ``"ne"``, ``"gt"``, ``"ge"``, ``"lt"``, ``"le"``."""
SIG_OPS = {op.name.lower(): op for op in SignalOp}
"""``sig_op`` of ``dl.notify``: ``"set"``, ``"add"``."""
SCOPES = ("cta", "gpu", "sys")
"""Memory scopes of waits, notifies and fences."""
SEMANTICS = ("acquire", "relaxed", "release", "acq_rel")
"""Memory semantics of ``dl.wait``."""


def _unwrap(value):
    return value.value if isinstance(value, tl.constexpr) else value


def _interpreting(semantic) -> bool:
    return semantic is None or isinstance(semantic.builder, _interp.InterpreterBuilder)


def _host_atomics():
    """The host-memory atomics of the interpreted primitives (the SHMEM extension)."""
    from jax_triton_dist.shmem import host_atomics

    return host_atomics


def _check_choice(value, choices, what: str, fn: str) -> None:
    if value not in choices:
        raise ValueError(f"dl.{fn}: {what} must be one of {list(choices)}, got {value!r}")


def _primitive(interpret: Callable, *, choices: Mapping[str, tuple] | None = None,
               name: str | None = None) -> Callable:
    """Makes a builtin whose interpreter implementation is ``interpret``.

    The decorated function is the CUDA implementation; it receives ``_semantic`` and
    ``_generator`` (the code generator) and plain Python values for constexprs. The
    Ascend implementation is the function of the same name in ``ascend.py`` (it receives
    ``_builder`` instead of ``_semantic``). ``choices`` maps parameters to their allowed
    values, checked once, before any implementation runs (``name``: the primitive's name
    in messages, default the function's).
    """

    def decorator(compiled: Callable) -> Callable:
        signature = inspect.signature(compiled)
        label = name or compiled.__name__

        @functools.wraps(compiled)
        def builtin(*args, _semantic=None, _builder=None, _generator=None, **kwargs):
            args = [_unwrap(a) for a in args]
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            if choices:
                bound = signature.bind_partial(*args, **kwargs)
                bound.apply_defaults()
                for param, allowed in choices.items():
                    _check_choice(bound.arguments[param], allowed, param, label)
            if _builder is not None:  # Triton 3.2 code generation: triton-ascend
                return _ascend.lowering(label)(*args, _builder=_builder,
                                               _generator=_generator, **kwargs)
            if _interpreting(_semantic):
                return interpret(*args, **kwargs)
            return compiled(*args, _semantic=_semantic, _generator=_generator, **kwargs)

        setattr(builtin, tl.core.TRITON_BUILTIN, True)
        return builtin

    return decorator


# ---------------------------------------------------------------------------
# Interpreter helpers
# ---------------------------------------------------------------------------


def _scalar(value, dtype: tl.dtype) -> tl.tensor:
    np_dtype = _interp._get_np_dtype(dtype)
    return tl.tensor(_interp.TensorHandle(np.array([value], dtype=np_dtype), dtype), dtype)


def _ints(value) -> np.ndarray:
    if isinstance(value, tl.tensor):
        return np.asarray(value.handle.data).astype(np.int64)
    return np.asarray(value, dtype=np.int64)


def _scalar_int(value, what: str) -> int:
    data = _ints(value).reshape(-1)
    if data.size != 1:
        raise ValueError(f"{current().who()}: {what} must be a scalar, got shape {data.shape}")
    return int(data[0])


def _pointer_data(ptr, fn: str) -> tuple[np.ndarray, tl.dtype]:
    if not isinstance(ptr, tl.tensor) or not ptr.dtype.is_ptr():
        raise TypeError(f"{current().who()}: dl.{fn} expects a pointer, got {ptr!r}")
    return np.asarray(ptr.handle.data, dtype=np.uint64), ptr.dtype.element_ty


def _check_in_heap(addresses: np.ndarray, fn: str) -> None:
    ctx = current()
    base = int(ctx.heap_bases[ctx.rank])
    lo, hi = int(addresses.min()), int(addresses.max())
    if lo < base or hi >= base + ctx.heap_size:
        bad = lo if lo < base else hi
        raise ValueError(
            f"{ctx.who()}: dl.{fn}: address 0x{bad:x} is not in this rank's symmetric heap "
            f"[0x{base:x}, 0x{base + ctx.heap_size:x}); only symmetric buffers (workspaces, "
            "symmetric arguments) can be addressed on peers"
        )


def _translate(addresses: np.ndarray, peer, fn: str) -> np.ndarray:
    ctx = current()
    peers = _ints(peer)
    if peers.size and (peers.min() < 0 or peers.max() >= ctx.num_ranks):
        bad = int(peers.min() if peers.min() < 0 else peers.max())
        raise ValueError(
            f"{ctx.who()}: dl.{fn}: peer {bad} is out of range [0, {ctx.num_ranks})"
        )
    _check_in_heap(addresses, fn)
    delta = ctx.heap_bases[peers].astype(np.int64) - np.int64(ctx.heap_bases[ctx.rank])
    return (addresses.astype(np.int64) + delta).astype(np.uint64)


# ---------------------------------------------------------------------------
# Rank queries
# ---------------------------------------------------------------------------


@_primitive(lambda: _scalar(current().rank, tl.int32))
def rank(_semantic=None, _generator=None):
    """This device's rank along the kernel's mesh axis (``int32``)."""
    return _compiled.rank(_semantic)


@_primitive(lambda: _scalar(current().num_ranks, tl.int32))
def num_ranks(_semantic=None, _generator=None):
    """Number of ranks along the kernel's mesh axis (``int32``)."""
    return _compiled.num_ranks(_semantic)


@_primitive(lambda: _scalar(current().epoch, tl.int32))
def epoch(_semantic=None, _generator=None):
    """How many times this call site has run on this rank, this run included (from 1).

    Every rank sees the same sequence, so a kernel can write flags with the epoch as
    value and wait for ``>= epoch``: flags never need a reset between calls.
    """
    return _compiled.epoch(_semantic)


@_primitive(lambda: _scalar(current().barrier_area, tl.pointer_type(tl.uint64)))
def barrier_area(_semantic=None, _generator=None):
    """This rank's ``num_ranks`` uint64 counters that ``barrier_all`` uses."""
    return _compiled.barrier_area(_semantic)


# ---------------------------------------------------------------------------
# Addressing, signalling and waiting
# ---------------------------------------------------------------------------


def _symm_at_interp(ptr, peer):
    data, _ = _pointer_data(ptr, "symm_at")
    moved = _translate(data, peer, "symm_at")
    if moved.shape != data.shape:
        raise ValueError(
            f"{current().who()}: dl.symm_at: peer of shape {moved.shape} does not match the "
            f"pointer's shape {data.shape}"
        )
    return tl.tensor(_interp.TensorHandle(moved, ptr.handle.dtype), ptr.type)


@_primitive(_symm_at_interp)
def symm_at(ptr, peer, _semantic=None, _generator=None):
    """Address on rank ``peer`` of the symmetric address ``ptr`` (scalar or block)."""
    return _compiled.symm_at(ptr, peer, _semantic)


def _flag_addresses(flag_ptrs, n, fn: str) -> tuple[list[int], tl.dtype]:
    data, element = _pointer_data(flag_ptrs, fn)
    if not element.is_int() or element.primitive_bitwidth not in (32, 64):
        raise TypeError(
            f"{current().who()}: dl.{fn}: flags must be 32- or 64-bit integers, got {element}"
        )
    itemsize = element.primitive_bitwidth // 8
    if data.size == 1:
        base = int(data.reshape(-1)[0])
        return [base + i * itemsize for i in range(n)], element
    if n > data.size:
        raise ValueError(f"{current().who()}: dl.{fn}: n={n} flags but {data.size} pointers given")
    return [int(a) for a in data.reshape(-1)[:n]], element


def _wait_interp(flag_ptrs, n=1, scope="gpu", semantic="acquire", value=1, cmp="eq"):
    ctx = current()
    count = _scalar_int(n, "n")
    addresses, element = _flag_addresses(flag_ptrs, count, "wait")
    expected = _scalar_int(value, "value")
    itemsize = element.primitive_bitwidth // 8
    bounds.check(np.array(addresses, np.uint64), None, itemsize, "dl.wait", str(element))
    who = f"{ctx.who()}: dl.wait(cmp={cmp!r})"
    _timeline.record_interpreted(_timeline.Kind.WAIT_START)
    _host_atomics().wait_flags(addresses, itemsize, element.is_int_signed(), CMPS[cmp],
                               expected, ctx.timeout, who, ctx.abort_word, ctx.epoch,
                               ctx.run_abort_word)
    _timeline.record_interpreted(_timeline.Kind.WAIT_END)
    return _scalar(0, tl.int32)


@_primitive(_wait_interp, choices={"scope": SCOPES, "semantic": SEMANTICS, "cmp": CMPS})
def wait(flag_ptrs, n=1, scope="gpu", semantic="acquire", value=1, cmp="eq", _semantic=None,
         _generator=None):
    """Spins until each of ``n`` flags compares true with ``value``; returns a token.

    Args:
      flag_ptrs: a pointer to the first of ``n`` consecutive flags, or a block of flag
        pointers (the first ``n`` are waited on). Flags are 32- or 64-bit integers.
      n: number of flags.
      scope: ``"cta"``, ``"gpu"`` or ``"sys"`` (memory scope of the acquire).
      semantic: ``"acquire"`` (default) or ``"relaxed"``.
      value: the value to compare with.
      cmp: ``"eq"`` (default), ``"ne"``, ``"gt"``, ``"ge"``, ``"lt"`` or ``"le"``.

    A wait that is not satisfied within the timeout (``JTD_WAIT_TIMEOUT``, default 60 s)
    fails with the rank, the flag index and address, the expected and the seen value.
    """
    return _compiled.wait(flag_ptrs, n, value, cmp, semantic, scope, _semantic, _generator)


def _notify_interp(ptr, peer, signal=1, sig_op="set", scope="gpu"):
    data, element = _pointer_data(ptr, "notify")
    if not element.is_int() or element.primitive_bitwidth not in (32, 64):
        raise TypeError(f"{current().who()}: dl.notify: flags must be 32- or 64-bit integers, "
                        f"got {element}")
    value = _scalar_int(signal, "signal") & ((1 << element.primitive_bitwidth) - 1)
    remote = _translate(data, peer, "notify")
    bounds.check(remote, None, element.primitive_bitwidth // 8, "dl.notify", str(element))
    peers = _ints(peer).reshape(-1)
    _timeline.record_interpreted(_timeline.Kind.NOTIFY, int(peers[0]) if peers.size == 1 else -1)
    for address in remote.reshape(-1):
        _host_atomics().signal_op(int(address), value, SIG_OPS[sig_op],
                               element.primitive_bitwidth // 8)


@_primitive(_notify_interp, choices={"sig_op": SIG_OPS, "scope": SCOPES})
def notify(ptr, peer, signal=1, sig_op="set", scope="gpu", _semantic=None, _generator=None):
    """Sets (``sig_op="set"``) or adds to (``"add"``) the flag ``ptr`` on rank ``peer``.

    The update has release semantics: writes made before it are visible to a rank that
    observes the flag with ``wait``.
    """
    return _compiled.notify(ptr, peer, signal, sig_op, scope, _semantic, _generator)


@_primitive(lambda x, token: x)
def consume_token(x, token, _semantic=None, _generator=None):
    """Returns ``x``, ordered after the ``wait`` that produced ``token``.

    (The wait's acquire loads and the barrier that ends it already order later loads.)
    """
    return x


def _fence_interp(scope="gpu"):
    _host_atomics().fence()


@_primitive(_fence_interp, choices={"scope": SCOPES})
def fence(scope="gpu", _semantic=None, _generator=None):
    """Orders this program's earlier memory operations before its later ones."""
    return _compiled.fence(scope, _semantic)


# ---------------------------------------------------------------------------
# Calls into external device libraries
# ---------------------------------------------------------------------------

_interpreter_externs: dict[str, Callable] = {}


def register_interpreter_extern(symbol: str, fn: Callable[..., np.ndarray]) -> None:
    """Registers the interpreter's implementation of extern ``symbol``.

    ``fn`` receives the arguments as NumPy arrays and returns a NumPy array.
    """
    _interpreter_externs[symbol] = fn


def _extern_interp(lib_name, lib_path, symbol, args, ret_dtype, is_pure=True):
    fn = _interpreter_externs.get(symbol)
    if fn is None:
        raise NotImplementedError(
            f"dl.extern_call: '{symbol}' from {lib_name} has no interpreter implementation; "
            "register one with jax_triton_dist.language.register_interpreter_extern"
        )
    arrays = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(a) for a in args]
    result = np.asarray(fn(*arrays), dtype=_interp._get_np_dtype(ret_dtype))
    if result.ndim == 0:
        return _scalar(result.item(), ret_dtype)
    shape = [int(s) for s in result.shape]
    return tl.tensor(_interp.TensorHandle(result, ret_dtype), tl.block_type(ret_dtype, shape))


@_primitive(_extern_interp)
def extern_call(lib_name, lib_path, symbol, args, ret_dtype, is_pure=True, _semantic=None,
                _generator=None):
    """Calls ``symbol`` of the device library ``lib_name`` (at ``lib_path``).

    On compiled backends the library is linked into the kernel; in the interpreter
    the function registered with :func:`register_interpreter_extern` runs instead.
    """
    return _compiled.extern_call(lib_name, lib_path, symbol, args, ret_dtype, is_pure,
                                 _semantic)
