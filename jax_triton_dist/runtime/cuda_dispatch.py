"""CUDA backend: plans the launches of a call site on one GPU (one process, local GPUs).

The C++ handler (xla_ffi/cuda_launch.cc) calls :func:`plan` on the first call of a
(call site, device). Planning reads the device's mesh coordinates once, joins the team,
allocates the team's symmetric regions (one ``cuMemAlloc`` per rank, peers mapped with
peer access) and each rank's context, compiles the kernel for the device (once per call
site), loads it, points its ``jtd_ctx`` global at the rank's context, and registers the
launch plan. Later calls launch from C++ without Python.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np

from jax_triton_dist import shmem
from jax_triton_dist.runtime import call_site, cuda_compile

try:  # built only where the CUDA headers were found
    from jax_triton_dist import _cuda
except ImportError:  # pragma: no cover - depends on the build machine
    _cuda = None

__all__ = ["plan", "bind_context", "regions", "compile_site", "launch_params", "OPERAND",
           "RESULT", "VALUE", "STAGED"]

_CTX_HEADER = struct.Struct("<iiiiqq")  # rank, num_ranks, epoch, reserved, barrier, timeout
_SCALAR_FORMATS = {"i1": "<?", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "u8": "<B",
                   "u16": "<H", "u32": "<I", "u64": "<Q", "fp32": "<f", "fp64": "<d"}
OPERAND, RESULT, VALUE, STAGED = 0, 1, 2, 3

_compile_lock = threading.Lock()
_compiled: dict[int, Any] = {}


def regions(site: call_site.CallSite, team: call_site.TeamState) -> list[tuple[int, int]]:
    """Allocates every member's region and context; returns ``(region, ctx)`` per rank."""
    _, _, _, total = site.region_layout
    ctx_offset = call_site.aligned(total)
    ctx_size = _CTX_HEADER.size + 8 * site.num_ranks
    devices = list(team.pes)
    for device in set(devices):
        for peer in set(devices) - {device}:
            _cuda.enable_peer_access(device, peer)
    bases = [_cuda.alloc(device, ctx_offset + ctx_size) for device in devices]
    timeout_ns = int(shmem.wait_timeout() * 1e9)
    for rank, (device, base) in enumerate(zip(devices, bases, strict=True)):
        header = _CTX_HEADER.pack(rank, site.num_ranks, 0, 0, base, timeout_ns)
        _cuda.write(device, base + ctx_offset, header + struct.pack(f"<{len(bases)}Q", *bases))
    return [(base, base + ctx_offset) for base in bases]


def _positional(site: call_site.CallSite) -> list[tuple[str, Any]]:
    kinds = {"array": lambda i: ("pointer", site.inputs[i].dtype),
             "output": lambda i: ("pointer", site.outputs[i].dtype),
             "workspace": lambda i: ("pointer", site.workspaces[i].dtype),
             "scalar": lambda v: ("scalar", v)}
    return [kinds[kind](value) for kind, value in site.params]


def compile_site(call_id: int, site: call_site.CallSite):
    """Triton signature and compiled kernel of a call site (compiled once)."""
    with _compile_lock:
        if call_id not in _compiled:
            positional = _positional(site)
            signature, constexprs = cuda_compile.signature_of(site.kernel, positional,
                                                              site.kwargs)
            attrs = cuda_compile.divisibility(signature, positional, site.kwargs)
            kernel = cuda_compile.compile_kernel(
                site.kernel, signature, constexprs, attrs=attrs,
                num_warps=site.launch.get("num_warps", 4),
                num_stages=site.launch.get("num_stages", 3))
            _compiled[call_id] = (signature, kernel)
        return _compiled[call_id]


def _value(type_name: str, value: Any) -> tuple[int, int, int, int]:
    fmt = _SCALAR_FORMATS.get(type_name)
    if fmt is None:
        raise TypeError(f"unsupported scalar kernel argument type {type_name}")
    raw = struct.pack(fmt, value)
    return (VALUE, 0, int.from_bytes(raw.ljust(8, b"\0"), "little"), 0, len(raw))


def launch_params(site: call_site.CallSite, signature: dict[str, str],
                  region: int) -> list[tuple[int, int, int, int, int]]:
    """``(kind, index, value, alt, size)`` per kernel parameter: an operand, a result, a
    value, or an operand staged into the symmetric slot ``value`` (odd epochs: ``alt``)
    and ``size`` bytes long."""
    _, workspace_offsets, staging, _ = site.region_layout
    positional = dict(zip(signature, site.params, strict=False))
    params = []
    for name, type_name in signature.items():
        if type_name == "constexpr":
            continue
        kind, value = positional.get(name, ("keyword", site.kwargs.get(name)))
        if kind == "array" and value in staging:
            even, odd = staging[value]
            params.append((STAGED, value + 1, region + even, region + odd,
                           site.inputs[value].nbytes))
        elif kind == "array":
            params.append((OPERAND, value + 1, 0, 0, 8))  # operand 0 holds the coordinates
        elif kind == "output":
            params.append((RESULT, value, 0, 0, 8))
        elif kind == "workspace":
            params.append((VALUE, 0, region + workspace_offsets[value], 0, 8))
        else:
            params.append(_value(type_name, value))
    return params


def bind_context(device: int, module: int, kernel: Any, ctx: int) -> None:
    """Points the loaded module's ``jtd_ctx`` at ``ctx`` (kernels that use no distributed
    primitive have no such global)."""
    if f" {cuda_compile.CTX_SYMBOL};" not in kernel.asm["ptx"]:
        return
    address, _ = _cuda.module_global(device, module, cuda_compile.CTX_SYMBOL)
    _cuda.write(device, address, struct.pack("<Q", ctx))


def _plan(call_id: int, device: int, coords_addr: int) -> None:
    site = call_site.lookup(call_id)
    raw = _cuda.read(device, coords_addr, 4 * len(site.mesh_axes))
    coords = tuple(int(c) for c in np.frombuffer(raw, np.int32))
    rank, team = site.join(coords, device, shmem.wait_timeout(), regions)
    region, ctx = team.region[rank]
    signature, kernel = compile_site(call_id, site)
    module, function = _cuda.load_function(device, kernel.asm["cubin"], kernel.metadata.name,
                                           kernel.metadata.shared)
    bind_context(device, module, kernel, ctx)
    grid = list(site.grid) + [1] * (3 - len(site.grid))
    _cuda.set_plan(call_id, device, function, grid, 32 * kernel.metadata.num_warps,
                   kernel.metadata.shared, launch_params(site, signature, region), ctx + 8)


def plan(call_id: int, device: int, coords_addr: int) -> str | None:
    """Plans (call site, device); returns None, or the message of the failure."""
    try:
        _plan(call_id, device, coords_addr)
    except Exception as error:  # reported to XLA, which raises it in the caller
        return f"GPU {device}: {type(error).__name__}: {error}"
    return None
