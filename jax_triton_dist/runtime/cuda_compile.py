"""Compiles distributed kernels for NVIDIA GPUs with stock Triton (no GPU needed).

The result links the device library of ``language.device_abi`` (the rank context) and
exposes its module global ``CTX_SYMBOL``, which the CUDA runtime sets for each loaded copy.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from jax_triton_dist import dtypes
from jax_triton_dist.language import compiled as _compiled
from jax_triton_dist.language import device_abi, timed_kernel
from jax_triton_dist.runtime import interpreter

__all__ = ["compile_kernel", "signature_of", "divisibility", "uses_nvshmem"]


def signature_of(kernel: Any, positional: list[tuple[str, Any]],
                 kwargs: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton signature and constexprs of a launch (see :func:`divisibility` for hints).

    Args:
      kernel: the ``@triton.jit`` kernel.
      positional: ``("pointer", dtype)`` or ``("scalar", value)`` per positional argument.
      kwargs: keyword arguments; those annotated ``tl.constexpr`` become constexprs.
    """
    params = inspect.signature(kernel.fn).parameters
    constexpr_names = interpreter.constexpr_names(kernel.fn)
    signature, constexprs = {}, {}
    values = dict(zip(params, positional, strict=False))
    for name, param in params.items():
        if name in values and values[name][0] == "pointer":
            signature[name] = _pointer_sig(values[name][1])
            continue
        if name in values:
            value = values[name][1]
        elif name in kwargs:
            value = kwargs[name]
        elif param.default is not inspect.Parameter.empty:
            value = param.default
        else:
            raise TypeError(f"kernel {kernel.fn.__name__}: no value for parameter {name}")
        # Like Triton's JIT, an integer 1 (typically a unit stride) becomes a constant, so
        # that the compiler knows the access is contiguous.
        unit = isinstance(value, int) and not isinstance(value, bool) and value == 1
        if name in constexpr_names or unit:
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name] = mangle_type(value)
    return signature, constexprs


def divisibility(signature: dict[str, str], positional: list[tuple[str, Any]],
                 kwargs: Mapping[str, Any]) -> dict[tuple[int, ...], list]:
    """Triton's ``tt.divisibility`` hints, as its JIT would give them.

    Every pointer the runtime passes is 16-byte aligned (XLA buffers; workspaces at
    256-byte offsets in allocations of at least that alignment); integer scalars that
    divide by 16 are marked too. The hints let Triton vectorise loads and stores.
    """
    values = dict(zip(signature, positional, strict=False))
    attrs = {}
    for index, (name, type_name) in enumerate(signature.items()):
        kind, value = values.get(name, ("scalar", kwargs.get(name)))
        aligned_int = (type_name in ("i32", "i64", "u32", "u64") and isinstance(value, int)
                       and value % 16 == 0)
        if type_name.startswith("*") or aligned_int:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return attrs


def _pointer_sig(dtype: Any) -> str:
    return "*" + dtypes.triton_name(dtype)


@functools.cache
def _lowering_key() -> str:
    """Hash of the Python that lowers the ``dl`` primitives. Triton's cache key covers the
    ``@triton.jit`` sources and the extern libraries' contents, not this: without it a
    changed lowering would reuse stale cubins."""
    from jax_triton_dist.language import nvshmem, primitives, timed_kernel, timeline

    digest = hashlib.sha256()
    for path in (_compiled.__file__, primitives.__file__, nvshmem.__file__,
                 device_abi.__file__, timeline.__file__, timed_kernel.__file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class _Source(ASTSource):
    def __init__(self, *args, num_ranks: int | None = None,
                 timeline: tuple[int, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_ranks = num_ranks
        self.timeline = timeline

    def hash(self):
        key = f"{super().hash()}-{_lowering_key()}-ranks{self.num_ranks}-tl{self.timeline}"
        return hashlib.sha256(key.encode()).hexdigest()


def compile_kernel(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], *,
                   attrs: dict | None = None, capability: int = 90, num_warps: int = 4,
                   num_stages: int = 3, num_ranks: int | None = None,
                   nvshmem_device_lib: str | None = None,
                   timeline: tuple[int, int] | None = None):
    """``triton.compile`` for ``sm_<capability>`` with the device library linked.

    ``num_ranks``: the launch's rank count, compiled in as a constant (loops over ranks
    get constant bounds; one rank folds every exchange away); None reads it at run time.
    ``nvshmem_device_lib``: NVSHMEM's ``libnvshmem_device.bc``, linked so that the kernel
    may make ``dl.nvshmem`` calls (its module then needs ``nvshmemx_cumodule_init``).
    ``timeline``: ``(offset, capacity)`` of a timed launch's timeline area (see
    ``language.compiled.compiling``): the kernel records its programs' start and end and
    the primitives their events; None: the kernel is compiled as it is.
    """
    if timeline is not None:
        kernel = timed_kernel.timed(kernel)
    source = _Source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs,
                     num_ranks=num_ranks, timeline=timeline)
    options = {"extern_libs": tuple(_compiled.extern_libs().items()), "num_warps": num_warps,
               "num_stages": num_stages}
    target = GPUTarget("cuda", capability, 32)

    def attempt(nvshmem: str):
        with _compiled.compiling(num_ranks=num_ranks, nvshmem=nvshmem, timeline=timeline):
            return triton.compile(source, target=target, options=options)

    try:
        return attempt("available" if nvshmem_device_lib else "absent")
    except Exception as error:  # Triton wraps what a builtin raises
        if not _caused_by(error, _compiled.NeedsNvshmem):
            raise
    # The kernel makes dl.nvshmem calls: link NVSHMEM's device library (only then: it is
    # large, and only some NVSHMEM releases' bitcode is readable by Triton's LLVM).
    options["extern_libs"] = tuple(_compiled.extern_libs(nvshmem_device_lib).items())
    try:
        return attempt("linked")
    except ValueError as error:
        if "Failed to parse library" not in str(error):
            raise
        raise RuntimeError(
            f"{getattr(kernel, '__name__', kernel)}: Triton cannot read NVSHMEM's device "
            f"bitcode {nvshmem_device_lib} (built by a newer LLVM than Triton's); dl.nvshmem "
            "calls need an NVSHMEM release whose bitcode Triton reads (3.4.5 is known to "
            "work with Triton 3.6)") from None


def _caused_by(error: BaseException, kind: type) -> bool:
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


def uses_nvshmem(kernel: Any) -> bool:
    """Whether a compiled kernel holds NVSHMEM device code (its loaded module needs
    ``nvshmemx_cumodule_init``)."""
    return "nvshmemi_device_state_d" in kernel.asm["ptx"]
