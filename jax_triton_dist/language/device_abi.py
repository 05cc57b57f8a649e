"""The device ABI of compiled distributed kernels: the one home of what the compiled
``dl`` primitives, the Python planner and the C++ launcher agree on.

* **The rank context**: a block of device memory per (call site, rank) that the compiled
  primitives read through the module global :data:`CTX_SYMBOL` (the runtime points each
  loaded copy of a kernel at its rank's context). Its layout is :data:`HEADER` (scalar
  fields) followed by ``heap_base[num_ranks]`` (int64) and ``pe[num_ranks]`` (int32). The
  LLVM library that reads it (:func:`llvm_library`) is generated from this layout.
* **The error record** (:data:`RECORD`): a block of host-mapped memory per GPU where a
  wait that timed out writes what it waited for (instead of trapping, which would lose
  the CUDA context); the launcher reads it without synchronising the device.
* **Parameter kinds** of a launch plan (:class:`ParamKind`): what the C++ handler puts in
  each kernel parameter (``xla_ffi/cuda_launch.cc`` has the same enum; a test checks it).
* **The staging-slot rule** (:func:`staging_slot`): symmetric arguments alternate between
  two slots by epoch parity (the C++ handler applies the same rule; a test checks it).
* **Ascend** (the lowering of ``language/ascend.py``): the context travels as trailing
  kernel arguments (:data:`ASCEND_TRAILING_ARGS`), and a wait reads
  :data:`ASCEND_WAIT_LANES` consecutive flags at once.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import struct
import tempfile
from collections.abc import Sequence

__all__ = ["CTX_SYMBOL", "HEADER", "HEADER_FIELDS", "EPOCH_OFFSET", "ParamKind",
           "RECORD", "RECORD_FIELDS", "RecordStatus", "record_offset", "context_size",
           "pack_context", "staging_slot", "llvm_library", "library_path",
           "ASCEND_TRAILING_ARGS", "ASCEND_WAIT_LANES"]

CTX_SYMBOL = "jtd_ctx"
"""Module global holding the device address of the rank's context."""

HEADER_FIELDS = (
    # (name, struct code, LLVM type, read with a volatile load)
    ("rank", "i", "i32", False),
    ("num_ranks", "i", "i32", False),
    ("epoch", "i", "i32", True),  # written on the stream before every launch
    ("reserved", "i", "i32", False),
    ("barrier_area", "q", "i64", False),  # address of num_ranks u64 counters
    ("timeout_ns", "q", "i64", False),  # dl.wait watchdog
    ("error_record", "q", "i64", False),  # device address of the GPU's RECORD (0: none)
    ("abort_word", "q", "i64", False),  # this rank's int64 abort word (symmetric)
    ("site", "q", "i64", False),  # the call site's id, for the record
)
HEADER = struct.Struct("<" + "".join(code for _, code, _, _ in HEADER_FIELDS))
"""The context's scalar fields, little-endian, in the order of :data:`HEADER_FIELDS`."""


def _offset(name: str) -> int:
    offset = 0
    for field, code, _, _ in HEADER_FIELDS:
        if field == name:
            return offset
        offset += struct.calcsize("<" + code)
    raise KeyError(name)


EPOCH_OFFSET = _offset("epoch")
"""Byte offset of the epoch in the context (the launcher writes it before each launch)."""


class ParamKind(enum.IntEnum):
    """What a kernel parameter of a launch plan holds."""

    OPERAND = 0  # an operand buffer of the call
    RESULT = 1  # a result buffer of the call
    VALUE = 2  # fixed bytes (scalars, workspace addresses)
    STAGED = 3  # an operand copied into a symmetric slot first (see staging_slot)


ASCEND_TRAILING_ARGS = (
    # (name, TTIR type): appended, in this order, to every kernel's own parameters
    ("rank", "i32"),  # dl.rank() ("args" mapping)
    ("num_ranks", "i32"),  # dl.num_ranks() when the rank count is not compiled in
    ("epoch", "i32"),  # dl.epoch()
    ("heaps", "!tt.ptr<i64>"),  # heap base of every rank (dl.symm_at, "args" mapping)
    ("barrier_area", "!tt.ptr<i64>"),  # num_ranks u64 counters (dl.barrier_all)
    ("team", "i32"),  # the ACLSHMEM team of the kernel's axis ("aclshmem" mapping)
)
"""The rank context of an Ascend kernel: trailing kernel arguments (Ascend has no module
globals a runtime could point at a context)."""

ASCEND_WAIT_LANES = 8
"""A wait on Ascend loads this many consecutive flags and tests the first (a scalar load,
even a volatile one, is served from the scalar cache, so a spin must load a block). The
runtime leaves ``8 * ASCEND_WAIT_LANES`` bytes after every region of flags."""


RECORD_FIELDS = (
    # (name, struct code): what a wait that timed out leaves for the host
    ("status", "I"),  # RecordStatus
    ("rank", "i"),
    ("num_ranks", "i"),
    ("flag_index", "i"),
    ("epoch", "i"),
    ("reserved", "i"),
    ("site", "q"),
    ("address", "q"),  # the flag's device address
    ("expected", "q"),
    ("seen", "q"),
)
RECORD = struct.Struct("<" + "".join(code for _, code in RECORD_FIELDS))
"""The error record's layout (the C++ launcher has the same struct; a test checks)."""


class RecordStatus(enum.IntEnum):
    """``status`` of the error record."""

    EMPTY = 0
    WRITING = 1  # a wait claimed it and is writing the fields
    WRITTEN = 2


def record_offset(name: str) -> int:
    """Byte offset of field ``name`` in the error record."""
    offset = 0
    for field, code in RECORD_FIELDS:
        if field == name:
            return offset
        offset += struct.calcsize("<" + code)
    raise KeyError(name)


def staging_slot(epoch: int, even: int, odd: int) -> int:
    """The slot a symmetric argument is staged into for call ``epoch``: ``even`` for even
    epochs, ``odd`` for odd ones, so a rank one call ahead never overwrites the slot a
    slower peer still reads."""
    return odd if epoch % 2 else even


def context_size(num_ranks: int) -> int:
    """Bytes of the context of a team of ``num_ranks``."""
    return HEADER.size + 12 * num_ranks


def pack_context(rank: int, num_ranks: int, barrier_area: int, timeout_ns: int,
                 heap_bases: Sequence[int], pes: Sequence[int], *, error_record: int = 0,
                 abort_word: int = 0, site: int = 0) -> bytes:
    """The context of ``rank`` (epoch 0: the launcher writes it per call)."""
    if len(heap_bases) != num_ranks or len(pes) != num_ranks:
        raise ValueError(f"pack_context: {len(heap_bases)} heap bases and {len(pes)} PEs for "
                         f"{num_ranks} ranks")
    values = {"rank": rank, "num_ranks": num_ranks, "epoch": 0, "reserved": 0,
              "barrier_area": barrier_area, "timeout_ns": timeout_ns,
              "error_record": error_record, "abort_word": abort_word, "site": site}
    header = HEADER.pack(*(values[name] for name, _, _, _ in HEADER_FIELDS))
    return header + struct.pack(f"<{num_ranks}Q{num_ranks}i", *heap_bases, *pes)


# ---------------------------------------------------------------------------
# The LLVM library that reads the context (linked into kernels by extern_libs)
# ---------------------------------------------------------------------------

_PRELUDE = f"""; jax_triton_dist device library (CUDA): the rank context of a compiled kernel.
; Generated from jax_triton_dist/language/device_abi.py; do not edit.

@{CTX_SYMBOL} = addrspace(1) externally_initialized global i64 0, align 8

define internal ptr addrspace(1) @jtd_field(i64 %offset) alwaysinline {{
  %base = load i64, ptr addrspace(1) @{CTX_SYMBOL}, align 8
  %addr = add i64 %base, %offset
  %p = inttoptr i64 %addr to ptr addrspace(1)
  ret ptr addrspace(1) %p
}}
"""


def _scalar_reader(name: str, llvm_type: str, volatile: bool) -> str:
    align = 4 if llvm_type == "i32" else 8
    load = "load volatile" if volatile else "load"
    return f"""
define {llvm_type} @jtd_{name}() alwaysinline {{
  %p = call ptr addrspace(1) @jtd_field(i64 {_offset(name)})
  %v = {load} {llvm_type}, ptr addrspace(1) %p, align {align}
  ret {llvm_type} %v
}}
"""


_TABLES = f"""
define i64 @jtd_heap_base(i32 %rank) alwaysinline {{
  %r = sext i32 %rank to i64
  %scaled = mul i64 %r, 8
  %offset = add i64 %scaled, {HEADER.size}
  %p = call ptr addrspace(1) @jtd_field(i64 %offset)
  %v = load i64, ptr addrspace(1) %p, align 8
  ret i64 %v
}}

define i32 @jtd_pe(i32 %rank) alwaysinline {{
  %n = call i32 @jtd_num_ranks()
  %n64 = sext i32 %n to i64
  %table = mul i64 %n64, 8
  %start = add i64 %table, {HEADER.size}
  %r = sext i32 %rank to i64
  %scaled = mul i64 %r, 4
  %offset = add i64 %start, %scaled
  %p = call ptr addrspace(1) @jtd_field(i64 %offset)
  %v = load i32, ptr addrspace(1) %p, align 4
  ret i32 %v
}}
"""


@functools.cache
def llvm_library() -> str:
    """The LLVM IR of the context readers: ``jtd_<field>()`` for every header field but the
    reserved one, ``jtd_heap_base(rank)`` and ``jtd_pe(rank)``."""
    readers = "".join(_scalar_reader(name, llvm_type, volatile)
                      for name, _, llvm_type, volatile in HEADER_FIELDS if name != "reserved")
    return _PRELUDE + readers + _TABLES


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jax_triton_dist")


@functools.cache
def library_path() -> str:
    """A file holding :func:`llvm_library` (Triton's ``extern_libs`` take paths), written
    once under ``$XDG_CACHE_HOME/jax_triton_dist`` (or the temporary directory) and named
    by its contents' hash."""
    text = llvm_library()
    name = f"libjtd_device-{hashlib.sha256(text.encode()).hexdigest()[:16]}.ll"
    for folder in (_cache_dir(), os.path.join(tempfile.gettempdir(), "jax_triton_dist")):
        path = os.path.join(folder, name)
        try:
            if not os.path.exists(path):
                os.makedirs(folder, exist_ok=True)
                fd, partial = tempfile.mkstemp(dir=folder, suffix=".ll.partial")
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(partial, path)  # atomic: concurrent writers write the same text
            return path
        except OSError:
            continue
    raise OSError(f"cannot write the device library {name} under {_cache_dir()} or the "
                  "temporary directory")
