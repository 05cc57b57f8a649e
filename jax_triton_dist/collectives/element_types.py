"""How each element type goes through the collectives' kernels.

* **Data movement** (``all_gather``, ``all_to_all``, the exchange of a reduction's inputs
  never changes bits): every type travels as the unsigned integer of its width (``bool``
  as ``uint8``; a complex number as the two integers of its parts), so results are
  bit-exact, NaN payloads and signed zeros included, and one compiled kernel serves every
  type of one width.
* **Reductions** (``all_reduce``, ``reduce_scatter``): integers (8 to 64 bits, signed or
  not) add, and take max and min, exactly in their own type, wrapping on overflow as XLA
  does; ``float32`` and ``float64`` accumulate in their own type, ``float16`` and
  ``bfloat16`` in ``float32``; the float8 types travel and accumulate as ``float32``
  (exact conversions) and round once to their type at the end; complex numbers sum as
  pairs of their parts. Sums run in rank order, so every rank gets the same bits.
  ``bool`` sums as ``int32`` (the result is ``int32``, as in ``jax.lax.psum``); its max
  and min are the logical or and and.

Types narrower than a byte (``int4``, ``float4_e2m1fn``, ...) are refused: XLA packs them
below a byte, which a kernel's element pointer cannot address.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["check", "to_bits", "from_bits", "sum_result_type", "reduction_type",
           "to_reduction", "from_reduction"]

_UINT = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
         8: np.dtype(np.uint64)}
_NATIVE_REDUCTION = frozenset(np.dtype(d) for d in (
    "float32", "float64", "float16", ml_dtypes.bfloat16, "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64"))


def check(dtype: Any, fn: str) -> np.dtype:
    """``dtype`` if the collectives can move it.

    Raises:
      TypeError: not a numeric or boolean type, or narrower than a byte.
    """
    dtype = np.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
        raise TypeError(f"{fn}: unsupported dtype {dtype}: expected a boolean or numeric type")
    if jax.dtypes.itemsize_bits(dtype) < 8:
        raise TypeError(f"{fn}: dtype {dtype} is narrower than a byte, which XLA packs two or "
                        "more to a byte and a kernel cannot address; cast to int8 or uint8")
    return dtype


def _part(dtype: np.dtype) -> np.dtype:
    """The real type of a complex type's parts (the type itself otherwise)."""
    return np.dtype(np.zeros((), dtype).real.dtype) if dtype.kind == "c" else dtype


def to_bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as unsigned integers of its width (complex: an extra trailing
    dimension of 2, real and imaginary part)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(np.uint8)
    if dtype.kind == "c":
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    carrier = _UINT[_part(dtype).itemsize]
    return x if x.dtype == carrier else jax.lax.bitcast_convert_type(x, carrier)


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of :func:`to_bits` for an array of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return bits.astype(np.bool_)
    part = _part(dtype)
    values = bits if bits.dtype == part else jax.lax.bitcast_convert_type(bits, part)
    if dtype.kind == "c":
        return jax.lax.complex(values[..., 0], values[..., 1]).astype(dtype)
    return values


def sum_result_type(dtype: Any) -> np.dtype:
    """The element type of a sum of ``dtype`` values (``int32`` for ``bool``)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


def reduction_type(dtype: Any, op: str, fn: str) -> np.dtype:
    """The element type a reduction of ``dtype`` with ``op`` runs in, in the kernel.

    Raises:
      TypeError: a type ``op`` is not defined on (max/min of complex numbers, a
        ``bool`` sum scattered).
    """
    dtype = check(dtype, fn)
    if dtype.kind == "c":
        if op != "sum":
            raise TypeError(f"{fn}: op={op!r} is not defined on complex numbers ({dtype}); "
                            "only op='sum' is")
        return _part(dtype)
    if dtype == np.bool_:
        if op == "sum":
            raise TypeError(f"{fn}: cannot sum bool values; cast them to an integer type")
        return np.dtype(np.uint8)
    if dtype in _NATIVE_REDUCTION:
        return dtype
    return np.dtype(np.float32)  # the float8 types


def to_reduction(x: jax.Array, work: np.dtype) -> jax.Array:
    """``x`` in the form a reduction runs on: ``work`` elements (complex: a trailing
    dimension of 2 for the parts)."""
    if np.dtype(x.dtype).kind == "c":
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    return x if x.dtype == work else x.astype(work)


def from_reduction(y: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of :func:`to_reduction`: the result in ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return jax.lax.complex(y[..., 0], y[..., 1]).astype(dtype)
    return y if y.dtype == dtype else y.astype(dtype)
