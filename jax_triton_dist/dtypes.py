"""Element types: the one table of what a kernel argument may be, and the subsets each op
family accepts.

Each :class:`ElementType` row gives the NumPy dtype, Triton's name for it (pointer
signatures ``*<name>``, scalar signatures) and the ``struct`` code of a scalar kernel
argument of that type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["ElementType", "ELEMENT_TYPES", "KERNEL_DTYPES", "FLOAT_DTYPES",
           "GEMM_DTYPES", "element_type", "triton_name", "scalar_format", "check_dtype"]


@dataclasses.dataclass(frozen=True)
class ElementType:
    """One element type a kernel argument may have."""

    dtype: np.dtype
    triton: str  # Triton's name: "fp32", "bf16", "i1", ...
    scalar: str | None  # struct code of a scalar argument of this type (None: not passed)


ELEMENT_TYPES = tuple(ElementType(np.dtype(d), t, f) for d, t, f in (
    ("float32", "fp32", "<f"),
    ("float16", "fp16", "<e"),
    ("float64", "fp64", "<d"),
    (ml_dtypes.bfloat16, "bf16", None),
    ("int8", "i8", "<b"),
    ("int16", "i16", "<h"),
    ("int32", "i32", "<i"),
    ("int64", "i64", "<q"),
    ("uint8", "u8", "<B"),
    ("uint16", "u16", "<H"),
    ("uint32", "u32", "<I"),
    ("uint64", "u64", "<Q"),
    ("bool", "i1", "<?"),
))
"""Every element type of kernel arguments and results."""

_BY_DTYPE = {t.dtype: t for t in ELEMENT_TYPES}
_BY_TRITON = {t.triton: t for t in ELEMENT_TYPES}

KERNEL_DTYPES = frozenset(_BY_DTYPE)
"""Element types a ``triton_call`` argument or result may have."""
FLOAT_DTYPES = frozenset(t.dtype for t in ELEMENT_TYPES if t.triton.startswith(("fp", "bf")))
"""The floating-point element types (bfloat16 among them, which NumPy does not count as
``np.floating``)."""
GEMM_DTYPES = frozenset(np.dtype(d) for d in ("float32", ml_dtypes.bfloat16, "float16"))
"""Input element types of the fused GEMM ops."""


def element_type(dtype: Any) -> ElementType:
    """The row of ``dtype``.

    Raises:
      TypeError: not a kernel element type.
    """
    row = _BY_DTYPE.get(np.dtype(dtype))
    if row is None:
        raise TypeError(f"unsupported element type {np.dtype(dtype)}; supported: "
                        + ", ".join(sorted(d.name for d in KERNEL_DTYPES)))
    return row


def triton_name(dtype: Any) -> str:
    """Triton's name of ``dtype`` (``"fp32"``, ``"bf16"``, ...)."""
    return element_type(dtype).triton


def scalar_format(triton: str) -> str:
    """``struct`` code of a scalar kernel argument of Triton type ``triton``.

    Raises:
      TypeError: scalars of that type cannot be passed.
    """
    row = _BY_TRITON.get(triton)
    if row is None or row.scalar is None:
        raise TypeError(f"unsupported scalar kernel argument type {triton}")
    return row.scalar


def check_dtype(dtype: Any, allowed: frozenset[np.dtype], what: str) -> np.dtype:
    """``np.dtype(dtype)`` if it is in ``allowed``.

    Raises:
      TypeError: it is not; the message names ``what`` and lists ``allowed``.
    """
    dtype = np.dtype(dtype)
    if dtype not in allowed:
        raise TypeError(f"{what}: unsupported dtype {dtype}; supported: "
                        + ", ".join(sorted(d.name for d in allowed)))
    return dtype
