"""Ascend lowering of the distributed primitives (triton-ascend: Triton 3.2 builtins).

Under triton-ascend's code generator a ``dl`` builtin receives ``_builder`` (not
``_semantic``) and ``primitives.py`` sends it here, to the function of the same name.
Two mappings, chosen with :func:`compiling`:

* ``"args"`` — what the published compiler lowers today: the rank context is a set of
  trailing kernel arguments (``device_abi.ASCEND_TRAILING_ARGS``). The primitives emit
  *placeholders* — calls of externs named ``jtd_<argument>`` with no operands — that the
  Ascend lowering (``jax_triton_dist.ascend.lowering``) replaces by those arguments after
  ``make_ttir``. ``symm_at`` moves a pointer by the difference of two heap bases of the
  table; ``notify`` is a block barrier, then a store (``"set"``) or an ``atomic_add``
  whose result is unused (``"add"``: it lowers to an atomic-add store to global memory;
  a fetch-and-add, whose result is used, triton-ascend emulates under a launch-local lock,
  which is not atomic across devices); ``wait`` spins on a volatile *block* load of
  ``ASCEND_WAIT_LANES`` flags and tests the first (a scalar load, even volatile, is served
  from the scalar cache; a spin on a non-volatile load is deleted).
* ``"aclshmem"`` — the form an NPU with ACLSHMEM runs: the primitives emit externs named
  ``jtd_acl_<call>`` with scalar operands (pointer operands fail in the adapter: addresses
  travel as integers), which the lowering rewrites after ``ttir_to_linalg`` into
  ``hivm.hir.custom "dist.aclshmem_*"`` calls on the flag's memref. What cannot take that
  form (a ``symm_at`` with a block of peers, an ``"add"`` on a 64-bit flag) keeps the
  ``"args"`` form; :func:`forms` records, per primitive, which form it took and why.

Triton 3.2 and 3.6 share the ``triton.language`` surface that the helpers below use; the
builtins call only what both versions have, at code-generation time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import triton
import triton.language as tl
from triton.language import core
from triton.language import semantic as _tl_semantic

from jax_triton_dist.language.compare import fails
from jax_triton_dist.language.device_abi import ASCEND_WAIT_LANES

__all__ = ["MAPPINGS", "PLACEHOLDER_LIB", "ACLSHMEM_CMP", "ACLSHMEM_SIGNAL_OP", "compiling",
           "forms", "lowering"]

MAPPINGS = ("args", "aclshmem")
PLACEHOLDER_LIB = "jtd_ascend"
"""Library name of every placeholder extern (the lowering rewrites them all away)."""

# ACLSHMEM's enums (aclshmem_cmp_op_type_t, aclshmem_signal_op_type_t in its device
# header), from the project's names: the same numbers today, kept as a table per backend.
ACLSHMEM_CMP = {"eq": 0, "ne": 1, "gt": 2, "ge": 3, "lt": 4, "le": 5}
ACLSHMEM_SIGNAL_OP = {"set": 0, "add": 1}


@dataclasses.dataclass
class _Lowering:
    """How the kernel being compiled in this thread lowers the primitives."""

    mapping: str = "args"
    num_ranks: int | None = None
    force_args: frozenset[str] = frozenset()  # primitives kept in the "args" form
    forms: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def aclshmem(self, primitive: str) -> bool:
        """Whether ``primitive`` takes its ACLSHMEM form."""
        return self.mapping == "aclshmem" and primitive not in self.force_args


_state = threading.local()


def _current() -> _Lowering:
    lowering = getattr(_state, "lowering", None)
    if lowering is None:
        raise RuntimeError("dl primitives are being compiled for Ascend outside "
                           "jax_triton_dist.language.ascend.compiling()")
    return lowering


@contextlib.contextmanager
def compiling(*, mapping: str = "args", num_ranks: int | None = None,
              force_args: frozenset[str] = frozenset()) -> Iterator[_Lowering]:
    """Lowering of the kernel compiled (with triton-ascend) inside the block.

    Args:
      mapping: ``"args"`` or ``"aclshmem"`` (see the module docstring).
      num_ranks: the rank count, compiled in as a constant (None: read at run time).
      force_args: primitives that keep the ``"args"`` form under ``"aclshmem"``.

    Yields:
      The lowering state; its ``forms`` say what each primitive became.
    """
    if mapping not in MAPPINGS:
        raise ValueError(f"ascend mapping must be one of {MAPPINGS}, got {mapping!r}")
    previous = getattr(_state, "lowering", None)
    _state.lowering = _Lowering(mapping, num_ranks, frozenset(force_args))
    try:
        yield _state.lowering
    finally:
        _state.lowering = previous


def forms() -> dict[str, dict[str, str]]:
    """``{primitive: {form: reason}}`` recorded while compiling the current kernel."""
    return _current().forms


def _record(primitive: str, form: str, reason: str) -> None:
    _current().forms.setdefault(primitive, {})[form] = reason


# ---------------------------------------------------------------------------
# Placeholders
# ---------------------------------------------------------------------------


def _placeholder(name: str, dtype, args: list, types: tuple, pure: bool, _builder):
    return core.extern_elementwise(PLACEHOLDER_LIB, "", list(args), {types: (f"jtd_{name}", dtype)},
                                   is_pure=pure, _builder=_builder)


def _argument(name: str, dtype, _builder):
    """The trailing kernel argument ``name`` (a placeholder until the lowering)."""
    return _placeholder(name, dtype, [], (), True, _builder)


def _int(value, dtype, _builder):
    value = value.value if isinstance(value, tl.constexpr) else value
    return core.cast(_tl_semantic.to_tensor(value, _builder), dtype, _builder=_builder)


def _acl(symbol: str, dtype, args: list, types: tuple, pure: bool, _builder):
    """A placeholder of the ACLSHMEM call ``symbol`` (rewritten after ttir_to_linalg)."""
    return _placeholder(f"acl_{symbol}", dtype, args, types, pure, _builder)


def _itemsize(ptr) -> int:
    return max(1, ptr.dtype.element_ty.primitive_bitwidth // 8)


def _flag_type(ptr, fn: str):
    element = ptr.dtype.element_ty
    if not element.is_int() or element.primitive_bitwidth not in (32, 64):
        raise TypeError(f"dl.{fn}: flags must be 32- or 64-bit integers, got {element}")
    return element


def _scalar_pointer(ptr, fn: str):
    if not isinstance(ptr, tl.tensor) or not ptr.dtype.is_ptr():
        raise TypeError(f"dl.{fn} expects a pointer, got {ptr!r}")
    if ptr.type.is_block():
        raise ValueError(f"dl.{fn}: Ascend kernels take a scalar pointer to the first of n "
                         "consecutive flags (a block of flag pointers is CPU-only)")


# ---------------------------------------------------------------------------
# Helpers in Triton (pure tl: the same source under Triton 3.2 and 3.6)
# ---------------------------------------------------------------------------


@triton.jit
def _shifted(ptr, delta, SHIFT: tl.constexpr):
    """``ptr`` moved by ``delta`` bytes (a multiple of its element size)."""
    return ptr + (delta >> SHIFT)


@triton.jit
def _heap_delta(heaps, peer, me):
    """Bytes from this rank's heap to ``peer``'s (scalar or block ``peer``)."""
    return tl.load(heaps + peer) - tl.load(heaps + me)


@triton.jit
def _store_flag(ptr, value):
    tl.store(ptr, value.to(ptr.dtype.element_ty))


@triton.jit
def _add_flag(ptr, value):
    tl.atomic_add(ptr, value.to(ptr.dtype.element_ty))


@triton.jit
def _first_lane(flag_ptr, LANES: tl.constexpr):
    """The flag at ``flag_ptr``, read with a volatile block load of ``LANES`` flags."""
    lanes = tl.arange(0, LANES)
    seen = tl.load(flag_ptr + lanes, volatile=True)
    return tl.sum(tl.where(lanes == 0, seen, 0), 0)


@triton.jit
def _spin(flag_ptr, n, value, CMP: tl.constexpr, LANES: tl.constexpr):
    """Spins until each of ``n`` consecutive flags satisfies ``CMP value``."""
    target = value.to(flag_ptr.dtype.element_ty)
    for i in range(0, n):
        seen = _first_lane(flag_ptr + i, LANES)
        while fails(seen, target, CMP):
            seen = _first_lane(flag_ptr + i, LANES)
    tl.debug_barrier()
    return 0


# ---------------------------------------------------------------------------
# The primitives (names and parameters as in primitives.py, with _builder)
# ---------------------------------------------------------------------------


def _team(_builder):
    return _argument("team", tl.int32, _builder)


def rank(_builder=None, _generator=None):
    lowering = _current()
    if lowering.num_ranks == 1:
        _record("rank", "constant", "one rank: rank 0")
        return _tl_semantic.to_tensor(0, _builder)
    if lowering.aclshmem("rank"):
        _record("rank", "aclshmem_team_my_pe", "the rank in the team of the kernel's axis")
        return _acl("team_my_pe", tl.int32, [_team(_builder)], (tl.int32,), True, _builder)
    _record("rank", "argument", "trailing kernel argument 'rank'")
    return _argument("rank", tl.int32, _builder)


def num_ranks(_builder=None, _generator=None):
    lowering = _current()
    if lowering.num_ranks is not None:
        _record("num_ranks", "constant", "the call site's rank count, compiled in")
        return _tl_semantic.to_tensor(int(lowering.num_ranks), _builder)
    if lowering.aclshmem("num_ranks"):
        _record("num_ranks", "aclshmem_team_n_pes", "the size of the kernel's team")
        return _acl("team_n_pes", tl.int32, [_team(_builder)], (tl.int32,), True, _builder)
    _record("num_ranks", "argument", "trailing kernel argument 'num_ranks'")
    return _argument("num_ranks", tl.int32, _builder)


def epoch(_builder=None, _generator=None):
    _record("epoch", "argument", "trailing kernel argument 'epoch' (no ACLSHMEM counterpart)")
    return _argument("epoch", tl.int32, _builder)


def barrier_area(_builder=None, _generator=None):
    _record("barrier_area", "argument", "trailing kernel argument 'barrier_area'")
    area = _argument("barrier_area", tl.pointer_type(tl.int64), _builder)
    return core.cast(area, tl.pointer_type(tl.uint64), _builder=_builder)


def _delta(peer, _builder, _generator):
    """Bytes from this rank's heap to ``peer``'s."""
    block_peer = isinstance(peer, tl.tensor) and peer.type.is_block()
    if _current().aclshmem("symm_at") and not block_peer:
        _record("symm_at", "aclshmem_ptr",
                "aclshmem_ptr of the barrier area, as a distance between heaps")
        area = _argument("barrier_area", tl.pointer_type(tl.int64), _builder)
        return _acl("ptr_delta", tl.int64, [_address(area, _builder),
                                            _int(peer, tl.int32, _builder)],
                    (tl.int64, tl.int32), True, _builder)
    reason = ("a block of peers: aclshmem_ptr takes one peer" if block_peer
              and _current().aclshmem("symm_at") else "heap-base table (trailing argument "
              "'heaps')")
    _record("symm_at", "heap table", reason)
    heaps = _argument("heaps", tl.pointer_type(tl.int64), _builder)
    me = rank(_builder=_builder)
    return _generator.call_JitFunction(_heap_delta, [heaps, peer, me], {})


def symm_at(ptr, peer, _builder=None, _generator=None):
    itemsize = _itemsize(ptr)
    if itemsize & (itemsize - 1):
        raise TypeError(f"dl.symm_at: unsupported element type {ptr.dtype.element_ty}")
    delta = _delta(peer, _builder, _generator)
    return _generator.call_JitFunction(_shifted, [ptr, delta, itemsize.bit_length() - 1], {})


def _address(ptr, _builder):
    return core.cast(ptr, tl.int64, bitcast=True, _builder=_builder)


def notify(ptr, peer, signal=1, sig_op="set", scope="gpu", _builder=None, _generator=None):
    _scalar_pointer(ptr, "notify")
    element = _flag_type(ptr, "notify")
    core.debug_barrier(_builder=_builder)  # this program's writes before the flag
    value = _int(signal, element, _builder)
    peer = _int(peer, tl.int32, _builder)
    if _current().aclshmem("notify") and (sig_op == "set" or element.primitive_bitwidth == 32):
        symbol = f"int{element.primitive_bitwidth}_p" if sig_op == "set" else "signal_op"
        _record("notify", f"aclshmem {symbol}", f"sig_op={sig_op!r} on a {element} flag")
        args = [_address(ptr, _builder), value, peer]
        _acl(f"notify_{sig_op}", tl.int32, args, (tl.int64, element, tl.int32), False, _builder)
        return None
    remote = symm_at(ptr, peer, _builder=_builder, _generator=_generator)
    if sig_op == "set":
        _record("notify", "barrier + store", "a store to the peer's flag after a block barrier")
        _generator.call_JitFunction(_store_flag, [remote, value], {})
    else:
        _record("notify", "barrier + atomic_add",
                "an atomic_add whose result is unused lowers to an atomic-add store to global "
                "memory" + (" (ACLSHMEM's signal_op is int32-only)"
                            if _current().mapping == "aclshmem" else ""))
        _generator.call_JitFunction(_add_flag, [remote, value], {})
    return None


def wait(flag_ptrs, n=1, scope="gpu", semantic="acquire", value=1, cmp="eq", _builder=None,
         _generator=None):
    _scalar_pointer(flag_ptrs, "wait")
    element = _flag_type(flag_ptrs, "wait")
    if _current().aclshmem("wait"):
        _record("wait", f"aclshmem_wait_until_int{element.primitive_bitwidth}",
                "one call per flag, never marked side-effect free")
        target = _int(value, element, _builder)
        return _generator.call_JitFunction(
            _acl_wait_flags, [flag_ptrs, n, target, ACLSHMEM_CMP[cmp]], {})
    _record("wait", "spin on a volatile block load",
            f"{ASCEND_WAIT_LANES} flags loaded, the first tested; a block barrier after")
    return _generator.call_JitFunction(
        _spin, [flag_ptrs, n, _int(value, tl.int64, _builder), cmp, ASCEND_WAIT_LANES], {})


@core.builtin
def _acl_wait_until(flag, cmp_code, value, _builder=None):
    """The placeholder of one ``aclshmem_wait_until`` on the flag at ``flag``."""
    element = flag.dtype.element_ty
    code = _int(cmp_code, tl.int32, _builder)
    return _acl("wait_until", tl.int32, [_address(flag, _builder), code, value],
                (tl.int64, tl.int32, element), False, _builder)


@triton.jit
def _acl_wait_flags(flag_ptr, n, value, CMP_CODE: tl.constexpr):
    """``aclshmem_wait_until`` on each of ``n`` consecutive flags, then a block barrier."""
    for i in range(0, n):
        _acl_wait_until(flag_ptr + i, CMP_CODE, value)
    tl.debug_barrier()
    return 0


def consume_token(x, token, _builder=None, _generator=None):
    _record("consume_token", "identity",
            "waits are side-effecting loops or calls ending in a block barrier: later loads "
            "stay after them")
    return x


def fence(scope="gpu", _builder=None, _generator=None):
    if _current().aclshmem("fence"):
        _record("fence", "aclshmem_fence", "")
        _acl("fence", tl.int32, [], (), False, _builder)
    else:
        _record("fence", "block barrier", "no memory fence op in triton-ascend 3.2")
        core.debug_barrier(_builder=_builder)
    return None


_UNSUPPORTED = {
    "extern_call": "tl.extern_elementwise reaches ttadapter but bishengir-compile rejects it "
                   "(and extern_libs is ignored): device libraries cannot be called on Ascend",
}


def lowering(name: str) -> Callable:
    """The Ascend lowering of primitive ``name``.

    Raises:
      NotImplementedError: it has none (the message says why).
    """
    if name.startswith("nvshmem."):
        raise NotImplementedError(
            f"dl.{name} is an NVSHMEM device call: it compiles only for the nvshmem backend "
            "(NVIDIA GPUs); on Ascend use dl.putmem / dl.getmem / dl.signal_op")
    if name in _UNSUPPORTED:
        raise NotImplementedError(f"dl.{name} on Ascend: {_UNSUPPORTED[name]}")
    fn = globals().get(name)
    if name.startswith("_") or not callable(fn):
        raise NotImplementedError(f"dl.{name} has no Ascend lowering")
    return fn
