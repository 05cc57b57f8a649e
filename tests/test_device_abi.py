"""The device ABI has one home (language/device_abi.py): the C++ launcher and the LLVM
context library agree with it."""

import re
import struct

import numpy as np
import pytest
import triton
import triton.language as tl

import jax_triton_dist.language as dl
from jax_triton_dist.language import device_abi
from jax_triton_dist.language.device_abi import HEADER, HEADER_FIELDS, ParamKind
from jax_triton_dist.runtime import cuda_compile, cuda_dispatch

launcher = cuda_dispatch.launcher()
needs_launcher = pytest.mark.skipif(launcher is None, reason="built without the CUDA launcher")


@needs_launcher
def test_launcher_parameter_kinds_are_the_abis():
    assert launcher.param_kinds() == {kind.name: int(kind) for kind in ParamKind}


@needs_launcher
def test_launcher_staging_slot_rule_is_the_abis():
    for epoch in range(6):
        assert launcher.staging_slot(epoch, 1000, 2000) == device_abi.staging_slot(
            epoch, 1000, 2000)
    assert [device_abi.staging_slot(e, 0, 1) for e in range(4)] == [0, 1, 0, 1]


@needs_launcher
def test_launcher_error_record_is_the_abis():
    layout = launcher.record_layout()
    assert layout.pop("size") == device_abi.RECORD.size
    assert layout == {name: device_abi.record_offset(name) for name in layout}
    assert set(layout) >= {"status", "rank", "flag_index", "epoch", "site", "address",
                           "expected", "seen"}


def _reader_offsets(text: str) -> dict[str, tuple[str, int, bool]]:
    """``{field: (type, offset, volatile)}`` of the scalar readers in the LLVM text."""
    readers = {}
    pattern = (r"define (i32|i64) @jtd_(\w+)\(\) alwaysinline \{\n"
               r"  %p = call ptr addrspace\(1\) @jtd_field\(i64 (\d+)\)\n"
               r"  %v = (load volatile|load) ")
    for llvm_type, name, offset, load in re.findall(pattern, text):
        readers[name] = (llvm_type, int(offset), load == "load volatile")
    return readers


def test_llvm_readers_follow_the_header_layout():
    readers = _reader_offsets(device_abi.llvm_library())
    offset = 0
    for name, code, llvm_type, volatile in HEADER_FIELDS:
        if name != "reserved":
            assert readers.pop(name) == (llvm_type, offset, volatile), name
        offset += struct.calcsize("<" + code)
    assert offset == HEADER.size and not readers
    text = device_abi.llvm_library()
    assert f"%offset = add i64 %scaled, {HEADER.size}" in text  # heap_base[] after the header
    assert f"%start = add i64 %table, {HEADER.size}" in text  # pe[] after heap_base[]


def test_packed_context_reads_back_at_the_abi_offsets():
    heaps, pes = [0x1000, 0x2000, 0x3000], [4, 5, 6]
    raw = device_abi.pack_context(1, 3, 0xABC0, 7_000_000, heaps, pes, error_record=0xE000,
                                  abort_word=0xAB00, site=42)
    assert len(raw) == device_abi.context_size(3)
    fields = dict(zip([f[0] for f in HEADER_FIELDS], HEADER.unpack_from(raw), strict=True))
    assert fields == {"rank": 1, "num_ranks": 3, "epoch": 0, "reserved": 0,
                      "barrier_area": 0xABC0, "timeout_ns": 7_000_000, "error_record": 0xE000,
                      "abort_word": 0xAB00, "site": 42}
    assert struct.unpack_from("<i", raw, device_abi.EPOCH_OFFSET) == (0,)
    assert list(np.frombuffer(raw, np.uint64, 3, HEADER.size)) == heaps
    assert list(np.frombuffer(raw, np.int32, 3, HEADER.size + 24)) == pes
    with pytest.raises(ValueError, match="2 heap bases and 3 PEs for 3 ranks"):
        device_abi.pack_context(0, 3, 0, 0, heaps[:2], pes)


def test_library_file_holds_the_generated_text():
    with open(device_abi.library_path()) as f:
        assert f.read() == device_abi.llvm_library()


@triton.jit
def _context_reader(out_ptr):
    tl.store(out_ptr + 0, dl.rank())
    tl.store(out_ptr + 1, dl.num_ranks())
    tl.store(out_ptr + 2, dl.epoch())


def test_compiled_kernel_reads_the_context_global():
    positional = [("pointer", np.dtype(np.int32))]
    signature, constexprs = cuda_compile.signature_of(_context_reader, positional, {})
    kernel = cuda_compile.compile_kernel(_context_reader, signature, constexprs)
    ptx = kernel.asm["ptx"]
    assert f".visible .global .align 8 .u64 {device_abi.CTX_SYMBOL};" in ptx
    # The epoch is re-read every launch (volatile), at its ABI offset from the context.
    epoch_load = rf"ld\.volatile\.global\.[bu]32\s+%r\d+, \[%rd\d+\+{device_abi.EPOCH_OFFSET}\]"
    assert re.search(epoch_load, ptx), ptx


def test_cpp_comparisons_and_signal_ops_are_the_pythons():
    from jax_triton_dist import _shmem
    from jax_triton_dist.shmem.signals import Cmp, SignalOp

    assert _shmem.enum_values() == {"Cmp": {c.name: int(c) for c in Cmp},
                                    "SignalOp": {o.name: int(o) for o in SignalOp}}
